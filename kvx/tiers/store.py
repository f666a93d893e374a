"""TieredStore: fixed-size KV blocks keyed by block hash in host memory, on disk, in objects.

Every tier is one registered region carved into slots (an ``alloc_host`` pool, a slab file, a
set of objects), moved through the store's own :class:`kvx.Agent`: callers register their
memory (host, or GPU with the cuda backend) with ``store.agent`` and pass prepared lists, so
blocks go straight between an engine's cache and a tier.

Integrity: each stored block has its key, length and CRC32; a block read from a lower tier is
checked before it is promoted or handed out, and one that fails is dropped and counted as a
miss -- never returned. The disk tier journals its index (see :mod:`kvx.tiers.journal`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvx

from ..errors import BlockNotFound, TierError, UsageError
from ..memory import DescList
from .events import BlockRemoved, BlockStored, Event, EventBus
from .journal import Journal
from .policies import DEFAULT_POLICY, EvictionPolicy, make_policy

__all__ = ["TieredStore", "HostTier", "DiskTier", "ObjectTier", "Tier", "LookupResult", "StoreStats", "BadKey"]

log = logging.getLogger(__name__)

_KEY_TYPES = (bytes, int, str)


class BadKey(UsageError, TypeError):
    """Block hashes were not a sequence of ``bytes``, ``int`` or ``str`` keys."""


def _keys(hashes: Any) -> Sequence[Hashable]:
    """Check a caller's block hashes: a list/tuple (or array) of bytes, int or str keys."""
    if isinstance(hashes, (str, bytes, bytearray)) or not isinstance(hashes, (Sequence, np.ndarray)):
        raise BadKey(f"block hashes must be a sequence of keys, not {type(hashes).__name__}")
    if isinstance(hashes, np.ndarray):
        if hashes.ndim != 1 or hashes.dtype.kind not in "iu":
            raise BadKey("a numpy array of block hashes must be one-dimensional integers")
        return hashes.tolist()
    for h in hashes:
        if type(h) not in _KEY_TYPES and not isinstance(h, _KEY_TYPES):
            raise BadKey(f"a block hash must be bytes, int or str, not {type(h).__name__}")
    return hashes


def _prepared(pl: Any, what: str) -> None:
    if not isinstance(pl, kvx.PreparedList):
        raise UsageError(f"{what} must be a kvx.PreparedList (agent.prepare(...)), not {type(pl).__name__}")


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    evicted: int = 0
    demoted: int = 0
    promoted: int = 0
    corrupt: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    """``hits``: length of the longest stored prefix; ``tiers``: the tier index of each of them."""

    hits: int
    tiers: tuple[int, ...]


@dataclass(slots=True)
class StoreStats:
    """Occupancy and counters per tier (``stats()``)."""

    tiers: list[dict[str, Any]] = field(default_factory=list)
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hits: int = 0


class Tier:
    """A tier: ``capacity`` slots of ``block_bytes`` over one registered region."""

    medium = "?"
    #: blocks outlive the store (a read keeps the tier's copy rather than moving it up)
    persistent = False

    def __init__(self, nbytes: int | None = None, blocks: int | None = None) -> None:
        if (nbytes is None) == (blocks is None):
            raise UsageError("give a tier its size as nbytes= or blocks=")
        self._nbytes = nbytes
        self._blocks = blocks
        self.capacity = 0
        self.block_bytes = 0
        self.plist: kvx.PreparedList | None = None
        self.policy: EvictionPolicy | None = None
        self.index: dict[Hashable, tuple[int, int]] = {}  # key -> (slot, crc)
        self.free: list[int] = []
        self.stats = TierStats()
        self.reg: kvx.Registration | None = None

    def _size(self, block_bytes: int) -> int:
        n = self._blocks if self._blocks is not None else int(self._nbytes or 0) // block_bytes
        if n < 1:
            raise UsageError(f"{type(self).__name__} holds no whole block of {block_bytes} bytes")
        return n

    def attach(self, agent: kvx.Agent, block_bytes: int, policy: str) -> None:
        self.block_bytes = block_bytes
        self.capacity = self._size(block_bytes)
        self.reg = agent.register(self.region(self.capacity, block_bytes))
        self.plist = agent.prepare(DescList.blocks(self.reg, block_bytes))
        if len(self.plist) < self.capacity:
            raise TierError(f"{type(self).__name__}: region holds {len(self.plist)} blocks, not {self.capacity}")
        self.policy = make_policy(policy, self.capacity)
        self.free = list(range(self.capacity - 1, -1, -1))
        self.recover()

    def region(self, n: int, block_bytes: int) -> Any:
        raise NotImplementedError

    def recover(self) -> None:
        """Rebuild the index after a restart (tiers that persist)."""

    def committed(self, key: Hashable, parent: Hashable | None, slot: int, crc: int) -> None:
        """A block is now stored (persisting tiers journal it)."""

    def dropped(self, key: Hashable, slot: int) -> None:
        """A block left the tier."""

    def host_view(self, slot: int) -> memoryview | None:
        """Bytes of a slot if the CPU can read them directly (host tier)."""
        return None

    def close(self) -> None:
        if self.reg is not None:
            self.reg.release()


