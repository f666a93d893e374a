"""Framed, bounded message channels over stream sockets (AF_UNIX or TCP).

A frame is an 8-byte header (magic, kind, length) and a msgpack body; a message may carry a
raw payload frame after it and, on AF_UNIX, file descriptors. Each channel has one reader
thread that hands messages to a callback and matches replies to requests.
"""

from __future__ import annotations

import array
import itertools
import logging
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from . import wire
from .errors import PeerDisconnected, ProtocolError, RemoteError, TransferTimeout

__all__ = ["Channel", "recv_exact"]

log = logging.getLogger(__name__)

MessageHandler = Callable[["Channel", dict[str, Any], "memoryview | None", list[int]], None]

K_MSG = 1
K_DATA = 2
_MAX_FDS = 8
#: Buffers up to this size are plain (zeroed) bytearrays; larger ones are committed as bytes arrive.
_SMALL = 64 << 10


def _buffer(n: int) -> memoryview:
    """A writable buffer of ``n`` bytes whose memory is committed only as bytes are written
    (a large uninitialized allocation), so a claimed length costs nothing until the bytes come."""
    if n <= _SMALL:
        return memoryview(bytearray(n))
    return np.empty(n, dtype=np.uint8).data


def recv_exact(sock: socket.socket, n: int, into: memoryview | None = None,
               deadline: float | None = None) -> tuple[memoryview, list[int]]:
    """Read exactly ``n`` bytes (and any fds sent with them); raise PeerDisconnected on EOF and,
    when a ``deadline`` (monotonic) is given, TransferTimeout once it passed."""
    buf = into if into is not None else _buffer(n)
    got = 0
    fds: list[int] = []
    is_unix = sock.family == socket.AF_UNIX
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                for fd in fds:
                    _close_fd(fd)
                raise TransferTimeout("handshake deadline passed")
            sock.settimeout(left)
        try:
            nbytes = _recv_some(sock, buf, got, n, is_unix, fds)
        except OSError as exc:
            for fd in fds:
                _close_fd(fd)
            if deadline is not None and isinstance(exc, TimeoutError):
                raise TransferTimeout("handshake deadline passed") from None
            raise
        if nbytes == 0:
            for fd in fds:
                _close_fd(fd)
            raise PeerDisconnected("connection closed by peer")
        got += nbytes
    return buf, fds


def _recv_some(sock: socket.socket, buf: memoryview, got: int, n: int, is_unix: bool, fds: list[int]) -> int:
    """One receive into ``buf[got:n]``; on AF_UNIX the first one also collects passed fds."""
    if is_unix and got == 0:
        fdsize = array.array("i").itemsize * _MAX_FDS
        nbytes, anc, _flags, _addr = sock.recvmsg_into([buf[got:n]], socket.CMSG_SPACE(fdsize))
        for level, typ, data in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                a = array.array("i")
                a.frombytes(data[: len(data) - (len(data) % a.itemsize)])
                fds.extend(a)
        return int(nbytes)
    return sock.recv_into(buf[got:n], n - got)


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


