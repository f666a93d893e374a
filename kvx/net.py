"""Frames, the HMAC handshake, bounded accept loops, the refusal log, listeners and the addresses
they advertise: what a kvx listener does before it trusts a connection (the tcp backend's data
listener, the discovery side channel, and -- for the limits, the busy notice and the refusal log --
the same-node link).

Before a peer has proved the token (or, without a token, before the handshake is over) it gets:

- at most :data:`MAX_HANDSHAKES` connections in their handshake at once per listener; one more
  is told ``busy`` (so its dialler reports the true reason) and closed;
- frames of at most :data:`PREAUTH_MAX` bytes holding at most :data:`PREAUTH_ITEMS` msgpack items,
  read into buffers that grow only as bytes arrive;
- one deadline (``handshake_timeout``) for the whole handshake, not one per ``recv``.

The dialling side bounds what a listener may answer in the same way: a handshake reply is at most
:data:`PREAUTH_MAX` bytes, a side-channel reply (metadata, a descriptor list) at most
:data:`REPLY_MAX`.
"""

from __future__ import annotations

import ipaddress
import logging
import operator
import socket
import threading
import time
from typing import Any, Callable

from . import auth, wire
from .errors import AuthError, PeerDisconnected, ProtocolError, TransferTimeout, UsageError

__all__ = ["MAX_HANDSHAKES", "PREAUTH_MAX", "PREAUTH_ITEMS", "REPLY_MAX", "RefusalLog", "accept_loop",
           "advertised", "client_handshake", "notice", "open_listener", "recv_exact_deadline", "recv_frame",
           "send_frame", "server_handshake"]

log = logging.getLogger(__name__)

#: Connections one listener lets run their handshake at once.
MAX_HANDSHAKES = 32
#: Largest frame before authentication (either side).
PREAUTH_MAX = 64 << 10
#: Most msgpack containers' items in one frame before authentication.
PREAUTH_ITEMS = 64
#: Largest side-channel reply (agent metadata or a published descriptor list).
REPLY_MAX = 16 << 20
#: Bytes read per ``recv`` while a buffer grows (a claimed length allocates nothing by itself).
_STEP = 1 << 20

_K_MSG = 1


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send one msgpack frame on a blocking (or timeout-mode) socket."""
    sock.sendall(wire.frame_header(_K_MSG, len(body)) + body)


def notice(sock: socket.socket, t: str, why: str) -> None:
    """Tell a peer about to be closed why (``denied``, ``busy``): best effort, never blocks."""
    body = wire.pack(t, msg=why)
    try:
        sock.send(wire.frame_header(_K_MSG, len(body)) + body, socket.MSG_DONTWAIT)
    except OSError:
        pass


def recv_exact_deadline(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Read exactly ``n`` bytes before ``deadline`` (monotonic); memory grows only as they arrive.

    Raises
    ------
    TransferTimeout
        If the deadline passes first.
    PeerDisconnected
        If the peer closes the connection first.
    """
    parts: list[bytes] = []
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("handshake deadline passed")
        sock.settimeout(left)
        try:
            part = sock.recv(min(n - got, _STEP))
        except TimeoutError:
            raise TransferTimeout("handshake deadline passed") from None
        if not part:
            raise PeerDisconnected("connection closed during the handshake")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def recv_frame(sock: socket.socket, deadline: float, max_bytes: int, max_items: int | None = None) -> dict[str, Any]:
    """Read one frame before ``deadline`` (monotonic), of at most ``max_bytes`` bytes and (when
    given) ``max_items`` items per msgpack container; raise ProtocolError on anything else."""
    hdr = recv_exact_deadline(sock, wire.HEADER, deadline)
    kind, n = wire.parse_frame_header(hdr, max_bytes)
    if kind != _K_MSG:
        raise ProtocolError("expected a message frame")
    return wire.unpack(recv_exact_deadline(sock, n, deadline), max_bytes=max_bytes, max_items=max_items)


class RefusalLog:
    """Log refused connections and requests without flooding the log.

    Per kind of refusal, the first ``burst`` of each ``period`` seconds are logged at WARNING one
    by one; the rest are counted and summed up in one WARNING line when the next period starts (or
    at :meth:`flush`). :attr:`counts` holds the totals per kind since the start.
    """

    def __init__(self, logger: logging.Logger, burst: int = 5, period: float = 60.0) -> None:
        self.logger = logger
        self.burst = burst
        self.period = period
        self.counts: dict[str, int] = {}
        self._win: dict[str, list[float]] = {}  # kind -> [window start, logged, suppressed]
        self._lock = threading.Lock()

    def __call__(self, kind: str, fmt: str, *args: Any) -> None:
        """Count one refusal of ``kind``; log ``fmt % args`` unless over this period's burst."""
        now = time.monotonic()
        summary = None
        with self._lock:
            total = self.counts.get(kind, 0)
            self.counts[kind] = total + 1
            w = self._win.get(kind)
            if w is None or now - w[0] >= self.period:
                if w is not None and w[2]:
                    summary = (int(w[2]), now - w[0], total)
                w = self._win[kind] = [now, 0, 0]
            if w[1] < self.burst:
                w[1] += 1
                emit = True
            else:
                w[2] += 1
                emit = False
        if summary is not None:
            self._summary(kind, *summary)
        if emit:
            self.logger.warning(fmt, *args)

    def _summary(self, kind: str, n: int, secs: float, total: int) -> None:
        self.logger.warning("%d more refused %s not logged one by one in the last %.1f s (%d in all)",
                            n, kind, secs, total)

    def flush(self) -> None:
        """Log the summaries of refusals counted but not logged yet."""
        now = time.monotonic()
        with self._lock:
            pend = [(k, int(w[2]), now - w[0], self.counts.get(k, 0)) for k, w in self._win.items() if w[2]]
            for k, _n, _s, _t in pend:
                self._win[k][2] = 0
        for k, n, secs, total in pend:
            self._summary(k, n, secs, total)


