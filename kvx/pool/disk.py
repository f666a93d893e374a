""":class:`DiskSpill`: a pool member's disk tier, below its arena of host memory.

A storing member with a disk tier does not drop the blocks its policy evicts from the arena: it
writes them to a slab file (one slot per block) and keeps their key and checksum. A lookup that
finds a block only on disk brings it back into an arena slot (evicting, and so spilling, another
block), checks it against the checksum its writer committed, and serves it from there: a remote
reader only ever reads the arena, under a lease, as for any block. A block that fails its
checksum on the way back is dropped (a miss, never served).

The slab is scratch space: it is created empty when the member joins and removed when it
leaves (a restarted member starts empty, as without a disk tier). Its I/O is synchronous
(``pwrite``/``preadv`` of one block, under the owner's lock): a disk tier trades the latency of
the lookups that hit it for capacity.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from .._native import nh64
from ..errors import TierError, TierFull, UsageError
from ..tiers.policies import EvictionPolicy, make_policy

__all__ = ["DiskSpill", "DiskStats"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DiskStats:
    spilled: int = 0
    evicted: int = 0
    restored: int = 0
    corrupt: int = 0
    errors: int = 0


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


class DiskSpill:
    """A slab file of ``capacity // block_bytes`` block slots at ``path`` (a file name; its
    directory must exist), with its own eviction ``policy``. Not thread-safe: the owner calls it
    under its lock."""

    def __init__(self, path: str, capacity: int, block_bytes: int, policy: str = "lru") -> None:
        if not isinstance(path, str) or not path:
            raise UsageError("a pool member's disk tier needs a file path")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < block_bytes:
            raise UsageError(f"disk capacity {capacity!r} holds no block of {block_bytes} bytes")
        self.path = path
        self.block_bytes = block_bytes
        self.nslots = capacity // block_bytes
        self.policy: EvictionPolicy = make_policy(policy, self.nslots)
        self.index: dict[bytes, tuple[int, int]] = {}  # key -> (slot, checksum)
        self.free = list(range(self.nslots - 1, -1, -1))
        self.stats = DiskStats()
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
            os.ftruncate(self.fd, self.nslots * block_bytes)
        except OSError as exc:
            raise TierError(f"cannot create the disk tier {path!r}: {exc}") from exc

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def spill(self, key: bytes, addr: int, crc: int) -> bool:
        """Write the block at ``addr`` (``block_bytes`` of this process) to disk under ``key``,
        evicting the disk's own victim if it is full; False if it could not be written."""
        if key in self.index:
            self.policy.hit(key)
            return True
        self.policy.miss(key)
        if not self.free:
            try:
                v = self.policy.victim()
            except TierFull:
                return False
            self._drop(v)  # type: ignore[arg-type]
            self.stats.evicted += 1
        s = self.free.pop()
        try:
            n = os.pwrite(self.fd, _view(addr, self.block_bytes), s * self.block_bytes)
            if n != self.block_bytes:
                raise OSError(f"short write ({n} of {self.block_bytes} bytes)")
        except OSError as exc:
            self.free.append(s)
            self.stats.errors += 1
            log.warning("pool disk tier: writing a block failed: %s", exc)
            return False
        self.index[key] = (s, crc)
        self.policy.inserted(key, None)
        self.stats.spilled += 1
        return True

    def take(self, key: bytes) -> tuple[int, int] | None:
        """Remove ``key`` from the disk index and return its ``(slot, checksum)``; the slot
        stays reserved (not reused) until :meth:`restore` or :meth:`give_back`."""
        got = self.index.pop(key, None)
        if got is not None:
            self.policy.removed(key)
        return got

    def restore(self, slot: int, crc: int, addr: int) -> bool:
        """Read reserved ``slot`` into ``addr`` and free it; True if the bytes match ``crc``."""
        try:
            dst = _view(addr, self.block_bytes)
            n = os.preadv(self.fd, [dst], slot * self.block_bytes)
            if n != self.block_bytes:
                raise OSError(f"short read ({n} of {self.block_bytes} bytes)")
        except OSError as exc:
            self.stats.errors += 1
            log.warning("pool disk tier: reading a block failed: %s", exc)
            self.free.append(slot)
            return False
        self.free.append(slot)
        if nh64(dst) != crc:
            self.stats.corrupt += 1
            log.warning("pool disk tier: a block failed its checksum (dropped)")
            return False
        self.stats.restored += 1
        return True

    def give_back(self, key: bytes, slot: int, crc: int) -> None:
        """Put a taken block back (it could not be restored for want of an arena slot)."""
        self.index[key] = (slot, crc)
        self.policy.inserted(key, None)

    def _drop(self, key: bytes) -> None:
        s, _ = self.index.pop(key)
        self.policy.removed(key)
        self.free.append(s)

    def close(self) -> None:
        """Close and remove the slab."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def check(self) -> None:
        """Assert the bookkeeping's invariants (tests)."""
        used = {s for s, _ in self.index.values()}
        assert len(used) == len(self.index), "a disk slot holds two blocks"
        assert used.isdisjoint(self.free), "a used disk slot is free"
        assert len(self.policy) == len(self.index), "disk policy and index disagree"
