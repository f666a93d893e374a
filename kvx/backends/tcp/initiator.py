"""The tcp backend's initiator side: transfer requests, chunks, the streams and their threads, the
thread-less fast stream, and the connection to one peer."""

from __future__ import annotations

import collections
import errno
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import wire
from ...errors import (
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from ..base import Op, Request, ThreadRequest
from .common import _K_MSG, ERRORS, _net, _why
from .staging import Copier, Slot, SlotRing, Ticket

if TYPE_CHECKING:
    from .backend import TcpBackend

log = logging.getLogger(__name__)


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
    #: the target's memory kind and (CUDA) devices, raw uint64; sent when not HOST
    rkind: int = 0
    rdev: bytes | None = None
    #: local blocks go through a staging slot (CUDA memory, or host memory when forced)
    copier: Copier | None = None
    ldev: np.ndarray | None = None
    slot: Slot | None = None
    ring: SlotRing | None = None
    ticket: Ticket | None = None
    #: a read into a list with keep_digests on: its digest array and the rows of ``laddr``
    dig: np.ndarray | None = None
    drows: np.ndarray | None = None


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
        #: staging slots of this connection, per copier (made at its first staged chunk)
        self.rings: dict[int, SlotRing] = {}
        #: staged reads received, their scatters running: (ticket, chunk)
        self.inflight: collections.deque[tuple[Ticket, _Chunk]] = collections.deque()
        #: a staged write taken from the queue ahead of the one being sent (its gather running)
        self.ahead: _Chunk | None = None
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
            for ring in self.rings.values():
                ring.close()

    def ring(self, copier: Copier) -> SlotRing:
        r = self.rings.get(id(copier))
        if r is None:
            be = self.conn.backend
            r = self.rings.setdefault(id(copier), SlotRing(copier, be.stage_bytes, be.stage_slots))
        return r

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
        if ch.rkind:
            body = wire.pack(t, rid=ch.rid, addr=ch.raddr, nbytes=ch.rnb, k=ch.rkind, dev=ch.rdev)
        else:
            body = wire.pack(t, rid=ch.rid, addr=ch.raddr, nbytes=ch.rnb)
        head = wire.frame_header(_K_MSG, len(body)) + body
        self.add_pending(ch.rid, ch)
        if ch.op is Op.WRITE and ch.slot is not None:
            _net.sendv(self.fd, head, np.array([ch.slot.addr], dtype=np.uint64),
                       np.array([ch.nbytes], dtype=np.uint64), conn.timeout)
        elif ch.op is Op.WRITE:
            _net.sendv(self.fd, head, ch.laddr, ch.lnb, conn.timeout)
        else:
            _net.sendv(self.fd, head, None, None, conn.timeout)
        self.last = time.monotonic()

    def _stage(self, ch: _Chunk) -> None:
        """Take ``ch``'s staging slot (from this stream's ring); for a write, start gathering its
        blocks into it."""
        assert ch.copier is not None
        ring = self.ring(ch.copier)
        ch.slot = ring.take(self.conn.timeout)
        ch.ring = ring
        if ch.op is Op.WRITE:
            try:
                ch.ticket = ch.copier.gather(ch.slot, ch.laddr, ch.lnb, ch.ldev)
            except BaseException:
                self._unstage(ch)
                raise

    @staticmethod
    def _unstage(ch: _Chunk) -> None:
        if ch.slot is not None and ch.ring is not None:
            ch.ring.give(ch.slot)
        ch.slot = None

    def _send_staged(self, ch: _Chunk) -> None:
        """Stage ``ch`` (unless staged ahead), start staging the next queued write (kept as
        ``self.ahead``: its gather runs while ``ch`` is on the wire), wait for ``ch``'s gather and
        send it. A local failure fails ``ch``'s request; raises OSError from the socket."""
        try:
            if ch.slot is None:
                self._stage(ch)
            if ch.op is Op.WRITE:
                if self.ahead is None:
                    nxt = self.conn.take_staged_write(self.idx)
                    if nxt is not None:
                        try:
                            self._stage(nxt)
                            self.ahead = nxt
                        except KVXError as exc:
                            nxt.req.chunk_done(exc)
                if ch.ticket is not None:
                    ch.ticket.wait(self.conn.timeout)
        except KVXError as exc:
            self._unstage(ch)
            ch.req.chunk_done(exc)
            return
        with self.send_lock:
            try:
                self.send_chunk(ch)
            finally:
                if ch.op is Op.WRITE:
                    self._unstage(ch)  # sent: the bytes are in the socket's buffer

    def _sender(self) -> None:
        conn = self.conn
        item: Any = None
        try:
            while True:
                item, self.ahead = (self.ahead, None) if self.ahead is not None else (conn.take(self.idx), None)
                if item is None or conn.dead:
                    return
                try:
                    if isinstance(item, _Chunk) and item.copier is not None:
                        if item.req.failed:
                            self._unstage(item)
                            continue
                        self._send_staged(item)
                        continue
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
            for it in (item, self.ahead):  # taken from the queue, so the connection's failure cannot reach them
                if isinstance(it, _Chunk) and it.rid == 0:
                    self._unstage(it)
                    it.req.chunk_done(conn.error or PeerDisconnected(f"peer {conn.name!r} is disconnected"))
            self.ahead = None
            self._exit()

    def _reader(self) -> None:
        conn = self.conn
        idle = min(0.5, conn.timeout / 4)
        try:
            while not conn.dead:
                if self.inflight:  # staged reads scattering: finish those done, never sleep on the socket
                    self._reap(False)
                try:
                    body = _net.recv_frame(self.fd, conn.max_msg, conn.timeout, 0.0 if self.inflight else idle, 0.0)
                except ValueError as exc:
                    raise ProtocolError(str(exc)) from None
                if body == -1 and self.inflight:
                    self._reap(True)
                    continue
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
            while self.inflight:  # the scatters already started still land (their requests complete)
                self._reap(True)
            self._exit()

    def _reap(self, block: bool) -> None:
        """Complete the staged reads whose scatter finished (``block``: wait for the oldest)."""
        while self.inflight:
            tk, ch = self.inflight[0]
            err: BaseException | None = None
            if not tk.done():
                if not block:
                    return
                try:
                    tk.wait(self.conn.timeout)
                except KVXError as exc:
                    err = exc
            block = False
            self.inflight.popleft()
            self._unstage(ch)
            ch.req.chunk_done(err)

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
                if take and item.slot is not None:
                    _net.recvv(self.fd, np.array([item.slot.addr], dtype=np.uint64),
                               np.array([item.nbytes], dtype=np.uint64), self.conn.timeout, 0.0,
                               self.conn.backend.rcv_lowat)
                elif take and item.dig is not None:
                    out = np.empty(item.laddr.shape[0], dtype=np.uint64)
                    _net.recvv(self.fd, item.laddr, item.lnb, self.conn.timeout, 0.0, self.conn.backend.rcv_lowat,
                               out)
                    item.dig[item.drows] = out
                elif take:
                    _net.recvv(self.fd, item.laddr, item.lnb, self.conn.timeout, 0.0, self.conn.backend.rcv_lowat)
                else:
                    _net.discard(self.fd, msg["n"], self.conn.timeout)
            except (KVXError, OSError) as exc:
                # the chunk left ``pending`` with this reply: the connection's failure cannot reach it
                if isinstance(item, _Chunk):
                    self._unstage(item)
                    item.req.chunk_done(ERRORS(exc, self.conn.name))
                raise
            if isinstance(item, _Chunk) and take and item.slot is not None and item.copier is not None:
                try:
                    self.inflight.append((item.copier.scatter(item.slot, item.laddr, item.lnb, item.ldev), item))
                except KVXError as exc:
                    self._unstage(item)
                    item.req.chunk_done(exc)
                return
            if isinstance(item, _Chunk):
                self._unstage(item)
                item.req.chunk_done(None if take else ProtocolError("read reply of the wrong size"))
            return
        if item is None:
            return  # a cancelled request's reply
        if isinstance(item, _Chunk):
            self._unstage(item)  # a refused staged read gives its slot back
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

    __slots__ = ("dig", "done", "err", "fs", "laddr", "lnb", "nbytes", "notify", "rid")

    def __init__(self, fs: "_FastStream", nbytes: int, laddr: Any, lnb: Any, notify: bytes | None) -> None:
        self.fs = fs
        self.nbytes = nbytes
        self.rid = 0
        self.laddr = laddr
        self.lnb = lnb
        self.notify = notify
        self.done = False
        self.err: BaseException | None = None
        #: a read into a list with keep_digests on: (its digest array, the local rows)
        self.dig: tuple[np.ndarray, list[int]] | None = None

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
                        if req.dig is not None:
                            out = np.empty(len(req.dig[1]), dtype=np.uint64)
                            _net.recvv(self.fd, req.laddr, req.lnb, conn.timeout, 0.0, 0, out)
                            req.dig[0][req.dig[1]] = out
                        else:
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
        #: the largest staged frame the peer takes (its metadata; 0: it serves no CUDA memory)
        self.stage = 0
        #: the peer stages its host memory too (``TcpOptions.stage_host``)
        self.stage_host = False
        self.dead = False
        self.error: BaseException | None = None
        #: control frames, notifications, and data chunks when there is one stream
        self._q: collections.deque[Any] = collections.deque()
        #: each stream's own data chunks (``put_chunks`` spreads a transfer over the streams)
        self._sq: list[collections.deque[Any]] = []
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

    def _own(self, idx: int) -> "collections.deque[Any]":
        """Stream ``idx``'s chunk queue (caller holds ``_cv``)."""
        while len(self._sq) <= idx:
            self._sq.append(collections.deque())
        return self._sq[idx]

    def put_chunks(self, chunks: list[Any]) -> None:
        """Queue a transfer's chunks, each on the stream with the fewest chunks queued or
        unanswered. Not one shared queue: a read's request frames take microseconds to send, so
        whichever sender thread is awake would take them all and the whole read would come back
        on one connection (writes balanced themselves only because sending a payload keeps a
        sender busy)."""
        n = len(self.streams)
        if n <= 1:
            self.put(chunks)
            return
        with self._cv:
            if self.dead:
                raise PeerDisconnected(f"peer {self.name!r} is disconnected: {self.error}")
            qs = [self._own(i) for i in range(n)]
            load = [len(qs[i]) + len(self.streams[i].pending) for i in range(n)]
            for ch in chunks:
                i = load.index(min(load))
                qs[i].append(ch)
                load[i] += 1
            self._cv.notify_all()

    def take(self, idx: int = 0) -> Any:
        """The next item for stream ``idx``: a shared one (control frames first), else its own."""
        with self._cv:
            own = self._own(idx)
            while not self._q and not own and not self.dead:
                self._cv.wait()
            if self.dead:
                return None
            return self._q.popleft() if self._q else own.popleft()

    def take_staged_write(self, idx: int = 0) -> "_Chunk | None":
        """Stream ``idx``'s next item if it is a staged write not yet staged (without waiting)."""
        with self._cv:
            q = self._q if self._q else self._own(idx)
            if q and not self.dead:
                it = q[0]
                if isinstance(it, _Chunk) and it.copier is not None and it.op is Op.WRITE and it.slot is None:
                    return q.popleft()  # type: ignore[no-any-return]
        return None

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
            for q in self._sq:
                queued += list(q)
                q.clear()
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


