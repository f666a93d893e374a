"""Metadata exchange: the agent's TCP side channel, and etcd for clusters.

Metadata is bytes (:meth:`kvx.Agent.metadata`); this module moves it.

- :class:`SideChannel` -- a small authenticated TCP server that answers "give me your
  metadata" and "give me the descriptor list published under NAME". When the agent runs the
  ``tcp`` backend and the side channel is asked for the same address as
  ``AgentConfig.listen``, it shares the tcp listener (one port per agent).
- :func:`fetch_metadata`, :func:`fetch_descs` -- the client side.
- :class:`EtcdDiscovery` -- agents publish their metadata under ``/{namespace}/agents/{name}``
  with a lease (TTL) kept alive by a thread; peers look each other up and watch for removal.
  Uses etcd's JSON gateway through ``etcd3gw`` (``pip install kvx[etcd]``).

Every connection to a side channel runs the HMAC challenge of :mod:`kvx.auth` (with
``KVX_AUTH_TOKEN`` when set) within the handshake timeout, like tcp data connections.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from . import config, wire
from .errors import (
    BackendUnavailable,
    KVXError,
    PeerDisconnected,
    TransferTimeout,
    UsageError,
)
from .memory import DescList
from .net import (
    MAX_HANDSHAKES,
    REPLY_MAX,
    RefusalLog,
    accept_loop,
    advertised,
    client_handshake,
    open_listener,
    send_frame,
    server_handshake,
)

if TYPE_CHECKING:
    from .agent import Agent

__all__ = ["SideChannel", "fetch_metadata", "fetch_descs", "EtcdDiscovery"]

log = logging.getLogger(__name__)

_NAME_MAX = 256


def _token(token: str | None) -> str | None:
    return config.get("KVX_AUTH_TOKEN") if token is None else (token or None)


class SideChannel:
    """Serve an agent's metadata (and named descriptor lists) over authenticated TCP.

    Parameters
    ----------
    agent
        The agent whose ``metadata()`` is served.
    host, port
        Where to listen (port 0: any free port). If the agent's tcp backend already listens on
        ``(host, port) == agent.config.listen``, the side channel shares that listener.

    Attributes
    ----------
    address
        ``(host, port)`` to give :func:`fetch_metadata`.
    """

    def __init__(self, agent: "Agent", host: str = "127.0.0.1", port: int = 0) -> None:
        self._agent = agent
        self._token = agent.config.auth_token
        self._timeout = float(agent.config.handshake_timeout)
        self._descs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._lsock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._conns: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self._hs = threading.BoundedSemaphore(MAX_HANDSHAKES)
        #: refused connections: logged a few at a time, counted per kind
        self.refused = RefusalLog(log)
        self._tcp: Any = None
        tcp: Any = next((b for b in agent.backends if b.name == "tcp"), None)
        if tcp is not None and agent.config.listen is not None and (host, port) == tuple(agent.config.listen):
            tcp.side_handler = self._handle
            self._tcp = tcp
            self.address: tuple[str, int] = tcp.address
            self._addrs = tcp._addrs
        else:
            self._lsock = open_listener(host, port)
            self.address = tuple(self._lsock.getsockname()[:2])  # type: ignore[assignment]
            self._addrs = advertised(self._lsock)
            self._thread = threading.Thread(target=self._accept_loop, name=f"kvx-side-{agent.name}", daemon=True)
            self._thread.start()

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """Addresses peers should dial (the listener's own, or the host's for a wildcard bind)."""
        return list(self._addrs)

    def publish_descs(self, name: str, descs: DescList | bytes) -> None:
        """Serve ``descs`` to authenticated peers asking for ``name`` (:func:`fetch_descs`)."""
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
            raise UsageError("descriptor list name must be a non-empty string of at most 256 characters")
        data = descs.to_bytes() if isinstance(descs, DescList) else bytes(descs)
        with self._lock:
            self._descs[name] = data

    def unpublish_descs(self, name: str) -> None:
        """Stop serving the list called ``name``."""
        with self._lock:
            self._descs.pop(name, None)

    def _accept_loop(self) -> None:
        assert self._lsock is not None
        accept_loop(self._lsock, lambda: self._closed, self._hs, self._start_serving, "side channel",
                    self.refused)

    def _start_serving(self, s: socket.socket, addr: Any) -> None:
        t = threading.Thread(target=self._serve, args=(s, addr), name="kvx-side-serve", daemon=True)
        with self._lock:
            self._conns[id(s)] = (s, t)
        t.start()

    def _serve(self, s: socket.socket, addr: Any) -> None:
        try:
            try:
                hello = server_handshake(s, self._token, self._agent.id, self._agent.name, self._timeout)
            finally:
                self._hs.release()
            self._handle(s, hello)
        except (KVXError, OSError) as exc:
            self.refused("connections", "side channel: refused a connection from %s:%s: %s", addr[0], addr[1], exc)
        finally:
            with self._lock:
                self._conns.pop(id(s), None)
            try:
                s.close()
            except OSError:
                pass

    def _handle(self, s: socket.socket, hello: dict[str, Any]) -> None:
        """Answer one authenticated request (also called by the tcp backend's listener)."""
        svc = hello["svc"]
        s.settimeout(self._timeout)
        if svc == "meta":
            if self._agent.closed:
                send_frame(s, wire.pack("denied", msg="agent is closed"))
                return
            send_frame(s, wire.pack("meta", meta=self._agent.metadata()))
        elif svc == "descs":
            key = hello.get("key")
            with self._lock:
                data = self._descs.get(key) if isinstance(key, str) else None
            if data is None:
                send_frame(s, wire.pack("missing", msg=f"no descriptor list named {key!r}"))
            else:
                send_frame(s, wire.pack("descs", descs=data))
        else:
            send_frame(s, wire.pack("missing", msg=f"unknown service {svc!r}"))

    def close(self) -> None:
        """Stop serving; joins the listener's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._tcp is not None:
            if self._tcp.side_handler == self._handle:
                self._tcp.side_handler = None
            return
        assert self._lsock is not None
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            conns = list(self._conns.values())
        for s, _t in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _s, t in conns:
            t.join(timeout=5.0)
        self.refused.flush()

    def __enter__(self) -> "SideChannel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ask(host: str, port: int, svc: str, token: str | None, timeout: float, **extra: Any) -> dict[str, Any]:
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except (UnicodeError, ValueError, TypeError, OverflowError) as exc:  # not an address at all
        raise UsageError(f"bad side channel address {host!r:.80}:{port!r}: {exc}") from exc
    except OSError as exc:
        raise PeerDisconnected(f"cannot reach the side channel at {host!r:.80}:{port}: {exc}") from exc
    try:
        return client_handshake(s, _token(token), uuid.uuid4().hex, "kvx-discovery", svc, timeout,
                                max_reply=REPLY_MAX, **extra)
    except OSError as exc:
        raise PeerDisconnected(f"side channel at {host}:{port} failed: {exc}") from exc
    finally:
        s.close()


def fetch_metadata(host: str, port: int, *, token: str | None = None, timeout: float = 5.0) -> bytes:
    """Fetch an agent's metadata from its side channel.

    Parameters
    ----------
    host, port
        The side channel's address (:attr:`SideChannel.address`).
    token
        Shared secret; ``None`` uses ``KVX_AUTH_TOKEN``, ``""`` sends none.
    timeout
        Bound on connecting and on the whole exchange, in seconds.

    Raises
    ------
    AuthError
        If the agent refused our proof.
    PeerDisconnected, TransferTimeout, ProtocolError
        If it cannot be reached, is too slow, or answers garbage.
    """
    rep = _ask(host, port, "meta", token, timeout)
    if rep.get("t") == "denied":
        raise PeerDisconnected(f"{host}:{port}: {rep.get('msg')}")
    wire.check(rep, "meta", {"meta": bytes})
    return rep["meta"]  # type: ignore[no-any-return]


def fetch_descs(host: str, port: int, name: str, *, token: str | None = None, timeout: float = 5.0) -> DescList:
    """Fetch the descriptor list an agent published under ``name`` (:meth:`SideChannel.publish_descs`).

    Raises
    ------
    KeyError
        If nothing is published under ``name``.
    """
    rep = _ask(host, port, "descs", token, timeout, key=name)
    if rep.get("t") == "missing":
        raise KeyError(name)
    wire.check(rep, "descs", {"descs": bytes})
    return DescList.from_bytes(rep["descs"])


# ---- etcd ------------------------------------------------------------------------------------
def _etcd_client(endpoint: str, timeout: float) -> Any:
    try:
        from etcd3gw.client import Etcd3Client
    except ImportError as exc:
        raise BackendUnavailable("etcd discovery needs etcd3gw: pip install kvx[etcd]") from exc
    from urllib.parse import urlparse

    u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return Etcd3Client(host=u.hostname or "127.0.0.1", port=u.port or 2379, protocol=u.scheme or "http",
                       timeout=timeout)


class EtcdDiscovery:
    """Publish and find agents' metadata in etcd (JSON gateway, via ``etcd3gw``).

    Layout: ``/{namespace}/agents/{name}`` holds the agent's metadata bytes, attached to a
    lease of ``ttl`` seconds that a thread refreshes every ``ttl / 3`` seconds. When the agent
    (or its process, or its link) dies the key disappears within ``ttl`` seconds.

    Parameters
    ----------
    endpoints
        etcd endpoints (``http://host:port``); the first one that answers is used.
        Empty: ``KVX_ETCD_ENDPOINTS``.
    namespace
        Key prefix (default ``KVX_ETCD_NAMESPACE`` or ``"kvx"``).
    ttl
        Lease time-to-live in seconds.
    """

    def __init__(self, endpoints: list[str] | tuple[str, ...] | str | None = None, namespace: str | None = None,
                 ttl: int = 10, timeout: float = 5.0) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        eps = list(endpoints or config.get("KVX_ETCD_ENDPOINTS"))
        if not eps:
            raise UsageError("no etcd endpoints given (argument or KVX_ETCD_ENDPOINTS)")
        self.namespace = (namespace if namespace is not None else config.get("KVX_ETCD_NAMESPACE")).strip("/")
        self.ttl = int(ttl)
        if self.ttl < 2:
            raise UsageError("ttl must be at least 2 seconds")
        self._timeout = timeout
        last: Exception | None = None
        self._client: Any = None
        for ep in eps:
            c = _etcd_client(ep, timeout)
            try:
                c.status()
                self._client = c
                break
            except Exception as exc:  # etcd3gw raises requests' and its own errors
                last = exc
        if self._client is None:
            raise PeerDisconnected(f"no etcd endpoint answered ({', '.join(eps)}): {last}")
        self._lease: Any = None
        self._published: list[str] = []
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._watches: list[Any] = []

    def key(self, name: str) -> str:
        """The etcd key of agent ``name``."""
        return f"/{self.namespace}/agents/{name}"

    def publish(self, agent: "Agent | str", meta: bytes | None = None) -> None:
        """Publish ``agent.metadata()`` (or ``meta`` under the name ``agent``) with the lease.

        Call again after registering memory to refresh the published region table.
        """
        name = agent if isinstance(agent, str) else agent.name
        data = meta if meta is not None else agent.metadata()  # type: ignore[union-attr]
        if self._lease is None:
            self._lease = self._client.lease(self.ttl)
            self._keeper = threading.Thread(target=self._keepalive, name="kvx-etcd-lease", daemon=True)
            self._keeper.start()
        self._client.put(self.key(name), data, lease=self._lease)
        if name not in self._published:
            self._published.append(name)

    def _keepalive(self) -> None:
        period = max(0.5, self.ttl / 3)
        while not self._stop.wait(period):
            try:
                self._lease.refresh()
            except Exception as exc:
                log.warning("etcd lease refresh failed: %r", exc)

    def get(self, name: str) -> bytes | None:
        """The metadata published under ``name`` now, or None."""
        vals = self._client.get(self.key(name))
        if not vals:
            return None
        v = vals[0]
        return v if isinstance(v, bytes) else str(v).encode("latin-1")

    def lookup(self, name: str, timeout: float = 10.0) -> bytes:
        """Wait (bounded) until agent ``name`` is published; return its metadata.

        Raises
        ------
        TransferTimeout
            If it does not appear within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            v = self.get(name)
            if v is not None:
                return v
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"agent {name!r} not published in etcd within {timeout:.1f} s")
            time.sleep(0.1)

    def names(self) -> list[str]:
        """Names of the agents published under this namespace."""
        prefix = self.key("")
        out = []
        for _v, meta in self._client.get_prefix(prefix):
            k = meta.get("key", b"")
            k = k.decode() if isinstance(k, bytes) else str(k)
            out.append(k[len(prefix):])
        return sorted(out)

    def wait_removed(self, name: str, timeout: float) -> bool:
        """Wait until agent ``name``'s key is gone (lease expired or revoked); False on timeout."""
        deadline = time.monotonic() + timeout
        while self.get(name) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def watch(self, name: str, callback: Callable[[str, bytes | None], None]) -> Callable[[], None]:
        """Call ``callback("put", meta)`` / ``callback("delete", None)`` as ``name`` changes.

        Returns a function that cancels the watch.
        """
        events, cancel = self._client.watch(self.key(name))

        def run() -> None:
            try:
                for ev in events:
                    kv = ev.get("kv", {})
                    if ev.get("type") == "DELETE":
                        callback("delete", None)
                    else:
                        v = kv.get("value")
                        callback("put", v if isinstance(v, bytes) else None)
            except Exception:  # the stream ends when cancelled
                log.debug("etcd watch ended", exc_info=True)

        t = threading.Thread(target=run, name=f"kvx-etcd-watch-{name}", daemon=True)
        t.start()
        self._watches.append(cancel)
        return cancel  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop refreshing and revoke the lease (the published keys vanish now). Idempotent."""
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5.0)
            self._keeper = None
        for c in self._watches:
            try:
                c()
            except Exception:
                pass
        self._watches.clear()
        if self._lease is not None:
            try:
                self._lease.revoke()
            except Exception as exc:
                log.warning("etcd lease revoke failed: %r", exc)
            self._lease = None

    def __enter__(self) -> "EtcdDiscovery":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