class HostTier(Tier):
    """Blocks in an ``alloc_host`` pool (other local processes can read it directly)."""

    medium = "CPU"

    def region(self, n: int, block_bytes: int) -> Any:
        self.pool = kvx.alloc_host(n * block_bytes)
        return self.pool

    def host_view(self, slot: int) -> memoryview:
        bb = self.block_bytes
        return self.pool.data[slot * bb: (slot + 1) * bb]


class DiskTier(Tier):
    """Blocks in a slab file with a journaled index; survives ``kill -9`` of its process.

    Parameters
    ----------
    path
        Directory for ``slab.bin`` and ``index.log`` (created if absent).
    nbytes, blocks
        Size of the tier.
    fsync
        fdatasync the journal after every record (durable across power loss, slower).
    """

    medium = "DISK"
    persistent = True

    def __init__(self, path: str | os.PathLike[str], nbytes: int | None = None, blocks: int | None = None,
                 fsync: bool = False) -> None:
        super().__init__(nbytes, blocks)
        if not isinstance(path, (str, os.PathLike)):
            raise UsageError(f"DiskTier path must be a str or os.PathLike, not {type(path).__name__}")
        self.path = os.fspath(path)
        self.fsync = fsync
        self.journal: Journal | None = None
        self.parents: dict[Hashable, Hashable | None] = {}

    def attach(self, agent: kvx.Agent, block_bytes: int, policy: str) -> None:
        try:
            super().attach(agent, block_bytes, policy)
        except OSError as exc:
            raise TierError(f"disk tier {self.path!r}: {exc.strerror or exc}") from exc

    def region(self, n: int, block_bytes: int) -> Any:
        os.makedirs(self.path, exist_ok=True)
        meta = os.path.join(self.path, "tier.meta")
        want = f"{block_bytes} {n}\n"
        if os.path.exists(meta):
            with open(meta) as f:
                have = f.read()
            if have != want:  # geometry changed: the old index means nothing
                for name in ("index.log", "slab.bin"):
                    try:
                        os.unlink(os.path.join(self.path, name))
                    except FileNotFoundError:
                        pass
        with open(meta, "w") as f:
            f.write(want)
        return kvx.FileRegion(os.path.join(self.path, "slab.bin"), n * block_bytes)

    def recover(self) -> None:
        jpath = os.path.join(self.path, "index.log")
        live: dict[Hashable, tuple[int, int, int, Hashable | None]] = {}
        byslot: dict[int, Hashable] = {}
        for op, key, parent, slot, crc, length in Journal.replay(jpath):
            if not (0 <= slot < self.capacity):
                continue
            if op == "put" and length == self.block_bytes:
                old = byslot.get(slot)
                if old is not None:
                    live.pop(old, None)
                if key in live:
                    byslot.pop(live[key][0], None)
                live[key] = (slot, crc, length, parent)
                byslot[slot] = key
            elif op == "del":
                if key in live and live[key][0] == slot:
                    del live[key]
                    byslot.pop(slot, None)
        Journal.compact(jpath, live)
        self.journal = Journal(jpath, fsync=self.fsync)
        assert self.policy is not None
        used = set()
        # parents first so the chain structure is rebuilt
        order = sorted(live, key=lambda k: _depth(k, live))
        for key in order:
            slot, crc, _length, parent = live[key]
            self.index[key] = (slot, crc)
            self.parents[key] = parent
            self.policy.inserted(key, parent if parent in self.index else None)
            used.add(slot)
        self.free = [s for s in range(self.capacity - 1, -1, -1) if s not in used]
        if live:
            log.info("disk tier %s recovered %d blocks", self.path, len(live))

    def committed(self, key: Hashable, parent: Hashable | None, slot: int, crc: int) -> None:
        assert self.journal is not None
        self.parents[key] = parent
        self.journal.put(key, parent, slot, crc, self.block_bytes)

    def dropped(self, key: Hashable, slot: int) -> None:
        assert self.journal is not None
        self.parents.pop(key, None)
        self.journal.delete(key, slot)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
        super().close()