def accept_loop(lsock: socket.socket, closed: Callable[[], bool], hs: threading.BoundedSemaphore,
                start: Callable[[socket.socket, Any], None], what: str, refused: RefusalLog) -> None:
    """Accept connections on ``lsock`` until it is closed (or ``closed()``), handing each to
    ``start(sock, addr)`` -- which serves it on a thread of its own and releases ``hs`` once the
    handshake is over -- unless ``hs`` says too many are still in their handshake: then it is told
    ``busy`` and closed at once."""
    while not closed():
        try:
            s, addr = lsock.accept()
        except OSError:
            return
        if closed():
            s.close()
            return
        if not hs.acquire(blocking=False):
            refused("connections (busy)", "%s: refused a connection from %s: too many connections in their handshake",
                    what, addr)
            notice(s, "busy", "too many connections in their handshake")
            s.close()
            continue
        start(s, addr)


def server_handshake(sock: socket.socket, token: str | None, my_id: str, my_name: str,
                     timeout: float) -> dict[str, Any]:
    """Run the listener's side of the HMAC handshake within ``timeout`` seconds in all; return the
    client's hello.

    Raises
    ------
    AuthError, ProtocolError, TransferTimeout, PeerDisconnected, OSError
        If the client fails to prove the token, speaks garbage, or is too slow.
    """
    deadline = time.monotonic() + timeout
    nonce = auth.new_nonce()
    sock.settimeout(timeout)
    send_frame(sock, wire.pack("challenge", nonce=nonce, id=my_id))
    msg = recv_frame(sock, deadline, PREAUTH_MAX, PREAUTH_ITEMS)
    wire.check(msg, "hello", {"name": str, "id": str, "mac": bytes, "svc": str})
    try:
        auth.verify(token, nonce, msg["id"], my_id, msg["mac"])
    except AuthError:
        try:
            send_frame(sock, wire.pack("denied", msg="authentication failed"))
        except OSError:
            pass
        raise
    return msg


def client_handshake(sock: socket.socket, token: str | None, my_id: str, my_name: str, svc: str,
                     timeout: float, expect_id: str | None = None, max_reply: int = PREAUTH_MAX,
                     **extra: Any) -> dict[str, Any]:
    """Run the connecting side of the handshake within ``timeout`` seconds in all; return the
    server's first reply after hello (at most ``max_reply`` bytes).

    Raises
    ------
    AuthError
        If the server refused our proof (or closed the connection right after it).
    PeerDisconnected
        If the server is busy (too many connections in their handshake) or closed the
        connection before its challenge.
    ProtocolError
        If it answered with something else than the protocol, or too much.
    """
    deadline = time.monotonic() + timeout
    try:
        ch = recv_frame(sock, deadline, PREAUTH_MAX, PREAUTH_ITEMS)
    except PeerDisconnected as exc:
        raise PeerDisconnected("the listener closed the connection before its challenge") from exc
    if ch.get("t") == "busy":
        raise PeerDisconnected(f"the listener is busy ({ch.get('msg')!s:.200}); retry later")
    if ch.get("t") == "denied":
        raise AuthError(f"the listener refused us: {ch.get('msg')!s:.200}")
    wire.check(ch, "challenge", {"nonce": bytes, "id": str})
    if expect_id is not None and ch["id"] != expect_id:
        raise ProtocolError("the listener answered with another agent id (stale metadata?)")
    mac = auth.prove(token, ch["nonce"], my_id, ch["id"])
    send_frame(sock, wire.pack("hello", name=my_name, id=my_id, mac=mac, svc=svc, **extra))
    try:
        rep = recv_frame(sock, deadline, max_reply, PREAUTH_ITEMS)
    except PeerDisconnected as exc:
        raise AuthError("the listener closed the handshake after our proof (wrong KVX_AUTH_TOKEN?)") from exc
    if rep.get("t") == "denied":
        raise AuthError(f"the listener refused us: {rep.get('msg', 'authentication failed')!s:.200} "
                        "(wrong or missing KVX_AUTH_TOKEN)")
    return rep


def open_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``(host, port)``.

    Raises
    ------
    UsageError
        If the address is not one this machine can listen on (bad host, port, address in use).
    """
    try:
        if isinstance(port, bool):
            raise TypeError("bool")
        port = operator.index(port)
    except TypeError:
        raise UsageError(f"cannot listen on port {port!r}: not a port number (0..65535)") from None
    if not 0 <= port <= 65535:
        raise UsageError(f"cannot listen on port {port!r}: not a port number (0..65535)")
    if not isinstance(host, str):
        raise UsageError(f"cannot listen on host {host!r:.80}: not a string")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        fam, st, proto, _c, addr = infos[0]
    except (OSError, UnicodeError, ValueError, TypeError, OverflowError) as exc:
        raise UsageError(f"cannot listen on {host!r:.80} port {port!r}: {exc}") from exc
    s = socket.socket(fam, st | socket.SOCK_CLOEXEC, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(128)
    except OSError as exc:
        s.close()
        raise UsageError(f"cannot listen on {host!r:.80} port {port}: {exc}") from exc
    return s


def advertised(sock: socket.socket) -> list[tuple[str, int]]:
    """Addresses peers should dial to reach the listening ``sock``, best first.

    The socket's own address, or for a wildcard bind (``0.0.0.0``, ``::``) this host's
    non-loopback addresses and then the loopback one. The tcp backend and the discovery side
    channel publish these in their metadata.
    """
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
