"""The tiers of a :class:`~kvx.tiers.store.TieredStore`: host memory, disk slab, objects.

A tier is one registered region carved into *slots* of ``block_bytes``. It holds ``capacity``
blocks (what its eviction policy manages) in ``capacity + spare`` slots: the spare slots let a
block that was evicted stay readable in its old slot while the write-back queue copies it to
the next tier, without making anyone wait for that copy.

Durability of the disk tier (see ``docs/storage-files.md``): a block's data is written to a free
slot first and only then its ``PUT`` record is appended to the journal; a slot is reused only
after its old block's ``DEL`` record was appended. Recovery after ``kill -9`` therefore finds
every journaled block byte-identical (the checksum catches anything else).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import kvx

from .. import _args
from ..errors import ArgumentTypeError, ArgumentValueError, TierError
from ..memory import DescList
from .checksum import TAG
from .journal import Journal
from .policies import EvictionPolicy, make_policy

__all__ = ["Tier", "HostTier", "JournaledTier", "DiskTier", "ObjectTier", "TierStats", "PACK_BYTES_MAX"]

log = logging.getLogger(__name__)


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
    writeback_errors: int = 0
    compacted: int = 0


class Tier:
    """A tier: ``capacity`` blocks of ``block_bytes`` over one registered region.

    ``spare`` extra slots (default: the store's write-back depth) hold blocks on their way
    down while the policy already counts them out.
    """

    medium = "?"
    #: blocks outlive the store (a read keeps the tier's copy rather than moving it up)
    persistent = False

    def __init__(self, nbytes: int | None = None, blocks: int | None = None) -> None:
        if (nbytes is None) == (blocks is None):
            raise ArgumentTypeError(f"give {type(self).__name__} its size as nbytes= or blocks= (one of them)")
        what = type(self).__name__
        self._nbytes = None if nbytes is None else _args.size(nbytes, f"{what} nbytes")
        self._blocks = None if blocks is None else _args.size(blocks, f"{what} blocks")
        self.capacity = 0
        self.spare = 0
        self.nslots = 0
        self.block_bytes = 0
        #: slots out of use for now (a persisting tier could not record a removal yet)
        self.retired = 0
        self.plist: kvx.PreparedList | None = None
        self.policy: EvictionPolicy | None = None
        self.index: dict[Hashable, tuple[int, int]] = {}  # key -> (slot, crc)
        self.free: list[int] = []
        self.busy: dict[int, int] = {}  # slot -> readers/writers in flight
        self.deferred: set[int] = set()  # released while busy: free once the last user is done
        self.stats = TierStats()
        self.reg: kvx.Registration | None = None

    def _size(self, block_bytes: int) -> int:
        n = self._blocks if self._blocks is not None else int(self._nbytes or 0) // block_bytes
        if n < 1:
            raise ArgumentValueError(f"{type(self).__name__} holds no whole block of {block_bytes} bytes")
        if n * block_bytes > _args.MAX_BYTES:
            raise ArgumentValueError(f"{type(self).__name__} of {n} blocks of {block_bytes} bytes "
                                     "is larger than 2**62 bytes")
        return n

    def attach(self, agent: kvx.Agent, block_bytes: int, policy: str, spare: int = 0) -> None:
        self.block_bytes = block_bytes
        self.capacity = self._size(block_bytes)
        self.spare = spare
        self.nslots = self.capacity + spare
        self.reg = agent.register(self.region(self.nslots, block_bytes))
        self.plist = agent.prepare(DescList.blocks(self.reg, block_bytes))
        if len(self.plist) < self.nslots:
            raise TierError(f"{type(self).__name__}: region holds {len(self.plist)} blocks, not {self.nslots}")
        self.policy = make_policy(policy, self.capacity)
        self.free = list(range(self.nslots - 1, -1, -1))
        self.recover()

    # slots ------------------------------------------------------------------------------
    def pin(self, slot: int) -> None:
        self.busy[slot] = self.busy.get(slot, 0) + 1

    def unpin(self, slot: int) -> bool:
        """Drop one user of ``slot``; True if that freed it."""
        n = self.busy[slot] - 1
        if n:
            self.busy[slot] = n
            return False
        del self.busy[slot]
        if slot in self.deferred:
            self.deferred.discard(slot)
            self.freed(slot)
            return True
        return False

    def release(self, slot: int) -> None:
        """The slot holds no block any more: free now, or once its users are done."""
        if slot in self.busy:
            self.deferred.add(slot)
        else:
            self.freed(slot)

    def freed(self, slot: int) -> None:
        """``slot`` can be handed out again."""
        self.free.append(slot)

    def can_alloc(self) -> bool:
        return bool(self.free)

    def room(self, m: int, reserve: int) -> bool:
        """Room for ``m`` more blocks on their way (``reserve``: slots kept back besides)."""
        return len(self.deferred) + m + reserve <= self.spare

    def alloc(self) -> int:
        """A free slot for a new block (the caller made sure one exists: ``can_alloc``)."""
        return self.free.pop()

    # hooks ------------------------------------------------------------------------------
    def region(self, n: int, block_bytes: int) -> Any:
        raise NotImplementedError

    def recover(self) -> None:
        """Rebuild the index after a restart (tiers that persist)."""

    def noted(self, key: Hashable, parent: Hashable | None) -> None:
        """A block now belongs to this tier (its data may still be on its way)."""

    def committed(self, records: Iterable[tuple[Hashable, Hashable | None, int, int]]) -> None:
        """``(key, parent, slot, crc)`` blocks are now in their slots (persisting tiers journal them)."""

    def dropped(self, key: Hashable, slot: int) -> bool:
        """A block left the tier. False if its slot must not be reused (a persisting tier could
        not record the removal: its record still names this slot, so the bytes there must stay)."""
        return True

    def record_removals(self) -> bool:
        """Try again to record the removals ``dropped`` could not; True once none is left."""
        return True

    def host_view(self, slot: int) -> memoryview | None:
        """Bytes of a slot if the CPU can read them directly (host tier)."""
        return None

    def close(self) -> None:
        if self.reg is not None:
            self.reg.release()
            self.reg = None


class HostTier(Tier):
    """Blocks in an ``alloc_host`` pool (other local processes can read it directly)."""

    medium = "CPU"

    def region(self, n: int, block_bytes: int) -> Any:
        self.pool = kvx.alloc_host(n * block_bytes)
        return self.pool

    def host_view(self, slot: int) -> memoryview:
        bb = self.block_bytes
        return self.pool.data[slot * bb: (slot + 1) * bb]


class JournaledTier(Tier):
    """A tier whose index is an append-only journal in a local directory (see :mod:`.journal`):
    after ``kill -9`` it recovers every block whose bytes landed and whose record was written.

    ``path`` None: no journal (the tier starts empty every time).
    """

    def __init__(self, path: str | os.PathLike[str] | None, nbytes: int | None = None, blocks: int | None = None,
                 fsync: bool = False) -> None:
        super().__init__(nbytes, blocks)
        self.path = None if path is None else _args.path(path, f"{type(self).__name__} path")
        self.fsync = _args.flag(fsync, f"{type(self).__name__} fsync")
        self.journal: Journal | None = None
        self.parents: dict[Hashable, Hashable | None] = {}
        #: removals the journal could not record yet (disk full): their slots stay out of use, since
        #: the journal still names them, until a later write records the removal
        self._unrecorded: list[tuple[Hashable, int]] = []

    def attach(self, agent: kvx.Agent, block_bytes: int, policy: str, spare: int = 0) -> None:
        try:
            super().attach(agent, block_bytes, policy, spare)
        except OSError as exc:
            raise TierError(f"{self.medium.lower()} tier {self.path!r}: {exc.strerror or exc}") from exc

    def check_meta(self, want: str, files: tuple[str, ...]) -> None:
        """Keep the journal (and ``files``) only if ``tier.meta`` describes the same layout:
        ``want``'s first word (the block size, the checksum, and whatever else must match)
        decides. A tier of the CRC-32 era (no checksum tag) is dropped, never misread."""
        assert self.path is not None
        os.makedirs(self.path, exist_ok=True)
        meta = os.path.join(self.path, "tier.meta")
        if os.path.exists(meta):
            with open(meta) as f:
                have = f.read()
            # another layout: the old index means nothing. Another slot count (capacity or the
            # store's write-back depth changed) keeps it: recovery skips slots beyond the end.
            if have.split()[:1] != want.split()[:1]:
                log.warning("%s tier %s: written with another layout or checksum (%r, now %r); its blocks are "
                            "dropped", self.medium.lower(), self.path, " ".join(have.split()[:1]),
                            " ".join(want.split()[:1]))
                for name in ("index.log", *files):
                    try:
                        os.unlink(os.path.join(self.path, name))
                    except FileNotFoundError:
                        pass
        with open(meta, "w") as f:
            f.write(want)

    def recover(self) -> None:
        if self.path is None:
            self.recovered(set())
            return
        jpath = os.path.join(self.path, "index.log")
        live: dict[Hashable, tuple[int, int, int, Hashable | None]] = {}
        byslot: dict[int, Hashable] = {}
        for op, key, parent, slot, crc, length in Journal.replay(jpath):
            if not (0 <= slot < self.nslots):
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
        # more than the tier holds now (a smaller capacity, same slots): keep the most recent
        while len(live) > self.capacity:
            live.pop(next(iter(live)))
        Journal.compact(jpath, live)
        self.journal = Journal(jpath, fsync=self.fsync)
        assert self.policy is not None
        # parents first so the chain structure is rebuilt
        order = sorted(live, key=lambda k: _depth(k, live))
        for key in order:
            slot, crc, _length, parent = live[key]
            self.index[key] = (slot, crc)
            self.parents[key] = parent
            self.policy.inserted(key, parent if parent in self.index else None)
        self.recovered({s for s, _c, _l, _p in live.values()})
        if live:
            log.info("%s tier %s recovered %d blocks", self.medium.lower(), self.path, len(live))

    def recovered(self, used: set[int]) -> None:
        """Slots ``used`` hold recovered blocks; the others are free."""
        self.free = [s for s in range(self.nslots - 1, -1, -1) if s not in used]

    def noted(self, key: Hashable, parent: Hashable | None) -> None:
        if self.path is not None:
            self.parents[key] = parent

    def committed(self, records: Iterable[tuple[Hashable, Hashable | None, int, int]]) -> None:
        if self.journal is None:
            return
        self._record_removals()
        self.journal.put_many((k, p, s, c, self.block_bytes) for k, p, s, c in records)

    def dropped(self, key: Hashable, slot: int) -> bool:
        if self.journal is None:
            return True
        self.parents.pop(key, None)
        self._unrecorded.append((key, slot))
        self.retired += 1
        try:
            self._record_removals(own=slot)
        except OSError as exc:  # disk full, I/O error: keep the bytes the journal still points at
            log.warning("%s tier %s: cannot journal the removal of a block (%s); %d slots stay out of use "
                        "until the journal can be written", self.medium.lower(), self.path, exc, self.retired)
            return False
        return True

    def record_removals(self) -> bool:
        if self.journal is None:
            return True
        try:
            self._record_removals()
        except OSError:
            return False
        return True

    def _record_removals(self, own: int | None = None) -> None:
        """Journal the removals not recorded yet (oldest first) and release their slots, all but
        ``own`` (``dropped``'s caller releases that one when ``dropped`` returns True)."""
        assert self.journal is not None
        while self._unrecorded:
            key, slot = self._unrecorded[0]
            self.journal.delete(key, slot)
            self._unrecorded.pop(0)
            self.retired -= 1
            if slot != own:
                self.release(slot)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        super().close()


class DiskTier(JournaledTier):
    """Blocks in a slab file with a journaled index; survives ``kill -9`` of its process.

    Parameters
    ----------
    path
        Directory for ``slab.bin`` and ``index.log`` (created if absent).
    nbytes, blocks
        Size of the tier.
    fsync
        fdatasync the journal after every batch of records (with ``KVX_POSIX_SYNC=data`` for
        the slab writes: durable across power loss, slower).
    """

    medium = "DISK"
    persistent = True
    path: str

    def __init__(self, path: str | os.PathLike[str], nbytes: int | None = None, blocks: int | None = None,
                 fsync: bool = False) -> None:
        _args.path(path, "DiskTier path")  # required here (JournaledTier takes None)
        super().__init__(path, nbytes, blocks, fsync)

    def region(self, n: int, block_bytes: int) -> Any:
        self.check_meta(f"{block_bytes}:{TAG} {n}\n", ("slab.bin",))
        return kvx.FileRegion(os.path.join(self.path, "slab.bin"), n * block_bytes)


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


#: a pack object holds at most this many bytes (a write-back batch larger than that is split)
PACK_BYTES_MAX = 64 << 20


class ObjectTier(JournaledTier):
    """Blocks in S3 objects through the ``s3`` backend, packed: each object (a *pack*) holds
    ``pack_blocks`` blocks, written whole by one PUT and read block by block with ranged GETs.

    A pack is immutable while any of its blocks is stored: new blocks go to the *open* pack,
    which the write-back queue writes once it is full, or earlier when nothing else is being
    written to this tier (so a lone demotion is not held back). A block that leaves the tier
    leaves a dead entry in its pack; a pack whose entries are all dead is reused, and when
    fewer than two packs are free, the store *compacts*: it moves the live blocks of the
    emptiest pack into the open one (through the same queue), freeing that pack. The tier
    keeps ``capacity + spare`` slots plus a quarter (at least three packs) as room for the dead
    entries; its objects are ``{prefix}/pack-{n}``, at most that many.

    Parameters
    ----------
    bucket
        The bucket (created if absent).
    nbytes, blocks
        Size of the tier.
    prefix
        Key prefix of the tier's objects.
    pack_blocks
        Blocks per object (1: one object per block, as before packing); at most
        ``PACK_BYTES_MAX`` bytes per object, and at most half the store's ``writeback_depth``
        (the store lowers it to that, so that one pack fills while another is written).
    journal
        A local directory for the tier's index journal (``tier.meta``, ``index.log``): with it,
        the tier recovers its blocks after a restart or ``kill -9`` exactly as the disk tier does.
        Without it the tier starts empty each time (its old objects are overwritten).
    fsync
        fdatasync the journal after every batch of records.
    """

    medium = "OBJECT"

    def __init__(self, bucket: str, nbytes: int | None = None, blocks: int | None = None,
                 prefix: str = "kvx-tier", pack_blocks: int = 64,
                 journal: str | os.PathLike[str] | None = None, fsync: bool = False) -> None:
        super().__init__(journal, nbytes, blocks, fsync)
        _args.name(bucket, "ObjectTier bucket")
        if not isinstance(prefix, str):
            raise ArgumentTypeError(f"ObjectTier prefix must be a str, not {type(prefix).__name__}")
        pack_blocks = _args.size(pack_blocks, "ObjectTier pack_blocks")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.pack_blocks = pack_blocks
        self.npacks = 0
        self.pack_used: list[int] = []  # per pack: slots handed out and not freed yet
        self.free_packs: list[int] = []
        self.open_pack: int | None = None
        self.open_next = 0
        self.compacting: set[int] = set()
        #: slots of blocks being moved by compaction -> their old slot
        self.moving: dict[int, int] = {}
        self.pack_plist: kvx.PreparedList | None = None

    def attach(self, agent: kvx.Agent, block_bytes: int, policy: str, spare: int = 0) -> None:
        self.pack_blocks = max(1, min(self.pack_blocks, PACK_BYTES_MAX // block_bytes))
        cap = self._size(block_bytes)
        base = -(-(cap + spare) // self.pack_blocks)
        self.npacks = base + max(3, -(-base // 4))
        # the slots past capacity + spare are the room for dead entries
        super().attach(agent, block_bytes, policy, self.npacks * self.pack_blocks - cap)
        assert self.reg is not None
        self.pack_plist = agent.prepare(DescList.blocks(self.reg, self.pack_blocks * block_bytes))

    def region(self, n: int, block_bytes: int) -> Any:
        pb = self.pack_blocks
        if self.path is not None:
            self.check_meta(f"{block_bytes}:{pb}:{self.bucket}:{self.prefix}:{TAG} {n}\n", ())
        return [kvx.ObjectRegion(self.bucket, f"{self.prefix}/pack-{i}", pb * block_bytes) for i in range(n // pb)]

    # packs ------------------------------------------------------------------------------
    def recovered(self, used: set[int]) -> None:
        pb = self.pack_blocks
        self.pack_used = [0] * self.npacks
        for s in used:
            self.pack_used[s // pb] += 1
        self.free_packs = [p for p in range(self.npacks - 1, -1, -1) if not self.pack_used[p]]
        self.free = []
        self.open_pack = None
        self.open_next = 0

    def avail(self) -> int:
        """Slots that can be handed out without compaction."""
        open_left = self.pack_blocks - self.open_next if self.open_pack is not None else 0
        return open_left + len(self.free_packs) * self.pack_blocks

    def can_alloc(self) -> bool:
        return self.avail() > 0

    def room(self, m: int, reserve: int) -> bool:
        return self.avail() >= m + reserve

    def committed(self, records: Iterable[tuple[Hashable, Hashable | None, int, int]]) -> None:
        records = list(records)
        for _k, _p, s, _c in records:
            self.moving.pop(s, None)
        super().committed(records)

    def dropped(self, key: Hashable, slot: int) -> bool:
        old = self.moving.pop(slot, None)
        if old is not None and self.journal is not None:  # a move that did not land: its old record goes too
            try:
                self.journal.delete(key, old)
            except OSError:  # the old record stays; its pack is reused later, so the checksum drops it
                log.warning("object tier %s: cannot journal the removal of a moved block", self.path)
        return super().dropped(key, slot)

    def alloc(self) -> int:
        pb = self.pack_blocks
        if self.open_pack is None or self.open_next >= pb:
            self.seal()
            if not self.free_packs:
                raise TierError("object tier: no free pack (compaction is behind)")
            self.open_pack = self.free_packs.pop()
            self.open_next = 0
        slot = self.open_pack * pb + self.open_next
        self.open_next += 1
        self.pack_used[self.open_pack] += 1
        return slot

    def seal(self) -> None:
        """No more blocks go to the open pack (it is being written)."""
        p = self.open_pack
        if p is None:
            return
        self.open_pack = None
        self.open_next = 0
        if not self.pack_used[p]:
            self.free_packs.append(p)

    def ready(self, pack: int) -> bool:
        """All blocks bound for ``pack`` have been handed their slots."""
        return pack != self.open_pack or self.open_next >= self.pack_blocks

    def freed(self, slot: int) -> None:
        p = slot // self.pack_blocks
        self.pack_used[p] -= 1
        if not self.pack_used[p] and p != self.open_pack:
            self.free_packs.append(p)
            self.compacting.discard(p)

    def needs_compaction(self, want: int = 0) -> bool:
        return not self.compacting and (len(self.free_packs) < 2 or self.avail() < want)

    def compaction_victim(self, busy: set[int]) -> tuple[int, list[Hashable]] | None:
        """The sealed pack with the fewest live blocks (not ``busy``: being written) and its keys."""
        pb = self.pack_blocks
        live: dict[int, list[Hashable]] = {}
        for k, (s, _c) in self.index.items():
            live.setdefault(s // pb, []).append(k)
        best: tuple[int, list[Hashable]] | None = None
        for p in range(self.npacks):
            if p == self.open_pack or not self.pack_used[p] or p in busy or p in self.compacting:
                continue
            keys = live.get(p, [])
            if len(keys) >= pb:
                continue
            if best is None or len(keys) < len(best[1]):
                best = (p, keys)
        return best
