"""``tcp``: host memory between agents on any nodes, over TCP.

Design (see ``docs/networking.md``):

- **Listener.** Each agent listens on ``AgentConfig.listen`` (default ``127.0.0.1`` port 0,
  reachable from this machine only); its metadata section lists the addresses peers should
  dial. A wildcard bind (``0.0.0.0``/``::``) advertises the host's resolved addresses first
  and loopback last.
- **Connections.** A peer is reached through a small pool of streams (``STREAMS``, default
  2); a transfer is cut into chunks of about ``CHUNK`` bytes (many descriptors each) that the
  streams' sender threads take from one per-peer queue, pipelined without waiting for replies,
  so one large transfer keeps every stream busy.
- **Data path.** One frame per chunk: an 8-byte header, a msgpack body carrying the target's
  descriptors as raw uint64 bytes, then the payload. ``kvx._net`` sends it with ``sendmsg``
  over one iovec per (coalesced) registered descriptor and the target receives it with
  ``recvmsg`` straight into its registered memory: the kernel gathers and scatters, so a
  transfer costs the copies of a raw TCP stream. Reads are the mirror image.
- **Fast path.** Transfers of at most ``FAST_MAX`` bytes (16 descriptors) use one more,
  thread-less connection per peer: the posting thread sends request and payload, the thread
  that tests or waits reads the reply itself (short spin, then poll); the target validates such
  requests without numpy and spins briefly for the next one.
- **Target-side validation.** The target checks every descriptor of every request against its
  live registrations (``ctx.validate_local``) and re-checks and *pins* the regions under its
  own lock before it touches memory; ``deregister`` unpins-waits (bounded, then cuts the
  connections still holding the region), so a release racing a transfer fails cleanly with
  :class:`~kvx.errors.RemoteError` and nothing is written after release returns. A refused
  write's payload is drained into a scratch buffer, never into registered memory.
- **Authentication.** Every connection starts with the HMAC challenge of :mod:`kvx.auth`;
  before it completes, frames are limited to 64 KiB and the whole handshake must finish within
  ``handshake_timeout`` (slow-loris bound); at most ``MAX_HANDSHAKES`` run at once.
- **Failure bounds.** All socket I/O is nonblocking with ``poll``: no progress for
  ``peer_timeout`` seconds fails the peer; TCP keepalive and ``TCP_USER_TIMEOUT`` detect a dead
  or cut-off peer on idle connections; pending transfers turn FAILED with
  :class:`~kvx.errors.PeerDisconnected`.
- **Notifications** travel on the same streams, sent after every chunk of their transfer was
  acknowledged by the target, i.e. after the data landed.
"""

from __future__ import annotations

