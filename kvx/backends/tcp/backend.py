"""The tcp backend: its options, peers and posting transfers (the target's side: :mod:`.target`)."""

from __future__ import annotations

import logging
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ... import config as _cfg
from ... import wire
from ...errors import (
    BackendUnavailable,
    PeerDisconnected,
    ProtocolError,
    UsageError,
)
from ...memory import MemoryKind
from ...net import (
    advertised,
    client_handshake,
    open_listener,
)
from ..base import (
    BAD_INDEX,
    Backend,
    BackendContext,
    DoneRequest,
    Op,
    PeerInfo,
    PreparedList,
    Request,
    Route,
    region_rows,
)
from .common import (
    _K_MSG,
    _U64,
    MAX_DESCS,
    SMALL_DESCS,
    _coalesce,
    _hostname_ok,
    _i64,
    _net,
    _split_large,
    _split_rep,
    _why,
    tune_socket,
)
from .initiator import _Chunk, _FastRequest, _FastStream, _PeerConn, _Stream, _TcpRequest
from .staging import MAX_STAGED_DESCS, Copier, HostCopier, cuda_copier
from .target import _Target

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prep:
    addr: np.ndarray
    nbytes: np.ndarray
    kind: MemoryKind = MemoryKind.HOST
    dev: np.ndarray | None = None  # CUDA lists: the device of each descriptor
    copier: Copier | None = None  # local lists staged through pinned slots
    #: HOST lists with keep_digests on: kvx-nh64 of each descriptor as last read into it
    digests: np.ndarray | None = None


def _strict_bounds(cum: np.ndarray, chunk: int, most: int) -> list[int]:
    """Frame boundaries over descriptors of cumulative sizes ``cum`` (each at most ``chunk``):
    every frame holds at most ``chunk`` bytes and ``most`` descriptors (one search per frame)."""
    n = cum.shape[0]
    bounds = [0]
    base = 0
    while bounds[-1] < n:
        a = bounds[-1]
        b = int(np.searchsorted(cum, _U64(base + chunk), side="right"))
        b = min(max(b, a + 1), a + most, n)
        bounds.append(b)
        base = int(cum[b - 1])
    return bounds


# ---- the backend -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TcpOptions:
    """Options of the ``tcp`` backend (``AgentConfig(options={"tcp": TcpOptions(...)})``).

    Parameters
    ----------
    streams
        TCP connections per peer; a large transfer is striped over them (``KVX_TCP_STREAMS``).
    chunk
        Bytes per data frame, the pipelining unit of large transfers (``KVX_TCP_CHUNK``).
    fast_max
        Largest transfer (at most 16 descriptors) on the low-latency path; 0 turns it off
        (``KVX_TCP_FAST_MAX``).
    spin_us
        Microseconds a waiter retries its socket before sleeping (``KVX_TCP_SPIN_US``).
    serve_spin_us
        Microseconds a serving thread waits for the next small request before sleeping
        (``KVX_TCP_SERVE_SPIN_US``).
    rcvlowat
        ``SO_RCVLOWAT`` of large receives, bytes; 0 = off (``KVX_TCP_RCVLOWAT``).
    stage_bytes
        Bytes per pinned staging slot: the largest frame of a transfer touching CUDA memory
        (``KVX_TCP_STAGE_BYTES``).
    stage_slots
        Staging slots per connection: the frames of one connection gathered, on the wire or
        scattering at once (``KVX_TCP_STAGE_SLOTS``).
    stage_host
        Move host memory through the staging path too (a test of the GPU pipeline on machines
        without a GPU; slower) (``KVX_TCP_STAGE_HOST``).
    cuda_order
        How the staging copies of GPU memory are ordered with the caller's GPU work, as
        :attr:`kvx.backends.cuda.CudaOptions.order` (``KVX_CUDA_ORDER``).
    """

    streams: int = _cfg.option("KVX_TCP_STREAMS")
    chunk: int = _cfg.option("KVX_TCP_CHUNK")
    fast_max: int = _cfg.option("KVX_TCP_FAST_MAX")
    spin_us: float = _cfg.option("KVX_TCP_SPIN_US")
    serve_spin_us: float = _cfg.option("KVX_TCP_SERVE_SPIN_US")
    rcvlowat: int = _cfg.option("KVX_TCP_RCVLOWAT")
    stage_bytes: int = _cfg.option("KVX_TCP_STAGE_BYTES")
    stage_slots: int = _cfg.option("KVX_TCP_STAGE_SLOTS")
    stage_host: bool = _cfg.option("KVX_TCP_STAGE_HOST")
    cuda_order: str = _cfg.option("KVX_CUDA_ORDER")


