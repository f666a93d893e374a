"""Pool membership in etcd: each storing member keeps one key alive under a lease.

Layout: ``/{namespace}/pool/{pool}/members/{name}`` holds the member's record (msgpack: its id,
capacity, block size, control address and agent metadata), attached to a lease of ``ttl`` seconds
that a thread refreshes every ``ttl / 3`` seconds. A member that dies (``kill -9``, a cut link)
stops refreshing and its key vanishes within ``ttl`` seconds; :meth:`Membership.close` revokes the
lease at once. Everyone (members and clients) reads the live records with one range request every
``refresh`` seconds. etcd is reached through its JSON gateway (``etcd3gw``, ``pip install kvx[etcd]``),
as :mod:`kvx.discovery` does: no consensus, master or index service of kvx's own.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import msgpack

from ..discovery import _etcd_client
from ..errors import PeerDisconnected, ProtocolError, UsageError

__all__ = ["Member", "Membership", "encode_record", "decode_record"]

log = logging.getLogger(__name__)

#: Largest member record read from etcd (agent metadata included).
RECORD_MAX = 4 << 20
_NAME_MAX = 200


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One live member as its record in etcd describes it."""

    name: str
    id: str
    capacity: int  # bytes of host memory it stores
    block_bytes: int
    ctl: tuple[str, int]  # control channel address
    meta: bytes  # its agent's metadata
    arena: int  # address of its arena in its agent's registrations
    nslots: int


def check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > _NAME_MAX or "/" in name:
        raise UsageError(f"{what} must be a non-empty string of at most {_NAME_MAX} characters without '/'")
    return name


def encode_record(m: Member) -> bytes:
    return msgpack.packb({"v": 1, "name": m.name, "id": m.id, "cap": m.capacity, "bb": m.block_bytes,
                          "ctl": list(m.ctl), "meta": m.meta, "arena": m.arena, "nslots": m.nslots},
                         use_bin_type=True)


def decode_record(data: bytes) -> Member:
    """Parse a record read from etcd (schema-checked: etcd is shared, its values are input)."""
    if len(data) > RECORD_MAX:
        raise ProtocolError("pool member record too large")
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=16, max_map_len=32)
    except Exception as exc:
        raise ProtocolError(f"malformed pool member record: {exc}") from exc
    if not isinstance(d, dict) or d.get("v") != 1:
        raise ProtocolError("not a version-1 pool member record")
    ints = ("cap", "bb", "arena", "nslots")
    for k in ints:
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d[k] < 0:
            raise ProtocolError(f"pool member record: bad {k!r}")
    ctl = d.get("ctl")
    if (not isinstance(ctl, list) or len(ctl) != 2 or not isinstance(ctl[0], str)
            or not isinstance(ctl[1], int) or not 0 < ctl[1] < 65536):
        raise ProtocolError("pool member record: bad control address")
    if not isinstance(d.get("name"), str) or not isinstance(d.get("id"), str) or not isinstance(d.get("meta"), bytes):
        raise ProtocolError("pool member record: bad name, id or metadata")
    if d["bb"] < 1 or d["nslots"] * d["bb"] > d["cap"] + d["bb"]:
        raise ProtocolError("pool member record: inconsistent sizes")
    return Member(d["name"], d["id"], d["cap"], d["bb"], (ctl[0], ctl[1]), d["meta"], d["arena"], d["nslots"])


