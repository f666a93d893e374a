"""The extra config of ``--hicache-storage-backend dynamic`` as kvx reads it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

from kvx import UsageError

log = logging.getLogger(__name__)

#: Keys SGLang itself reads from the same JSON object (not ours, not errors).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
                         "enable_metadata_cache", "metadata_ttl"})
STORES = ("file", "tiered")
#: Number settings that may be 0 (off).
_ZERO_OK = frozenset({"prefault_gb", "pool_capacity_gb"})
_GB = 1 << 30


@dataclass(frozen=True, slots=True)
class HiCacheKVXConfig:
    """Settings of :class:`kvx_sglang.HiCacheKVX` (keys of the extra-config JSON).

    Attributes
    ----------
    store
        ``"file"``: a slab file of pages with a journaled index under ``path`` (one kvx
        transfer per batch). ``"tiered"``: a ``kvx.tiers.TieredStore`` -- host memory
        (``host_gb``), then optionally disk (``disk_path``, ``disk_gb``) and S3
        (``s3_bucket``, ``s3_gb``).
    path
        Directory of the slab (``store="file"``).
    capacity_gb
        Size of the slab; pages beyond it evict the least recently used.
    fsync
        fdatasync the index journal after each batch.
    direct_io
        Read and write the slab with ``O_DIRECT`` (bypassing the page cache), as SGLang's
        HiCacheNixl does by default.
    inline
        Move each batch of the ``file`` store in the calling thread (SGLang's prefetch/backup
        thread, GIL released) instead of on kvx's I/O threads. Default false: a batch is spread
        over the I/O threads (a set's two transfers, a get's pages), which on an idle host moves
        a 64-token batch 1.3-1.4x faster than one thread (docs/benchmarks.md, "HiCache first
        fill"), and its wait is bounded by ``timeout_s``. True saves the hand-off, which on a host
        whose cores are all busy can be most of a batch's wait; the batch is then bounded by
        the kernel's I/O, not by ``timeout_s``. O_DIRECT always uses the threads.
    prefault_gb
        Never-written slots kept in the page cache ahead of the slab's fill (``store="file"``,
        buffered; default 0, off): a background thread writes zeros into the next slots, this
        much ahead of the fill, starting when the store is built (building does not wait for
        it); a set then rewrites cached pages (about half the kernel time of a first write),
        and a set handed a slot being zeroed waits for that step. It lowers set latency at the
        cost of the thread's time (zeros plus a rewrite take more CPU than one first write) and
        this much page cache.
    timeout_s
        Bound on one batch transfer.
    policy
        Eviction policy of the tiered store (``kvx.tiers.POLICIES``), default adaptive.
    pool_etcd, pool_name, pool_member, pool_capacity_gb, pool_host, pool_replicas, pool_timeout_s
        A cluster-wide kvx pool (``docs/pool.md``) as the last tier of the tiered store, on
        with ``pool_etcd`` (etcd endpoint(s), ``http://host:2379``): pool
        ``{pool_name}.{config suffix}`` (one per model and rank), this instance's member name
        ``pool_member`` (default: host name and process id), ``pool_capacity_gb`` of host
        memory stored for the pool (0: a client), listening on ``pool_host`` (the address other
        members dial), ``pool_replicas`` owners per page fragment, ``pool_timeout_s`` the bound
        on one round with one member.
    """

    store: str = "file"
    path: str = "/tmp/kvx_hicache"
    capacity_gb: float = 16.0
    fsync: bool = False
    direct_io: bool = False
    inline: bool = False
    timeout_s: float = 60.0
    prefault_gb: float = 0.0
    host_gb: float = 4.0
    disk_path: str | None = None
    disk_gb: float = 64.0
    s3_bucket: str | None = None
    s3_gb: float = 256.0
    policy: str | None = None
    pool_etcd: str | None = None
    pool_name: str = "kvx"
    pool_member: str | None = None
    pool_capacity_gb: float = 0.0
    pool_host: str = "127.0.0.1"
    pool_replicas: float = 1.0
    pool_timeout_s: float = 5.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "HiCacheKVXConfig":
        """Validate the extra config; unknown keys are errors (typos lose data silently)."""
        extra = dict(extra or {})
        if not extra.get("interface_v1"):
            raise UsageError('kvx HiCache storage is zero-copy only: add "interface_v1": 1 to '
                             "--hicache-storage-backend-extra-config")
        mine = {f.name: f for f in fields(cls)}
        kw: dict[str, Any] = {}
        for k, v in extra.items():
            if k in SGLANG_KEYS:
                continue
            f = mine.get(k)
            if f is None:
                raise UsageError(f"unknown kvx HiCache setting {k!r} (known: {', '.join(sorted(mine))})")
            want = {"store": str, "path": str, "disk_path": str, "s3_bucket": str, "policy": str,
                    "fsync": bool, "direct_io": bool, "inline": bool, "pool_etcd": str, "pool_name": str,
                    "pool_member": str, "pool_host": str}.get(k, float)
            if want is float:
                zero_ok = k in _ZERO_OK
                if (isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if zero_ok else v > 0)
                        or v == float("inf")):
                    kind = "a number >= 0" if zero_ok else "a positive number"
                    raise UsageError(f"kvx HiCache setting {k!r} must be {kind}, not {v!r}")
                v = float(v)
            elif not isinstance(v, want):
                raise UsageError(f"kvx HiCache setting {k!r} must be a {want.__name__}, not {v!r}")
            kw[k] = v
        cfg = cls(**kw)
        if cfg.store not in STORES:
            raise UsageError(f"kvx HiCache store must be one of {STORES}, not {cfg.store!r}")
        cfg._check_pool({k for k in kw if k.startswith("pool_")})
        return cfg

    def _check_pool(self, given: set[str]) -> None:
        if not self.pool_etcd:
            if given:
                raise UsageError(f"kvx HiCache settings {sorted(given)} need pool_etcd (the pool's etcd endpoint)")
            return
        if self.store != "tiered":
            raise UsageError('the kvx pool is the last tier of the tiered store: set "store": "tiered"')
        if not all(e.strip().startswith(("http://", "https://")) for e in self.pool_etcd.split(",")):
            raise UsageError(f"pool_etcd must be http(s)://host:port endpoints, not {self.pool_etcd!r}")
        if self.pool_replicas != int(self.pool_replicas) or not 1 <= self.pool_replicas <= 8:
            raise UsageError(f"pool_replicas must be an int in 1..8, not {self.pool_replicas!r}")
        for k in ("pool_name", "pool_member", "pool_host"):
            v = getattr(self, k)
            if v is not None and (not v or "/" in v or len(v) > 100):
                raise UsageError(f"kvx HiCache setting {k!r} must be a non-empty string without '/', not {v!r}")
        if self.pool_host in ("0.0.0.0", "::"):
            raise UsageError("pool_host is the address other members dial: not a wildcard")

    def bytes_of(self, gb: float) -> int:
        return int(gb * _GB)
