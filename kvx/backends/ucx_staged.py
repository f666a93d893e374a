"""The ucx backend's staged path: CUDA memory through pinned slots, one UCX operation per slot.

Where UCX has no transport that reaches GPU memory directly (``UCX_TLS=tcp,cuda_copy``: no
RDMA with GPUDirect, no cuda_ipc), every ``ucp_put_nbx``/``ucp_get_nbx`` on a CUDA block is a
device copy into one of UCX's bounce buffers plus an emulated remote operation: at 4 KiB blocks
that is ~17 us a block. The staged path moves a transfer as the tcp backend moves GPU memory:

- the side that holds the source gathers a chunk's blocks (at most ``stage_bytes``) into a
  pinned slot with the batched copy kernel (:mod:`kvx.backends.tcp.staging`; a memcpy for host
  memory) and puts the slot into a slot of the other side with ONE ``ucp_put_nbx``; the control
  message about the chunk is the put's notification, sent once the flush after it completed (the
  bytes are at the peer); the other side scatters the slot into its blocks with the kernel;
- write: at a peer's first staged write, the target gives it ``stage_slots`` landing slots
  (``so``); chunk k goes into landing slot k % ``stage_slots`` followed by ``sw`` (the target
  blocks); the target checks the blocks against its own live registrations (kind, device,
  bounds, as every backend's target does), scatters, answers ``sw_rep``; the initiator reuses
  a landing slot only after its previous chunk was answered;
- read: ``sr`` names the target blocks and one of the initiator's slots (address and remote
  key); the target checks, gathers, puts, and ``sr_rep`` follows the bytes;
- up to ``stage_slots`` chunks of a transfer are in flight (gather, UCX, scatter overlap).

Slots are per peer and direction (:class:`~kvx.backends.tcp.staging.SlotRing`), registered with
UCX once. What a peer can reach through the staging: the landing slots the target gave it (to
write) and the initiator's own slots it named in a read (the target puts into them); never memory
outside registrations, whatever the transport. Control messages ride the backend's
sealed channel (sequence numbers; HMAC with ``auth_token``). Every wait is bounded by
``peer_timeout``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import wire
from ..errors import KVXError, PeerDisconnected, ProtocolError, RemoteError, TransferError, TransferTimeout, UsageError
from ..memory import MemoryKind
from .base import DoneRequest, Op, PreparedList, Request, Route, ThreadRequest, paired_nbytes, validate
from .tcp.staging import MAX_STAGED_DESCS, Copier, HostCopier, Slot, SlotRing, cuda_copier

if TYPE_CHECKING:
    from .ucx import UcxBackend, _Client, _Peer

log = logging.getLogger(__name__)

_U64 = np.uint64
#: Transports with which UCX reaches GPU memory without host bounce buffers.
_DEVICE_RMA = ("rc", "dc", "ib", "cuda_ipc", "gdr_copy", "rocm_ipc")


def wanted(mode: str, tls: str | None, local: MemoryKind, remote: MemoryKind) -> bool:
    """Whether a transfer between lists of kinds ``local`` and ``remote`` goes staged."""
    if mode == "never":
        return False
    if mode == "host":
        return True
    if MemoryKind.CUDA not in (local, remote):
        return False
    if mode == "always":
        return True
    if not tls or tls.startswith("^"):
        return False  # UCX chooses among everything it finds: its own device paths included
    names = [t.strip().lower() for t in tls.split(",")]
    if any(n == "all" for n in names):
        return False
    return not any(n.startswith(d) for n in names for d in _DEVICE_RMA)


def effective_tls(opts_ucx: tuple[tuple[str, str], ...]) -> str | None:
    for k, v in opts_ucx:
        if k.upper() == "TLS":
            return v
    return os.environ.get("UCX_TLS")


class StagedRequest(ThreadRequest):
    """A staged transfer running on the stager's pool (its chunks are not abandoned midway:
    ``cancel`` cannot stop it)."""

    def cancel(self) -> bool:
        return False


def _bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype=_U64).tobytes()


def _arr(b: Any, n: int, what: str) -> np.ndarray:
    if not isinstance(b, bytes) or len(b) != 8 * n:
        raise ProtocolError(f"staged request: malformed {what}")
    return np.frombuffer(b, dtype=_U64)


def _chunks(nb: np.ndarray, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of descriptors of at most ``size`` bytes and MAX_STAGED_DESCS each
    (every descriptor is at most ``size`` bytes: callers split larger ones first)."""
    out = []
    n = int(nb.shape[0])
    cum = np.cumsum(nb, dtype=np.uint64)
    i = 0
    base = 0
    while i < n:
        j = int(np.searchsorted(cum, _U64(base + size), side="right"))
        j = max(i + 1, min(j, i + MAX_STAGED_DESCS, n))
        out.append((i, j))
        base = int(cum[j - 1])
        i = j
    return out


