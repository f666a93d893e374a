"""TieredStore: fixed-size KV blocks keyed by block hash in host memory, on disk, in objects.

Every tier is one registered region carved into slots (an ``alloc_host`` pool, a slab file, a
set of objects), moved through the store's own :class:`kvx.Agent`: callers register their
memory (host, or GPU with the cuda backend) with ``store.agent`` and pass prepared lists, so
blocks go straight between an engine's cache and a tier.

Bookkeeping and data movement are separate. Under the store lock, every decision (lookup,
admission, eviction, demotion, promotion) is made at once and in order, exactly as the policy
simulator makes it. The bytes of a demotion then move through a bounded *write-back queue*:
background workers take batches of jobs with the same source and destination tier and move
each batch with one transfer, outside the lock. Until a job lands, its destination slot is a
*landing* slot: readers are sent to the source slot, which stays pinned (not reused) until then.
``put`` waits only while the queue is full (``writeback_depth`` jobs), for at most its timeout.

Integrity: each stored block has its key, length and kvx-nh64 checksum
(:mod:`kvx.tiers.checksum`); a block read from a lower tier is checked before it is promoted or
handed out, and one that fails is dropped and counted as a miss -- never returned. A read from
the disk tier into host memory takes the checksums in the copy itself. The disk tier journals a
block only after its bytes landed (see :mod:`kvx.tiers.tier` and :mod:`kvx.tiers.journal`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvx

from ..errors import BackendUnavailable, BlockNotFound, KVXError, TierError, TierFull, UsageError
from ..memory import DescList
from .checksum import block_sum, keep_digests
from .events import BlockRemoved, BlockStored, Event, EventBus
from .metrics import Histogram
from .policies import DEFAULT_POLICY
from .remote import RemoteTier
from .tier import DiskTier, HostTier, JournaledTier, ObjectTier, Tier, TierStats

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


def _view(addr: int, n: int) -> memoryview:
    """A writable byte view of ``n`` bytes of this process's memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _prepared(pl: Any, what: str) -> None:
    if not isinstance(pl, kvx.PreparedList):
        raise UsageError(f"{what} must be a kvx.PreparedList (agent.prepare(...)), not {type(pl).__name__}")


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
    writeback_queued: int = 0
    writeback_active: int = 0
    #: the remote tier's own counters, and the store's view of it under ``"store"`` (hits,
    #: misses, stored, errors, promoted); None without one
    remote: dict[str, Any] | None = None


