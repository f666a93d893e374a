"""The control listener of a storing member: authenticated connections (the HMAC handshake of
:mod:`kvx.net`, as tcp data connections), then framed msgpack requests served by :class:`Owner`.

Bounds: at most :data:`kvx.net.MAX_HANDSHAKES` connections in their handshake, the handshake
timeout, control frames of at most :data:`CTL_MAX` bytes, batches of ``max_batch`` blocks. A
malformed frame drops the connection; a request that fails its schema checks is answered with an
error and changes nothing. A connection's grants and leases are undone when it closes.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from .. import wire
from ..channel import Channel
from ..errors import KVXError, ProtocolError
from ..net import MAX_HANDSHAKES, RefusalLog, accept_loop, open_listener, send_frame, server_handshake
from .owner import Owner

__all__ = ["ControlServer", "CTL_MAX", "SVC"]

log = logging.getLogger(__name__)

#: Largest control frame (a batch of 4096 hashes of 64 bytes, with parents, fits).
CTL_MAX = 1 << 20
#: The handshake's service name for pool control connections.
SVC = "kvx-pool"


class ControlServer:
    """Serve ``owner`` on ``(host, port)`` (port 0: any free port)."""

    def __init__(self, owner: Owner, host: str, port: int, token: str | None, my_id: str, my_name: str,
                 handshake_timeout: float, near: Any = None) -> None:
        self.owner = owner
        #: the :class:`~kvx.pool.near.NearServer` that serves same-node clients, or None
        self.near = near
        self._token = token
        self._id = my_id
        self._name = my_name
        self._hs_timeout = float(handshake_timeout)
        self._closed = False
        self._lock = threading.Lock()
        self._chans: dict[int, Channel] = {}
        self._hs = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.refused = RefusalLog(log)
        self._lsock = open_listener(host, port)
        self.address: tuple[str, int] = tuple(self._lsock.getsockname()[:2])  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._accept, name=f"kvx-pool-ctl-{my_name}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        accept_loop(self._lsock, lambda: self._closed, self._hs, self._start, "pool control", self.refused)

    def _start(self, s: socket.socket, addr: Any) -> None:
        threading.Thread(target=self._handshake, args=(s, addr), name="kvx-pool-hs", daemon=True).start()

    def _handshake(self, s: socket.socket, addr: Any) -> None:
        try:
            try:
                hello = server_handshake(s, self._token, self._id, self._name, self._hs_timeout)
            finally:
                self._hs.release()
            if hello["svc"] != SVC:
                raise ProtocolError(f"not a pool connection ({str(hello['svc'])[:40]!r})")
            send_frame(s, wire.pack("welcome", id=self._id, name=self._name))
            s.settimeout(None)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (KVXError, OSError) as exc:
            self.refused("connections", "pool: refused a control connection from %s: %s", addr, exc)
            try:
                s.close()
            except OSError:
                pass
            return
        ch = Channel(s, CTL_MAX, self._on_message, self._on_close, name=str(hello["name"])[:64])
        ch.extra["peer_id"] = hello["id"]  # the agent id it proved: its data connections' too
        with self._lock:
            if self._closed:
                s.close()
                return
            self._chans[id(ch)] = ch
        ch.start()

    def _on_message(self, ch: Channel, msg: dict[str, Any], payload: Any, fds: list[int]) -> None:
        rid = msg.get("rid")
        if not isinstance(rid, int) or isinstance(rid, bool) or payload is not None or fds:
            raise ProtocolError("a pool request carries an int rid and nothing else")
        try:
            near = self.near
            if near is not None and msg.get("t") in near.TYPES:
                t, fields = near.handle(ch, msg)
            else:
                t, fields = self.owner.handle(ch, msg)
        except ProtocolError as exc:
            self.refused("requests", "pool: refused a request from %s: %s", ch.peer_name, exc)
            ch.reply_error(rid, str(exc)[:200])
            return
        if t:  # "": a notification (a release asking for no answer)
            ch.reply(rid, t, **fields)

    def _on_close(self, ch: Channel) -> None:
        self.owner.drop_client(ch)
        if self.near is not None:
            self.near.drop(ch)
        with self._lock:
            self._chans.pop(id(ch), None)

    def close(self) -> None:
        """Stop accepting, close every connection (their grants and leases are undone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            chans = list(self._chans.values())
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        self._thread.join(timeout=5.0)
        for ch in chans:
            ch.close()
        self.refused.flush()