def _split(la: np.ndarray, ra: np.ndarray, nb: np.ndarray, ld: np.ndarray, rd: np.ndarray, size: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Descriptors larger than ``size`` split into pieces of at most ``size`` bytes."""
    if not (nb > _U64(size)).any():
        return la, ra, nb, ld, rd
    parts = ((nb + _U64(size - 1)) // _U64(size)).astype(np.int64)
    rep = np.repeat(np.arange(nb.shape[0]), parts)
    first = np.cumsum(parts) - parts
    k = (np.arange(rep.shape[0]) - first[rep]).astype(_U64)
    off = k * _U64(size)
    ln = np.minimum(nb[rep] - off, _U64(size))
    return la[rep] + off, ra[rep] + off, ln, ld[rep], rd[rep]


class Stager:
    """Both roles of the staged path for one :class:`~kvx.backends.ucx.UcxBackend`."""

    def __init__(self, backend: UcxBackend) -> None:
        self.b = backend
        o = backend.opts
        self.size = int(o.stage_bytes)
        self.nslots = int(o.stage_slots)
        self.timeout = backend.peer_timeout
        self._lock = threading.Lock()
        self._host: HostCopier | None = None
        self._cuda: Copier | None = None
        self._rings: dict[tuple[str, str], SlotRing] = {}  # (peer/client id, role) -> ring
        self._regs: dict[int, tuple[int, bytes]] = {}  # slot addr -> (memh, packed rkey)
        self._rkeys: dict[tuple[int, bytes], int] = {}  # (ep, packed) -> rkey handle
        self._land: dict[str, list[tuple[int, int]]] = {}  # peer id -> its landing slots (addr, rkey)
        self._wslots: dict[str, list[Slot]] = {}  # client id -> the landing slots we gave it
        self._busy: dict[int, int] = {}  # registration slot -> staged scatters/gathers on it
        self._busy_cv = threading.Condition(self._lock)
        self._ini = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvx-ucx-stage")
        self._tgt = ThreadPoolExecutor(max_workers=max(2, self.nslots), thread_name_prefix="kvx-ucx-stage-t")
        self._closed = False

    # ---- slots -------------------------------------------------------------------------------
    def _copier(self, kind: MemoryKind) -> Copier:
        with self._lock:
            if kind == MemoryKind.CUDA:
                if self._cuda is None:
                    self._cuda = cuda_copier()
                return self._cuda
            if self._host is None:
                self._host = HostCopier()
            return self._host

    def _slot_copier(self) -> Copier:
        """Who allocates slots: pinned (cudaHostAlloc) where CUDA runs, else plain host memory."""
        try:
            return self._copier(MemoryKind.CUDA)
        except KVXError:
            return self._copier(MemoryKind.HOST)

    def _ring(self, who: str, role: str) -> SlotRing:
        with self._lock:
            r = self._rings.get((who, role))
        if r is None:
            r = SlotRing(self._slot_copier(), self.size, self.nslots)
            with self._lock:
                r = self._rings.setdefault((who, role), r)
        return r

    def _reg(self, slot: Slot) -> tuple[int, bytes]:
        with self._lock:
            have = self._regs.get(slot.addr)
        if have is not None:
            return have
        try:
            memh, packed = self.b.w.mem_map(slot.addr, slot.size, False)
        except OSError as exc:
            raise TransferError(f"UCX cannot map a staging slot: {exc.strerror or exc}") from exc
        with self._lock:
            self._regs[slot.addr] = (int(memh), packed)
        return int(memh), packed

    def _rkey(self, ep: int, packed: bytes) -> int:
        key = (ep, packed)
        with self._lock:
            h = self._rkeys.get(key)
        if h is not None:
            return h
        try:
            h = int(self.b.w.rkey_unpack(ep, packed))
        except ValueError as exc:
            raise ProtocolError("malformed staging slot key") from exc
        except OSError as exc:
            raise PeerDisconnected(f"cannot use a staging slot key: {exc.strerror or exc}") from exc
        with self._lock:
            old = self._rkeys.setdefault(key, h)
        if old != h:
            self.b.w.rkey_destroy(h)
        return old

    def _push(self, ep: int, src: Slot, n: int, raddr: int, rkey: int, then: bytes) -> Any:
        """One ucp_put_nbx of ``n`` bytes of ``src`` to a peer's slot; the sealed control message
        ``then`` goes out once the bytes are at the peer (the post's flush). Returns the Xfer."""
        memh, _ = self._reg(src)
        one = np.zeros(1, dtype=np.int64)
        try:
            return self.b.w.post(0, ep, one, np.array([src.addr], _U64), np.array([n], _U64), np.array([memh], _U64),
                                 one, np.array([raddr], _U64), np.array([n], _U64), np.array([rkey], _U64), then)
        except OSError as exc:
            raise PeerDisconnected(f"a staged push failed: {exc.strerror or exc}") from exc

    # ---- initiator ---------------------------------------------------------------------------
    def post(self, route: StagedRoute, li: np.ndarray, ri: np.ndarray, notify: bytes | None) -> Request:
        lp, rp = route.lp, route.rp
        ln = paired_nbytes(li, ri, lp[1], rp[1])
        req = StagedRequest(int(ln.sum()))
        la, ld, ra, rd = lp[0][li], lp[2][li], rp[0][ri], rp[2][ri]
        self._ini.submit(self._run, route, la, ld, ra, rd, ln, notify, req)
        return req

    def _run(self, route: StagedRoute, la: np.ndarray, ld: np.ndarray, ra: np.ndarray, rd: np.ndarray,
             nb: np.ndarray, notify: bytes | None, req: StagedRequest) -> None:
        try:
            la, ra, nb, ld, rd = _split(la, ra, nb, ld, rd, self.size)
            if route.op is Op.WRITE:
                self._write(route, la, ld, ra, rd, nb)
            else:
                self._read(route, la, ld, ra, rd, nb)
            if notify is not None:
                self.b.notify(route.remote.peer or "", notify)
            req.finish(None)
        except KVXError as exc:
            req.finish(exc)
        except Exception as exc:  # pragma: no cover - a bug; the waiter sees it
            log.exception("ucx staged transfer failed")
            req.finish(TransferError(f"staged transfer failed: {exc}"))

    def _seal(self, p: _Peer, body: bytes) -> bytes:
        b = self.b
        if p.dead is not None or p.session is None:
            raise PeerDisconnected(f"peer {p.name!r} is not connected over ucx")
        with b._lock:
            return p.session.seal(b.me, "i", body)  # type: ignore[no-any-return]

    def _send(self, p: _Peer, body: bytes) -> None:
        msg = self._seal(p, body)
        try:
            self.b.w.am_send(p.ep, msg)
        except OSError as exc:
            raise PeerDisconnected(f"peer {p.name!r}: {exc.strerror or exc}") from exc

    def _reply(self, p: _Peer, rid: int, t: str) -> dict[str, Any]:
        rep = self.b._await_reply(p.ep, rid, self.timeout, f"peer {p.name!r}, staged transfer", peer=p)
        if rep is None:
            raise TransferTimeout(f"peer {p.name!r} did not answer a staged chunk within {self.timeout:.1f} s")
        if rep.get("t") != t:
            raise ProtocolError(f"peer {p.name!r} answered a staged chunk with {rep.get('t')!r}")
        err = rep.get("err")
        if err:
            raise RemoteError(f"peer {p.name!r} refused a staged chunk: {str(err)[:300]}")
        return rep

    def _landing(self, p: _Peer) -> list[tuple[int, int]]:
        """The peer's write slots for us, ``[(address, rkey handle)]`` (asked for once)."""
        with self._lock:
            have = self._land.get(p.id)
        if have is not None:
            return have
        rid = self.b._next_rid()
        self._send(p, wire.pack("so", rid=rid))
        rep = self._reply(p, rid, "so_rep")
        slots = rep.get("s")
        if (not isinstance(slots, list) or len(slots) != self.nslots
                or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], int) and isinstance(e[1], bytes)
                           for e in slots)):
            raise ProtocolError(f"peer {p.name!r} sent a malformed staging slot table (or uses other slot counts)")
        out = [(int(a), self._rkey(p.ep, k)) for a, k in slots]
        with self._lock:
            return self._land.setdefault(p.id, out)

    def _write(self, route: StagedRoute, la: np.ndarray, ld: np.ndarray, ra: np.ndarray, rd: np.ndarray,
               nb: np.ndarray) -> None:
        """Gather chunk k into one of our slots, put it into the peer's slot k % nslots; the
        ``sw`` message follows the bytes (the put's flush), the peer scatters and answers."""
        p = route.peer
        land = self._landing(p)
        ring = self._ring(p.id, "w")
        cp = self._copier(route.local.kind)
        kind = int(route.remote.kind)
        pending: list[tuple[int, Slot, Any]] = []
        try:
            for k, (s, e) in enumerate(_chunks(nb, self.size)):
                while len(pending) >= self.nslots:  # the peer's slot k % nslots is free again
                    rid, slot, _x = pending.pop(0)
                    self._reply(p, rid, "sw_rep")
                    ring.give(slot)
                slot = ring.take(self.timeout)
                n = int(nb[s:e].sum())
                taddr, trkey = land[k % self.nslots]
                rid = self.b._next_rid()
                try:
                    cp.gather(slot, la[s:e], nb[s:e], ld[s:e]).wait(self.timeout)
                    note = self._seal(p, wire.pack("sw", rid=rid, ts=k % self.nslots, n=n, kind=kind,
                                                   ra=_bytes(ra[s:e]), rn=_bytes(nb[s:e]), rd=_bytes(rd[s:e])))
                    x = self._push(p.ep, slot, n, taddr, trkey, note)
                except BaseException:
                    ring.give(slot)
                    raise
                pending.append((rid, slot, x))
            while pending:
                rid, slot, _x = pending.pop(0)
                self._reply(p, rid, "sw_rep")
                ring.give(slot)
        finally:
            for _rid, slot, x in pending:  # a failed transfer: a put may still read these slots
                self._after(x, ring, slot)

    def _after(self, x: Any, ring: SlotRing, slot: Slot) -> None:
        """Give ``slot`` back once the operation ``x`` reading it ended (bounded), off this thread."""
        def later() -> None:
            try:
                x.wait(self.timeout)
            except OSError:
                pass
            ring.give(slot)

        threading.Thread(target=later, name="kvx-ucx-stage-slot", daemon=True).start()

    def _read(self, route: StagedRoute, la: np.ndarray, ld: np.ndarray, ra: np.ndarray, rd: np.ndarray,
              nb: np.ndarray) -> None:
        """Ask for chunk k with the address and key of one of our slots; the peer gathers, puts
        into it, and its answer follows the bytes; we scatter."""
        p = route.peer
        ring = self._ring(p.id, "r")
        cp = self._copier(route.local.kind)
        kind = int(route.remote.kind)
        chunks = _chunks(nb, self.size)
        asked: list[tuple[int, int, int, Slot]] = []
        nxt = 0

        def ask() -> None:
            nonlocal nxt
            s, e = chunks[nxt]
            slot = ring.take(self.timeout)
            _memh, packed = self._reg(slot)
            rid = self.b._next_rid()
            asked.append((rid, s, e, slot))
            nxt += 1
            self._send(p, wire.pack("sr", rid=rid, a=slot.addr, k=packed, kind=kind, ra=_bytes(ra[s:e]),
                                    rn=_bytes(nb[s:e]), rd=_bytes(rd[s:e])))

        try:
            while nxt < len(chunks) and len(asked) < self.nslots:
                ask()
            while asked:
                rid, s, e, slot = asked[0]
                self._reply(p, rid, "sr_rep")
                asked.pop(0)
                try:
                    cp.scatter(slot, la[s:e], nb[s:e], ld[s:e]).wait(self.timeout)
                finally:
                    ring.give(slot)
                if nxt < len(chunks):
                    ask()
        finally:
            for _rid, _s, _e, slot in asked:  # the peer may still put into these: keep them out of use
                t = threading.Timer(self.timeout, ring.give, args=(slot,))
                t.daemon = True
                t.start()

    # ---- target ------------------------------------------------------------------------------
    def on_message(self, c: _Client, m: dict[str, Any]) -> None:
        """A staged request from an initiator (service thread): checked here, run on the pool."""
        t = m["t"]
        if t == "so":
            wire.check(m, "so", {"rid": int})
        elif t == "sw":
            wire.check(m, "sw", {"rid": int, "ts": int, "n": int, "kind": int, "ra": bytes, "rn": bytes, "rd": bytes})
        else:
            wire.check(m, "sr", {"rid": int, "a": int, "k": bytes, "kind": int, "ra": bytes, "rn": bytes, "rd": bytes})
        self._tgt.submit(self._serve, c, m)

    def _serve(self, c: _Client, m: dict[str, Any]) -> None:
        t = m["t"]
        rep = t + "_rep"
        try:
            if t == "so":
                out = self._serve_open(c)
            elif t == "sw":
                out = self._serve_write(c, m)
            else:
                self._serve_read(c, m)  # answered by the put's notification
                return
        except KVXError as exc:
            out = {"err": str(exc)[:500]}
        except Exception as exc:  # pragma: no cover - a bug; the initiator gets an error, not a hang
            log.exception("ucx: staged %s failed", t)
            out = {"err": f"internal error: {exc}"}
        self.b._send(c, "t", wire.pack(rep, rid=m["rid"], **out))

    def _serve_open(self, c: _Client) -> dict[str, Any]:
        """The client's landing slots (``nslots``, pinned, registered): written only by it."""
        with self._lock:
            have = self._wslots.get(c.id)
        if have is None:
            ring = self._ring(c.id, "tw")
            have = [ring.take(self.timeout) for _ in range(self.nslots)]
            with self._lock:
                have = self._wslots.setdefault(c.id, have)
        return {"s": [[sl.addr, self._reg(sl)[1]] for sl in have]}

    def _check(self, m: dict[str, Any]) -> tuple[MemoryKind, np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """The request's blocks, each inside a live registration of this agent (else refused);
        the registrations are marked busy (a release waits for them)."""
        k = len(m["rn"]) // 8
        if k == 0 or k > MAX_STAGED_DESCS:
            raise ProtocolError(f"a staged chunk of {k} blocks (1 to {MAX_STAGED_DESCS})")
        ra, rn, rd = _arr(m["ra"], k, "addresses"), _arr(m["rn"], k, "sizes"), _arr(m["rd"], k, "devices")
        if int(rn.sum()) > self.size or (rn == 0).any():
            raise ProtocolError(f"a staged chunk larger than the {self.size}-byte slot or with empty blocks")
        try:
            kind = MemoryKind(m["kind"])
        except ValueError:
            raise ProtocolError("a staged chunk of an unknown memory kind") from None
        if kind not in (MemoryKind.HOST, MemoryKind.CUDA):
            raise ProtocolError(f"a staged chunk of {kind.name} memory")
        b = self.b
        with b._lock:
            table = [(int(r.kind), r.addr, r.nbytes, r.dev, s, g) for s, (_m, _p, g, r) in b._mem.items()]
            slots, ok = validate(kind, ra, rn, rd, table)
            if not ok.all():
                raise RemoteError("a staged chunk names memory outside this agent's live registrations")
            used = np.unique(slots).tolist()
            with self._busy_cv:
                for s in used:
                    self._busy[s] = self._busy.get(s, 0) + 1
        return kind, ra, rn, rd, used

    def _done(self, used: list[int]) -> None:
        with self._busy_cv:
            for s in used:
                left = self._busy.get(s, 0) - 1
                if left > 0:
                    self._busy[s] = left
                else:
                    self._busy.pop(s, None)
            self._busy_cv.notify_all()

    def _serve_write(self, c: _Client, m: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            slots = self._wslots.get(c.id)
        if slots is None or not 0 <= m["ts"] < len(slots):
            raise ProtocolError("a staged write into a slot this peer was not given")
        kind, ra, rn, rd, used = self._check(m)
        try:
            if m["n"] != int(rn.sum()):
                raise ProtocolError("a staged chunk whose size does not match its blocks")
            self._copier(kind).scatter(slots[m["ts"]], ra, rn, rd).wait(self.timeout)
        finally:
            self._done(used)
        return {}

    def _serve_read(self, c: _Client, m: dict[str, Any]) -> None:
        kind, ra, rn, rd, used = self._check(m)
        ring = self._ring(c.id, "tr")
        try:
            slot = ring.take(self.timeout)
            try:
                self._copier(kind).gather(slot, ra, rn, rd).wait(self.timeout)
            except BaseException:
                ring.give(slot)
                raise
        finally:
            self._done(used)
        rk = self._rkey(c.ep, m["k"])
        b = self.b
        with b._lock:
            assert c.session is not None
            note = c.session.seal(b.me, "t", wire.pack("sr_rep", rid=m["rid"]))
        x = self._push(c.ep, slot, int(rn.sum()), m["a"], rk, note)
        self._after(x, ring, slot)

    def wait_idle(self, slot: int, timeout: float) -> None:
        """Before a registration is unmapped: staged copies on it finish (bounded)."""
        deadline = time.monotonic() + timeout
        with self._busy_cv:
            while self._busy.get(slot, 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("ucx: a staged copy on a released region did not finish in %.1f s", timeout)
                    return
                self._busy_cv.wait(left)

    # ---- teardown ----------------------------------------------------------------------------
    def drop(self, who: str) -> None:
        """A peer or client went away: its slots are freed (after their copies)."""
        with self._lock:
            rings = [self._rings.pop(k) for k in [k for k in self._rings if k[0] == who]]
            self._wslots.pop(who, None)
            self._land.pop(who, None)
        for r in rings:
            self._free_ring(r)

    def _free_ring(self, r: SlotRing) -> None:
        with self._lock:
            regs = [(s.addr, self._regs.pop(s.addr, None)) for s in r._all]
        for _a, reg in regs:
            if reg is not None:
                try:
                    self.b.w.mem_unmap(reg[0])
                except OSError:
                    pass
        r.close(self.timeout)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rings = list(self._rings.values())
            self._rings.clear()
            self._wslots.clear()
            self._land.clear()
            keys = list(self._rkeys.values())
            self._rkeys.clear()
        self._ini.shutdown(wait=False, cancel_futures=True)
        self._tgt.shutdown(wait=False, cancel_futures=True)
        for h in keys:
            try:
                self.b.w.rkey_destroy(h)
            except (OSError, ValueError, RuntimeError):
                pass
        for r in rings:
            self._free_ring(r)
        if self._host is not None:
            self._host.close()


class StagedRoute(Route):
    """A list pair on the staged path: both sides' (address, size, device) arrays and the peer."""

    __slots__ = ("direct", "lp", "peer", "rp")

    def __init__(self, backend: UcxBackend, op: Op, local: PreparedList, remote: PreparedList) -> None:
        super().__init__(backend, op, local, remote)
        ld, rd = local.descs, remote.descs
        self.lp = (np.ascontiguousarray(ld.addr, _U64), np.ascontiguousarray(ld.nbytes, _U64),
                   np.ascontiguousarray(ld.dev, _U64))
        self.rp = (np.ascontiguousarray(rd.addr, _U64), np.ascontiguousarray(rd.nbytes, _U64),
                   np.ascontiguousarray(rd.dev, _U64))
        self.peer = backend._live_peer(remote.peer)
        self.direct: Route | None = None  # one UCX operation per block, for small transfers

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        b: UcxBackend = self.backend  # type: ignore[assignment]
        p = self.peer
        li, ri = b.post_args(p, lidx, ridx)
        small = b.opts.stage_min
        if small and li.size and b.opts.stage != "host":
            try:
                nbytes = int(self.lp[1][li].sum())
            except IndexError:
                raise UsageError("bad transfer request: index out of range") from None
            if nbytes < small:
                if self.direct is None:
                    self.direct = b.direct_route(self.op, self.local, self.remote)
                return self.direct.post(lidx, ridx, notify)
        b._check_gens(p, self.local, self.remote)
        if li.size == 0 and notify is None:
            return DoneRequest(0)
        return b.stager().post(self, li, ri, notify)
