""":class:`PoolTier`: a pool as the remote last tier of a :class:`~kvx.tiers.TieredStore`.

A pool is not a slot tier of this node: its blocks live in other members' arenas, found by
placement rather than by a local index. It is a :class:`~kvx.tiers.RemoteTier`, which the store
asks only for what its local tiers miss (``lookup``, ``get``) and writes through to on ``put``
(the pool keeps blocks it holds already, so a second instance's put of a shared prefix moves
nothing). The store moves blocks with the pool's agent, so ``src``/``dst`` prepared for the
store serve the pool too::

    store = TieredStore([HostTier(nbytes=8 << 30), PoolTier(pool)], block_bytes=bb)
    # or: TieredStore([HostTier(nbytes=8 << 30)], block_bytes=bb, remote=PoolTier(pool))
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..agent import PreparedList
from ..errors import KVXError, UsageError
from ..tiers.remote import RemoteTier
from .pool import Pool

__all__ = ["PoolTier"]

log = logging.getLogger(__name__)


class PoolTier(RemoteTier):
    """The pool ``pool`` as the remote last tier of a store.

    Parameters
    ----------
    pool
        A joined :class:`~kvx.pool.Pool` (a storing member or a client). It belongs to the
        caller: closing the store leaves it joined.
    write_through
        Put every block the store stores into the pool as well (default). ``False``: the store
        only reads from the pool (another process fills it).
    close_pool
        Leave the pool (``pool.close()``) when the store closes. By default the pool belongs to
        the caller and stays joined.

    Notes
    -----
    Every failure of the pool (a dead or cut owner, an evicted block, a checksum that differs) is
    a shorter prefix, never an exception: the pool bounds each round with an owner by
    ``PoolConfig.timeout``.
    """

    medium = "pool"

    def __init__(self, pool: Pool, write_through: bool = True, close_pool: bool = False) -> None:
        if not isinstance(pool, Pool):
            raise UsageError(f"PoolTier takes a kvx.pool.Pool, not {type(pool).__name__}")
        self.pool = pool
        self.agent = pool.agent
        self.write_through = bool(write_through)
        self.close_pool = bool(close_pool)
        self.hits = 0
        self.misses = 0
        self.stored = 0
        self.errors = 0

    def bind(self, block_bytes: int) -> None:
        if block_bytes != self.pool.block_bytes:
            raise UsageError(f"the store's blocks are {block_bytes} bytes, the pool's {self.pool.block_bytes}")

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        """Blocks of ``hashes`` the pool holds as a prefix (0 on any failure)."""
        try:
            return self.pool.lookup(hashes)
        except KVXError as exc:
            self.errors += 1
            log.warning("pool tier: lookup failed: %s", exc)
            return 0

    def get(self, hashes: Sequence[Hashable], dst: PreparedList, idx: np.ndarray) -> int:
        """Read the prefix of ``hashes`` the pool holds into ``dst[idx]``; its length."""
        if not len(hashes):
            return 0
        try:
            got = self.pool.get(hashes, dst, idx)
        except KVXError as exc:
            self.errors += 1
            log.warning("pool tier: get failed: %s", exc)
            got = 0
        self.hits += got
        self.misses += len(hashes) - got
        return got

    def put(self, hashes: Sequence[Hashable], src: PreparedList, idx: np.ndarray) -> int:
        if not len(hashes):
            return 0
        try:
            n = self.pool.put(hashes, src, idx)
        except KVXError as exc:
            self.errors += 1
            log.warning("pool tier: put failed: %s", exc)
            return 0
        self.stored += n
        return n

    def stats(self) -> dict[str, Any]:
        return {"medium": self.medium, "hits": self.hits, "misses": self.misses, "stored": self.stored,
                "errors": self.errors, "pool": self.pool.stats()}

    def close(self) -> None:
        if self.close_pool:
            self.pool.close()