@dataclass(slots=True)
class _Job:
    """Copy one block's bytes from ``src`` to ``dst`` (``(tier, slot)`` each) and journal it."""

    key: Hashable
    crc: int
    parent: Hashable | None
    src: tuple[int, int]
    dst: tuple[int, int]
    t0: float


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
        Also write every new block to the next tier (evictions then just drop).
    agent
        The agent that moves the bytes (default: a private one with the backends the tiers need).
    pin_lease
        Seconds a ``pin`` lasts unless renewed.
    verify_host
        Check the CRC of host-tier blocks on every ``get`` too.
    writeback_depth
        Demotions queued or in flight at most; ``put`` waits (up to its timeout) past it.
    writeback_batch
        Blocks one worker moves with one transfer.
    writeback_workers
        Background threads draining the queue.
    get_chunk
        ``get``/``prefetch`` move at most this many blocks per transfer (one transfer per tier
        per chunk).
    promote
        Promote the disk blocks that a ``get`` reads straight into host memory to the host tier
        (after the get returns). False keeps them on disk only: a scan or a one-off read then
        leaves the host tier alone (reads through host slots -- objects, or a destination
        that is not host memory -- and ``prefetch`` still promote). It also admits the blocks a
        ``get`` read from the remote tier into the local tiers.
    remote
        A tier on other machines (:class:`~kvx.tiers.RemoteTier`, e.g. :class:`kvx.pool.PoolTier`)
        below the local ones, asked only for what they miss: ``lookup`` extends the local prefix
        with what it holds right after it (listed as tier ``len(store.tiers)``), ``get`` reads
        the blocks the local tiers miss from it, and ``put`` writes the blocks to it too before
        it returns (its ``write_through``). It may also be given as the last element of
        ``tiers``. A remote tier that names an ``agent`` makes it the store's agent.

    Notes
    -----
    Operations are thread-safe. ``put`` and ``get`` wait for their own transfers before they
    return; demotions finish in the background (``flush()`` waits for them; ``close()``
    drains them). Each tier holds ``writeback_depth + 2 * get_chunk + len(tiers) + 1`` spare
    slots besides its capacity, for blocks on their way down.
    """

    def __init__(self, tiers: Sequence[Tier | RemoteTier], block_bytes: int, policy: str = DEFAULT_POLICY,
                 write_through: bool = False, agent: kvx.Agent | None = None, pin_lease: float = 30.0,
                 verify_host: bool = False, writeback_depth: int = 64, writeback_batch: int = 64,
                 writeback_workers: int = 2, get_chunk: int = 64, promote: bool = True,
                 remote: RemoteTier | None = None) -> None:
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence) or not tiers:
            raise UsageError("a TieredStore needs a non-empty list of tiers")
        given = list(tiers)
        if isinstance(given[-1], RemoteTier):  # TieredStore([HostTier(...), PoolTier(pool)])
            if remote is not None:
                raise UsageError("a remote tier is given twice: as the last tier and as remote=")
            remote = given.pop()  # type: ignore[assignment]
        if remote is not None and not isinstance(remote, RemoteTier):
            raise UsageError(f"remote must be a kvx.tiers.RemoteTier, not {type(remote).__name__}")
        if any(isinstance(t, RemoteTier) for t in given):
            raise UsageError("a remote tier can only be the last tier")
        if not given:
            raise UsageError("a TieredStore needs a local tier (a HostTier) above its remote tier")
        local = [t for t in given if isinstance(t, Tier)]
        if len(local) != len(given):
            raise UsageError("tiers must be HostTier, DiskTier or ObjectTier instances (and a RemoteTier last)")
        if not isinstance(local[0], HostTier):
            raise UsageError("the first (top) tier must be a HostTier: blocks are checksummed there")
        if len({id(t) for t in local}) != len(local):
            raise UsageError("a tier object can appear only once")
        if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0:
            raise UsageError("block_bytes must be a positive int")
        for name, v in (("writeback_depth", writeback_depth), ("writeback_batch", writeback_batch),
                        ("writeback_workers", writeback_workers), ("get_chunk", get_chunk)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UsageError(f"{name} must be a positive int, not {v!r}")
        self.block_bytes = block_bytes
        self.tiers: list[Tier] = local
        self.write_through = write_through
        self.pin_lease = pin_lease
        self.verify_host = verify_host
        self.depth = writeback_depth
        self.wb_batch = writeback_batch
        self.chunk = get_chunk
        self.promote = bool(promote)
        self.remote = remote
        if remote is not None:
            remote.bind(block_bytes)
            ra = remote.agent
            if ra is not None:
                if agent is not None and agent is not ra:
                    raise UsageError(f"the remote tier moves blocks with agent {ra.name!r}: "
                                     "the store must use the same one (leave agent= out)")
                agent = ra
        self._own_agent = agent is None
        self.agent = agent if agent is not None else kvx.Agent(f"kvx-store-{os.getpid()}-{id(self):x}")
        #: the remote tier's counters as the store sees them
        self._rstats = {"hits": 0, "misses": 0, "stored": 0, "errors": 0, "promoted": 0}
        self.events = EventBus()
        self._lock = threading.RLock()
        self._room = threading.Condition(self._lock)  # slots freed / jobs done
        self._work = threading.Condition(self._lock)  # jobs queued / stop
        self._get_lock = threading.Lock()  # one get/prefetch moves data at a time
        self._where: dict[Hashable, int] = {}
        self._pins: dict[Hashable, float] = {}
        self._pending: set[Hashable] = set()
        self._landing: dict[tuple[int, int], tuple[int, int]] = {}
        self._jobs: list[_Job] = []
        self._active = 0
        self._writing: dict[int, set[int]] = {}  # packed tier -> packs being written now
        self._forcing = 0  # flush() calls waiting: open packs are written at once
        self._stop = False
        self._workers: list[threading.Thread] = []
        #: blocks read straight from a persistent tier by a get, to promote to the host tier
        #: afterwards: (key, tier, slot, checksum)
        self._promotions: deque[tuple[Hashable, int, int, int]] = deque()
        #: id(dst) -> (dst, its twin whose posix reads take checksums, the twin's digests)
        self._twins: dict[int, tuple[kvx.PreparedList, kvx.PreparedList, np.ndarray]] = {}
        self.stats_ = StoreStats()
        self.h_writeback = Histogram("writeback_latency", "demotion queued -> bytes landed and journaled")
        self.h_promote = Histogram("promotion_latency", "background promotion (disk -> host) queued -> landed")
        self.h_batch = Histogram("writeback_batch", "one write-back batch transfer")
        self.h_put = Histogram("put_latency", "put() call")
        self.h_get = Histogram("get_latency", "get() call")
        self._closed = False
        spare = self.depth + 2 * self.chunk + len(self.tiers) + 1
        try:
            for i, t in enumerate(self.tiers):
                if isinstance(t, ObjectTier):  # two packs can be in flight while the next one fills
                    t.pack_blocks = min(t.pack_blocks, max(1, self.depth // 2))
                t.attach(self.agent, block_bytes, policy, spare)
                for k in t.index:
                    self._where.setdefault(k, i)
        except BaseException:
            self.close()
            raise
        if len(self.tiers) > 1:
            for i in range(writeback_workers):
                th = threading.Thread(target=self._worker, name=f"kvx-writeback-{i}", daemon=True)
                th.start()
                self._workers.append(th)

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
        if self._promotions:  # earlier gets' promotions are decided before anyone looks
            self._settle_promotions()
        where = self._where
        tiers: list[int] = []
        for h in hashes:
            t = where.get(h)
            if t is None:
                break
            tiers.append(t)
        if self.remote is not None and len(tiers) < len(hashes):
            more = self._remote_call("lookup", list(hashes[len(tiers):]))
            tiers.extend([len(self.tiers)] * more)
        st = self.stats_
        st.lookups += 1
        st.lookup_blocks += len(hashes)
        st.lookup_hits += len(tiers)
        return LookupResult(len(tiers), tuple(tiers))

    def _remote_call(self, op: str, hashes: list[Hashable], pl: Any = None, idx: Any = None) -> int:
        """``self.remote.<op>(...)``, its result checked; a KVXError it raises is a miss (0)."""
        r = self.remote
        assert r is not None
        try:
            got = r.lookup(hashes) if op == "lookup" else getattr(r, op)(hashes, pl, idx)
        except KVXError as exc:
            self._rstats["errors"] += 1
            log.warning("remote tier %s: %s failed: %s", r.medium, op, exc)
            return 0
        if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got <= len(hashes):
            raise TierError(f"remote tier {r.medium}: {op} returned {got!r} for {len(hashes)} blocks")
        return got

    def __contains__(self, h: Hashable) -> bool:
        return h in self._where

    def __len__(self) -> int:
        return len(self._where)

    # --------------------------------------------------------------------- bookkeeping
    def _src_of(self, loc: tuple[int, int]) -> tuple[int, int]:
        """Where the bytes of the block at ``loc`` are now (a landing slot's source)."""
        landing = self._landing
        while True:
            nxt = landing.get(loc)
            if nxt is None:
                return loc
            loc = nxt

    def _pin(self, loc: tuple[int, int]) -> None:
        self.tiers[loc[0]].pin(loc[1])

    def _unpin(self, loc: tuple[int, int]) -> None:
        self.tiers[loc[0]].unpin(loc[1])

    def _relocate(self, key: Hashable) -> None:
        for i, t in enumerate(self.tiers):
            if key in t.index:
                self._where[key] = i
                return
        self._where.pop(key, None)

    def _queued(self) -> int:
        return len(self._jobs) + self._active

    def _has_room(self, m: int, queue: bool = True) -> bool:
        if queue and self._queued() >= self.depth:
            return False
        return all(t.room(m, len(self.tiers)) for t in self.tiers)

    def _wait_room(self, m: int, deadline: float, flush: Any = None, queue: bool = True) -> None:
        """Backpressure: wait (lock released) until the queue has room for ``m`` more blocks.

        ``queue=False`` (reads) waits only for spare slots, not for the queue bound: a read of a
        block on its way down must not wait for that very write-back."""
        if self._has_room(m, queue):
            return
        if flush is not None:
            flush()  # nothing half-admitted may be seen by others while we wait
        while True:
            self._compact(m + len(self.tiers))  # a packed tier short of free packs: start one
            if self._has_room(m, queue):
                break
            left = deadline - time.monotonic()
            if left <= 0 or self._stop:
                raise TierError(f"write-back queue still full ({self._queued()} blocks queued or in flight, "
                                f"depth {self.depth}) at the end of the timeout")
            self._room.wait(min(left, 1.0))

    def _enqueue(self, key: Hashable, crc: int, parent: Hashable | None, src: tuple[int, int],
                 dst: tuple[int, int], later: list[_Job] | None = None) -> None:
        """Queue a copy ``src`` -> ``dst``; readers of ``dst`` use ``src`` until it landed.
        With ``later``, the job is only made (slots pinned, readers redirected) and appended to
        ``later``: the caller queues it when it is done with the CPU."""
        src = self._src_of(src)
        self._pin(src)
        self._pin(dst)
        self._landing[dst] = src
        job = _Job(key, crc, parent, src, dst, time.monotonic())
        if later is not None:
            later.append(job)
            return
        self._jobs.append(job)
        self._work.notify()

    def _make_room(self, ti: int, events: list[Event],
                   batch: dict[Hashable, tuple[int, Hashable | None, int]] | None = None,
                   flush: Any = None) -> int:
        """Make room for one block in tier ``ti`` (demoting or dropping victims); return a free slot.

        ``batch`` holds blocks admitted by the ``put`` in progress but not written yet. If the
        policy picks one of them: with a lower tier, ``flush()`` writes the batch so the victim
        can be demoted; without one, the victim is simply not stored.
        """
        t = self.tiers[ti]
        pol = t.policy
        assert pol is not None
        if t.retired and not t.can_alloc() and not t.record_removals():
            # evicting more would only retire more slots: refuse until the journal can be written
            raise TierFull(f"{t.medium} tier: {t.retired} slots are out of use until its journal can record their "
                           "removal (disk full?)")
        while len(pol) >= t.capacity:
            self._expire_pins()
            v = pol.victim()
            if batch is not None and v in batch:
                if ti + 1 < len(self.tiers) and flush is not None:
                    flush()
                else:
                    slot = batch.pop(v)[0]
                    pol.removed(v)
                    self._pending.discard(v)
                    t.free.append(slot)
                    continue
            slot, crc = t.index[v]
            lower = ti + 1
            if lower < len(self.tiers) and v not in self.tiers[lower].index:
                lt = self.tiers[lower]
                lslot = self._make_room(lower, events)
                parent = pol.parent_of(v)
                lt.index[v] = (lslot, crc)
                lt.policy.inserted(v, parent if parent in lt.index else None)  # type: ignore[union-attr]
                lt.noted(v, parent)
                self._enqueue(v, crc, parent, (ti, slot), (lower, lslot))
                lt.stats.stored += 1
                t.stats.demoted += 1
                if self.events.active:
                    events.append(BlockStored([v], parent, lt.medium, self.block_bytes))
            self._forget(ti, v, slot, events)
            t.stats.evicted += 1
        if not t.can_alloc():  # the backpressure check keeps spare slots; this is a bug if reached
            raise TierError(f"{t.medium} tier has no free slot ({len(t.deferred)} held by transfers in flight, "
                            f"{t.retired} out of use)")
        slot = t.alloc()
        if isinstance(t, ObjectTier) and t.needs_compaction():
            self._compact(0)
        return slot

    def _compact(self, want: int) -> None:
        """Start compacting packed tiers short of free packs: the live blocks of the emptiest
        pack move to the open pack through the write-back queue (readers use the old slot until
        they landed); the old pack is free once the last of them did."""
        for ti, t in enumerate(self.tiers):
            if not isinstance(t, ObjectTier) or not t.needs_compaction(want):
                continue
            busy = {j.dst[1] // t.pack_blocks for j in self._jobs if j.dst[0] == ti} | self._writing.get(ti, set())
            found = t.compaction_victim(busy)
            if found is None or len(found[1]) > t.avail():
                continue
            pack, keys = found
            t.compacting.add(pack)
            assert t.policy is not None
            for k in keys:
                old, crc = t.index[k]
                new = t.alloc()
                t.index[k] = (new, crc)
                t.moving[new] = old
                parent = t.parents.get(k) if t.path is not None else t.policy.parent_of(k)
                self._enqueue(k, crc, parent, (ti, old), (ti, new))
                t.release(old)  # pinned by the move: free once it landed
            t.stats.compacted += len(keys)
            log.debug("object tier: compacting pack %d (%d live blocks)", pack, len(keys))

    def _forget(self, ti: int, key: Hashable, slot: int, events: list[Event]) -> None:
        t = self.tiers[ti]
        del t.index[key]
        assert t.policy is not None
        t.policy.removed(key)
        self._relocate(key)
        if t.dropped(key, slot):
            t.release(slot)
        if self.events.active:
            events.append(BlockRemoved([key], t.medium))

    def _expire_pins(self) -> None:
        if not self._pins:
            return
        now = time.monotonic()
        for k, until in list(self._pins.items()):
            if until <= now:
                self._unpin_one(k)

    # --------------------------------------------------------------------- write-back workers
    def _take(self) -> list[_Job]:
        """Pop the next batch: up to ``writeback_batch`` jobs with the first job's (source,
        destination) tiers, or, for a packed destination, every job of one pack once that pack
        is complete (or nothing else is being written to its tier). Jobs whose block already
        left its destination are cancelled here."""
        out: list[_Job] = []
        rest: list[_Job] = []
        pair: tuple[int, int] | None = None
        pack: tuple[int, int] | None = None
        now = time.monotonic()
        for j in self._jobs:
            dt = self.tiers[j.dst[0]]
            if dt.index.get(j.key) != (j.dst[1], j.crc):
                self._settle(j)  # nobody will read it there: skip the copy
                continue
            if isinstance(dt, ObjectTier):
                p = (j.dst[0], j.dst[1] // dt.pack_blocks)
                if pack is None and pair is None and (dt.ready(p[1]) or self._stop or self._forcing
                                                      or now - j.t0 >= self.linger):
                    pack = p
                (out if p == pack else rest).append(j)
                continue
            q = (j.src[0], j.dst[0])
            if pair is None and pack is None:
                pair = q
            (out if q == pair and len(out) < self.wb_batch else rest).append(j)
        self._jobs = rest
        if pack is not None:
            t = self.tiers[pack[0]]
            assert isinstance(t, ObjectTier)
            if t.open_pack == pack[1]:
                t.seal()
            self._writing.setdefault(pack[0], set()).add(pack[1])
        return out

    def _settle(self, j: _Job) -> None:
        if self._landing.get(j.dst) == j.src:
            del self._landing[j.dst]
        self._unpin(j.src)
        self._unpin(j.dst)

    def _worker(self) -> None:
        # blocks per batch -> (buffer, its blocks, its registration, the buffer as one block)
        staging: dict[int, tuple[np.ndarray, kvx.PreparedList, kvx.Registration, kvx.PreparedList]] = {}
        try:
            while True:
                pev: list[Event] = []
                with self._lock:
                    while True:
                        if self._promotions and not self._stop:
                            try:
                                self._promote_pending(pev)
                            except KVXError as exc:  # an optimisation: never worth the worker
                                log.warning("background promotions dropped: %s", exc)
                                self._promotions.clear()
                        batch = self._take() if self._jobs else []
                        if batch or (self._stop and not self._jobs):
                            break
                        if not self._jobs:
                            self._room.notify_all()
                        self._work.wait(self.linger)  # jobs of an open pack wait for it to fill
                    if not batch:
                        return
                    self._active += len(batch)
                self.events.emit(pev)
                dt = self.tiers[batch[0].dst[0]]
                packed = isinstance(dt, ObjectTier)
                n = dt.pack_blocks if isinstance(dt, ObjectTier) else self.wb_batch
                t0 = time.monotonic()
                try:
                    if n not in staging and (packed or not isinstance(self.tiers[batch[0].src[0]], HostTier)):
                        buf = np.zeros(n * self.block_bytes, np.uint8)
                        reg = self.agent.register(buf)
                        staging[n] = (buf, self.agent.prepare(DescList.blocks(reg, self.block_bytes)), reg,
                                      self.agent.prepare(DescList.blocks(reg, buf.nbytes)))
                    ok = self._move_pack(batch, staging[n]) if packed else self._move_batch(batch, staging.get(n))
                except Exception as exc:  # the blocks are dropped from their destination: a miss later
                    log.warning("write-back of %d blocks to the %s tier failed: %s", len(batch), dt.medium, exc)
                    ok = [False] * len(batch)
                self.h_batch.observe(time.monotonic() - t0)
                events: list[Event] = []
                with self._lock:
                    if isinstance(dt, ObjectTier):
                        self._writing[batch[0].dst[0]].discard(batch[0].dst[1] // dt.pack_blocks)
                    self._finish(batch, ok, events)
                    self._active -= len(batch)
                    self._room.notify_all()
                    self._work.notify_all()
                self.events.emit(events)
        finally:
            for _buf, _pl, reg, _ipl in staging.values():
                try:
                    reg.release()
                except Exception:
                    log.debug("staging release", exc_info=True)

    def _move_batch(self, batch: list[_Job], staging: Any) -> list[bool]:
        """One transfer for the whole batch (two through host staging when neither side is host)."""
        src_t, dst_t = self.tiers[batch[0].src[0]], self.tiers[batch[0].dst[0]]
        assert src_t.plist is not None and dst_t.plist is not None
        ss = [j.src[1] for j in batch]
        ds = [j.dst[1] for j in batch]
        timeout = self.agent_timeout
        if isinstance(src_t, HostTier):
            self.agent.write(src_t.plist, ss, dst_t.plist, ds).wait(timeout)
            return [True] * len(batch)
        buf, spl, _reg, _ipl = staging
        n = len(batch)
        self.agent.read(spl, list(range(n)), src_t.plist, ss).wait(timeout)
        bb = self.block_bytes
        ok = [block_sum(buf.data[i * bb:(i + 1) * bb]) == j.crc for i, j in enumerate(batch)]
        good = [i for i in range(n) if ok[i]]
        if good:
            self.agent.write(spl, good, dst_t.plist, [ds[i] for i in good]).wait(timeout)
        return ok

    def _move_pack(self, batch: list[_Job], staging: tuple[np.ndarray, kvx.PreparedList, Any, kvx.PreparedList]
                   ) -> list[bool]:
        """Write one pack: gather its blocks at their offsets in a staging image (one read per
        source tier, all in flight together), check every block's CRC there, then PUT the image
        as one object. Offsets of blocks no longer stored are zeroed."""
        dti = batch[0].dst[0]
        dt = self.tiers[dti]
        assert isinstance(dt, ObjectTier) and dt.pack_plist is not None
        pb, bb = dt.pack_blocks, self.block_bytes
        pack = batch[0].dst[1] // pb
        buf, spl, _reg, ipl = staging
        offs = [j.dst[1] - pack * pb for j in batch]
        timeout = self.agent_timeout
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for j, o in zip(batch, offs):
            g = groups.setdefault(j.src[0], ([], []))
            g[0].append(o)
            g[1].append(j.src[1])
        reqs = []
        for sti, (os_, ss) in groups.items():
            st = self.tiers[sti]
            if isinstance(st, HostTier):
                pool = st.pool.data
                for o, s in zip(os_, ss):
                    buf.data[o * bb:(o + 1) * bb] = pool[s * bb:(s + 1) * bb]
            else:
                assert st.plist is not None
                reqs.append(self.agent.read(spl, os_, st.plist, ss))
        for r in reqs:
            r.wait(timeout)
        ok = [block_sum(buf.data[o * bb:(o + 1) * bb]) == j.crc for j, o in zip(batch, offs)]
        mask = np.ones(pb, bool)
        mask[[o for o, good in zip(offs, ok) if good]] = False
        holes = np.flatnonzero(mask)
        if holes.size:
            buf.reshape(pb, bb)[holes] = 0
        if any(ok):
            self.agent.write(ipl, [0], dt.pack_plist, [pack]).wait(timeout)
        return ok

    agent_timeout: float = 120.0
    #: seconds the jobs of an open pack wait for it to fill before it is written anyway
    linger: float = 0.05

    def _finish(self, batch: list[_Job], ok: list[bool], events: list[Event]) -> None:
        records: dict[int, list[tuple[Hashable, Hashable | None, int, int]]] = {}
        now = time.monotonic()
        for j, good in zip(batch, ok):
            dti, dslot = j.dst
            dt = self.tiers[dti]
            here = dt.index.get(j.key) == (dslot, j.crc)
            self._settle(j)
            if here and good:
                records.setdefault(dti, []).append((j.key, j.parent, dslot, j.crc))
                dt.stats.bytes_in += self.block_bytes
            elif here:
                dt.stats.writeback_errors += 1
                self._forget(dti, j.key, dslot, events)
            (self.h_promote if dti == 0 else self.h_writeback).observe(now - j.t0)
        for dti, recs in records.items():
            try:
                self.tiers[dti].committed(recs)
            except OSError as exc:  # journal unwritable: the blocks are not durable, so not stored
                log.warning("journal of the %s tier failed: %s", self.tiers[dti].medium, exc)
                for k, _p, slot, _c in recs:
                    if self.tiers[dti].index.get(k, (None,))[0] == slot:
                        self._forget(dti, k, slot, events)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued demotion has landed (and, on disk, been journaled).

        Raises
        ------
        TierError
            If the queue did not drain within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            self._forcing += 1  # open packs are written now, full or not
            self._work.notify_all()
            try:
                while self._queued() or self._promotions:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TierError(f"write-back queue did not drain in {timeout} s ({self._queued()} left)")
                    self._room.wait(min(left, 1.0))
            finally:
                self._forcing -= 1

    # ---------------------------------------------------------------------------------------
    def put(self, hashes: Sequence[Hashable], src: kvx.PreparedList, src_idx: Any = None,
            parent: Hashable | None = None, timeout: float = 60.0) -> int:
        """Store the blocks ``src[src_idx]`` under ``hashes`` in the local tiers and, with a
        remote tier that writes through, in it as well (before returning). Returns the number
        of blocks newly stored locally; see :meth:`_put_local` for the rest."""
        n = self._put_local(hashes, src, src_idx, parent, timeout)
        r = self.remote
        if r is not None and r.write_through and len(hashes):
            hs = list(hashes)
            sidx = np.arange(len(hs), dtype=np.int64) if src_idx is None else np.asarray(src_idx, dtype=np.int64)
            self._rstats["stored"] += self._remote_call("put", hs, src, sidx)
        return n

    def _put_local(self, hashes: Sequence[Hashable], src: kvx.PreparedList, src_idx: Any = None,
                   parent: Hashable | None = None, timeout: float = 60.0) -> int:
        """Store the blocks ``src[src_idx]`` under ``hashes`` (one chain: each block's parent is
        the previous hash; the first's is ``parent``). Blocks already stored are touched.

        Returns the number of blocks newly stored (the policy may decline some: admission).
        Waits up to ``timeout`` seconds for its transfer and, while the write-back queue is
        full, for room in it (``TierError`` past that).

        When it returns, the caller may reuse ``src``: the blocks were copied into host slots and
        checksummed there, and nothing the store does later reads the caller's memory.

        Raises
        ------
        TierFull
            If the host tier can make no room (every block pinned, or an ancestor of a pinned one).
        """
        self._check()
        hashes = _keys(hashes)
        _prepared(src, "src")
        t_start = time.monotonic()
        deadline = t_start + timeout
        n = len(hashes)
        sidx = np.arange(n, dtype=np.int64) if src_idx is None else np.asarray(src_idx, dtype=np.int64)
        if sidx.shape != (n,):
            raise UsageError("src_idx must have one index per hash")
        if n and (sidx.min() < 0 or sidx.max() >= len(src)):
            raise UsageError(f"src_idx out of range for a list of {len(src)} blocks")
        if src.descs.nbytes.size and not np.all(src.descs.nbytes[sidx] == self.block_bytes):
            raise UsageError(f"source blocks must be {self.block_bytes} bytes")
        top = self.tiers[0]
        events: list[Event] = []
        with self._lock:
            if self._promotions:  # earlier gets' promotions first: decisions stay in order
                self._promote_pending(events)
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
                    self.agent.write(src, sidx[[v[2] for v in batch.values()]], tplist, slots).wait(
                        max(0.001, deadline - time.monotonic()))
                except BaseException:
                    for h, slot in zip(keys, slots):
                        pol.removed(h)
                        self._pending.discard(h)
                        top.free.append(slot)
                    batch.clear()
                    raise
                batch.clear()
                for h, p, slot in zip(keys, parents, slots):
                    crc = block_sum(mv[slot * bb:(slot + 1) * bb])
                    top.index[h] = (slot, crc)
                    where[h] = 0
                    self._pending.discard(h)
                top.stats.stored += len(keys)
                top.stats.bytes_in += len(keys) * bb
                total[0] += len(keys)
                if self.events.active:
                    events.append(BlockStored(keys, parents[0], top.medium, bb))
                if self.write_through and len(self.tiers) > 1:
                    self._write_through(keys, parents, events)

            try:
                prev = parent
                for i, h in enumerate(hashes):
                    self._wait_room(1, deadline, flush)  # before looking: others may act meanwhile
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
            finally:
                for h, (slot, _p, _i) in batch.items():  # an error left some admitted but unwritten
                    pol.removed(h)
                    self._pending.discard(h)
                    top.free.append(slot)
        self.events.emit(events)
        self.h_put.observe(time.monotonic() - t_start)
        return total[0]

    def _write_through(self, keys: list[Hashable], parents: list[Hashable | None], events: list[Event]) -> None:
        top, lt = self.tiers[0], self.tiers[1]
        assert lt.policy is not None
        for h, p in zip(keys, parents):
            if h in lt.index or h not in top.index:
                continue
            lslot = self._make_room(1, events)
            slot, crc = top.index[h]
            lt.index[h] = (lslot, crc)
            lt.policy.inserted(h, p if p in lt.index else None)
            lt.noted(h, p)
            self._enqueue(h, crc, p, (0, slot), (1, lslot))
            lt.stats.stored += 1

    # ---------------------------------------------------------------------------------------
    def get(self, hashes: Sequence[Hashable], dst: kvx.PreparedList, dst_idx: Any = None,
            timeout: float = 60.0) -> int:
        """Copy stored blocks into ``dst[dst_idx]``, verifying each; promote lower-tier hits.

        One transfer per tier per ``get_chunk`` blocks: lower-tier blocks are read into host
        slots together and checked, then all blocks go to ``dst`` together.

        When it returns, ``dst`` holds the blocks (exactly as they were put) and the store never
        reads or writes it again: promotions it decides re-read the tier's own slots later.

        Raises
        ------
        BlockNotFound
            If a block is absent or failed its checksum (it is then dropped). Blocks before it
            in ``hashes`` have been copied; the count is in the exception's ``args[1]``.
        """
        self._check()
        hashes = _keys(hashes)
        _prepared(dst, "dst")
        t_start = time.monotonic()
        n = len(hashes)
        didx = np.arange(n, dtype=np.int64) if dst_idx is None else np.asarray(dst_idx, dtype=np.int64)
        if didx.shape != (n,):
            raise UsageError("dst_idx must have one index per hash")
        if n and (didx.min() < 0 or didx.max() >= len(dst)):
            raise UsageError(f"dst_idx out of range for a list of {len(dst)} blocks")
        deadline = time.monotonic() + timeout
        if self.remote is None:
            done = self._fetch(hashes, dst, didx, deadline)
        else:
            done = self._fetch_remote(list(hashes), dst, didx, deadline)
        self.h_get.observe(time.monotonic() - t_start)
        return done

    def _fetch_remote(self, hashes: list[Hashable], dst: kvx.PreparedList, didx: np.ndarray, deadline: float) -> int:
        """``_fetch``, then the blocks the local tiers missed from the remote tier (admitted into
        the local tiers afterwards when ``promote``)."""
        try:
            return self._fetch(hashes, dst, didx, deadline)
        except BlockNotFound as exc:
            k = int(exc.args[1]) if len(exc.args) > 1 else 0
            why = exc.args[0] if exc.args else ""
        got = self._remote_call("get", hashes[k:], dst, didx[k:])
        self._rstats["hits"] += got
        self._rstats["misses"] += len(hashes) - k - got
        if got and self.promote:
            try:
                self._rstats["promoted"] += self._put_local(hashes[k:k + got], dst, didx[k:k + got],
                                                            hashes[k - 1] if k else None,
                                                            max(0.001, deadline - time.monotonic()))
            except KVXError as exc:  # an optimisation: dst holds the blocks anyway
                log.debug("remote hits not admitted locally: %s", exc)
        if k + got < len(hashes):
            medium = self.remote.medium  # type: ignore[union-attr]
            raise BlockNotFound(f"{why}; not in the remote tier ({medium}) either" if not got else
                                f"block {hashes[k + got]!r} is not stored here nor in the remote tier ({medium})",
                                k + got)
        return k + got

    def _fetch(self, hashes: Sequence[Hashable], dst: kvx.PreparedList | None, didx: Any,
               deadline: float) -> int:
        done = 0
        with self._get_lock:
            for c0 in range(0, len(hashes), self.chunk):
                done = self._fetch_chunk(hashes[c0:c0 + self.chunk], dst,
                                         None if didx is None else didx[c0:c0 + self.chunk], done, deadline)
        return done

    def _fetch_chunk(self, keys: Sequence[Hashable], dst: kvx.PreparedList | None, didx: Any, done: int,
                     deadline: float) -> int:
        """Copy one chunk of blocks to ``dst`` (or only promote them: ``dst`` None).

        Host blocks go host -> ``dst``. Blocks of a persistent tier (disk) go straight from their
        slot into a host ``dst``, their checksums taken in the copy (or over ``dst`` after it);
        their promotion to the host tier is decided after this get returns, by a write-back
        worker or the store's next operation, and its bytes move as a write-back job (the disk
        copy stays, so nothing waits for it). Other lower-tier blocks
        (objects; or any, when ``dst`` is not host memory) are read into host slots, checked,
        then copied to ``dst`` with the host blocks."""
        top = self.tiers[0]
        assert isinstance(top, HostTier)
        assert top.plist is not None and top.policy is not None
        keep = self._hold(dst)  # the destination's memory, kept alive while we check it in place
        direct_ok = keep is not None
        if direct_ok:
            assert dst is not None
            if self._promotions:  # earlier gets' promotions first: decisions stay in order
                self._settle_promotions()
            fast = self._fetch_disk(keys, dst, didx, done, deadline)
            if fast is not None:
                return fast
        events: list[Event] = []
        pins: list[tuple[int, int]] = []
        reads: list[int] = []  # host slot per block, in order (-1: read straight from a lower tier)
        # promotions through host slots: (position, key, source loc, host slot, crc, tier, tier slot)
        promos: list[tuple[int, Hashable, tuple[int, int], int, int, int, int]] = []
        # straight reads: (position, key, source loc, crc, tier, tier slot)
        directs: list[tuple[int, Hashable, tuple[int, int], int, int, int]] = []
        fail: tuple[int, str] | None = None
        promote: list[tuple[Hashable, int, int, int]] = []
        with self._lock:
            if self._promotions:  # earlier gets' promotions first: decisions stay in order
                self._promote_pending(events)
            self._wait_room(len(keys), deadline, queue=False)
            if dst is not None and not direct_ok:
                self._wait_landed(keys, deadline)
            where, tiers, landing = self._where, self.tiers, self._landing
            for i, h in enumerate(keys):
                ti = where.get(h)
                if ti is None:
                    top.stats.misses += 1
                    fail = (i, f"block {h!r} is not stored")
                    break
                t = tiers[ti]
                slot, crc = t.index[h]
                assert t.policy is not None
                t.policy.hit(h)
                t.stats.hits += 1
                src = self._src_of((ti, slot)) if landing else (ti, slot)
                busy = tiers[src[0]].busy  # pinned: not reused while we read it (Tier.pin)
                busy[src[1]] = busy.get(src[1], 0) + 1
                pins.append(src)
                if ti == 0:
                    if src[0] == 0 or dst is None:
                        reads.append(src[1] if src[0] == 0 else -1)
                    else:  # being promoted in the background: read it from where it is
                        directs.append((i, h, src, crc, 0, slot))
                        reads.append(-1)
                    continue
                if direct_ok and t.persistent and src[0] != 0:
                    directs.append((i, h, src, crc, ti, slot))
                    promote.append((h, ti, slot, crc))  # decided after this get (_promote_pending)
                    reads.append(-1)
                    continue
                hslot = self._admit_top(h, t, crc, events)[0]
                self._landing[(0, hslot)] = src
                self._pin((0, hslot))
                pins.append((0, hslot))
                promos.append((i, h, src, hslot, crc, ti, slot))
                reads.append(hslot)
        bad: list[int] = []
        dbad: list[int] = []
        err: BaseException | None = None
        bb = self.block_bytes
        try:
            left = max(0.001, deadline - time.monotonic())
            pending = []
            digs: dict[int, np.ndarray] = {}  # source tier -> checksums taken in the copy, by dst row
            dgroups: dict[int, tuple[list[int], list[int]]] = {}
            drows = didx.tolist() if directs else []
            for i, _h, src, _crc, _ti, _slot in directs:
                g = dgroups.setdefault(src[0], ([], []))
                g[0].append(drows[i])
                g[1].append(src[1])
            for sti, (dd, ss) in dgroups.items():  # straight into dst, in flight while promotions run
                assert dst is not None
                req, dig = self._read_direct(dst, dd, self.tiers[sti], ss)
                pending.append(req)
                if dig is not None:
                    digs[sti] = dig
            groups: dict[int, list[tuple[int, int]]] = {}
            for _i, _h, src, hslot, _crc, _ti, _slot in promos:
                groups.setdefault(src[0], []).append((src[1], hslot))
            for sti, pairs in groups.items():
                st = self.tiers[sti]
                if sti == 0:  # still on its way down from the host tier itself
                    pool = top.pool.data
                    for s, d in pairs:
                        pool[d * bb:(d + 1) * bb] = pool[s * bb:(s + 1) * bb]
                else:
                    assert st.plist is not None
                    self.agent.read(top.plist, [d for _s, d in pairs], st.plist, [s for s, _d in pairs]).wait(left)
            sums = self._crcs([top.host_view(p[3]) for p in promos])
            bad = [k for k, p in enumerate(promos) if sums[k] != p[4]]
            for r in pending:
                r.wait(left)
            if directs:
                assert dst is not None
                dbad = self._check_direct(dst, drows, directs, digs)
                for k in dbad:  # corrupt bytes never stay in the destination
                    _view(int(dst.descs.addr[didx[directs[k][0]]]), bb)[:] = bytes(bb)
            limit = fail[0] if fail is not None else len(keys)
            if bad:
                limit = min(limit, promos[bad[0]][0])
            if dbad:
                limit = min(limit, directs[dbad[0]][0])
            if self.verify_host:
                for i in range(limit):
                    h = keys[i]
                    if reads[i] >= 0 and self._where.get(h) == 0 and block_sum(top.host_view(reads[i])) != \
                            top.index.get(h, (0, None))[1]:
                        limit = i
                        fail = (i, f"block {h!r} failed its checksum and was dropped")
                        with self._lock:
                            if h in top.index:
                                top.stats.corrupt += 1
                                self._forget(0, h, top.index[h][0], events)
                        break
            hp = [i for i in range(limit) if reads[i] >= 0]
            if dst is not None and hp:
                self.agent.read(dst, didx[hp], top.plist, [reads[i] for i in hp]).wait(left)
            if dst is not None:
                top.stats.bytes_out += limit * bb
        except BaseException as exc:
            err = exc
            bad = list(range(len(promos)))  # nothing landed for sure: undo every promotion
            limit = 0
        with self._lock:
            badset = set(bad)
            for k, (_i, h, src, hslot, crc, ti, slot) in enumerate(promos):
                if self._landing.get((0, hslot)) == src:
                    del self._landing[(0, hslot)]
                t = self.tiers[ti]
                mine = top.index.get(h) == (hslot, crc)
                if k in badset:
                    if mine:
                        self._forget(0, h, hslot, events)
                    if err is None and t.index.get(h) == (slot, crc):
                        log.warning("block %r in %s tier failed its checksum: dropped", h, t.medium)
                        t.stats.corrupt += 1
                        self._forget(ti, h, slot, events)
                    continue
                t.stats.promoted += 1
                if mine and not t.persistent and not self.write_through and t.index.get(h) == (slot, crc):
                    self._forget(ti, h, slot, events)
                if self.events.active:
                    events.append(BlockStored([h], None, top.medium, bb))
            for k in dbad:
                _i, h, src, crc, ti, _slot = directs[k]
                self._drop_corrupt(h, crc, {ti, src[0], 0}, src[0], events)
            tiers = self.tiers
            for ti, slot in pins:
                tiers[ti].unpin(slot)
            if promote and err is None and self.promote:
                dbadkeys = {directs[k][1] for k in dbad}
                self._promotions.extend(p for p in promote if p[0] not in dbadkeys)
                self._work.notify()
            self._room.notify_all()
        self.events.emit(events)
        if err is not None:
            raise err
        first_bad = min([promos[k][0] for k in bad[:1]] + [directs[k][0] for k in dbad[:1]], default=None)
        if first_bad is not None and (fail is None or first_bad <= fail[0]):
            raise BlockNotFound(f"block {keys[first_bad]!r} failed its checksum and was dropped", done + limit)
        if fail is not None:
            raise BlockNotFound(fail[1], done + limit)
        return done + limit

    def _drop_corrupt(self, h: Hashable, crc: int, tiers: Iterable[int], read_from: int, events: list[Event]) -> None:
        """Block ``h`` read from tier ``read_from`` failed its checksum: drop every copy of it
        with that checksum in ``tiers`` (lock held)."""
        log.warning("block %r in %s tier failed its checksum: dropped", h, self.tiers[read_from].medium)
        for dti in tiers:  # every copy the store would serve it from
            dt = self.tiers[dti]
            if h in dt.index and dt.index[h][1] == crc:
                dt.stats.corrupt += int(dti == read_from)
                self._forget(dti, h, dt.index[h][0], events)

    def _fetch_disk(self, keys: Sequence[Hashable], dst: kvx.PreparedList, didx: Any, done: int,
                    deadline: float) -> int | None:
        """The usual get from disk, with per-batch rather than per-block work: every block of the
        chunk on the same disk tier, landed there, and ``dst`` local host memory (the caller
        checked). One read straight into ``dst`` with the checksums taken in the copy; the
        promotions are queued for later. None (nothing done) when the chunk is not such a case:
        the general path then serves it."""
        where = self._where
        if not keys:
            return None
        ti = where.get(keys[0])
        if not ti:
            return None
        t = self.tiers[ti]
        if not isinstance(t, DiskTier) or t.plist is None:
            return None
        with self._lock:
            if self._promotions or ti != where.get(keys[0]):
                return None
            try:
                locs = [t.index[h] for h in keys]
            except KeyError:
                return None
            if any(where[h] != ti for h in keys):
                return None  # some are in the host tier too
            slots = [loc[0] for loc in locs]
            landing = self._landing
            if landing and any((ti, s) in landing for s in slots):
                return None  # some still on their way down
            policy = t.policy
            assert policy is not None
            hit = policy.hit
            for h in keys:
                hit(h)
            t.stats.hits += len(keys)
            busy = t.busy  # pinned: not reused while we read them (Tier.pin)
            for s in slots:
                busy[s] = busy.get(s, 0) + 1
        n = len(keys)
        rows = didx.tolist()
        err: BaseException | None = None
        bad: list[int] = []
        try:
            req, dig = self._read_direct(dst, rows, t, slots)
            req.wait(max(0.001, deadline - time.monotonic()))
            want = np.array([loc[1] for loc in locs], dtype=np.uint64)
            if dig is not None:
                bad = np.flatnonzero(dig[didx] != want).tolist()
            else:
                bb = self.block_bytes
                addr = dst.descs.addr
                bad = [k for k, r in enumerate(rows) if block_sum(_view(int(addr[r]), bb)) != locs[k][1]]
            for k in bad:  # corrupt bytes never stay in the destination
                _view(int(dst.descs.addr[rows[k]]), self.block_bytes)[:] = bytes(self.block_bytes)
        except BaseException as exc:
            err = exc
        events: list[Event] = []
        limit = bad[0] if bad else n
        with self._lock:
            for s in slots:
                t.unpin(s)
            if err is None:
                self.tiers[0].stats.bytes_out += limit * self.block_bytes
                for k in bad:
                    self._drop_corrupt(keys[k], locs[k][1], (ti, 0), ti, events)
                if self.promote:
                    badset = set(bad)
                    self._promotions.extend((h, ti, loc[0], loc[1]) for k, (h, loc) in enumerate(zip(keys, locs))
                                            if k not in badset)
                    self._work.notify()
            self._room.notify_all()
        self.events.emit(events)
        if err is not None:
            raise err
        if bad:
            raise BlockNotFound(f"block {keys[bad[0]]!r} failed its checksum and was dropped", done + limit)
        return done + n

    def _read_direct(self, dst: kvx.PreparedList, rows: list[int], t: Tier, slots: list[int]
                     ) -> tuple[Any, np.ndarray | None]:
        """Post one read of ``t``'s ``slots`` into the host ``dst`` rows ``rows``. From a disk
        tier it goes through a twin of ``dst`` whose posix transfers take the kvx-nh64 checksum of
        every block in the copy; returns the request and that twin's checksums by ``dst`` row
        (None: checksum ``dst`` after the read, e.g. an O_DIRECT slab)."""
        assert t.plist is not None
        if isinstance(t, DiskTier):
            tw = self._twin(dst)
            if tw is not None:
                try:
                    return self.agent.read(tw[0], rows, t.plist, slots), tw[1]
                except BackendUnavailable:  # O_DIRECT: no checksums in the copy
                    pass
        return self.agent.read(dst, rows, t.plist, slots), None

    def _twin(self, dst: kvx.PreparedList) -> tuple[kvx.PreparedList, np.ndarray] | None:
        """A second prepared list over ``dst``'s descriptors with ``keep_digests`` on, and its
        digest array (cached for a few destinations; only one get runs at a time, so its
        transfers never move the same rows at once). None if the posix backend cannot."""
        hit = self._twins.get(id(dst))
        if hit is not None and hit[0] is dst and hit[1].gens == dst.gens:
            return hit[1], hit[2]
        try:
            twin = self.agent.prepare(dst.descs)
            dig = keep_digests(self.agent, twin)
        except (KVXError, AttributeError):
            return None
        if twin.gens != dst.gens:  # a region of dst was registered anew since dst was prepared
            return None
        while len(self._twins) >= 4:
            self._twins.pop(next(iter(self._twins)))
        self._twins[id(dst)] = (dst, twin, dig)
        return twin, dig

    def _check_direct(self, dst: kvx.PreparedList, drows: list[int],
                      directs: list[tuple[int, Hashable, tuple[int, int], int, int, int]],
                      digs: dict[int, np.ndarray]) -> list[int]:
        """Positions in ``directs`` of blocks whose bytes in ``dst`` do not match their checksum:
        the sums taken in the copy where there are some, otherwise computed over ``dst``."""
        rows = np.array([drows[d[0]] for d in directs], dtype=np.int64)
        want = np.array([d[3] for d in directs], dtype=np.uint64)
        if len(digs) == 1 and len({d[2][0] for d in directs}) == 1:  # the usual case: one tier, sums in the copy
            return np.flatnonzero(next(iter(digs.values()))[rows] != want).tolist()
        have = np.empty(len(directs), dtype=np.uint64)
        src = np.fromiter((d[2][0] for d in directs), dtype=np.int64, count=len(directs))
        for sti in np.unique(src).tolist():
            sel = np.flatnonzero(src == sti)
            dig = digs.get(sti)
            if dig is not None:
                have[sel] = dig[rows[sel]]
            else:
                bb = self.block_bytes
                have[sel] = [block_sum(_view(int(dst.descs.addr[r]), bb)) for r in rows[sel].tolist()]
        return np.flatnonzero(have != want).tolist()

    def _admit_top(self, h: Hashable, t: Tier, crc: int, events: list[Event]) -> tuple[int, Hashable | None]:
        """Take block ``h`` of lower tier ``t`` into the host tier (room made, policy told); its
        bytes are not there yet. Returns its host slot and its parent."""
        top = self.tiers[0]
        assert t.policy is not None and top.policy is not None
        parent = t.parents.get(h) if isinstance(t, JournaledTier) else None
        if parent is None:
            parent = t.policy.parent_of(h)
        hslot = self._make_room(0, events)
        top.index[h] = (hslot, crc)
        top.policy.inserted(h, parent if parent in top.index else None)
        self._where[h] = 0
        return hslot, parent

    def _settle_promotions(self) -> None:
        events: list[Event] = []
        with self._lock:
            self._promote_pending(events)
        self.events.emit(events)

    def _promote_pending(self, events: list[Event]) -> None:
        """Promote to the host tier the blocks that earlier gets read straight from a persistent
        tier (lock held): the same decisions a get made itself before (admission into the host
        tier, evictions), now off the get's path; the bytes move disk -> host as write-back
        jobs. A promotion is an optimisation: one whose block moved or left since is skipped,
        and with no spare slot and nothing in flight to free one, the rest are dropped."""
        top = self.tiers[0]
        assert top.policy is not None
        while self._promotions:
            if not self._has_room(1, queue=False):
                if not self._queued():
                    log.debug("no spare host slot: %d promotions skipped", len(self._promotions))
                    self._promotions.clear()
                return
            h, ti, slot, crc = self._promotions.popleft()
            t = self.tiers[ti]
            if self._where.get(h) != ti or t.index.get(h) != (slot, crc):
                continue  # already in the host tier, moved or gone
            # Making room in the host tier may demote a victim there, and making room for that
            # one below may evict ``h`` itself from this very slot: pinned, the slot keeps h's
            # bytes (it is not handed out again) until the promotion copied them.
            src = self._src_of((ti, slot))
            self._pin(src)
            try:
                hslot, parent = self._admit_top(h, t, crc, events)
                self._enqueue(h, crc, parent, src, (0, hslot))
            except TierFull as exc:  # every host block pinned: promotions wait for another get
                log.debug("promotions skipped: %s", exc)
                self._promotions.clear()
                return
            finally:
                self._unpin(src)
            t.stats.promoted += 1
            if self.events.active:
                events.append(BlockStored([h], None, top.medium, self.block_bytes))

    def _hold(self, dst: kvx.PreparedList | None) -> list[Any] | None:
        """References to the objects that own a local host ``dst``'s memory (so a registration
        released meanwhile cannot unmap what a checksum reads in place), or None when ``dst``
        cannot be read in place: not local host memory, or a registration already gone."""
        if dst is None or dst.peer is not None or dst.kind != kvx.MemoryKind.HOST:
            return None
        regions = self.agent.regions()
        owners = []
        for s in np.asarray(dst.used).tolist():
            entry = regions.get(int(s))
            if entry is None or entry[1] != dst.gens.get(int(s)) or getattr(entry[0], "owner", None) is None:
                return None
            owners.append(entry[0].owner)
        return owners

    def _wait_landed(self, keys: Sequence[Hashable], deadline: float) -> None:
        """Wait (lock released) until no host block of ``keys`` is still being promoted in the
        background (a destination that is not host memory is reached from host slots only)."""
        top = self.tiers[0]
        while True:
            if not any((0, top.index[h][0]) in self._landing for h in keys if self._where.get(h) == 0):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TierError("blocks still on their way to the host tier at the end of the timeout")
            self._room.wait(min(left, 1.0))

    @staticmethod
    def _crcs(views: list[memoryview]) -> list[int]:
        """Checksums of blocks in memory."""
        return [block_sum(v) for v in views]

    def prefetch(self, hashes: Sequence[Hashable]) -> threading.Thread:
        """Promote the stored prefix of ``hashes`` to the top tier in the background."""
        self._check()
        hashes = list(_keys(hashes))

        def run() -> None:
            k = self.lookup(hashes).hits
            try:
                self._fetch(hashes[:k], None, None, time.monotonic() + 60.0)
            except (BlockNotFound, UsageError):
                pass
            except Exception:
                log.exception("prefetch failed")

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
        for t in self.tiers:
            if h in t.index:
                t.policy.set_evictable(h, True)  # type: ignore[union-attr]

    def delete(self, hashes: Sequence[Hashable]) -> int:
        """Remove blocks from every tier; returns how many were stored."""
        hashes = _keys(hashes)
        events: list[Event] = []
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._where:
                    continue
                self._unpin_one(h)
                for ti, t in enumerate(self.tiers):
                    if h in t.index:
                        self._forget(ti, h, t.index[h][0], events)
                n += 1
            self._room.notify_all()
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
        """Occupancy and counters per tier, and the write-back queue (earlier gets' promotions
        are decided first, so the counters include them)."""
        events: list[Event] = []
        with self._lock:
            if self._promotions:
                self._promote_pending(events)
            s = StoreStats(lookups=self.stats_.lookups, lookup_blocks=self.stats_.lookup_blocks,
                           lookup_hits=self.stats_.lookup_hits, writeback_queued=len(self._jobs),
                           writeback_active=self._active)
            for t in self.tiers:
                d = {"medium": t.medium, "capacity": t.capacity, "used": len(t.index),
                     "pinned": sum(1 for k in self._pins if k in t.index), "held": len(t.deferred)}
                d.update({k: getattr(t.stats, k) for k in TierStats.__dataclass_fields__})
                s.tiers.append(d)
        if self.remote is not None:  # outside the lock: the remote's counters are its own
            s.remote = {**self.remote.stats(), "store": dict(self._rstats)}
        self.events.emit(events)
        return s

    def prometheus(self, prefix: str = "kvx_store") -> str:
        """The stats in Prometheus text exposition format (counters, gauges, latency histograms)."""
        st = self.stats()
        lines = []
        for name, help_ in [("used", "blocks stored"), ("capacity", "slots"),
                            ("held", "slots of evicted blocks still read by transfers in flight"),
                            ("hits", "block hits"), ("misses", "block misses"), ("stored", "blocks stored"),
                            ("evicted", "evictions"), ("demoted", "demotions"), ("promoted", "promotions"),
                            ("corrupt", "blocks dropped on checksum failure"),
                            ("writeback_errors", "demotions that failed to land (block dropped)"),
                            ("compacted", "blocks moved by compaction of the object tier's packs"),
                            ("bytes_in", "bytes stored"), ("bytes_out", "bytes read")]:
            kind = "gauge" if name in ("used", "capacity", "held") else "counter"
            metric = f"{prefix}_{name}" + ("_total" if kind == "counter" else "")
            lines.append(f"# HELP {metric} {help_}")
            lines.append(f"# TYPE {metric} {kind}")
            for i, t in enumerate(st.tiers):
                lines.append(f'{metric}{{tier="{i}",medium="{t["medium"]}"}} {t[name]}')
        lines.append(f"# HELP {prefix}_writeback_queue demotions queued or in flight")
        lines.append(f"# TYPE {prefix}_writeback_queue gauge")
        lines.append(f"{prefix}_writeback_queue {st.writeback_queued + st.writeback_active}")
        lines.append(f"# TYPE {prefix}_writeback_depth gauge")
        lines.append(f"{prefix}_writeback_depth {self.depth}")
        lines.append(f"# TYPE {prefix}_lookups_total counter")
        lines.append(f"{prefix}_lookups_total {st.lookups}")
        lines.append(f"# TYPE {prefix}_lookup_blocks_total counter")
        lines.append(f"{prefix}_lookup_blocks_total {st.lookup_blocks}")
        lines.append(f"# TYPE {prefix}_lookup_hits_total counter")
        lines.append(f"{prefix}_lookup_hits_total {st.lookup_hits}")
        for h in (self.h_put, self.h_get, self.h_writeback, self.h_promote, self.h_batch):
            lines.extend(h.prometheus(prefix))
        return "\n".join(lines) + "\n"

    def close(self, timeout: float = 60.0) -> None:
        """Drain the write-back queue (at most ``timeout`` s), stop its workers, release the tiers
        (the disk tier's journal stays for recovery) and the private agent."""
        if self._closed:
            return
        self._closed = True
        if self._workers:
            try:
                self.flush(timeout)
            except TierError as exc:
                log.warning("closing with demotions still in flight (not journaled): %s", exc)
            with self._lock:
                self._stop = True
                self._work.notify_all()
            for th in self._workers:
                th.join(timeout=max(1.0, timeout / 4))
        for t in self.tiers:
            try:
                t.close()
            except Exception:
                log.exception("closing tier")
        if self.remote is not None:
            try:
                self.remote.close()
            except Exception:
                log.exception("closing the remote tier")
        if self._own_agent:
            self.agent.close()
