"""Tiered KV block store: host memory, disk and object tiers with pluggable eviction.

See DESIGN section 7, ``docs/policy.md`` (eviction) and ``docs/storage-files.md`` (the disk tier);
a :class:`RemoteTier` (``kvx.pool.PoolTier``) below the local tiers is asked for what they miss.
"""

from .events import BlockRemoved, BlockStored, ZmqEventPublisher
from .policies import DEFAULT_POLICY, POLICIES, EvictionPolicy, make_policy
from .remote import RemoteTier
from .store import BadKey, DiskTier, HostTier, LookupResult, ObjectTier, StoreStats, Tier, TieredStore

__all__ = [
    "BadKey",
    "DEFAULT_POLICY",
    "POLICIES",
    "BlockRemoved",
    "BlockStored",
    "DiskTier",
    "EvictionPolicy",
    "HostTier",
    "LookupResult",
    "ObjectTier",
    "RemoteTier",
    "StoreStats",
    "Tier",
    "TieredStore",
    "ZmqEventPublisher",
    "make_policy",
]