class TcpBackend(_Target, Backend):
    """Host and CUDA memory to and from agents on any node over TCP; see the module docstring."""

    name = "tcp"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.CUDA})
    remote = True
    local = False
    notifications = True
    Options = TcpOptions

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        self.max_msg = int(_cfg.get("KVX_MAX_MESSAGE"))
        self.timeout = float(self.cfg.peer_timeout)
        self.inline = int(self.cfg.inline_bytes)
        opts: TcpOptions = ctx.options if ctx.options is not None else TcpOptions()
        self.opts = opts
        self.fast_max = max(0, int(opts.fast_max))
        self.streams = max(1, int(opts.streams))
        self.chunk = max(4096, int(opts.chunk))
        #: seconds the thread waiting for a fast-path reply retries the socket before sleeping in
        #: poll: a reply arriving within it costs no wakeup
        self.spin = float(opts.spin_us) * 1e-6
        #: seconds a serving thread keeps retrying its socket after a small request before
        #: sleeping: the next small request of a burst is picked up without a wakeup
        self.serve_spin = float(opts.serve_spin_us) * 1e-6
        #: SO_RCVLOWAT for large receives: wake once this many bytes are queued, not per segment
        self.rcv_lowat = int(opts.rcvlowat)
        self.stage_bytes = max(64 << 10, int(opts.stage_bytes))
        self.stage_slots = max(2, int(opts.stage_slots))
        self.stage_host = bool(opts.stage_host)
        self.cuda_order = opts.cuda_order
        self._host_copier = HostCopier() if self.stage_host else None
        self._lock = threading.RLock()
        self._closed = False
        self._peers: dict[str, _PeerConn] = {}
        self._init_target()
        host, port = self.cfg.listen if self.cfg.listen is not None else ("127.0.0.1", 0)
        self._lsock = open_listener(host, port)
        self.address: tuple[str, int] = tuple(self._lsock.getsockname()[:2])  # type: ignore[assignment]
        self._addrs = advertised(self._lsock)
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvx-tcp-accept-{ctx.agent_name}",
                                          daemon=True)
        self._acceptor.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if _net is None:
            return "the native module kvx._net is not built (pip install -e . rebuilds it)"
        return None

    # ---- metadata --------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        md: dict[str, Any] = {"addrs": [[h, p] for h, p in self._addrs], "streams": self.streams,
                              "stage": self.stage_bytes}
        if self.stage_host:
            md["stage_host"] = True
        return md

    # ---- peers -----------------------------------------------------------------------------
    def connect(self, peer: PeerInfo) -> bool:
        sec = peer.sections.get(self.name)
        if sec is None:
            return False
        addrs = sec.get("addrs") if isinstance(sec, dict) else None
        if (not isinstance(addrs, list) or not addrs or len(addrs) > 64
                or not all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) and _hostname_ok(a[0])
                           and isinstance(a[1], int) and not isinstance(a[1], bool) and 0 < a[1] < 65536
                           for a in addrs)):
            raise ProtocolError(f"malformed tcp section in {peer.name!r} metadata")
        stage = sec.get("stage", 0)
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 1 << 40:
            raise ProtocolError(f"malformed tcp section in {peer.name!r} metadata")
        conn = _PeerConn(self, peer.name)
        #: the largest staged frame the peer takes (0: it stages nothing, so serves no CUDA memory)
        conn.stage = stage
        conn.stage_host = sec.get("stage_host") is True
        socks: list[socket.socket] = []
        try:
            for i in range(self.streams + (1 if self.fast_max else 0)):
                socks.append(self._dial(peer, addrs, i))
        except BaseException:
            for s in socks:
                s.close()
            raise
        for s in socks:
            s.setblocking(False)
        if self.fast_max:
            conn.fast = _FastStream(conn, socks[-1])
        for i, s in enumerate(socks[: self.streams]):
            conn.streams.append(_Stream(conn, s, i))
        with self._lock:
            if self._closed:
                for s in socks:
                    s.close()
                return False
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = conn
        if old is not None:
            old.close()
        for st in conn.streams:
            st.start()
        return True

    def _dial(self, peer: PeerInfo, addrs: list[list[Any]], idx: int) -> socket.socket:
        last: BaseException | None = None
        hto = float(self.cfg.handshake_timeout)
        for host, port in addrs:
            try:
                s = socket.create_connection((host, port), timeout=hto)
            except (UnicodeError, ValueError) as exc:  # not resolvable as a name at all
                raise ProtocolError(f"bad tcp address {host!r:.80} in {peer.name!r} metadata: {exc}") from exc
            except OSError as exc:
                last = exc
                continue
            try:
                tune_socket(s, self.timeout)
                rep = client_handshake(s, self.cfg.auth_token, self.ctx.agent_id, self.ctx.agent_name, "data",
                                       hto, expect_id=peer.agent_id)
                wire.check(rep, "welcome", {"name": str, "id": str})
                return s
            except BaseException:
                s.close()
                raise
        raise PeerDisconnected(f"cannot reach {peer.name!r} over tcp at "
                               f"{', '.join(f'{h}:{p}' for h, p in addrs)}: {last}")

    def refresh_regions(self, peer_name: str) -> list[tuple[int, int, int, int, int, int]] | None:
        conn = self._peers.get(peer_name)
        if conn is None or conn.dead:
            return None
        msg = conn.control("regions", float(self.cfg.handshake_timeout))
        return region_rows(msg.get("rows"))

    def disconnect(self, peer_name: str) -> None:
        with self._lock:
            conn = self._peers.pop(peer_name, None)
        if conn is not None:
            conn.close()

    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        copier: Copier | None = None
        if plist.peer is not None:
            conn = self._peers.get(plist.peer)
            if conn is None or conn.dead:
                raise PeerDisconnected(f"not connected to {plist.peer!r} over tcp")
        elif d.kind == MemoryKind.CUDA:
            copier = cuda_copier(self.cuda_order)
        else:
            copier = self._host_copier
        dev = np.ascontiguousarray(d.dev, dtype=_U64) if d.kind == MemoryKind.CUDA else None
        return _Prep(np.ascontiguousarray(d.addr, dtype=_U64), np.ascontiguousarray(d.nbytes, dtype=_U64),
                     d.kind, dev, copier)

    def keep_digests(self, plist: PreparedList) -> np.ndarray:
        """Checksum every block this backend reads into the local HOST list ``plist``.

        From now on each read into ``plist`` takes the kvx-nh64 checksum (``kvx._native.nh64``)
        of every descriptor it fills right after the kernel copied the descriptor's bytes out of
        the socket (while they are still in cache, instead of a second pass over memory) and,
        before the transfer is seen finished (``wait``/``done`` returned True), stores it at the
        descriptor's row of the returned array (one uint64 per descriptor of ``plist``). Rows of a
        failed read hold nothing meaningful. Transfers running at the same time must not fill the
        same rows. Reads into ``plist`` of a descriptor longer than ``KVX_TCP_CHUNK`` are refused
        (``BackendUnavailable``): the checksum is of whole descriptors, which then span frames.

        Raises
        ------
        UsageError
            If ``plist`` is not a local HOST list prepared by this backend's agent, or is staged
            (``KVX_TCP_STAGE_HOST``).
        """
        p: _Prep | None = plist.bdata.get(self.name)
        if p is None or plist.peer is not None or p.kind is not MemoryKind.HOST or p.copier is not None:
            raise UsageError("keep_digests needs a local, unstaged HOST list prepared by this agent")
        if p.digests is None:
            p.digests = np.zeros(len(p.addr), dtype=_U64)
        return p.digests

    # ---- transfers -------------------------------------------------------------------------
    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        return _TcpRoute(self, op, local, remote)

    def _post(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any, peer: str,
              notify: bytes | None) -> Request:
        """Post one transfer (indices as the user gave them; bad ones raise IndexError,
        ValueError or TypeError, which the route turns into UsageError)."""
        conn = self._peers.get(peer)
        if conn is None or conn.dead:
            raise PeerDisconnected(f"peer {peer!r} is not connected over tcp"
                                   + (f": {conn.error}" if conn is not None else ""))
        if self.fast_max and lp.copier is None and rp.kind == MemoryKind.HOST:
            small = self._small(op, lp, lidx, rp, ridx)
            if small is not None:
                req = self._fast_post(conn, op, *small, notify)
                if req is not None:
                    return req
        li, ri = _i64(lidx), _i64(ridx)
        if li.shape != ri.shape:
            raise ValueError("index lists differ in length")
        if li.size == 0:
            return DoneRequest(0)
        if (li >= len(lp.addr)).any() or (ri >= len(rp.addr)).any() or (li < 0).any() or (ri < 0).any():
            raise IndexError("descriptor index out of range")
        ln = lp.nbytes[li]
        if not np.array_equal(ln, rp.nbytes[ri]):
            raise ValueError("paired descriptors differ in length")
        laddr, raddr = lp.addr[li], rp.addr[ri]
        dig = lp.digests if op is Op.READ else None
        if dig is not None and int(ln.max()) > self.chunk:
            raise BackendUnavailable("tcp takes checksums of descriptors of at most KVX_TCP_CHUNK "
                                     f"({self.chunk}) bytes")
        rstaged = rp.kind == MemoryKind.CUDA or conn.stage_host
        chunk, most = self.chunk, MAX_DESCS
        if rstaged:
            if conn.stage <= 0:
                raise BackendUnavailable(f"peer {conn.name!r} does not serve GPU memory over tcp")
            chunk, most = min(chunk, conn.stage), MAX_STAGED_DESCS
        if lp.copier is not None:
            chunk, most = min(chunk, self.stage_bytes), MAX_STAGED_DESCS
        ldev = rdev = None
        if lp.dev is not None or rp.dev is not None:  # devices follow the descriptors through the split
            cut = _split_rep(ln, chunk)
            ldev = lp.dev[li] if lp.dev is not None else None
            rdev = rp.dev[ri] if rp.dev is not None else None
            if cut is not None:
                ldev = ldev[cut[0]] if ldev is not None else None
                rdev = rdev[cut[0]] if rdev is not None else None
        laddr, raddr, ln = _split_large(laddr, raddr, ln, chunk)
        total = int(ln.sum())
        cum = np.cumsum(ln)
        if rstaged or lp.copier is not None:
            bounds = _strict_bounds(cum, chunk, most)  # a staged frame must fit a slot
        else:
            g = np.maximum((cum - _U64(1)) // _U64(chunk), (np.arange(ln.shape[0]) // most).astype(_U64))
            edges = np.flatnonzero(g[1:] != g[:-1]) + 1 if ln.shape[0] > 1 else np.zeros(0, dtype=np.int64)
            bounds = [0, *edges.tolist(), ln.shape[0]]
        req = _TcpRequest(total, len(bounds) - 1, conn, notify)
        chunks = []
        rkind = int(MemoryKind.CUDA) if rp.kind == MemoryKind.CUDA else 0
        for a, b in zip(bounds, bounds[1:]):
            if lp.copier is None and dig is None:
                la, lnb = _coalesce(laddr[a:b], ln[a:b])
            else:  # staged, or hashed per descriptor: one iovec each
                la, lnb = laddr[a:b], ln[a:b]
            chunks.append(_Chunk(op, req, la, lnb, raddr[a:b].tobytes(), ln[a:b].tobytes(),
                                 int(cum[b - 1] - (cum[a - 1] if a else 0)), 0, rkind,
                                 rdev[a:b].tobytes() if rdev is not None else None, lp.copier,
                                 ldev[a:b] if ldev is not None else None,
                                 dig=dig, drows=li[a:b] if dig is not None else None))
        if len(chunks) == 1 and total <= self.inline and lp.copier is None:
            # small: send from the posting thread when a stream is free (saves a thread hop)
            for st in conn.streams:
                if st.send_lock.acquire(blocking=False):
                    try:
                        st.send_chunk(chunks[0])
                    except OSError as exc:
                        err = PeerDisconnected(f"peer {conn.name!r}: send failed: {_why(exc)}")
                        conn.fail(err)
                        raise err from exc
                    finally:
                        st.send_lock.release()
                    return req
        conn.put_chunks(chunks)
        return req

    def _small(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any
               ) -> tuple[bytes, bytes, bytes, bytes, int, Any] | None:
        """The fast path's descriptors, computed without numpy, or None when not small:
        (local addr, local nbytes as native u64; target addr, nbytes as little-endian u64; bytes;
        for a read into a list with keep_digests on, (its digest array, the local rows), else None)."""
        if type(lidx) is int:
            lidx = [lidx]
        if type(ridx) is int:
            ridx = [ridx]
        if isinstance(lidx, np.ndarray) and lidx.size <= SMALL_DESCS:
            lidx = lidx.tolist()
        if isinstance(ridx, np.ndarray) and ridx.size <= SMALL_DESCS:
            ridx = ridx.tolist()
        if not isinstance(lidx, (list, tuple)) or not isinstance(ridx, (list, tuple)):
            return None
        k = len(lidx)
        if k == 0 or k > SMALL_DESCS or len(ridx) != k:
            return None
        nl, nr = lp.addr.shape[0], rp.addr.shape[0]
        la, ln, ra, rn = [], [], [], []
        for i, j in zip(lidx, ridx):
            if type(i) is not int or type(j) is not int:
                return None  # numpy scalars, bools...: the general path checks them
            if not (0 <= i < nl and 0 <= j < nr):
                raise IndexError("descriptor index out of range")
            la.append(int(lp.addr[i]))
            ln.append(int(lp.nbytes[i]))
            ra.append(int(rp.addr[j]))
            rn.append(int(rp.nbytes[j]))
        if ln != rn:
            raise ValueError("paired descriptors differ in length")
        total = sum(ln)
        if total > self.fast_max:
            return None
        dig = (lp.digests, list(lidx)) if op is Op.READ and lp.digests is not None else None
        return (struct.pack(f"={k}Q", *la), struct.pack(f"={k}Q", *ln), struct.pack(f"<{k}Q", *ra),
                struct.pack(f"<{k}Q", *rn), total, dig)

    def _fast_post(self, conn: _PeerConn, op: Op, la: bytes, ln: bytes, ra: bytes, rn: bytes, total: int,
                   dig: Any, notify: bytes | None) -> Request | None:
        """Send a small transfer on the peer's fast stream; None when that stream is busy."""
        fs = conn.fast
        if fs is None:
            return None
        if not fs.owner.acquire(blocking=False):
            fs.reap(0.0)  # the previous reply may be in: reading it frees the stream
            if not fs.owner.acquire(blocking=False):
                return None
        req = _FastRequest(fs, total, la, ln, notify)
        req.dig = dig
        req.rid = rid = conn.next_rid()
        body = wire.pack("w" if op is Op.WRITE else "r", rid=rid, addr=ra, nbytes=rn)
        head = wire.frame_header(_K_MSG, len(body)) + body
        if op is Op.WRITE:
            fs.send(req, head, la, ln)
        else:
            fs.send(req, head, None, None)
        return req

    def notify(self, peer_name: str, message: bytes) -> None:
        conn = self._peers.get(peer_name)
        if conn is None or conn.dead:
            raise PeerDisconnected(f"peer {peer_name!r} is not connected over tcp")
        conn.put([(wire.pack("notif", msg=message), 0, None)])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        if self._acceptor is not threading.current_thread():
            self._acceptor.join(timeout=5.0)
        for p in peers:
            p.close()
        with self._lock:
            served = list(self._served.values())
        for s, _t, _p in served:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _s, t, _p in served:
            if t is not threading.current_thread():
                t.join(timeout=5.0)
        self.refused.flush()
        if self._host_copier is not None:
            self._host_copier.close()


class _TcpRoute(Route):
    """A list pair resolved once: both sides' prepared arrays and the peer's name; small
    transfers' descriptors are computed once per plan and posted straight to the fast stream."""

    __slots__ = ("_lp", "_peer", "_rp", "_small_ok")

    def __init__(self, backend: TcpBackend, op: Op, local: PreparedList, remote: PreparedList) -> None:
        super().__init__(backend, op, local, remote)
        self._lp: _Prep = local.bdata[backend.name]
        self._rp: _Prep = remote.bdata[backend.name]
        self._peer: str = remote.peer  # type: ignore[assignment]
        # the fast stream carries host memory on both sides only (no staging)
        self._small_ok = bool(backend.fast_max) and self._lp.copier is None and self._rp.kind == MemoryKind.HOST

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        try:
            return self.backend._post(self.op, self._lp, lidx, self._rp, ridx,  # type: ignore[attr-defined, no-any-return]
                                      self._peer, notify)
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        b: TcpBackend = self.backend  # type: ignore[assignment]
        try:
            small = b._small(self.op, self._lp, lidx, self._rp, ridx) if self._small_ok else None
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None
        if small is None:
            return super().plan(lidx, ridx, notify)
        peer, op, peers, fast_post, slow = self._peer, self.op, b._peers, b._fast_post, self.post
        lp, hashed = self._lp, small[5] is not None or op is not Op.READ

        def post() -> Request:
            if not hashed and lp.digests is not None:  # keep_digests came after the plan
                return slow(lidx, ridx, notify)
            conn = peers.get(peer)
            if conn is None or conn.dead:
                raise PeerDisconnected(f"peer {peer!r} is not connected over tcp"
                                       + (f": {conn.error}" if conn is not None else ""))
            req = fast_post(conn, op, *small, notify)
            return req if req is not None else slow(lidx, ridx, notify)

        return post