def _depth(k: Hashable, live: dict[Hashable, tuple[int, int, int, Hashable | None]]) -> int:
    d = 0
    seen = set()
    while True:
        p = live.get(k)
        if p is None or p[3] is None or p[3] in seen:
            return d
        seen.add(k)
        k = p[3]
        d += 1


class ObjectTier(Tier):
    """One object per slot (``{prefix}/{slot}``) in an S3 bucket, through the ``s3`` backend."""

    medium = "OBJECT"

    def __init__(self, bucket: str, nbytes: int | None = None, blocks: int | None = None,
                 prefix: str = "kvx-tier") -> None:
        super().__init__(nbytes, blocks)
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def region(self, n: int, block_bytes: int) -> Any:
        return [kvx.ObjectRegion(self.bucket, f"{self.prefix}/{i}", block_bytes) for i in range(n)]


class TieredStore:
    """KV blocks keyed by chained block hashes across an ordered list of tiers.

    Parameters
    ----------
    tiers
        Top (fastest) first, e.g. ``[HostTier(nbytes=1 << 30), DiskTier("/nvme/kv", nbytes=...)]``.
    block_bytes
        Size of every block.
    policy
        Eviction policy name (``kvx.tiers.policies.POLICIES``); default adaptive.
    write_through
        Also write every new block to the next tier at once (evictions then just drop).
    agent
        The agent that moves the bytes (default: a private one with the backends the tiers need).
    pin_lease
        Seconds a ``pin`` lasts unless renewed.

    Notes
    -----
    Operations are thread-safe. ``put`` and ``get`` wait for their transfers before they
    return (blocks become visible to ``lookup`` only once stored and checksummed).
    """

    def __init__(self, tiers: Sequence[Tier], block_bytes: int, policy: str = DEFAULT_POLICY,
                 write_through: bool = False, agent: kvx.Agent | None = None, pin_lease: float = 30.0,
                 verify_host: bool = False) -> None:
        if not tiers:
            raise UsageError("a TieredStore needs at least one tier")
        if not isinstance(tiers[0], HostTier):
            raise UsageError("the first (top) tier must be a HostTier: blocks are checksummed there")
        if not isinstance(block_bytes, int) or block_bytes <= 0:
            raise UsageError("block_bytes must be a positive int")
        self.block_bytes = block_bytes
        self.tiers = list(tiers)
        self.write_through = write_through
        self.pin_lease = pin_lease
        self.verify_host = verify_host
        self._own_agent = agent is None
        self.agent = agent if agent is not None else kvx.Agent(f"kvx-store-{os.getpid()}-{id(self):x}")
        self.events = EventBus()
        self._lock = threading.RLock()
        self._where: dict[Hashable, int] = {}
        self._pins: dict[Hashable, float] = {}
        self._pending: set[Hashable] = set()
        self.stats_ = StoreStats()
        self._closed = False
        self._staging: dict[int, Any] = {}
        try:
            for t in self.tiers:
                t.attach(self.agent, block_bytes, policy)
                for k in t.index:
                    self._where.setdefault(k, self.tiers.index(t))
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------
    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise UsageError("the store is closed")

    def lookup(self, hashes: Sequence[Hashable]) -> LookupResult:
        """Longest stored prefix of ``hashes`` and which tier holds each of its blocks."""
        self._check()
        hashes = _keys(hashes)
        where = self._where
        tiers: list[int] = []
        for h in hashes:
            t = where.get(h)
            if t is None:
                break
            tiers.append(t)
        st = self.stats_
        st.lookups += 1
        st.lookup_blocks += len(hashes)
        st.lookup_hits += len(tiers)
        return LookupResult(len(tiers), tuple(tiers))

    def __contains__(self, h: Hashable) -> bool:
        return h in self._where

    def __len__(self) -> int:
        return len(self._where)

    # ---------------------------------------------------------------------------------------
    def _make_room(self, ti: int, events: list[Event],
                   batch: dict[Hashable, tuple[int, Hashable | None, int]] | None = None,
                   flush: Any = None) -> int:
        """Free one slot in tier ``ti`` (demoting or dropping a victim); return the slot.

        ``batch`` holds blocks admitted by the ``put`` in progress but not written yet. If the
        policy picks one of them: with a lower tier, ``flush()`` writes the batch so the victim
        can be demoted; without one, the victim is simply not stored.
        """
        t = self.tiers[ti]
        if t.free:
            return t.free.pop()
        assert t.policy is not None
        self._expire_pins()
        v = t.policy.victim()
        if batch is not None and v in batch:
            if ti + 1 < len(self.tiers) and flush is not None:
                flush()
            else:
                slot = batch.pop(v)[0]
                t.policy.removed(v)
                self._pending.discard(v)
                return slot
        slot, crc = t.index[v]
        lower = ti + 1
        if lower < len(self.tiers) and not (self.write_through and v in self.tiers[lower].index):
            lt = self.tiers[lower]
            if v not in lt.index:
                lslot = self._make_room(lower, events)
                assert t.plist is not None and lt.plist is not None
                self._move(t, slot, lt, lslot)
                parent = self._parent_hint(t, v)
                lt.index[v] = (lslot, crc)
                lt.policy.inserted(v, parent if parent in lt.index else None)  # type: ignore[union-attr]
                lt.committed(v, parent, lslot, crc)
                lt.stats.stored += 1
                t.stats.demoted += 1
                events.append(BlockStored([v], parent, lt.medium, self.block_bytes))
            self._where[v] = lower
        elif lower < len(self.tiers) and v in self.tiers[lower].index:
            self._where[v] = lower
        else:
            del self._where[v]
        self._forget(ti, v, slot, events)
        t.stats.evicted += 1
        return slot

    def _move(self, src: Tier, sslot: int, dst: Tier, dslot: int) -> None:
        """Copy one block between tiers: directly when one side is the host pool, else through
        a host staging buffer (no backend moves FILE <-> OBJECT)."""
        assert src.plist is not None and dst.plist is not None
        if isinstance(src, HostTier):
            self.agent.write(src.plist, [sslot], dst.plist, [dslot]).wait()
        elif isinstance(dst, HostTier):
            self.agent.read(dst.plist, [dslot], src.plist, [sslot]).wait()
        else:
            _buf, sl = self._staging_buf()
            self.agent.read(sl, [0], src.plist, [sslot]).wait()
            self.agent.write(sl, [0], dst.plist, [dslot]).wait()

    def _parent_hint(self, t: Tier, key: Hashable) -> Hashable | None:
        assert t.policy is not None
        return t.policy.parent_of(key)

    def _forget(self, ti: int, key: Hashable, slot: int, events: list[Event]) -> None:
        t = self.tiers[ti]
        del t.index[key]
        assert t.policy is not None
        t.policy.removed(key)
        t.dropped(key, slot)
        events.append(BlockRemoved([key], t.medium))

    def _expire_pins(self) -> None:
        if not self._pins:
            return
        now = time.monotonic()
        for k, until in list(self._pins.items()):
            if until <= now:
                self._unpin_one(k)

    # ---------------------------------------------------------------------------------------
    def put(self, hashes: Sequence[Hashable], src: kvx.PreparedList, src_idx: Any = None,
            parent: Hashable | None = None, timeout: float = 60.0) -> int:
        """Store the blocks ``src[src_idx]`` under ``hashes`` (one chain: each block's parent is
        the previous hash; the first's is ``parent``). Blocks already stored are touched.

        Returns the number of blocks newly stored (the policy may decline some: admission).
        """
        self._check()
        hashes = _keys(hashes)
        _prepared(src, "src")
        n = len(hashes)
        sidx = np.arange(n, dtype=np.int64) if src_idx is None else np.asarray(src_idx, dtype=np.int64)
        if sidx.shape != (n,):
            raise UsageError("src_idx must have one index per hash")
        if src.descs.nbytes.size and not np.all(src.descs.nbytes[sidx] == self.block_bytes):
            raise UsageError(f"source blocks must be {self.block_bytes} bytes")
        top = self.tiers[0]
        events: list[Event] = []
        with self._lock:
            pol = top.policy
            assert pol is not None and top.plist is not None
            where = self._where
            batch: dict[Hashable, tuple[int, Hashable | None, int]] = {}
            total = [0]
            bb = self.block_bytes
            mv = top.pool.data  # type: ignore[attr-defined]
            tplist = top.plist

            def flush() -> None:
                if not batch:
                    return
                keys = list(batch)
                slots = [v[0] for v in batch.values()]
                parents = [v[1] for v in batch.values()]
                try:
                    self.agent.write(src, sidx[[v[2] for v in batch.values()]], tplist, slots).wait(timeout)
                except BaseException:
                    for h, slot in zip(keys, slots):
                        pol.removed(h)
                        self._pending.discard(h)
                        top.free.append(slot)
                    batch.clear()
                    raise
                batch.clear()
                for h, p, slot in zip(keys, parents, slots):
                    crc = zlib.crc32(mv[slot * bb:(slot + 1) * bb])
                    top.index[h] = (slot, crc)
                    top.committed(h, p, slot, crc)
                    where[h] = 0
                    self._pending.discard(h)
                top.stats.stored += len(keys)
                top.stats.bytes_in += len(keys) * bb
                total[0] += len(keys)
                if self.events.active:
                    events.append(BlockStored(keys, parents[0], top.medium, bb))
                if self.write_through and len(self.tiers) > 1:
                    self._write_through(keys, parents, events)

            prev = parent
            for i, h in enumerate(hashes):
                ti = where.get(h)
                if ti is not None:
                    tpol = self.tiers[ti].policy
                    assert tpol is not None
                    tpol.hit(h)
                    self.tiers[ti].stats.hits += 1
                elif h not in self._pending:
                    pol.miss(h)
                    if pol.admit(h, prev):
                        slot = self._make_room(0, events, batch, flush)
                        batch[h] = (slot, prev, i)
                        pol.inserted(h, prev)
                        self._pending.add(h)
                prev = h
            flush()
        self.events.emit(events)
        return total[0]

    def _write_through(self, keys: list[Hashable], parents: list[Hashable | None], events: list[Event]) -> None:
        top, lt = self.tiers[0], self.tiers[1]
        assert top.plist is not None and lt.plist is not None and lt.policy is not None
        for h, p in zip(keys, parents):
            if h in lt.index:
                continue
            lslot = self._make_room(1, events)
            slot, crc = top.index[h]
            self._move(top, slot, lt, lslot)
            lt.index[h] = (lslot, crc)
            lt.policy.inserted(h, p if p in lt.index else None)
            lt.committed(h, p, lslot, crc)
            lt.stats.stored += 1

    # ---------------------------------------------------------------------------------------
    def _verify(self, t: Tier, key: Hashable, data: memoryview) -> bool:
        _slot, crc = t.index[key]
        return zlib.crc32(data) == crc

    def _staging_buf(self) -> tuple[np.ndarray, kvx.PreparedList]:
        tid = threading.get_ident()
        s = self._staging.get(tid)
        if s is None:
            buf = np.zeros(self.block_bytes, np.uint8)
            reg = self.agent.register(buf)
            s = (buf, self.agent.prepare(reg.descs), reg)
            self._staging[tid] = s
        return s[0], s[1]

    def get(self, hashes: Sequence[Hashable], dst: kvx.PreparedList, dst_idx: Any = None,
            timeout: float = 60.0) -> int:
        """Copy stored blocks into ``dst[dst_idx]``, verifying each; promote lower-tier hits.

        Raises
        ------
        BlockNotFound
            If a block is absent or failed its checksum (it is then dropped). Blocks before it
            in ``hashes`` have been copied; the count is in the exception's ``args[1]``.
        """
        self._check()
        hashes = _keys(hashes)
        _prepared(dst, "dst")
        n = len(hashes)
        didx = np.arange(n, dtype=np.int64) if dst_idx is None else np.asarray(dst_idx, dtype=np.int64)
        if didx.shape != (n,):
            raise UsageError("dst_idx must have one index per hash")
        done = 0
        events: list[Event] = []
        with self._lock:
            for i, h in enumerate(hashes):
                ti = self._where.get(h)
                if ti is None:
                    self.tiers[0].stats.misses += 1
                    self.events.emit(events)
                    raise BlockNotFound(f"block {h!r} is not stored", done)
                t = self.tiers[ti]
                if ti > 0:
                    if not self._promote(ti, h, events):
                        self.events.emit(events)
                        raise BlockNotFound(f"block {h!r} failed its checksum and was dropped", done)
                    t = self.tiers[0]
                elif self.verify_host:
                    slot, _ = t.index[h]
                    view = t.host_view(slot)
                    if view is not None and not self._verify(t, h, view):
                        self._drop_corrupt(0, h, events)
                        self.events.emit(events)
                        raise BlockNotFound(f"block {h!r} failed its checksum and was dropped", done)
                slot, _ = t.index[h]
                assert t.policy is not None and t.plist is not None
                t.policy.hit(h)
                t.stats.hits += 1
                self.agent.read(dst, [int(didx[i])], t.plist, [slot]).wait(timeout)
                t.stats.bytes_out += self.block_bytes
                done += 1
        self.events.emit(events)
        return done

    def _drop_corrupt(self, ti: int, key: Hashable, events: list[Event]) -> None:
        t = self.tiers[ti]
        slot, _ = t.index[key]
        self._forget(ti, key, slot, events)
        t.free.append(slot)
        t.stats.corrupt += 1
        if self._where.get(key) == ti:
            del self._where[key]

    def _promote(self, ti: int, key: Hashable, events: list[Event]) -> bool:
        """Bring a lower-tier block to the top tier after verifying it; False if corrupt."""
        t, top = self.tiers[ti], self.tiers[0]
        assert t.plist is not None and top.plist is not None and top.policy is not None
        # make room first: demotions below may use the staging buffer themselves
        tslot = self._make_room(0, events)
        if key not in t.index:  # the demotions pushed this very block further down, or out
            ti2 = self._where.get(key)
            if ti2 is None or ti2 == 0:
                top.free.append(tslot)
                return ti2 == 0
            t, ti = self.tiers[ti2], ti2
        assert t.plist is not None
        slot, crc = t.index[key]
        buf, sl = self._staging_buf()
        self.agent.read(sl, [0], t.plist, [slot]).wait()
        if zlib.crc32(buf.data) != crc:
            log.warning("block %r in %s tier failed its checksum: dropped", key, t.medium)
            self._drop_corrupt(ti, key, events)
            top.free.append(tslot)
            return False
        parent = getattr(t, "parents", {}).get(key) if isinstance(t, DiskTier) else None
        if parent is None and t.policy is not None:
            parent = t.policy.parent_of(key)
        self.agent.write(sl, [0], top.plist, [tslot]).wait()
        top.index[key] = (tslot, crc)
        top.policy.inserted(key, parent if parent in top.index else None)
        top.committed(key, parent, tslot, crc)
        self._where[key] = 0
        t.stats.promoted += 1
        if not self.write_through and not t.persistent:
            self._forget(ti, key, slot, events)
            t.free.append(slot)
        events.append(BlockStored([key], parent, top.medium, self.block_bytes))
        return True

    def prefetch(self, hashes: Sequence[Hashable]) -> threading.Thread:
        """Promote the stored prefix of ``hashes`` to the top tier in the background."""
        self._check()
        hashes = _keys(hashes)

        def run() -> None:
            events: list[Event] = []
            with self._lock:
                for h in hashes:
                    ti = self._where.get(h)
                    if ti is None:
                        break
                    if ti > 0 and not self._promote(ti, h, events):
                        break
            self.events.emit(events)

        th = threading.Thread(target=run, name="kvx-prefetch", daemon=True)
        th.start()
        return th

    # ---------------------------------------------------------------------------------------
    def pin(self, hashes: Sequence[Hashable], lease: float | None = None) -> int:
        """Keep blocks from eviction for ``lease`` seconds (default ``pin_lease``); returns count."""
        self._check()
        hashes = _keys(hashes)
        until = time.monotonic() + (self.pin_lease if lease is None else lease)
        n = 0
        with self._lock:
            for h in hashes:
                ti = self._where.get(h)
                if ti is None:
                    continue
                self.tiers[ti].policy.set_evictable(h, False)  # type: ignore[union-attr]
                self._pins[h] = until
                n += 1
        return n

    def unpin(self, hashes: Sequence[Hashable]) -> None:
        """Make blocks evictable again."""
        hashes = _keys(hashes)
        with self._lock:
            for h in hashes:
                self._unpin_one(h)

    def _unpin_one(self, h: Hashable) -> None:
        if self._pins.pop(h, None) is None:
            return
        ti = self._where.get(h)
        if ti is not None:
            self.tiers[ti].policy.set_evictable(h, True)  # type: ignore[union-attr]

    def delete(self, hashes: Sequence[Hashable]) -> int:
        """Remove blocks from every tier; returns how many were stored."""
        hashes = _keys(hashes)
        events: list[Event] = []
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._where:
                    continue
                self._pins.pop(h, None)
                for ti, t in enumerate(self.tiers):
                    if h in t.index:
                        slot, _ = t.index[h]
                        self._forget(ti, h, slot, events)
                        t.free.append(slot)
                del self._where[h]
                n += 1
        self.events.emit(events)
        return n

    def announce(self) -> int:
        """Emit a ``BlockStored`` event for every block stored now, per tier (for example after
        the disk tier recovered its index at start-up, so a KV-aware router or an engine's
        offload index can be rebuilt). Returns the number of blocks announced."""
        events: list[Event] = []
        with self._lock:
            for t in self.tiers:
                keys = list(t.index)
                if keys:
                    events.append(BlockStored(keys, None, t.medium, self.block_bytes))
        self.events.emit(events)
        return sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))

    # ---------------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Occupancy and counters per tier."""
        s = StoreStats(lookups=self.stats_.lookups, lookup_blocks=self.stats_.lookup_blocks,
                       lookup_hits=self.stats_.lookup_hits)
        for t in self.tiers:
            d = {"medium": t.medium, "capacity": t.capacity, "used": len(t.index),
                 "pinned": sum(1 for k in self._pins if k in t.index)}
            d.update({k: getattr(t.stats, k) for k in TierStats.__dataclass_fields__})
            s.tiers.append(d)
        return s

    def prometheus(self, prefix: str = "kvx_store") -> str:
        """The stats in Prometheus text exposition format."""
        st = self.stats()
        lines = []
        for name, help_ in [("used", "blocks stored"), ("capacity", "slots"), ("hits", "block hits"),
                            ("misses", "block misses"), ("evicted", "evictions"), ("demoted", "demotions"),
                            ("promoted", "promotions"), ("corrupt", "blocks dropped on checksum failure"),
                            ("bytes_in", "bytes stored"), ("bytes_out", "bytes read")]:
            kind = "gauge" if name in ("used", "capacity") else "counter"
            metric = f"{prefix}_{name}" + ("_total" if kind == "counter" else "")
            lines.append(f"# HELP {metric} {help_}")
            lines.append(f"# TYPE {metric} {kind}")
            for i, t in enumerate(st.tiers):
                lines.append(f'{metric}{{tier="{i}",medium="{t["medium"]}"}} {t[name]}')
        lines.append(f"# TYPE {prefix}_lookup_blocks_total counter")
        lines.append(f"{prefix}_lookup_blocks_total {st.lookup_blocks}")
        lines.append(f"# TYPE {prefix}_lookup_hits_total counter")
        lines.append(f"{prefix}_lookup_hits_total {st.lookup_hits}")
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Release tiers (the disk tier's journal stays for recovery) and the private agent."""
        if self._closed:
            return
        self._closed = True
        for t in self.tiers:
            try:
                t.close()
            except Exception:
                log.exception("closing tier")
        for _buf, _pl, reg in self._staging.values():
            reg.release()
        if self._own_agent:
            self.agent.close()
