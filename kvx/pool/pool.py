""":class:`Pool`: a node's membership in a cluster-wide KV pool, and the client of every owner.

There is no master and no index: the owners of a block are the top members of a weighted
rendezvous hash (:mod:`kvx.pool.placement`) over the live members that etcd lists
(:mod:`kvx.pool.membership`). Every operation is batched per owner and posted to all owners at
once, in three rounds of messages:

- ``put``: grant (slots for the blocks not held yet) -> one kvx write per owner into the granted
  slots of its registered arena -> commit (with the blocks' checksums);
- ``get``: lookup with a short lease on the slots -> one one-sided kvx read per owner, for the
  blocks of the common prefix only -> checksum check of every block read (against the checksum
  committed with it: a lease that ran out mid-read and let the slot be reused fails it) ->
  release, not waited for;
- ``lookup``: the lookup round without lease and data.

An owner on the client's node (``PoolConfig.near``) moves the bytes itself instead, in one
round each (``fetch``, ``store``; :mod:`kvx.pool.near`): one copy, no socket in between, the
same checksums and the same rule that no client reaches the arena.

Failure is a miss, never wrong bytes: an owner that is dead, cut off, slow past ``timeout``,
that evicted the block or whose lease ran out ends the served prefix at its first block; a
block whose checksum differs from the one committed is a miss too (``stats()["corrupt"]``).
A member that failed is skipped for ``retry`` seconds, so a dead owner costs one timeout,
not one per call, until its membership lease runs out in etcd.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from .. import wire
from .._native import nh64
from ..agent import Agent, PreparedList
from ..backends.base import index_array
from ..backends.tcp import TcpBackend
from ..channel import Channel
from ..config import AgentConfig
from ..errors import (
    KVXError,
    ProtocolError,
    RemoteError,
    TransferTimeout,
    UsageError,
)
from ..memory import MemoryKind, alloc_host
from ..net import client_handshake
from ..tiers.policies import DEFAULT_POLICY
from .disk import DiskSpill
from .membership import Member, Membership, check_name
from .near import NEAR_WINDOW, Landing, NearServer, on_this_node, slot_rows
from .owner import BUSY, HELD, LOCAL, REFUSED, Owner
from .placement import Placement, key64, key_bytes
from .server import CTL_MAX, SVC, ControlServer

__all__ = ["Pool", "PoolConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Settings of a pool member or client.

    Attributes
    ----------
    replicas
        Owners per block (1: no replication). Puts write every replica; gets read the first that
        serves.
    policy
        Eviction policy of this member's arena (``kvx.tiers.policies``).
    namespace
        etcd key prefix (``/{namespace}/pool/{pool}/members/{name}``).
    host
        Address this member's control and data listeners bind to; ``advertise`` (default: the
        same) is what peers dial.
    ttl
        Seconds the membership lease lives without refresh (how long a dead member stays listed).
    refresh
        Seconds between reads of the member list.
    lease_ttl, grant_ttl
        Seconds an owner keeps a read lease / a write grant before undoing it.
    timeout
        Bound on each round (messages and transfers) with one owner.
    retry
        Seconds an owner that failed is skipped (its blocks miss meanwhile).
    max_batch
        Most blocks per request to one owner (larger batches are split).
    strict
        The owner's data plane is target-validated (tcp only) and lets a peer's descriptor into
        the arena only within slots it holds a grant or lease on. ``False`` also allows one-sided
        paths (same-node shared mappings, UCX), which map the whole arena: integrity then rests
        on the checksums alone.
    prefault
        Touch every page of the arena when joining, so that its memory is committed at start
        (a member that cannot have it fails now, not under load) and no put pays page faults.
    near
        Owners on this node serve this client by copying between their arena and its memory
        themselves (``fetch``/``store``, :mod:`kvx.pool.near`) instead of over tcp: both sides
        need the ``host`` backend. The client never reaches the arena, so this keeps ``strict``.
    near_window
        Bytes of the landing buffer a client keeps per same-node owner (a fetch of more blocks
        than it holds, or while another fetch uses it, goes over tcp).
    """

    replicas: int = 1
    policy: str = DEFAULT_POLICY
    namespace: str = "kvx"
    host: str = "127.0.0.1"
    advertise: str | None = None
    ttl: int = 5
    refresh: float = 1.0
    lease_ttl: float = 10.0
    grant_ttl: float = 10.0
    timeout: float = 5.0
    retry: float = 2.0
    max_batch: int = 4096
    strict: bool = True
    prefault: bool = True
    near: bool = True
    near_window: int = NEAR_WINDOW

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= 8:
            raise UsageError("replicas must be an int in 1..8")
        for f in ("refresh", "lease_ttl", "grant_ttl", "timeout", "retry"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise UsageError(f"PoolConfig.{f} must be a positive number of seconds")
        if not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= 4096:
            raise UsageError("max_batch must be an int in 1..4096")
        if not isinstance(self.near, bool):
            raise UsageError("near must be a bool")
        if not isinstance(self.near_window, int) or isinstance(self.near_window, bool) or \
                not 0 < self.near_window <= 1 << 34:
            raise UsageError("near_window must be an int of bytes in 1 .. 16 GiB")


class _GuardedAgent(Agent):
    """An agent whose target-side validation also asks the pool owner (``guard``)."""

    guard: Any = None

    def _validate_local(self, kind: MemoryKind, addr: np.ndarray, nbytes: np.ndarray, dev: np.ndarray) -> np.ndarray:
        slots = super()._validate_local(kind, addr, nbytes, dev)
        g = self.guard
        return slots if g is None else g(kind, addr, nbytes, slots)


@dataclass(slots=True)
class _Conn:
    member: Member
    chan: Channel
    arena: PreparedList
    near: Landing | None = None  # the owner serves this client itself (same node)


class _Ev(threading.Event):
    """An answer's event that also tells a queue which call it answered (``tag``)."""

    def __init__(self, q: "queue.SimpleQueue[int]", tag: int) -> None:
        super().__init__()
        self.q, self.tag = q, tag

    def set(self) -> None:
        super().set()
        self.q.put(self.tag)


class _Call:
    """One request to one owner, sent now, answered later (all owners' at once). With ``q``,
    the call's ``tag`` is put on it when the answer (or the connection's failure) comes."""

    __slots__ = ("chan", "ev", "res", "rid", "t")

    def __init__(self, chan: Channel, t: str, q: "queue.SimpleQueue[int] | None" = None, tag: int = 0,
                 **fields: Any) -> None:
        self.chan = chan
        self.t = t
        self.rid = next(chan._ids)
        self.ev = threading.Event() if q is None else _Ev(q, tag)
        self.res: Any = None
        slot = [self.ev, None]
        self.res = slot
        with chan._wlock:
            chan._waiters[self.rid] = slot
        try:
            chan.send(wire.pack(t, rid=self.rid, pl=False, **fields))
        except BaseException:
            with chan._wlock:
                chan._waiters.pop(self.rid, None)
            raise

    def wait(self, deadline: float) -> dict[str, Any]:
        try:
            if not self.ev.wait(max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"no answer from pool member {self.chan.peer_name!r} to {self.t!r} in time")
        finally:
            with self.chan._wlock:
                self.chan._waiters.pop(self.rid, None)
        res = self.res[1]
        if isinstance(res, BaseException):
            raise res
        msg = res[0]
        if msg.get("t") == "error":
            raise RemoteError(f"pool member {self.chan.peer_name!r}: {str(msg.get('msg'))[:200]}")
        return msg  # type: ignore[no-any-return]


class _Done:
    """The local owner's answer, in the shape of a :class:`_Call`."""

    __slots__ = ("msg",)

    def __init__(self, t: str, fields: dict[str, Any]) -> None:
        self.msg = {"t": t, **fields}

    def wait(self, deadline: float) -> dict[str, Any]:
        return self.msg


def _ints(v: Any, n: int, lo: int, hi: int, what: str) -> list[int]:
    """``v`` checked to be a list of ``n`` ints in ``lo..hi`` (vectorised: no per-item Python)."""
    if not isinstance(v, list) or len(v) != n:
        raise ProtocolError(f"pool member answered a malformed {what}")
    if n:
        # every item an int (type, not isinstance: no bool; numpy would convert floats), then
        # the range on an array (an int outside the dtype raises OverflowError)
        if set(map(type, v)) != {int}:
            raise ProtocolError(f"pool member answered a malformed {what}")
        try:
            a = np.array(v, dtype=np.uint64 if hi > _I64_MAX else np.int64)
        except OverflowError:
            raise ProtocolError(f"pool member answered a malformed {what}") from None
        if int(a.min()) < lo or int(a.max()) > hi:
            raise ProtocolError(f"pool member answered a malformed {what}")
    return v


_I64_MAX = (1 << 63) - 1


class Pool:
    """Join (or use) the cluster-wide KV pool ``pool``.

    Parameters
    ----------
    name
        This member's name, unique in the pool (also its agent's name).
    etcd
        etcd endpoint(s), ``http://host:2379`` (comma-separated: the first that answers).
    pool
        The pool's name.
    capacity
        Bytes of host memory this member stores for the pool (0: a client that stores nothing).
    block_bytes
        Size of every block (all members of a pool use the same). 0, for a client that stores
        nothing: it only looks up (``lookup``, ``members``), among members of any block size
        (an engine's scheduler, which knows the hashes but not the workers' block layout).
    config
        The agents' settings (the owner agent listens on ``(options.host, 0)`` unless ``listen``
        is set, and runs the tcp backend only when ``strict``).
    options
        Pool settings (:class:`PoolConfig`).
    agent
        Move blocks with this agent (an engine's own, e.g. the one its connector registered the
        KV cache with) instead of a new one; it must run the tcp backend. The pool adds its
        members as peers of it and leaves it open at :meth:`close`.
    disk, disk_capacity
        A storing member's disk tier: a slab file at path ``disk`` (created empty, removed at
        :meth:`close`) of ``disk_capacity`` bytes, below the arena. Blocks the arena's policy
        evicts go there and are still served: a lookup brings them back into the arena
        (:mod:`kvx.pool.disk`).

    Attributes
    ----------
    agent
        The agent through which blocks move: register and prepare ``src``/``dst`` with it. A
        storing member runs a second agent, ``"{name}/owner"``, that holds its arena and serves
        it to peers (tcp only when ``strict``), so ``agent`` keeps every backend for local work.
    """

    def __init__(self, name: str, *, etcd: str, pool: str, capacity: int, block_bytes: int,
                 config: AgentConfig | None = None, options: PoolConfig | None = None,
                 agent: Agent | None = None, disk: str | None = None, disk_capacity: int = 0) -> None:
        check_name(name, "member name")
        for what, v in (("capacity", capacity), ("block_bytes", block_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UsageError(f"{what} must be a non-negative int")
        if block_bytes > 1 << 30 or (block_bytes < 1 and capacity):
            raise UsageError("block_bytes must be in 1 .. 1 GiB (0: a client that only looks up)")
        if 0 < capacity < block_bytes:
            raise UsageError(f"capacity {capacity} holds no block of {block_bytes} bytes")
        if disk is not None and not capacity:
            raise UsageError("a disk tier needs a storing member (capacity > 0)")
        self.name = name
        self.block_bytes = block_bytes
        self.capacity = capacity
        self.opts = opts = options if options is not None else PoolConfig()
        cfg = config if config is not None else AgentConfig()
        ocfg = cfg  # the owner agent's: it holds the arena and serves it to peers
        if capacity:
            if ocfg.listen is None:
                ocfg = dataclasses.replace(ocfg, listen=(opts.host, 0))
            if opts.strict:
                ocfg = dataclasses.replace(ocfg, backends=("tcp",))
        self.closed = False
        self._lock = threading.RLock()
        self._conns: dict[str, _Conn] = {}
        self._suspect: dict[str, float] = {}
        self._place: tuple[Placement, list[Member]] | None = None
        self._stats: dict[str, int] = defaultdict(int)
        #: why an owner last refused blocks of a put ("member: reason"), or ""
        self.last_refusal = ""
        self.owner: Owner | None = None
        self._server: ControlServer | None = None
        self._members: Membership | None = None
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._oagent: _GuardedAgent | None = None
        self._near: NearServer | None = None
        #: id(dst) -> (dst, its twin with the tcp backend's keep_digests on, the digest array)
        self._twins: dict[int, tuple[PreparedList, PreparedList, np.ndarray]] = {}
        #: take the checksums of tcp reads in the receive (False: re-read every landed block;
        #: benchmarks/pool_get_cpu.py compares the two)
        self._sums_in_copy = True
        if agent is not None and (not isinstance(agent, Agent) or agent.closed):
            raise UsageError("agent must be an open kvx.Agent")
        self._own_agent = agent is None
        self.agent: Agent = agent if agent is not None else Agent(
            name, dataclasses.replace(cfg, listen=None) if capacity else cfg)
        try:
            if capacity:
                nslots = capacity // block_bytes
                self._oagent = oa = _GuardedAgent(f"{name}/owner", ocfg)
                self._arena = alloc_host(nslots * block_bytes)
                if opts.prefault:
                    self._arena[::4096] = 0
                self._reg = oa.register(self._arena)
                base = int(self._reg.descs.addr[0])
                spill = DiskSpill(disk, disk_capacity, block_bytes, opts.policy) if disk is not None else None
                self.owner = Owner(nslots, block_bytes, base, opts.policy, opts.grant_ttl, opts.lease_ttl,
                                   opts.max_batch, disk=spill)
                if opts.strict:
                    oa.guard = self.owner.guard
                    tcp = oa.backend("tcp")
                    tcp.scalar_checks = False  # type: ignore[attr-defined]  # every request through the guard
                if opts.near:
                    self._near = NearServer(name, cfg, self._arena, self.owner, opts.timeout)
                self._server = ControlServer(self.owner, opts.host, 0, ocfg.auth_token, oa.id, name,
                                             ocfg.handshake_timeout, near=self._near)
                self._reaper = threading.Thread(target=self._reap, name=f"kvx-pool-reap-{name}", daemon=True)
                self._reaper.start()
            self._members = Membership(etcd, pool, opts.namespace, opts.ttl, opts.refresh,
                                       timeout=opts.timeout, on_change=self._on_members)
            if capacity:
                assert self._server is not None and self.owner is not None
                host = opts.advertise or self._server.address[0]
                if host in ("0.0.0.0", "::", ""):
                    raise UsageError("a member listening on every address needs PoolConfig(advertise=...): "
                                     "the address peers dial")
                ctl = (host, self._server.address[1])
                self._members.join(Member(name, oa.id, nslots * block_bytes, block_bytes, ctl,
                                          oa.metadata(), base, nslots))
            self._on_members(self._members.view())
        except BaseException:
            self.close()
            raise

    # ---- membership ------------------------------------------------------------------------
    def _on_members(self, view: dict[str, Member]) -> None:
        bb = self.block_bytes
        ms = [m for m in view.values() if m.capacity > 0 and (m.block_bytes == bb or not bb)]
        pl = Placement([m.name for m in ms], [float(m.capacity) for m in ms])
        byname = {m.name: m for m in ms}
        with self._lock:
            self._place = (pl, [byname[n] for n in pl.names])
            gone = [c for n, c in self._conns.items() if n not in byname or byname[n].id != c.member.id]
            for c in gone:
                self._conns.pop(c.member.name, None)
        for c in gone:
            self._close_conn(c)

    def members(self) -> list[str]:
        """Names of the live members that store blocks (as etcd lists them now)."""
        with self._lock:
            return [] if self._place is None else list(self._place[0].names)

    def refresh(self) -> None:
        """Read the member list from etcd now (it is also read every ``refresh`` seconds)."""
        if self._members is not None:
            self._on_members(self._members.read())

    def _reap(self) -> None:
        while not self._stop.wait(0.2):
            if self.owner is not None:
                self.owner.expire()

    # ---- connections -----------------------------------------------------------------------
    def _conn(self, m: Member) -> _Conn | None:
        with self._lock:
            c = self._conns.get(m.name)
            if c is not None and c.chan.alive and c.member.id == m.id:
                return c
            if self._suspect.get(m.name, 0.0) > time.monotonic():
                return None
            if c is not None:
                self._conns.pop(m.name, None)
                self._close_conn(c)
            cfg = self.agent.config
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection(m.ctl, timeout=min(self.opts.timeout, cfg.handshake_timeout))
                client_handshake(sock, cfg.auth_token, self.agent.id, self.name, SVC, float(cfg.handshake_timeout),
                                 expect_id=m.id)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                ch = Channel(sock, CTL_MAX, self._unsolicited, name=m.name)
                ch.start()
                sock = None
                try:
                    peer = f"{m.name}/owner"
                    self.agent.remove_peer(peer)
                    if self.agent.add_peer(m.meta) != peer:
                        raise ProtocolError(f"pool member {m.name!r} published another agent's metadata")
                    bb = m.block_bytes
                    arena = self.agent.prepare(slot_rows(m.arena, m.nslots, bb), peer=peer)
                except BaseException:
                    ch.close()
                    raise
            except (KVXError, OSError) as exc:
                log.warning("pool: cannot reach member %s at %s:%s: %s", m.name, m.ctl[0], m.ctl[1], exc)
                if sock is not None:
                    sock.close()
                self._fail(m.name)
                return None
            c = _Conn(m, ch, arena, self._near_landing(m, ch))
            self._conns[m.name] = c
            return c

    def _near_landing(self, m: Member, ch: Channel) -> Landing | None:
        """A landing buffer that owner ``m`` (on this node) now serves this client through, or
        None (another node, no host backend here, an owner that declines or predates it)."""
        if not (self.opts.near and self.block_bytes and on_this_node(m.meta)):
            return None
        try:
            self.agent.backend("host")
        except KVXError:
            return None
        land = None
        try:
            rows = max(1, min(self.opts.max_batch, self.opts.near_window // self.block_bytes))
            land = Landing(self.agent, rows, self.block_bytes)
            meta, known = self._meta()
            rep = _Call(ch, "near", meta=meta, addr=land.addr, rows=rows).wait(time.monotonic() + self.opts.timeout)
            wire.check(rep, "near", {"ok": bool, "why": str})
            if not rep["ok"]:
                raise ProtocolError(rep["why"][:200])
            land.known |= known
            return land
        except (KVXError, OSError) as exc:
            log.info("pool: member %s serves this client over tcp (%s)", m.name, exc)
            if land is not None:
                land.close()
            return None

    def _meta(self) -> tuple[bytes, set[tuple[int, int]]]:
        """This agent's metadata, and the (slot, generation) of the registrations it surely holds
        (taken before it: a registration made in between is left out, and announced again)."""
        known = {(s, g) for s, (_r, g) in self.agent.regions().items()}
        return self.agent.metadata(), known

    def _unsolicited(self, ch: Channel, msg: dict[str, Any], payload: Any, fds: list[int]) -> None:
        raise ProtocolError("a pool member sent an unsolicited message")

    def _close_conn(self, c: _Conn) -> None:
        c.chan.close()
        if c.near is not None:
            c.near.close()
        try:
            self.agent.remove_peer(f"{c.member.name}/owner")
        except KVXError:
            log.debug("pool: removing peer %s", c.member.name, exc_info=True)

    def _landed(self, x: Any, ok: bool, m: Any, what: str, deadline: float) -> bool:
        """Wait (until ``deadline``) for one owner's transfer ``x`` (None: nothing was posted);
        False if it failed, which cancels it and marks the owner failed for a while."""
        if x is None:
            return ok
        try:
            x.wait(max(0.0, deadline - time.monotonic()))
        except KVXError as exc:
            log.info("pool: %s %s failed: %s", what, m.name, exc)
            x.cancel()
            self._fail(m.name)
            return False
        return ok

    def _fail(self, name: str) -> None:
        """Skip member ``name`` for ``retry`` seconds (its blocks miss meanwhile)."""
        self._stats["member_failures"] += 1
        with self._lock:
            self._suspect[name] = time.monotonic() + self.opts.retry
            c = self._conns.pop(name, None)
        if c is not None:
            self._close_conn(c)

    # ---- helpers ----------------------------------------------------------------------------
    def _check(self, plist: Any, idx: Any, n: int, what: str) -> np.ndarray:
        if self.closed:
            raise UsageError(f"pool member {self.name!r} is closed")
        if not self.block_bytes:
            raise UsageError(f"pool client {self.name!r} only looks up (block_bytes=0): it moves no blocks")
        if type(plist) is not PreparedList or plist.agent is not self.agent or plist.peer is not None:
            raise UsageError(f"{what} must be a local PreparedList of this pool's agent (pool.agent.prepare)")
        if plist.kind != MemoryKind.HOST:
            raise UsageError(f"{what} must be host memory (the pool checksums every block on the CPU)")
        ia = index_array(idx, len(plist), f"{what} index")
        if len(ia) != n:
            raise UsageError(f"{n} hashes but {len(ia)} {what} indices")
        if n and not (plist.descs.nbytes[ia] == self.block_bytes).all():
            raise UsageError(f"every {what} block must be {self.block_bytes} bytes")
        return ia

    def _owners(self, keys: list[bytes]) -> tuple[np.ndarray, list[Member]]:
        with self._lock:
            place = self._place
        if place is None or len(place[0]) == 0:
            return np.full((len(keys), 1), -1, dtype=np.int64), []
        return place[0].owners(key64(keys), self.opts.replicas), place[1]

    def _groups(self, col: np.ndarray, positions: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(member index, positions in order) per owner, batches split at ``max_batch``."""
        out = []
        mb = self.opts.max_batch
        for j in np.unique(col[positions]):
            pos = positions[col[positions] == j]
            for i in range(0, len(pos), mb):
                out.append((int(j), pos[i:i + mb]))
        return out

    def _send(self, m: Member, t: str, q: "queue.SimpleQueue[int] | None" = None, tag: int = 0,
              **fields: Any) -> Any:
        """Send one request to ``m`` (the local owner answers at once); None if unreachable.
        With ``q``, ``tag`` is put on it once the answer is in (at once if None or local)."""
        if self._local(m):
            assert self.owner is not None
            try:
                rt, rf = self.owner.handle(LOCAL, {"t": t, **fields})
            except ProtocolError as exc:
                log.info("pool: the local owner refused %s: %s", t, exc)
                rt = ""
            if q is not None:
                q.put(tag)
            return _Done(rt, rf) if rt else None
        c = self._conn(m)
        call = None
        if c is not None:
            try:
                call = _Call(c.chan, t, q, tag, **fields)
            except KVXError as exc:
                log.info("pool: %s to %s failed: %s", t, m.name, exc)
                self._fail(m.name)
        if call is None and q is not None:
            q.put(tag)
        return call

    def _answer(self, m: Member, call: Any, deadline: float) -> dict[str, Any] | None:
        if call is None:
            return None
        try:
            return call.wait(deadline)  # type: ignore[no-any-return]
        except (KVXError, OSError) as exc:
            log.info("pool: member %s failed: %s", m.name, exc)
            if not isinstance(exc, RemoteError):
                self._fail(m.name)
            return None

    def _local(self, m: Member) -> bool:
        return m.name == self.name and self._oagent is not None and m.id == self._oagent.id

    # ---- put ----------------------------------------------------------------------------------
    def put(self, hashes: Sequence[Any], src: PreparedList, idx: Any) -> int:
        """Store blocks ``src[idx]`` under ``hashes`` (a chain: each block's parent is the one
        before it) with their owners; returns how many of them the pool now holds (written now or
        already held). Blocks an owner refused (full of leased blocks) or that failed are not
        counted; :meth:`stats` says why."""
        keys = [key_bytes(h) for h in hashes]
        ia = self._check(src, idx, len(keys), "src")
        n = len(keys)
        if n == 0:
            return 0
        self._stats["puts"] += 1
        self._stats["put_blocks"] += n
        addr = src.descs.addr[ia]
        block = ctypes.c_char * self.block_bytes
        sums = [nh64(block.from_address(a)) for a in addr.tolist()]
        parents: list[bytes | None] = [None, *keys[:-1]]
        own, mem = self._owners(keys)
        stored = np.zeros(n, dtype=bool)
        if mem:
            for r in range(own.shape[1]):
                self._put_round(keys, parents, sums, src, ia, own[:, r], mem, stored)
        self._stats["stored"] += int(stored.sum())
        return int(stored.sum())

    def _put_round(self, keys: list[bytes], parents: list[bytes | None], sums: list[int], src: PreparedList,
                   ia: np.ndarray, col: np.ndarray, mem: list[Member], stored: np.ndarray) -> None:
        deadline = time.monotonic() + self.opts.timeout
        groups = self._groups(col, np.arange(len(keys)))
        # an owner on this node reads the blocks from src itself (one round: store)
        near = [self._near_conn(mem[j]) for j, _pos in groups]
        calls = [self._send(mem[j], "grant", keys=[keys[p] for p in pos], parents=[parents[p] for p in pos])
                 if c is None else self._store(c, src, ia[pos], [keys[p] for p in pos],
                                               [parents[p] for p in pos], [sums[p] for p in pos])
                 for (j, pos), c in zip(groups, near)]
        posted: list[tuple[int, np.ndarray, list[int], bytes, Any, bool]] = []
        for (j, pos), call, nc in zip(groups, calls, near):
            m = mem[j]
            rep = self._answer(m, call, deadline)
            if rep is None:
                if nc is not None:
                    self._stats["put_failed"] += len(pos)
                continue
            try:
                if nc is not None:
                    wire.check(rep, "stored", {"why": str})
                    codes = _ints(rep.get("codes"), len(pos), BUSY, HELD, "store")
                else:
                    wire.check(rep, "granted", {"gid": bytes, "why": str})
                    codes = _ints(rep.get("codes"), len(pos), BUSY, m.nslots - 1, "grant")
            except ProtocolError as exc:
                log.warning("pool: %s: %s", m.name, exc)
                self._fail(m.name)
                continue
            c = np.asarray(codes, dtype=np.int64)
            stored[pos[c == HELD]] = True
            nref = int((c == REFUSED).sum())
            if nref:
                self._stats["refused"] += nref
                self.last_refusal = f"{m.name}: {rep['why'][:200]}"
                log.debug("pool: %s refused %d blocks: %s", m.name, nref, rep["why"][:200])
            self._stats["busy"] += int((c == BUSY).sum())
            g = c >= 0
            if g.any():  # one write per owner, posted as soon as its grant is in
                slots = [int(s) for s in c[g]]
                x, ok = self._write(m, src, ia[pos[g]], slots)
                posted.append((j, pos[g], slots, rep["gid"], x, ok))
        commits = []
        for j, pos, slots, gid, x, ok in posted:
            m = mem[j]
            ok = self._landed(x, ok, m, "write to", deadline)
            call = self._send(mem[j], "commit", gid=gid, slots=slots, sums=[sums[p] for p in pos], ok=ok)
            commits.append((j, pos, ok, call))
        deadline = time.monotonic() + self.opts.timeout
        for j, pos, ok, call in commits:
            rep = self._answer(mem[j], call, deadline)
            if rep is None or not ok:
                self._stats["put_failed"] += len(pos)
                continue
            if rep.get("t") == "committed" and rep.get("n") == len(pos):
                stored[pos] = True

    def _near_conn(self, m: Member) -> _Conn | None:
        """The connection to ``m`` if it is an owner on this node that serves this client itself."""
        if self._local(m):
            return None
        c = self._conn(m)
        return c if c is not None and c.near is not None else None

    def _store(self, c: _Conn, src: PreparedList, sidx: np.ndarray, keys: list[bytes],
               parents: list[bytes | None], sums: list[int]) -> Any:
        """Send a same-node owner a ``store`` of ``src[sidx]`` (with this agent's metadata if
        ``src`` lies in registrations it was not told of yet); None if it failed to go."""
        land = c.near
        assert land is not None
        fields: dict[str, Any] = {"keys": keys, "parents": parents, "sums": sums,
                                  "addrs": src.descs.addr[sidx].tolist()}
        if not set(src.gens.items()) <= land.known:
            fields["meta"], known = self._meta()
            land.known |= known
        self._stats["near_stores"] += 1
        try:
            return _Call(c.chan, "store", **fields)
        except KVXError as exc:
            log.info("pool: store to %s failed: %s", c.member.name, exc)
            self._fail(c.member.name)
            return None

    # ---- get / lookup ----------------------------------------------------------------------
    def lookup(self, hashes: Sequence[Any]) -> int:
        """Length of the prefix of ``hashes`` the pool holds now (no lease, no data moved)."""
        if self.closed:
            raise UsageError(f"pool member {self.name!r} is closed")
        keys = [key_bytes(h) for h in hashes]
        if not keys:
            return 0
        own, mem = self._owners(keys)
        if not mem:
            return 0
        done = 0
        for r in range(own.shape[1]):
            if done == len(keys):
                break
            done = self._round(keys, own[:, r], mem, done, None, None)
        return done

    def get(self, hashes: Sequence[Any], dst: PreparedList, idx: Any) -> int:
        """Read the longest held prefix of ``hashes`` into ``dst[idx]``; returns its length.

        Every block returned was checked against the checksum committed with it, under a lease
        that held until the read had ended. Blocks of ``dst`` past the returned prefix may have
        been written and hold nothing meaningful.
        """
        keys = [key_bytes(h) for h in hashes]
        ia = self._check(dst, idx, len(keys), "dst")
        n = len(keys)
        if n == 0:
            return 0
        self._stats["gets"] += 1
        self._stats["get_blocks"] += n
        own, mem = self._owners(keys)
        done = 0
        if mem:
            for r in range(own.shape[1]):
                if done == n:
                    break
                done = self._round(keys, own[:, r], mem, done, dst, ia)
        self._stats["hits"] += done
        self._stats["misses"] += n - done
        return done

    def _round(self, keys: list[bytes], col: np.ndarray, mem: list[Member], start: int,
               dst: PreparedList | None, ia: np.ndarray | None) -> int:
        """One lookup (and, with ``dst``, read) round over blocks ``start..``; returns the end of
        the served prefix."""
        n = len(keys)
        lease = dst is not None
        deadline = time.monotonic() + self.opts.timeout
        groups = self._groups(col, np.arange(start, n))
        twin = self._twin(dst) if dst is not None and self._sums_in_copy else None
        answered: queue.SimpleQueue[int] = queue.SimpleQueue()
        # an owner on this node copies the blocks into its landing itself (one round: fetch)
        lands: list[Landing | None] = []
        try:
            for j, pos in groups:
                lands.append(self._landing(mem[j], len(pos)) if lease else None)
            calls = [self._send(mem[j], "lookup", answered, g, keys=[keys[p] for p in pos], lease=lease)
                     if land is None else self._fetch(mem[j], land, answered, g, [keys[p] for p in pos])
                     for g, ((j, pos), land) in enumerate(zip(groups, lands))]
            return self._round_answers(keys, groups, calls, lands, mem, dst, ia, twin, answered, deadline)
        finally:
            for land in lands:
                if land is not None:
                    land.lock.release()

    def _round_answers(self, keys: list[bytes], groups: list[tuple[int, np.ndarray]], calls: list[Any],
                       lands: list[Landing | None], mem: list[Member], dst: PreparedList | None,
                       ia: np.ndarray | None, twin: Any, answered: "queue.SimpleQueue[int]", deadline: float) -> int:
        n = len(keys)
        lease = dst is not None
        reads: list[tuple[int, np.ndarray, list[int], Any, Any, bool]] = []
        bad_fetch: list[tuple[int, int]] = []  # (owner, position of a fetched block that failed its checksum)
        end = n
        for g in self._arrivals(answered, len(groups), deadline):  # each owner's answer as it comes
            (j, pos), call, land = groups[g], calls[g], lands[g]
            m = mem[j]
            rep = self._answer(m, call, deadline)
            if rep is None:
                end = min(end, int(pos[0]))
                if land is not None:  # its landing may still be written: the connection goes with it
                    self._fail(m.name)
                continue
            if land is not None:
                try:
                    wire.check(rep, "fetched", {"n": int})
                    k = rep["n"]
                    if not 0 <= k <= len(pos):
                        raise ProtocolError("pool member answered a malformed fetch")
                    sums = _ints(rep.get("sums"), k, 0, (1 << 64) - 1, "fetch")
                except ProtocolError as exc:
                    log.warning("pool: %s: %s", m.name, exc)
                    self._fail(m.name)
                    end = min(end, int(pos[0]))
                    continue
                if k < len(pos):
                    end = min(end, int(pos[k]))
                # landed already: taken now, while other owners still copy (checked block by block)
                take = bisect.bisect_left(pos[:k].tolist(), end)
                assert dst is not None and ia is not None
                bad = land.take(dst, ia[pos[:take]], sums[:take]) if take else 0
                self._stats["near_blocks"] += bad
                if bad < take:
                    bad_fetch.append((j, int(pos[bad])))
                continue
            try:
                wire.check(rep, "found", {"n": int})
                k = rep["n"]
                if not 0 <= k <= len(pos):
                    raise ProtocolError("pool member answered a malformed lookup")
                slots = _ints(rep.get("slots"), k, 0, m.nslots - 1, "lookup")
                gens = _ints(rep.get("gens"), k, 0, 1 << 62, "lookup")
                sums = _ints(rep.get("sums"), k, 0, (1 << 64) - 1, "lookup")
                lid = rep.get("lid")
                if lease and k and not (isinstance(lid, bytes) and len(lid) == 16):
                    raise ProtocolError("pool member answered a lookup without its lease")
            except ProtocolError as exc:
                log.warning("pool: %s: %s", m.name, exc)
                self._fail(m.name)
                end = min(end, int(pos[0]))
                continue
            del gens
            if k < len(pos):
                end = min(end, int(pos[k]))
            if not lease:
                continue
            assert dst is not None and ia is not None
            # the read is posted as soon as this owner answered (the others' answers may still
            # shorten the prefix: what is read past it is not looked at)
            take = bisect.bisect_left(pos[:k].tolist(), end)
            x, ok = self._read(m, dst, ia[pos[:take]], slots[:take], twin) if take else (None, True)
            reads.append((j, pos[:k], sums, lid if k else None, x, ok))
        if not lease:
            return end
        assert dst is not None and ia is not None
        for j, p in bad_fetch:
            if p < end:
                self._stats["corrupt"] += 1
                log.warning("pool: a block from %s failed its checksum (a miss)", mem[j].name)
                end = p
        for j, pos, sums, lid, x, ok in self._landings(reads):
            m = mem[j]
            ok = self._landed(x, ok, m, "read from", deadline)
            take = bisect.bisect_left(pos.tolist(), end)
            if not ok:
                end = min(end, int(pos[0]))
            elif take:
                # a tcp read into the twin took the checksums as the bytes landed: no second pass
                dig = twin[1] if twin is not None and x is not None and x.backend == "tcp" else None
                self._stats["sums_in_copy" if dig is not None else "sums_reread"] += take
                bad = self._verify(dst, ia[pos[:take]], sums[:take], dig)
                if bad < take:
                    self._stats["corrupt"] += 1
                    log.warning("pool: a block from %s failed its checksum (a miss)", m.name)
                    end = min(end, int(pos[bad]))
            if lid is not None:
                self._release(m, lid)
        return end

    def _landing(self, m: Member, nblocks: int) -> Landing | None:
        """The landing through which owner ``m`` serves a fetch of ``nblocks`` now, locked; None
        if it serves over tcp (another node, too many blocks, the landing busy)."""
        if self._local(m):
            return None
        c = self._conn(m)
        land = c.near if c is not None else None
        if land is None or nblocks > land.rows or not land.lock.acquire(blocking=False):
            return None
        return land

    def _fetch(self, m: Member, land: Landing, q: "queue.SimpleQueue[int]", tag: int, keys: list[bytes]) -> Any:
        with self._lock:
            c = self._conns.get(m.name)
        call = None
        if c is not None and c.near is land:
            try:
                call = _Call(c.chan, "fetch", q, tag, keys=keys)
            except KVXError as exc:
                log.info("pool: fetch to %s failed: %s", m.name, exc)
                self._fail(m.name)
        if call is None:
            q.put(tag)
        return call

    @staticmethod
    def _landings(reads: list[Any]) -> Iterator[Any]:
        """``reads`` (their transfer 5th) with those already landed first, so that their checksums
        are taken while the others are still on the wire; then the rest, in order."""
        left = list(range(len(reads)))
        while left:
            ready = [i for i in left if reads[i][4] is None or reads[i][4].done()] or left[:1]
            for i in ready:  # (left[:1]: none landed yet; the caller waits for it, bounded)
                yield reads[i]
            left = [i for i in left if i not in ready]

    @staticmethod
    def _arrivals(q: "queue.SimpleQueue[int]", n: int, deadline: float) -> Iterator[int]:
        """The tags ``0..n-1`` in the order their answers come on ``q``; by ``deadline``, the
        ones still out (their ``_answer`` then times out at once)."""
        left = set(range(n))
        while left:
            try:
                g = q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if g in left:
                left.discard(g)
                yield g
        yield from sorted(left)

    def _write(self, m: Member, src: PreparedList, sidx: np.ndarray, slots: list[int]) -> tuple[Any, bool]:
        """Post the write of ``src[sidx]`` into ``slots`` of ``m``: (transfer or None, posted)."""
        try:
            if self._local(m):
                for a, s in zip(src.descs.addr[sidx], slots):
                    ctypes.memmove(m.arena + s * self.block_bytes, int(a), self.block_bytes)
                return None, True
            c = self._conn(m)
            if c is None:
                return None, False
            return self.agent.write(src, sidx, c.arena, slots), True
        except KVXError as exc:
            log.info("pool: write to %s failed: %s", m.name, exc)
            return None, False

    def _read(self, m: Member, dst: PreparedList, didx: np.ndarray, slots: list[int],
              twin: tuple[PreparedList, np.ndarray] | None = None) -> tuple[Any, bool]:
        """Post the read of ``slots`` of ``m`` into ``dst[didx]``: (transfer or None, posted).
        With ``twin`` (see :meth:`_twin`), a remote read goes through it (the same memory)."""
        try:
            if self._local(m):
                for a, s in zip(dst.descs.addr[didx], slots):
                    ctypes.memmove(int(a), m.arena + s * self.block_bytes, self.block_bytes)
                return None, True
            c = self._conn(m)
            if c is None:
                return None, False
            return self.agent.read(twin[0] if twin is not None else dst, didx, c.arena, slots), True
        except KVXError as exc:
            log.info("pool: read from %s failed: %s", m.name, exc)
            return None, False

    def _release(self, m: Member, lid: bytes) -> None:
        """End a lease without waiting for the answer: the bytes were already checked against
        the checksums committed with them, which is what makes a lease that ran out mid-read (its
        slot reused) a miss; the release only lets the owner evict the blocks sooner."""
        if self._local(m):
            assert self.owner is not None
            self.owner.release(LOCAL, lid)
            return
        with self._lock:
            c = self._conns.get(m.name)
        if c is None or not c.chan.alive:
            return  # the owner drops the lease at its deadline
        try:
            c.chan.send(wire.pack("release", rid=next(c.chan._ids), pl=False, lid=lid, ack=False))
        except KVXError:
            pass

    def _twin(self, dst: PreparedList) -> tuple[PreparedList, np.ndarray] | None:
        """A second prepared list over ``dst``'s descriptors with the tcp backend's
        ``keep_digests`` on, and its digest array: tcp reads into it checksum each block as it
        lands (cached for a few destinations). None where tcp cannot (not running, blocks longer
        than its frames, ``dst`` staged or registered anew)."""
        with self._lock:
            hit = self._twins.get(id(dst))
        if hit is not None and hit[0] is dst and hit[1].gens == dst.gens:
            return hit[1], hit[2]
        try:
            tcp = self.agent.backend("tcp")
            if not isinstance(tcp, TcpBackend) or self.block_bytes > tcp.chunk:
                return None
            twin = self.agent.prepare(dst.descs)
            dig = tcp.keep_digests(twin)
        except KVXError:
            return None
        if twin.gens != dst.gens:  # a region of dst was registered anew since dst was prepared
            return None
        with self._lock:
            while len(self._twins) >= 4:
                self._twins.pop(next(iter(self._twins)))
            self._twins[id(dst)] = (dst, twin, dig)
        return twin, dig

    def _verify(self, dst: PreparedList, ia: np.ndarray, sums: list[int], dig: np.ndarray | None = None) -> int:
        """Index of the first block of ``dst[ia]`` whose checksum differs (``len`` if none):
        from ``dig`` (the checksums taken as the blocks landed, by row of ``dst``) where given,
        otherwise over the bytes in ``dst``."""
        if dig is not None:
            diff = np.flatnonzero(dig[ia] != np.array(sums, dtype=np.uint64))
            return int(diff[0]) if diff.size else len(sums)
        block = ctypes.c_char * self.block_bytes  # one array type, every block a view of it
        for i, (a, want) in enumerate(zip(dst.descs.addr[ia].tolist(), sums)):
            if nh64(block.from_address(a)) != want:
                return i
        return len(sums)

    # ---- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of this client (puts, gets, hits, misses, refused, corrupt, ...)
        and, on a storing member, of its owner (under ``"owner"``)."""
        out: dict[str, Any] = dict(self._stats)
        out["members"] = len(self.members())
        if self.last_refusal:
            out["last_refusal"] = self.last_refusal
        if self.owner is not None:
            o = self.owner
            out["owner"] = {**dataclasses.asdict(o.stats), "blocks": len(o.index), "slots": o.nslots,
                            "leases_active": len(o.leases), "grants_active": len(o.grants)}
            if o.disk is not None:
                out["owner"]["disk"] = {**dataclasses.asdict(o.disk.stats), "blocks": len(o.disk),
                                        "slots": o.disk.nslots}
        return out

    def close(self) -> None:
        """Leave the pool (the membership lease is revoked first), stop serving, close the agent.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._members is not None:
            self._members.close()
        if self._server is not None:
            self._server.close()
        if self._near is not None:
            self._near.close()
        if self._reaper is not None:
            self._reaper.join(timeout=5.0)
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for c in conns:
            c.chan.close()
        if self._own_agent:
            self.agent.close()
        else:
            for c in conns:
                try:
                    self.agent.remove_peer(f"{c.member.name}/owner")
                except KVXError:
                    pass
        if self._oagent is not None:
            self._oagent.close()
        if self.owner is not None and self.owner.disk is not None:
            with self.owner._lock:
                self.owner.disk.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Pool member {self.name!r} capacity={self.capacity} members={len(self.members())}>"

