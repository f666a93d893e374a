""":class:`PoolTier`: a pool as the last tier of a :class:`~kvx.tiers.TieredStore`.

A pool is not a slot tier of this node: its blocks live in other members' arenas, found by
placement rather than by a local index. So the store asks it through three calls, only for what
its local tiers cannot serve:

- ``lookup_after(hashes, k)``: the local tiers hold the first ``k`` blocks; how many more does the
  pool hold right after them;
- ``get_after(hashes, dst, idx, k)``: read those into ``dst`` (checksummed, leased, a miss on
  any failure);
- ``put_through(hashes, src, idx)``: what the store stores goes to the pool too (write-through:
  the pool keeps blocks it holds already, so a second instance's put of a shared prefix moves
  nothing).

:class:`PooledStore` is a :class:`~kvx.tiers.TieredStore` wired that way (``TieredStore([...,
PoolTier(pool)])`` builds one); the store's agent is the pool's agent, so ``src``/``dst`` prepared
for the store serve the pool too.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..agent import PreparedList
from ..errors import BlockNotFound, KVXError, UsageError
from ..tiers.store import LookupResult, TieredStore
from ..tiers.tier import Tier
from .pool import Pool

__all__ = ["PoolTier", "PooledStore"]

log = logging.getLogger(__name__)


class PoolTier:
    """The pool ``pool`` as the last tier of a store.

    Parameters
    ----------
    pool
        A joined :class:`~kvx.pool.Pool` (a storing member or a client).
    write_through
        Put every block the store stores into the pool as well (default). ``False``: the store
        only reads from the pool (another process fills it).
    """

    medium = "pool"
    #: not a slot tier of this node: the store asks it through the calls below
    remote = True
    #: the store class ``TieredStore([..., PoolTier(pool)])`` builds (set below)
    store_class: type

    def __init__(self, pool: Pool, write_through: bool = True) -> None:
        if not isinstance(pool, Pool):
            raise UsageError(f"PoolTier takes a kvx.pool.Pool, not {type(pool).__name__}")
        self.pool = pool
        self.write_through = bool(write_through)
        self.hits = 0
        self.misses = 0
        self.stored = 0
        self.errors = 0

    def bind(self, block_bytes: int) -> None:
        if block_bytes != self.pool.block_bytes:
            raise UsageError(f"the store's blocks are {block_bytes} bytes, the pool's {self.pool.block_bytes}")

    def lookup_after(self, hashes: Sequence[Hashable], k: int) -> int:
        """Blocks of ``hashes[k:]`` the pool holds as a prefix (0 on any failure)."""
        if k >= len(hashes):
            return 0
        try:
            return self.pool.lookup(hashes[k:])
        except KVXError as exc:
            self.errors += 1
            log.warning("pool tier: lookup failed: %s", exc)
            return 0

    def get_after(self, hashes: Sequence[Hashable], dst: PreparedList, idx: np.ndarray, k: int) -> int:
        """Read the prefix of ``hashes[k:]`` the pool holds into ``dst[idx[k:]]``; its length."""
        if k >= len(hashes):
            return 0
        try:
            got = self.pool.get(hashes[k:], dst, idx[k:])
        except KVXError as exc:
            self.errors += 1
            log.warning("pool tier: get failed: %s", exc)
            got = 0
        self.hits += got
        self.misses += len(hashes) - k - got
        return got

    def put_through(self, hashes: Sequence[Hashable], src: PreparedList, idx: np.ndarray) -> int:
        if not self.write_through or not len(hashes):
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
        """The pool belongs to the caller: closing the store leaves it joined."""


class PooledStore(TieredStore):
    """A :class:`~kvx.tiers.TieredStore` whose last tier is a :class:`PoolTier`: local tiers
    first, the pool only for the blocks they miss. Its ``agent`` is the pool's."""

    def __init__(self, tiers: Sequence[Any], block_bytes: int, **kw: Any) -> None:
        tiers = list(tiers)
        if not tiers or not isinstance(tiers[-1], PoolTier):
            raise UsageError("a PooledStore's last tier is a PoolTier")
        if any(isinstance(t, PoolTier) for t in tiers[:-1]):
            raise UsageError("a PoolTier can only be the last tier")
        pt: PoolTier = tiers.pop()
        pt.bind(block_bytes)
        agent = kw.pop("agent", None)
        if agent is not None and agent is not pt.pool.agent:
            raise UsageError("a store over a pool moves blocks with the pool's agent (pool.agent)")
        self.pool_tier = pt
        if not all(isinstance(t, Tier) for t in tiers):
            raise UsageError("tiers before the PoolTier must be HostTier, DiskTier or ObjectTier instances")
        super().__init__(tiers, block_bytes, agent=pt.pool.agent, **kw)
        self._own_agent = False  # the pool closes its agent

    def lookup(self, hashes: Sequence[Hashable]) -> LookupResult:
        """Longest prefix held locally and then by the pool; the pool's blocks are listed as tier
        ``len(self.tiers)``."""
        res = super().lookup(hashes)
        hs = list(hashes)
        more = self.pool_tier.lookup_after(hs, res.hits) if res.hits < len(hs) else 0
        if not more:
            return res
        return LookupResult(res.hits + more, res.tiers + (len(self.tiers),) * more)

    def get(self, hashes: Sequence[Hashable], dst: PreparedList, dst_idx: Any = None, timeout: float = 60.0) -> int:
        """As :meth:`TieredStore.get`; blocks the local tiers miss are read from the pool (one
        round per owner). Raises :class:`~kvx.BlockNotFound` (with the count served) only when
        neither has the next block."""
        hs = list(hashes)
        try:
            return super().get(hs, dst, dst_idx, timeout)
        except BlockNotFound as exc:
            k = int(exc.args[1]) if len(exc.args) > 1 else 0
            didx = np.arange(len(hs), dtype=np.int64) if dst_idx is None else np.asarray(dst_idx, dtype=np.int64)
            got = self.pool_tier.get_after(hs, dst, didx, k)
            if k + got < len(hs):
                raise BlockNotFound(f"block {hs[k + got]!r} is not stored here nor in the pool", k + got) from None
            return k + got

    def put(self, hashes: Sequence[Hashable], src: PreparedList, src_idx: Any = None,
            parent: Hashable | None = None, timeout: float = 60.0) -> int:
        """As :meth:`TieredStore.put`, and the blocks go to the pool too (``write_through``)."""
        hs = list(hashes)
        n = super().put(hs, src, src_idx, parent, timeout)
        sidx = np.arange(len(hs), dtype=np.int64) if src_idx is None else np.asarray(src_idx, dtype=np.int64)
        self.pool_tier.put_through(hs, src, sidx)
        return n

    def stats(self) -> Any:
        st = super().stats()
        try:
            st.tiers.append(self.pool_tier.stats())
        except AttributeError:  # pragma: no cover - another stats shape
            pass
        return st


PoolTier.store_class = PooledStore