import bisect
import collections
import errno
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import config as _cfg
from .. import wire
from .._slots import MAX_SLOTS
from ..errors import (
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from ..memory import MemoryKind, Region
from ..net import (
    MAX_HANDSHAKES,
    PREAUTH_MAX,
    RefusalLog,
    accept_loop,
    client_handshake,
    open_listener,
    recv_frame,
    send_frame,
    server_handshake,
)
from .base import Backend, BackendContext, DoneRequest, ErrorMap, Op, PeerInfo, PreparedList, Request, ThreadRequest

__all__ = ["TcpBackend", "TcpOptions", "STREAMS", "CHUNK", "MAX_HANDSHAKES", "PREAUTH_MAX", "client_handshake",
           "server_handshake", "send_frame", "recv_frame", "tune_socket", "advertised", "open_listener"]


log = logging.getLogger(__name__)

#: Default streams (TCP connections) per peer (``KVX_TCP_STREAMS``).
STREAMS = 2
#: Default target bytes per chunk, one request frame (``KVX_TCP_CHUNK``); larger descriptors are split.
CHUNK = 16 << 20
#: Most descriptors per chunk (bounds the request frame).
MAX_DESCS = 1 << 16
#: Transfers up to this many bytes (one chunk) take the fast path: a dedicated stream per peer,
#: request and payload sent by the posting thread, the reply read by the thread that tests or
#: waits (no sender/reader thread hop), target-side validation without numpy.
FAST_MAX = 64 << 10
#: Most descriptors a request may carry to be validated on the target's scalar (numpy-free) path.
SMALL_DESCS = 16

_K_MSG = 1
_U64 = np.uint64

try:
    from .. import _net  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - build problem
    _net = None  # type: ignore[assignment]


# ---- sockets (frames and handshakes: kvx.net) ------------------------------------------------
def tune_socket(sock: socket.socket, peer_timeout: float) -> None:
    """TCP_NODELAY, keepalive with short intervals and TCP_USER_TIMEOUT from ``peer_timeout``."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(1, int(peer_timeout / 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(peer_timeout) - idle))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(peer_timeout * 1000)))
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        log.debug("cannot tune a tcp socket", exc_info=True)


def advertised(sock: socket.socket) -> list[tuple[str, int]]:
    """Addresses peers should dial to reach the listening ``sock`` (best first)."""
    host, port = sock.getsockname()[:2]
    ip = ipaddress.ip_address(host)
    if not ip.is_unspecified:
        return [(host, port)]
    out: list[tuple[str, int]] = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            a = str(info[4][0])
            if not ipaddress.ip_address(a).is_loopback and (a, port) not in out:
                out.append((a, port))
    except OSError:
        pass
    out.append(("::1" if ip.version == 6 else "127.0.0.1", port))
    return out


def _coalesce(addr: np.ndarray, nb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge runs of contiguous descriptors (fewer iovecs); vectorized."""
    n = addr.shape[0]
    if n <= 1:
        return addr, nb
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(addr[1:], addr[:-1] + nb[:-1], out=brk[1:])
    if brk.all():
        return addr, nb
    starts = np.flatnonzero(brk)
    return addr[starts], np.add.reduceat(nb, starts).astype(_U64)


def _split_large(laddr: np.ndarray, raddr: np.ndarray, nb: np.ndarray, piece: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut descriptors longer than ``piece`` into pieces (same positions on both sides)."""
    big = nb > piece
    if not big.any():
        return laddr, raddr, nb
    cnt = ((nb + _U64(piece - 1)) // _U64(piece)).astype(np.int64)
    rep = np.repeat(np.arange(nb.shape[0]), cnt)
    first = np.cumsum(cnt) - cnt
    k = (np.arange(rep.shape[0]) - np.repeat(first, cnt)).astype(_U64)
    off = k * _U64(piece)
    ln = np.minimum(_U64(piece), nb[rep] - off)
    return laddr[rep] + off, raddr[rep] + off, ln


# ---- initiator side --------------------------------------------------------------------------
class _TcpRequest(ThreadRequest):
    """A transfer in flight: done when every chunk is acknowledged."""

    def __init__(self, nbytes: int, nchunks: int, conn: "_PeerConn", notify: bytes | None) -> None:
        super().__init__(nbytes)
        self._left = nchunks
        self._lock = threading.Lock()
        self._conn = conn
        self._notify = notify

    @property
    def failed(self) -> bool:
        return self._err is not None

    def chunk_done(self, err: BaseException | None = None) -> None:
        with self._lock:
            if self._ev.is_set():
                return
            if err is not None:
                self._err = err
                self._ev.set()
                return
            self._left -= 1
            if self._left > 0:
                return
        if self._notify is not None:
            self._conn.enqueue_notif(self._notify)
        self._ev.set()

    def cancel(self) -> bool:
        """Chunks not yet sent are dropped; chunks on the wire still land."""
        self.cancelled = True
        self.chunk_done(TransferError("transfer cancelled"))
        return True


@dataclass(slots=True)
class _Chunk:
    op: Op
    req: _TcpRequest
    laddr: np.ndarray  # local addresses (coalesced where contiguous)
    lnb: np.ndarray
    raddr: bytes  # target descriptors, raw uint64
    rnb: bytes
    nbytes: int
    rid: int = 0


class _Stream:
    """One TCP connection to a peer, with a sender and a reader thread."""

    def __init__(self, conn: "_PeerConn", sock: socket.socket, idx: int) -> None:
        self.conn = conn
        self.sock = sock
        self.fd = sock.fileno()
        self.idx = idx
        self.send_lock = threading.Lock()
        self.pending: dict[int, Any] = {}  # rid -> _Chunk | control slot
        self.plock = threading.Lock()
        self.last = time.monotonic()
        self._exits = 0
        self._xlock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._sender, name=f"kvx-tcp-send-{conn.name}-{idx}", daemon=True),
            threading.Thread(target=self._reader, name=f"kvx-tcp-recv-{conn.name}-{idx}", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _exit(self) -> None:
        with self._xlock:
            self._exits += 1
            last = self._exits == len(self.threads)
        if last:  # both threads left native I/O: the fd can go
            try:
                self.sock.close()
            except OSError:
                pass

    def add_pending(self, rid: int, item: Any) -> None:
        with self.plock:
            if not self.pending:
                self.last = time.monotonic()
            self.pending[rid] = item

    def send_chunk(self, ch: _Chunk) -> None:
        """Send one chunk (caller holds ``send_lock``); raises OSError."""
        conn = self.conn
        ch.rid = conn.next_rid()
        t = "w" if ch.op is Op.WRITE else "r"
        body = wire.pack(t, rid=ch.rid, addr=ch.raddr, nbytes=ch.rnb)
        head = wire.frame_header(_K_MSG, len(body)) + body
        self.add_pending(ch.rid, ch)
        if ch.op is Op.WRITE:
            _net.sendv(self.fd, head, ch.laddr, ch.lnb, conn.timeout)
        else:
            _net.sendv(self.fd, head, None, None, conn.timeout)
        self.last = time.monotonic()

    def _sender(self) -> None:
        conn = self.conn
        try:
            while True:
                item = conn.take()
                if item is None:
                    return
                try:
                    with self.send_lock:
                        if isinstance(item, _Chunk):
                            if item.req.failed:
                                continue
                            self.send_chunk(item)
                        else:  # a control frame: (body, rid, slot) or notification bytes
                            body, rid, slot = item
                            if rid:
                                self.add_pending(rid, slot)
                            _net.sendv(self.fd, wire.frame_header(_K_MSG, len(body)) + body, None, None,
                                       conn.timeout)
                except OSError as exc:
                    if isinstance(item, _Chunk):
                        item.req.chunk_done(PeerDisconnected(f"peer {conn.name!r}: send failed: {_why(exc)}"))
                    conn.fail(PeerDisconnected(f"peer {conn.name!r}: send failed: {_why(exc)}"))
                    return
        finally:
            self._exit()

    def _reader(self) -> None:
        conn = self.conn
        idle = min(0.5, conn.timeout / 4)
        try:
            while not conn.dead:
                try:
                    body = _net.recv_frame(self.fd, conn.max_msg, conn.timeout, idle, 0.0)
                except ValueError as exc:
                    raise ProtocolError(str(exc)) from None
                if body == -1:
                    with self.plock:
                        stalled = bool(self.pending) and time.monotonic() - self.last > conn.timeout
                    if stalled:
                        raise TransferTimeout(f"peer {conn.name!r} made no progress for {conn.timeout:.1f} s")
                    continue
                if body == 0:
                    raise PeerDisconnected(f"peer {conn.name!r} closed the connection")
                msg = wire.unpack(body, max_bytes=conn.max_msg)
                self.last = time.monotonic()
                self._handle(msg)
        except (KVXError, OSError) as exc:
            if not conn.dead:
                err = ERRORS(exc, conn.name)
                if isinstance(exc, ProtocolError):
                    log.warning("dropping the connection to %s: %s", conn.name, exc)
                conn.fail(err)
        finally:
            self._exit()

    def _handle(self, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "notif":
            wire.check(msg, "notif", {"msg": bytes})
            self.conn.backend.ctx.deliver(self.conn.name, msg["msg"])
            return
        rid = msg.get("re")
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise ProtocolError(f"unexpected {t!r} frame from the target")
        with self.plock:
            item = self.pending.pop(rid, None)
        if t == "rd":
            wire.check(msg, "rd", {"n": int})
            take = isinstance(item, _Chunk) and msg["n"] == item.nbytes and not item.req.failed
            try:
                if take:
                    _net.recvv(self.fd, item.laddr, item.lnb, self.conn.timeout, 0.0, self.conn.backend.rcv_lowat)
                else:
                    _net.discard(self.fd, msg["n"], self.conn.timeout)
            except (KVXError, OSError) as exc:
                # the chunk left ``pending`` with this reply: the connection's failure cannot reach it
                if isinstance(item, _Chunk):
                    item.req.chunk_done(ERRORS(exc, self.conn.name))
                raise
            if isinstance(item, _Chunk):
                item.req.chunk_done(None if take else ProtocolError("read reply of the wrong size"))
            return
        if item is None:
            return  # a cancelled request's reply
        if isinstance(item, _Chunk):
            if t == "ok":
                item.req.chunk_done()
            elif t == "err":
                item.req.chunk_done(RemoteError(f"{self.conn.name}: {msg.get('msg', 'refused')}"))
            else:
                raise ProtocolError(f"unexpected reply {t!r}")
        else:  # control request slot: [event, result]
            item[1] = msg
            item[0].set()


class _FastRequest(Request):
    """A small transfer on the fast stream: done when its reply was read (by whoever tests)."""

    __slots__ = ("done", "err", "fs", "laddr", "lnb", "nbytes", "notify", "rid")

    def __init__(self, fs: "_FastStream", nbytes: int, laddr: Any, lnb: Any, notify: bytes | None) -> None:
        self.fs = fs
        self.nbytes = nbytes
        self.rid = 0
        self.laddr = laddr
        self.lnb = lnb
        self.notify = notify
        self.done = False
        self.err: BaseException | None = None

    def finish(self, err: BaseException | None) -> None:
        if self.done:
            return
        self.err = err
        self.done = True
        if err is None and self.notify is not None:
            self.fs.conn.enqueue_notif(self.notify)

    def test(self) -> bool:
        if not self.done:
            self.fs.reap(0.0)
            if not self.done:
                return False
        if self.err is not None:
            raise self.err
        return True

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.done:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.fs.reap(left)
        return self.test()

    def cancel(self) -> bool:
        """The reply is still consumed later (the bytes may still land)."""
        self.finish(TransferError("transfer cancelled"))
        return True


class _FastStream:
    """A peer's dedicated connection for small transfers, without threads.

    One request at a time: the posting thread sends request and payload (``owner`` stays held
    until the reply was read); the thread that tests or waits reads the reply itself, first
    retrying the socket for ``SPIN`` seconds so a quick reply costs no wakeup. ``io`` serializes
    native I/O on the fd with closing it.
    """

    def __init__(self, conn: "_PeerConn", sock: socket.socket) -> None:
        self.conn = conn
        self.sock = sock
        self.fd = sock.fileno()
        self.owner = threading.Lock()
        self.io = threading.Lock()
        self.cur: _FastRequest | None = None
        self.closed = False

    def send(self, req: _FastRequest, head: bytes, laddr: Any, lnb: Any) -> None:
        """Send a request (caller holds ``owner``); raises PeerDisconnected."""
        conn = self.conn
        try:
            with self.io:
                if self.closed or conn.dead:
                    raise OSError(errno.ECONNRESET, "the fast stream is closed")
                self.cur = req
                _net.sendv(self.fd, head, laddr, lnb, conn.timeout)
        except OSError as exc:
            err = PeerDisconnected(f"peer {conn.name!r}: send failed: {_why(exc)}")
            conn.fail(err)
            raise err from exc

    def reap(self, wait: float) -> None:
        """Read the outstanding reply if it comes within ``wait`` seconds (0: only if there)."""
        req = self.cur
        if req is None:
            return
        if not (self.io.acquire(blocking=False) if wait <= 0 else self.io.acquire(timeout=wait)):
            return
        err: BaseException | None = None
        conn = self.conn
        try:
            if self.cur is not req:
                return
            if self.closed:
                err = conn.error or PeerDisconnected(f"peer {conn.name!r} is disconnected")
            else:
                try:
                    body = _net.recv_frame(self.fd, conn.max_msg, conn.timeout, max(0.0, wait),
                                           min(self.conn.backend.spin, wait) if wait > 0 else 0.0)
                    if body == -1:
                        return
                    if body == 0:
                        raise PeerDisconnected(f"peer {conn.name!r} closed the connection")
                    msg = wire.unpack(body, max_bytes=conn.max_msg)
                    t = msg["t"]
                    if msg.get("re") != req.rid:
                        raise ProtocolError(f"unexpected {t!r} frame on the fast stream")
                    if t == "rd":
                        wire.check(msg, "rd", {"n": int})
                        if msg["n"] != req.nbytes:
                            raise ProtocolError("read reply of the wrong size")
                        _net.recvv(self.fd, req.laddr, req.lnb, conn.timeout, 0.0)
                    elif t == "err":
                        err = RemoteError(f"{conn.name}: {msg.get('msg', 'refused')}")
                    elif t != "ok":
                        raise ProtocolError(f"unexpected reply {t!r}")
                except (KVXError, OSError, ValueError) as exc:
                    if isinstance(exc, ProtocolError):
                        log.warning("dropping the connection to %s: %s", conn.name, exc)
                    err = ERRORS(exc, conn.name)
                    self.closed = True  # the stream is out of sync: never reuse it
            self.cur = None
        finally:
            self.io.release()
        req.finish(err)
        if self.closed:
            conn.fail(err or PeerDisconnected(f"peer {conn.name!r} is disconnected"))
        else:
            self.owner.release()

    def fail(self, err: BaseException) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        req = self.cur
        if req is not None:
            req.finish(err)

    def close(self) -> None:
        got = self.io.acquire(timeout=5.0)  # shutdown() woke any call blocked in I/O
        try:
            self.closed = True
            self.sock.close()
        finally:
            if got:
                self.io.release()


class _PeerConn:
    """The streams to one peer and their shared chunk queue."""

    def __init__(self, backend: "TcpBackend", name: str) -> None:
        self.backend = backend
        self.name = name
        self.timeout = float(backend.cfg.peer_timeout)
        self.max_msg = backend.max_msg
        self.streams: list[_Stream] = []
        self.fast: _FastStream | None = None
        self.dead = False
        self.error: BaseException | None = None
        self._q: collections.deque[Any] = collections.deque()
        self._cv = threading.Condition()
        self._rid = 0
        self._rlock = threading.Lock()

    def next_rid(self) -> int:
        with self._rlock:
            self._rid += 1
            return self._rid

    def put(self, items: list[Any], front: bool = False) -> None:
        with self._cv:
            if self.dead:
                raise PeerDisconnected(f"peer {self.name!r} is disconnected: {self.error}")
            if front:
                self._q.extendleft(reversed(items))
            else:
                self._q.extend(items)
            self._cv.notify(len(items))

    def enqueue_notif(self, message: bytes) -> None:
        try:
            self.put([(wire.pack("notif", msg=message), 0, None)], front=True)
        except PeerDisconnected:
            log.warning("notification to %s lost: the peer is disconnected", self.name)

    def take(self) -> Any:
        with self._cv:
            while not self._q and not self.dead:
                self._cv.wait()
            if self.dead:
                return None
            return self._q.popleft()

    def control(self, t: str, timeout: float, **fields: Any) -> dict[str, Any]:
        """A request/reply on the streams (e.g. the region table)."""
        rid = self.next_rid()
        slot: list[Any] = [threading.Event(), None]
        self.put([(wire.pack(t, rid=rid, **fields), rid, slot)], front=True)
        if not slot[0].wait(timeout):
            raise TransferTimeout(f"no reply from {self.name!r} to {t!r} within {timeout:.1f} s")
        if isinstance(slot[1], BaseException):
            raise slot[1]
        if slot[1].get("t") == "err":
            raise RemoteError(f"{self.name}: {slot[1].get('msg')}")
        return slot[1]  # type: ignore[no-any-return]

    def fail(self, err: BaseException) -> None:
        with self._cv:
            if self.dead:
                return
            self.dead = True
            self.error = err
            queued = list(self._q)
            self._q.clear()
            self._cv.notify_all()
        log.info("tcp peer %s failed: %s", self.name, err)
        for s in self.streams:
            try:
                s.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        e0 = err if isinstance(err, TransferError) else PeerDisconnected(str(err))
        if self.fast is not None:
            self.fast.fail(e0)
        items = queued
        for s in self.streams:
            with s.plock:
                items += list(s.pending.values())
                s.pending.clear()
        e = err if isinstance(err, TransferError) else PeerDisconnected(str(err))
        for it in items:
            if isinstance(it, _Chunk):
                it.req.chunk_done(e)
            elif isinstance(it, list):
                it[1] = e
                it[0].set()
            elif isinstance(it, tuple) and it[2] is not None:
                it[2][1] = e
                it[2][0].set()

    def close(self) -> None:
        self.fail(PeerDisconnected(f"peer {self.name!r} was disconnected locally"))
        me = threading.current_thread()
        for s in self.streams:
            for t in s.threads:
                if t is not me and t.ident is not None:
                    t.join(timeout=5.0)
        if self.fast is not None:
            self.fast.close()


@dataclass(slots=True)
class _Prep:
    addr: np.ndarray
    nbytes: np.ndarray


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
    """

    streams: int = _cfg.option("KVX_TCP_STREAMS")
    chunk: int = _cfg.option("KVX_TCP_CHUNK")
    fast_max: int = _cfg.option("KVX_TCP_FAST_MAX")
    spin_us: float = _cfg.option("KVX_TCP_SPIN_US")
    serve_spin_us: float = _cfg.option("KVX_TCP_SERVE_SPIN_US")
    rcvlowat: int = _cfg.option("KVX_TCP_RCVLOWAT")


class TcpBackend(Backend):
    """Host memory to and from agents on any node over TCP; see the module docstring."""

    name = "tcp"
    kinds = frozenset({MemoryKind.HOST})
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
        self._lock = threading.RLock()
        self._closed = False
        # registrations as the target sees them, and pins held by serving threads
        self._cv = threading.Condition()
        self._lo = np.zeros(MAX_SLOTS, dtype=_U64)
        self._hi = np.zeros(MAX_SLOTS, dtype=_U64)
        self._live = np.zeros(MAX_SLOTS, dtype=bool)
        self._pins = np.zeros(MAX_SLOTS, dtype=np.int64)
        self._view: list[tuple[int, int, int]] = []
        self._starts: list[int] = []
        self._peers: dict[str, _PeerConn] = {}
        self._served: dict[int, tuple[socket.socket, threading.Thread, set[int]]] = {}
        self._hs = threading.BoundedSemaphore(MAX_HANDSHAKES)
        #: refused connections and requests: logged a few at a time, counted per kind
        self.refused = RefusalLog(log)
        #: hook for kvx.discovery.SideChannel sharing this listener: handler(sock, hello)
        self.side_handler: Callable[[socket.socket, dict[str, Any]], None] | None = None
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

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if not isinstance(region, Region) or region.kind != MemoryKind.HOST:
            raise RegistrationError("tcp backend registers HOST memory only")
        with self._cv:
            self._lo[slot] = region.addr
            self._hi[slot] = region.addr + region.nbytes
            self._live[slot] = True
            self._rebuild_view()
        return slot

    def deregister(self, region: Any, handle: Any) -> None:
        slot = int(handle)
        with self._cv:
            if self._lo[slot] != region.addr:
                return
            self._live[slot] = False
            self._rebuild_view()
            if self._cv.wait_for(lambda: self._pins[slot] == 0, self.timeout):
                self._lo[slot] = self._hi[slot] = 0
                return
            # a serving thread is stuck in I/O on this region: cut its connection to wake it
            stuck = [s for s, _t, pinned in self._served.values() if slot in pinned]
        for s in stuck:
            log.error("a peer did not finish a transfer on a released region within %.1f s; disconnecting it",
                      self.timeout)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._cv:
            if not self._cv.wait_for(lambda: self._pins[slot] == 0, 10.0):  # pragma: no cover
                log.error("tcp: region slot %d still pinned after cutting its connections", slot)
            self._lo[slot] = self._hi[slot] = 0

    def _pin(self, addr: np.ndarray, nb: np.ndarray, pinned: set[int]) -> str | None:
        """Validate target descriptors and pin their regions; return a refusal reason or None."""
        if addr.shape[0] == 0:
            return "empty descriptor list"
        slots = self.ctx.validate_local(MemoryKind.HOST, addr, nb, np.zeros_like(addr))
        bad = slots < 0
        if bad.any():
            i = int(np.argmax(bad))
            return f"descriptor {i} (0x{int(addr[i]):x}+{int(nb[i])}) is outside registered memory"
        used = np.unique(slots)
        with self._cv:  # re-check against our own view, atomically with pinning
            ok = (self._live[used].all() and bool(np.all(addr >= self._lo[slots]))
                  and bool(np.all(addr + nb <= self._hi[slots])))
            if not ok:
                return "the region was released"
            self._pins[used] += 1
        pinned.update(used.tolist())
        return None

    def _pin_small(self, ab: bytes, nbb: bytes, pinned: set[int]) -> tuple[str | None, int]:
        """``_pin`` for a few descriptors, without numpy: each descriptor must lie inside one
        live registration of ours (the view ``register``/``deregister`` keep, which a release
        updates before it returns); pins under the same lock. Returns (refusal or None, bytes)."""
        k = len(ab) // 8
        if k == 0:
            return "empty descriptor list", 0
        addrs = struct.unpack(f"<{k}Q", ab)
        nbs = struct.unpack(f"<{k}Q", nbb)
        total = sum(nbs)
        slots = []
        with self._cv:
            starts, view = self._starts, self._view
            for i, (a, n) in enumerate(zip(addrs, nbs)):
                j = bisect.bisect_right(starts, a) - 1
                if j < 0 or a + n > view[j][1]:
                    return (f"descriptor {i} (0x{a:x}+{n}) is outside registered memory"
                            " (or the region was released)"), total
                slots.append(view[j][2])
            used = set(slots)  # one pin per distinct region, as ``_unpin`` drops one per region
            for sl in used:
                self._pins[sl] += 1
        pinned.update(used)
        return None, total

    def _rebuild_view(self) -> None:
        """Sorted (start, end, slot) of live regions (caller holds ``_cv``)."""
        live = sorted((int(self._lo[sl]), int(self._hi[sl]), int(sl)) for sl in np.flatnonzero(self._live))
        self._view = live
        self._starts = [r[0] for r in live]

    def _unpin(self, pinned: set[int]) -> None:
        if not pinned:
            return
        with self._cv:
            self._pins[np.fromiter(pinned, dtype=np.int64)] -= 1
            self._cv.notify_all()
        pinned.clear()

    # ---- listener / target side ------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {"addrs": [[h, p] for h, p in self._addrs], "streams": self.streams}

    def _accept_loop(self) -> None:
        accept_loop(self._lsock, lambda: self._closed, self._hs, self._start_serving, "tcp", self.refused)

    def _start_serving(self, s: socket.socket, addr: Any) -> None:
        t = threading.Thread(target=self._serve, args=(s, addr), name="kvx-tcp-serve", daemon=True)
        with self._lock:
            self._served[id(s)] = (s, t, set())
        t.start()

    def _serve(self, s: socket.socket, addr: Any) -> None:
        key = id(s)
        pinned = self._served[key][2]
        who = f"{addr[0]}:{addr[1]}"
        try:
            try:
                hello = server_handshake(s, self.cfg.auth_token, self.ctx.agent_id, self.ctx.agent_name,
                                         float(self.cfg.handshake_timeout))
            except (KVXError, OSError) as exc:
                self.refused("connections", "tcp: refused a connection from %s: %s", who, exc)
                return
            finally:
                self._hs.release()
            if hello["svc"] != "data":
                h = self.side_handler
                if h is None:
                    self.refused("connections", "tcp: refused %r request from %s: no side channel here",
                                 hello["svc"], who)
                    return
                h(s, hello)
                return
            name = hello["name"]
            tune_socket(s, self.timeout)
            send_frame(s, wire.pack("welcome", name=self.ctx.agent_name, id=self.ctx.agent_id))
            s.setblocking(False)
            self._serve_loop(s, name, pinned)
        except (KVXError, OSError) as exc:
            log.info("tcp: connection from %s ended: %s", who, exc)
        finally:
            self._unpin(pinned)
            with self._lock:
                self._served.pop(key, None)
            try:
                s.close()
            except OSError:
                pass

    def _serve_loop(self, s: socket.socket, peer: str, pinned: set[int]) -> None:
        fd = s.fileno()
        to = self.timeout
        spin = 0.0
        while not self._closed:
            try:
                body = _net.recv_frame(fd, self.max_msg, to, 0.5, spin)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if body == -1:
                spin = 0.0
                continue
            if body == 0:
                return
            msg = wire.unpack(body, max_bytes=self.max_msg)
            t = msg["t"]
            if t in ("w", "r"):
                wire.check(msg, t, {"rid": int, "addr": bytes, "nbytes": bytes})
                rid = msg["rid"]
                ab, nbb = msg["addr"], msg["nbytes"]
                if len(ab) != len(nbb) or len(ab) % 8:
                    raise ProtocolError("malformed descriptor arrays")
                a2: Any
                n2: Any
                if len(ab) <= 8 * SMALL_DESCS:
                    # scalar path: same checks against our live registrations, no numpy
                    why, total = self._pin_small(ab, nbb, pinned)
                    a2, n2 = ab, nbb
                    if _BIG_ENDIAN:  # pragma: no cover - the wire is little-endian
                        a2, n2 = _native_u64(ab), _native_u64(nbb)
                else:
                    addr = np.frombuffer(ab, dtype=_U64)
                    nb = np.frombuffer(nbb, dtype=_U64)
                    total = int(nb.sum(dtype=np.float64))
                    why = self._pin(addr, nb, pinned)
                    if why is None:
                        a2, n2 = _coalesce(addr, nb)
                spin = self.serve_spin if total <= FAST_MAX else 0.0
                if t == "w":
                    if why is None:
                        try:
                            _net.recvv(fd, a2, n2, to, 0.0, self.rcv_lowat)
                        finally:
                            self._unpin(pinned)
                        _net.sendv(fd, _frame(wire.pack("ok", re=rid)), None, None, to)
                    else:
                        self.refused("requests", "tcp: refused a write from %s: %s", peer, why)
                        if total > self.max_msg:
                            raise ProtocolError(f"refused write of {total} bytes: {why}")
                        _net.discard(fd, total, to)
                        _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, to)
                else:
                    if why is None:
                        try:
                            _net.sendv(fd, _frame(wire.pack("rd", re=rid, n=total)), a2, n2, to)
                        finally:
                            self._unpin(pinned)
                    else:
                        self.refused("requests", "tcp: refused a read from %s: %s", peer, why)
                        _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, to)
            elif t == "notif":
                wire.check(msg, "notif", {"msg": bytes})
                self.ctx.deliver(peer, msg["msg"])
            elif t == "regions":
                wire.check(msg, "regions", {"rid": int})
                rows = [[int(MemoryKind.HOST), r.addr, r.nbytes, r.dev, slot, gen]
                        for slot, (r, gen) in self.ctx.regions().items()
                        if isinstance(r, Region) and r.kind == MemoryKind.HOST]
                _net.sendv(fd, _frame(wire.pack("rows", re=msg["rid"], rows=rows)), None, None, to)
            else:
                rid = msg.get("rid")
                if isinstance(rid, int):
                    _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=f"unknown request {t!r}")), None, None, to)

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
        conn = _PeerConn(self, peer.name)
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
        rows = msg.get("rows")
        if not isinstance(rows, list):
            raise ProtocolError("malformed region table")
        out = []
        for r in rows:
            if (not isinstance(r, list) or len(r) != 6
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 64) for x in r)
                    or not 0 < r[4] < MAX_SLOTS):
                raise ProtocolError("malformed region row")
            out.append(tuple(r))
        return out  # type: ignore[return-value]

    def disconnect(self, peer_name: str) -> None:
        with self._lock:
            conn = self._peers.pop(peer_name, None)
        if conn is not None:
            conn.close()

    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        if plist.peer is not None:
            conn = self._peers.get(plist.peer)
            if conn is None or conn.dead:
                raise PeerDisconnected(f"not connected to {plist.peer!r} over tcp")
        return _Prep(np.ascontiguousarray(d.addr, dtype=_U64), np.ascontiguousarray(d.nbytes, dtype=_U64))

    # ---- transfers -------------------------------------------------------------------------
    def post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
             notify: bytes | None) -> Request:
        lp: _Prep = local.bdata[self.name]
        rp: _Prep = remote.bdata[self.name]
        conn = self._peers.get(remote.peer)  # type: ignore[arg-type]
        if conn is None or conn.dead:
            raise PeerDisconnected(f"peer {remote.peer!r} is not connected over tcp"
                                   + (f": {conn.error}" if conn is not None else ""))
        if self.fast_max:
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
        laddr, raddr, ln = _split_large(laddr, raddr, ln, self.chunk)
        total = int(ln.sum())
        cum = np.cumsum(ln)
        g = np.maximum((cum - _U64(1)) // _U64(self.chunk), (np.arange(ln.shape[0]) // MAX_DESCS).astype(_U64))
        edges = np.flatnonzero(g[1:] != g[:-1]) + 1 if ln.shape[0] > 1 else np.zeros(0, dtype=np.int64)
        bounds = [0, *edges.tolist(), ln.shape[0]]
        req = _TcpRequest(total, len(bounds) - 1, conn, notify)
        chunks = []
        for a, b in zip(bounds, bounds[1:]):
            la, lnb = _coalesce(laddr[a:b], ln[a:b])
            chunks.append(_Chunk(op, req, la, lnb, raddr[a:b].tobytes(), ln[a:b].tobytes(),
                                 int(cum[b - 1] - (cum[a - 1] if a else 0))))
        if len(chunks) == 1 and total <= self.inline:
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
        conn.put(chunks)
        return req

    def _small(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any
               ) -> tuple[bytes, bytes, bytes, bytes, int] | None:
        """The fast path's descriptors, computed without numpy, or None when not small:
        (local addr, local nbytes as native u64; target addr, nbytes as little-endian u64; bytes)."""
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
        return (struct.pack(f"={k}Q", *la), struct.pack(f"={k}Q", *ln), struct.pack(f"<{k}Q", *ra),
                struct.pack(f"<{k}Q", *rn), total)

    def _fast_post(self, conn: _PeerConn, op: Op, la: bytes, ln: bytes, ra: bytes, rn: bytes, total: int,
                   notify: bytes | None) -> Request | None:
        """Send a small transfer on the peer's fast stream; None when that stream is busy."""
        fs = conn.fast
        if fs is None:
            return None
        if not fs.owner.acquire(blocking=False):
            fs.reap(0.0)  # the previous reply may be in: reading it frees the stream
            if not fs.owner.acquire(blocking=False):
                return None
        req = _FastRequest(fs, total, la, ln, notify)
        req.rid = rid = conn.next_rid()
        body = wire.pack("w" if op is Op.WRITE else "r", rid=rid, addr=ra, nbytes=rn)
        head = wire.frame_header(_K_MSG, len(body)) + body
        if op is Op.WRITE:
            fs.send(req, head, la, ln)
        else:
            fs.send(req, head, None, None)
        return req

    def make_plan(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
                  notify: bytes | None) -> Callable[[], Request | int]:
        """Small transfers: descriptors computed once, each post goes straight to the fast stream."""
        small = self._small(op, local.bdata[self.name], lidx, remote.bdata[self.name], ridx) \
            if self.fast_max else None
        if small is None:
            return super().make_plan(op, local, lidx, remote, ridx, notify)
        peer = remote.peer

        def post() -> Request | int:
            conn = self._peers.get(peer)  # type: ignore[arg-type]
            if conn is None or conn.dead:
                raise PeerDisconnected(f"peer {peer!r} is not connected over tcp"
                                       + (f": {conn.error}" if conn is not None else ""))
            req = self._fast_post(conn, op, *small, notify)
            return req if req is not None else self.post(op, local, lidx, remote, ridx, notify)

        return post

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


_BIG_ENDIAN = struct.pack("=H", 1) != struct.pack("<H", 1)


def _native_u64(b: bytes) -> bytes:  # pragma: no cover - big-endian hosts only
    k = len(b) // 8
    return struct.pack(f"={k}Q", *struct.unpack(f"<{k}Q", b))


def _frame(body: bytes) -> bytes:
    return wire.frame_header(_K_MSG, len(body)) + body


#: The tcp backend's error map: what a failure on the connection to a peer (``where``: its name)
#: means for the transfers on it. A transfer error passes; anything else cut the link.
ERRORS = ErrorMap(
    (OSError, None, lambda e, name: PeerDisconnected(f"peer {name!r}: {_why(e)}")),
    default=lambda e, name: PeerDisconnected(f"peer {name!r}: {e}"),
    keep=TransferError,
)


def _why(exc: OSError) -> str:
    if exc.errno == errno.ETIMEDOUT:
        return "no progress within the peer timeout (dead or cut off)"
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _hostname_ok(host: str) -> bool:
    """Whether ``host`` can be an IP address or a DNS name (at most 253 ASCII characters, labels
    of 1..63): what a peer's metadata may ask us to dial."""
    if not 0 < len(host) <= 253 or not host.isascii():
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label)
               for label in host.rstrip(".").split("."))


def _i64(x: Any) -> np.ndarray:
    a = np.atleast_1d(np.asarray(x))
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, not {a.dtype}")
    return a.astype(np.int64).reshape(-1)
