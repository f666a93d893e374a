"""kvx.pool: a cluster-wide KV pool with no master and no index.

Members join a pool by name in etcd under a lease; the owners of a block hash are chosen by
weighted rendezvous hashing over the live members; puts and gets are batched per owner (grant or
lease, one kvx transfer, commit or release) and posted to all owners at once; every failure is a
miss, never wrong bytes. :class:`PoolTier` makes a pool the last tier of a
:class:`~kvx.tiers.TieredStore`. See ``docs/pool.md``.
"""

from __future__ import annotations

from .placement import Placement
from .pool import Pool, PoolConfig
from .tier import PoolTier

__all__ = ["Pool", "PoolConfig", "PoolTier", "Placement"]