class Membership:
    """The live members of one pool, and (optionally) this process's own membership.

    Parameters
    ----------
    endpoint
        etcd endpoint (``http://host:2379``); comma-separated endpoints: the first that answers.
    pool
        The pool's name.
    namespace
        Key prefix (``/{namespace}/pool/{pool}/members/``).
    ttl
        Lease time-to-live in seconds of this process's record.
    refresh
        Seconds between reads of the member list.
    on_change
        Called (from the refresh thread) with the new ``{name: Member}`` map when it changed.
    """

    def __init__(self, endpoint: str, pool: str, namespace: str = "kvx", ttl: int = 5, refresh: float = 1.0,
                 timeout: float = 5.0, on_change: Callable[[dict[str, Member]], None] | None = None) -> None:
        check_name(pool, "pool name")
        if int(ttl) < 2:
            raise UsageError("the membership lease ttl must be at least 2 seconds")
        self.prefix = f"/{namespace.strip('/')}/pool/{pool}/members/"
        self.ttl = int(ttl)
        self.refresh_s = max(0.05, float(refresh))
        self._on_change = on_change
        last: Exception | None = None
        self._client: Any = None
        for ep in [e for e in str(endpoint).split(",") if e]:
            c = _etcd_client(ep, timeout)
            try:
                c.status()
                self._client = c
                break
            except Exception as exc:  # etcd3gw raises requests' errors and its own
                last = exc
        if self._client is None:
            raise PeerDisconnected(f"no etcd endpoint answered ({endpoint}): {last}")
        self._lock = threading.Lock()
        self._view: dict[str, Member] = {}
        self._lease: Any = None
        self._record: tuple[str, bytes] | None = None
        self._stop = threading.Event()
        self.bad_records = 0
        self.read()
        self._thread = threading.Thread(target=self._run, name="kvx-pool-members", daemon=True)
        self._thread.start()

    # ---- own record ----------------------------------------------------------------------
    def join(self, member: Member) -> None:
        """Publish ``member`` under a lease kept alive until :meth:`close`.

        Raises
        ------
        UsageError
            If a live member holds the name (the key is created atomically; a record left by a
            dead incarnation is waited for until it runs out, ``ttl`` seconds at most).
        """
        data = encode_record(member)
        deadline = time.monotonic() + self.ttl + 1
        with self._lock:
            lease = self._client.lease(self.ttl)
            # a record left by a dead incarnation of this member runs out within ttl seconds
            while not self._client.create(self.prefix + member.name, data, lease=lease):
                if time.monotonic() >= deadline:
                    try:
                        lease.revoke()
                    except Exception:  # it expires anyway
                        pass
                    raise UsageError(f"pool member name {member.name!r} is in use by a live member")
                time.sleep(0.2)
            self._record = (member.name, data)
            self._lease = lease
        self.read()

    def _keepalive(self) -> None:
        with self._lock:
            lease, rec = self._lease, self._record
        if lease is None or rec is None:
            return
        try:
            ttl = lease.refresh()
        except Exception as exc:
            log.warning("pool: etcd lease refresh failed: %r", exc)
            return
        if ttl <= 0:  # expired (a long pause, etcd restarted): join again under a new lease
            log.warning("pool: membership lease of %s expired; joining again", rec[0])
            try:
                with self._lock:
                    self._lease = self._client.lease(self.ttl)
                    self._client.put(self.prefix + rec[0], rec[1], lease=self._lease)
            except Exception as exc:
                log.warning("pool: rejoining failed: %r", exc)

    # ---- the view --------------------------------------------------------------------------
    def read(self) -> dict[str, Member]:
        """Read the live members now (one range request); returns and keeps the view."""
        view: dict[str, Member] = {}
        for v, meta in self._client.get_prefix(self.prefix):
            k = meta.get("key", b"")
            k = k.decode() if isinstance(k, bytes) else str(k)
            data = v if isinstance(v, bytes) else str(v).encode("latin-1")
            try:
                m = decode_record(data)
            except ProtocolError as exc:
                self.bad_records += 1
                log.warning("pool: ignoring the member record under %s: %s", k[:300], exc)
                continue
            if m.name != k[len(self.prefix):]:
                self.bad_records += 1
                continue
            view[m.name] = m
        with self._lock:
            changed = view != self._view
            self._view = view
        if changed and self._on_change is not None:
            self._on_change(dict(view))
        return view

    def view(self) -> dict[str, Member]:
        with self._lock:
            return dict(self._view)

    def _run(self) -> None:
        next_ka = time.monotonic() + self.ttl / 3
        while not self._stop.wait(min(self.refresh_s, max(0.05, next_ka - time.monotonic()))):
            now = time.monotonic()
            if now >= next_ka:
                self._keepalive()
                next_ka = now + self.ttl / 3
            try:
                self.read()
            except Exception as exc:
                log.warning("pool: reading members from etcd failed: %r", exc)

    def close(self) -> None:
        """Stop; revoke this process's lease (its record vanishes now). Idempotent."""
        self._stop.set()
        self._thread.join(timeout=10.0)
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            try:
                lease.revoke()
            except Exception as exc:
                log.warning("pool: etcd lease revoke failed: %r", exc)
