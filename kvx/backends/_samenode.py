"""The same-node peer link shared by the ``host`` and ``cuda`` backends.

Both backends listen on an abstract AF_UNIX socket and run the same handshake over it: the
listener checks the caller's user (SO_PEERCRED: the same uid only, root included), sends a challenge, checks
the HMAC in the ``hello`` (``KVX_AUTH_TOKEN``, :mod:`kvx.auth`), and answers ``welcome`` with two
descriptors: its control table (memfd, mapped read-only by the peer) and a fresh page of in-flight
counters for that peer (memfd, mapped read-write on both sides). What differs -- the size of a
counter, what the metadata section carries, what a peer object holds -- stays in each backend.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from .. import _native, auth, wire
from ..channel import Channel
from ..errors import AuthError, KVXError, PeerDisconnected, ProtocolError
from ..net import MAX_HANDSHAKES, PREAUTH_ITEMS, PREAUTH_MAX, RefusalLog, accept_loop, notice
from .base import PeerInfo

log = logging.getLogger(__name__)


class SameNodeLink:
    """Mixin: the listener's accept loop and handshake, and the dialling side's handshake.

    The backend provides the attributes annotated below, ``_on_message``/``_on_close`` (the
    channel callbacks) and ``_drop(peer)``, and sets the three class constants.
    """

    #: sizes of the control table this side shares and of one peer's in-flight counter page
    _CTRL_BYTES: int
    _INFL_BYTES: int
    #: memfd name of a counter page, and the link's name in log messages
    _INFL_NAME = "kvx-inflight"
    _LINK_WHAT = "same-node"
    #: False: the listener refuses every peer (an agent that only dials out, e.g. a pool owner's
    #: serving agent, whose registrations no peer may map or read one-sided); set it before the
    #: agent registers anything and before its metadata is published
    accept_peers = True

    cfg: Any
    ctx: Any
    max_msg: int
    _lsock: socket.socket
    _closed: bool
    _lock: Any  # a Lock or RLock
    _accepted: list[Channel]
    _peers: dict[str, Any]
    _ctrl_fd: int
    _on_message: Any
    _on_close: Any
    _drop: Any

    # ---- listener side ---------------------------------------------------------------------
    @property
    def refused(self) -> RefusalLog:
        """Refused connections: logged a few at a time, counted per kind."""
        r = self.__dict__.get("_refused")
        if r is None:
            r = self.__dict__.setdefault("_refused", RefusalLog(log))
        return r  # type: ignore[no-any-return]

    def _accept_loop(self) -> None:
        hs = threading.BoundedSemaphore(MAX_HANDSHAKES)
        accept_loop(self._lsock, lambda: self._closed, hs, lambda s, _a: self._start_handshake(s, hs),
                    self._LINK_WHAT, self.refused)

    def _start_handshake(self, s: socket.socket, hs: threading.BoundedSemaphore) -> None:
        def run() -> None:
            try:
                self._handshake_in(s)
            finally:
                hs.release()

        threading.Thread(target=run, name="kvx-samenode-hs", daemon=True).start()

    def _handshake_in(self, s: socket.socket) -> None:
        deadline = time.monotonic() + float(self.cfg.handshake_timeout)
        s.settimeout(self.cfg.handshake_timeout)
        try:
            pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():  # root too serves only its own user (CMA, mappings)
                notice(s, "denied", "a peer of another user is not served")
                raise AuthError(f"refusing same-node peer of another user (uid {uid}, pid {pid})")
            if not self.accept_peers:
                notice(s, "denied", "this agent accepts no same-node peers")
                raise AuthError(f"refusing same-node peer pid {pid}: this agent only dials out")
            chan = Channel(s, self.max_msg, self._on_message, self._on_close, name=f"pid{pid}")
            nonce = auth.new_nonce()
            chan.send(wire.pack("challenge", nonce=nonce, id=self.ctx.agent_id))
            msg, _, fds = chan.recv_one(PREAUTH_MAX, deadline, PREAUTH_ITEMS)
            for fd in fds:
                os.close(fd)
            wire.check(msg, "hello", {"name": str, "id": str, "mac": bytes})
            try:
                auth.verify(self.cfg.auth_token, nonce, msg["id"], self.ctx.agent_id, msg["mac"])
            except AuthError:
                notice(s, "denied", "authentication failed (wrong or missing KVX_AUTH_TOKEN)")
                raise
            infl_fd = os.memfd_create(self._INFL_NAME, os.MFD_CLOEXEC)
            try:
                os.ftruncate(infl_fd, self._INFL_BYTES)
                chan.extra["infl"] = _native.map_fd(infl_fd, self._INFL_BYTES, 0, True)
                chan.peer_name = msg["name"]
                chan.peer_id = msg["id"]
                chan.send(wire.pack("welcome", name=self.ctx.agent_name, id=self.ctx.agent_id),
                          fds=[self._ctrl_fd, infl_fd])
            finally:
                os.close(infl_fd)
        except (KVXError, OSError) as exc:
            self.refused("connections", "refused a %s connection: %s", self._LINK_WHAT, exc)
            try:
                s.close()
            except OSError:
                pass
            return
        s.settimeout(None)
        with self._lock:
            if self._closed:
                chan.close()
                return
            self._accepted.append(chan)
        chan.start()

    # ---- dialling side ---------------------------------------------------------------------
    def _dial(self, peer: PeerInfo, uds: str) -> tuple[Channel, int, int]:
        """Connect to ``peer``'s listener and run the handshake: (channel, not started yet;
        address of its control table mapped read-only; address of our counter page)."""
        deadline = time.monotonic() + float(self.cfg.handshake_timeout)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        s.settimeout(self.cfg.handshake_timeout)
        try:
            s.connect("\0" + uds)
        except OSError as exc:
            s.close()
            raise PeerDisconnected(f"cannot reach {peer.name!r} on this node: {exc}") from exc
        try:
            self._check_listener(s, peer)
        except KVXError:
            s.close()
            raise
        chan = Channel(s, self.max_msg, self._on_message, self._on_close, name=peer.name)
        fds: list[int] = []
        try:
            try:
                msg, _, f0 = chan.recv_one(PREAUTH_MAX, deadline, PREAUTH_ITEMS)
            except PeerDisconnected as exc:
                raise PeerDisconnected(f"{peer.name!r} closed the connection before its challenge") from exc
            fds += f0
            if msg.get("t") == "busy":
                raise PeerDisconnected(f"{peer.name!r} is busy ({msg.get('msg')!s:.200}); retry later")
            if msg.get("t") == "denied":
                raise AuthError(f"{peer.name!r} refused us: {msg.get('msg')!s:.200}")
            wire.check(msg, "challenge", {"nonce": bytes, "id": str})
            if msg["id"] != peer.agent_id:
                raise ProtocolError(f"{peer.name!r} answered with another agent id")
            mac = auth.prove(self.cfg.auth_token, msg["nonce"], self.ctx.agent_id, peer.agent_id)
            chan.send(wire.pack("hello", name=self.ctx.agent_name, id=self.ctx.agent_id, mac=mac))
            try:
                msg, _, f1 = chan.recv_one(PREAUTH_MAX, deadline, PREAUTH_ITEMS)
            except PeerDisconnected as exc:
                raise AuthError(f"{peer.name!r} closed the handshake after our proof "
                                "(wrong KVX_AUTH_TOKEN?)") from exc
            fds += f1
            if msg.get("t") == "denied":
                raise AuthError(f"{peer.name!r} refused us: {msg.get('msg')!s:.200}")
            wire.check(msg, "welcome", {"name": str, "id": str})
            if len(fds) != 2:
                raise ProtocolError("handshake did not carry the control table")
            ctrl = _native.map_fd(fds[0], self._CTRL_BYTES, 0, False)
            infl = _native.map_fd(fds[1], self._INFL_BYTES, 0, True)
        except (OSError, KVXError):
            s.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        s.settimeout(None)
        return chan, ctrl, infl

    def _check_listener(self, s: socket.socket, peer: PeerInfo) -> None:
        """The process behind the listener we reached must be the peer's: our own user (abstract
        socket names are open to every user: another one may have bound the name), and the pid
        its metadata names for this backend (one-sided copies go to that pid)."""
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise AuthError(f"the same-node listener of {peer.name!r} runs as another user (uid {uid}): refused")
        sec = peer.sections.get(str(getattr(self, "name", "")))  # the backend's name: its metadata section
        want = sec.get("pid") if isinstance(sec, dict) else None
        if pid != want or pid != peer.sections.get("_pid"):
            raise ProtocolError(f"{peer.name!r} metadata names pid {want!r}, but its listener is pid {pid}")

    def _adopt(self, name: str, p: Any, chan: Channel) -> None:
        """Make ``p`` (on ``chan``) the peer called ``name``, dropping one it replaces; start reading."""
        chan.extra["peer"] = p
        with self._lock:
            old = self._peers.pop(name, None)
            self._peers[name] = p
        if old is not None:
            self._drop(old)
        chan.start()

    def _close_link(self) -> bool:
        """Close the listener, drop every peer, close every accepted channel; False if closed before."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            acc = list(self._accepted)
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        for p in peers:
            self._drop(p)
        for c in acc:
            c.close()
        self.refused.flush()
        return True