class Channel:
    """One connection to a peer, with a reader thread.

    ``on_message(channel, msg, payload, fds)`` handles unsolicited messages (requests,
    notifications); replies (messages with ``re``) wake the matching :meth:`request`.
    """

    def __init__(self, sock: socket.socket, max_bytes: int, on_message: MessageHandler,
                 on_close: Callable[["Channel"], None] | None = None, name: str = "?") -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self.on_message = on_message
        self.on_close = on_close
        self.peer_name = name
        self.peer_id = ""
        self.alive = True
        self.error: BaseException | None = None
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiters: dict[int, list[Any]] = {}
        self._wlock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.extra: dict[str, Any] = {}

    # -- sending ------------------------------------------------------------------------------
    def send(self, msg: bytes, payload: Any = None, fds: list[int] | None = None) -> None:
        """Send one message (and an optional payload of bytes-like data)."""
        if not self.alive:
            raise PeerDisconnected(f"connection to {self.peer_name!r} is closed")
        hdr = wire.frame_header(K_MSG, len(msg))
        try:
            with self._send_lock:
                if fds:
                    self.sock.sendmsg([hdr], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                    self.sock.sendall(msg)
                else:
                    self.sock.sendall(hdr + msg)
                if payload is not None:
                    mv = memoryview(payload).cast("B")
                    self.sock.sendall(wire.frame_header(K_DATA, len(mv)))
                    self.sock.sendall(mv)
        except OSError as exc:
            self._fail(PeerDisconnected(f"connection to {self.peer_name!r} lost: {exc}"))
            raise PeerDisconnected(f"connection to {self.peer_name!r} lost: {exc}") from exc

    def request(self, t: str, timeout: float, payload: Any = None, fds: list[int] | None = None,
                **fields: Any) -> tuple[dict[str, Any], memoryview | None, list[int]]:
        """Send a request and wait (bounded) for its reply."""
        rid = next(self._ids)
        slot: list[Any] = [threading.Event(), None]
        with self._wlock:
            self._waiters[rid] = slot
        try:
            self.send(wire.pack(t, rid=rid, pl=payload is not None, **fields), payload, fds)
            if not slot[0].wait(timeout):
                raise TransferTimeout(f"no reply from {self.peer_name!r} to {t!r} within {timeout:.1f} s")
        finally:
            with self._wlock:
                self._waiters.pop(rid, None)
        res = slot[1]
        if isinstance(res, BaseException):
            raise res
        msg, pl, rfds = res
        if msg.get("t") == "error":
            for fd in rfds:
                _close_fd(fd)
            raise RemoteError(f"{self.peer_name}: {msg.get('msg', 'refused')}")
        return msg, pl, rfds

    def reply(self, rid: int, t: str, payload: Any = None, fds: list[int] | None = None, **fields: Any) -> None:
        self.send(wire.pack(t, re=rid, pl=payload is not None, **fields), payload, fds)

    def reply_error(self, rid: int, text: str) -> None:
        try:
            self.send(wire.pack("error", re=rid, msg=text))
        except PeerDisconnected:
            pass

    # -- receiving ----------------------------------------------------------------------------
    def recv_one(self, limit: int | None = None, deadline: float | None = None, max_items: int | None = None
                 ) -> tuple[dict[str, Any], memoryview | None, list[int]]:
        """Read one message with its payload (used directly during handshakes, there with a
        smaller size ``limit``, at most ``max_items`` per msgpack container, and one ``deadline``
        for the whole handshake)."""
        lim = self.max_bytes if limit is None else min(limit, self.max_bytes)
        hdr, fds = recv_exact(self.sock, wire.HEADER, deadline=deadline)
        try:
            kind, n = wire.parse_frame_header(bytes(hdr), lim)
            if kind != K_MSG:
                raise ProtocolError("expected a message frame")
            body, more = recv_exact(self.sock, n, deadline=deadline)
            fds += more
            msg = wire.unpack(body, max_bytes=lim, max_items=max_items)
            payload = None
            if msg.get("pl"):
                h2, _ = recv_exact(self.sock, wire.HEADER, deadline=deadline)
                k2, n2 = wire.parse_frame_header(bytes(h2), lim)
                if k2 != K_DATA:
                    raise ProtocolError("expected a data frame")
                payload, _ = recv_exact(self.sock, n2, deadline=deadline)
        except BaseException:
            for fd in fds:
                _close_fd(fd)
            raise
        return msg, payload, fds

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvx-chan-{self.peer_name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self.alive:
                msg, payload, fds = self.recv_one()
                rid = msg.get("re")
                if isinstance(rid, int) and not isinstance(rid, bool):
                    with self._wlock:
                        slot = self._waiters.get(rid)
                    if slot is not None:
                        slot[1] = (msg, payload, fds)
                        slot[0].set()
                    else:
                        for fd in fds:
                            _close_fd(fd)
                    continue
                try:
                    self.on_message(self, msg, payload, fds)
                except ProtocolError as exc:
                    log.warning("dropping connection from %s: %s", self.peer_name, exc)
                    raise
                except Exception:  # a handler's bug: keep serving, and fail the request at once
                    log.exception("handling %r from %s", msg.get("t"), self.peer_name)
                    rid = msg.get("rid")
                    if isinstance(rid, int) and not isinstance(rid, bool):
                        self.reply_error(rid, f"internal error handling {str(msg.get('t'))[:40]!r}")
        except (PeerDisconnected, ProtocolError, OSError) as exc:
            self._fail(exc if isinstance(exc, PeerDisconnected) else PeerDisconnected(str(exc)))

    def _fail(self, err: BaseException) -> None:
        with self._wlock:
            if not self.alive:
                return
            self.alive = False
            self.error = err
            waiters = list(self._waiters.values())
        for slot in waiters:
            slot[1] = PeerDisconnected(f"peer {self.peer_name!r} disconnected: {err}")
            slot[0].set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.on_close is not None:
            try:
                self.on_close(self)
            except Exception:
                log.exception("on_close")

    def close(self) -> None:
        """Close the connection; pending requests fail with PeerDisconnected."""
        self._fail(PeerDisconnected("closed locally"))
        try:
            self.sock.close()
        except OSError:
            pass
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=2.0)
