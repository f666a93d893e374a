"""``HiCacheKVX``: SGLang's HiCache L3 storage on kvx, zero-copy (``interface_v1``).

Load it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvx", "module_path": "kvx_sglang.hicache",
        "class_name": "HiCacheKVX", "interface_v1": 1, "path": "/nvme/kvx", "capacity_gb": 200}'

The host pool's memory is registered with kvx once (``register_mem_pool_host``); every
``batch_set_v1``/``batch_get_v1`` is one kvx transfer between the pool's page fragments and the
store (a slab file, or a ``kvx.tiers.TieredStore``). Each page carries a checksum of its bytes
(kvx-nh64 of each fragment, taken by kvx's posix copy in the same pass as the copy) recorded
when stored and checked when it is read back: a page that fails is a miss and is dropped,
never reported as loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

import kvx
from kvx import DescList, MemoryKind, UsageError, _native
from kvx.backends.posix import PosixOptions
from kvx.tiers.checksum import keep_digests

from .config import HiCacheKVXConfig
from .layout import LayoutError, PageGeometry
from .slab import PwritevWriter, SlabStore

log = logging.getLogger(__name__)

__all__ = ["HiCacheKVX", "LayoutError"]

def combine(frag: np.ndarray) -> np.ndarray:
    """Page checksums from the kvx-nh64 checksums of their fragments (``frag``: pages x fragments)."""
    h = frag[:, 0].copy()
    for f in range(1, frag.shape[1]):
        h = (h ^ frag[:, f]) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
    return h


class _HostView:
    """Checksums of host-pool pages: kvx-nh64 of each fragment, as the posix copy takes them.

    ``fused`` (buffered slabs): the posix backend takes them in the same pass as the copy
    (``keep_digests``) and :meth:`digest` only combines what the last transfer left. Otherwise
    (O_DIRECT) each fragment is hashed where it lies, after the transfer.
    """

    def __init__(self, ranges: list[tuple[int, int]], geom: PageGeometry, moved: np.ndarray | None) -> None:
        self.geom = geom
        self.moved = moved
        self.fused = moved is not None
        self.starts = np.array([a for a, _ in ranges], dtype=np.int64)
        self.views = [memoryview((ctypes.c_uint8 * n).from_address(a)).cast("B") for a, n in ranges]
        self.addrs = geom.host_addrs()

    def digest(self, pages: np.ndarray) -> np.ndarray:
        g = self.geom
        rows = g.frag_index(pages)
        if self.moved is not None:
            return combine(self.moved[rows].reshape(len(pages), g.nfrag))
        a = self.addrs[rows]
        r = (np.searchsorted(self.starts, a, side="right") - 1).tolist()
        off = (a - self.starts[r]).tolist()
        sizes = g.sizes.tolist()
        nf = g.nfrag
        views = self.views
        out = np.fromiter((_native.nh64(views[r[j]][off[j]:off[j] + sizes[j % nf]]) for j in range(len(rows))),
                          dtype=np.uint64, count=len(rows))
        return combine(out.reshape(len(pages), nf))


def _pool_tier(cfg: HiCacheKVXConfig, frag: int, name: str) -> Any:
    """The kvx pool of this model and rank (``name``) as the tiered store's last tier; the store's
    close leaves it."""
    import socket

    from kvx.pool import Pool, PoolConfig, PoolTier

    cap = cfg.bytes_of(cfg.pool_capacity_gb)
    cap -= cap % frag
    member = f"{cfg.pool_member or f'{socket.gethostname()}-{os.getpid()}'}-{name}"
    pool = Pool(member[:200], etcd=cfg.pool_etcd or "", pool=f"{cfg.pool_name}.{name}"[:200], capacity=cap,
                block_bytes=frag, options=PoolConfig(host=cfg.pool_host, replicas=int(cfg.pool_replicas),
                                                     timeout=cfg.pool_timeout_s))
    return PoolTier(pool, close_pool=True)


class _TieredPages:
    """Pages in a ``kvx.tiers.TieredStore``: one block per page fragment, keyed ``key/f``."""

    def __init__(self, cfg: HiCacheKVXConfig, geom: PageGeometry, ranges: list[tuple[int, int]], name: str) -> None:
        from kvx.tiers import DiskTier, HostTier, ObjectTier, TieredStore

        if int(geom.sizes.min()) != int(geom.sizes.max()):
            raise LayoutError("the tiered store needs page fragments of one size; use store='file'")
        self.geom = geom
        self.timeout = cfg.timeout_s
        frag = int(geom.sizes[0])
        tiers: list[Any] = [HostTier(nbytes=max(cfg.bytes_of(cfg.host_gb), frag))]
        if cfg.disk_path:
            tiers.append(DiskTier(os.path.join(cfg.disk_path, name), nbytes=max(cfg.bytes_of(cfg.disk_gb), frag)))
        if cfg.s3_bucket:
            tiers.append(ObjectTier(cfg.s3_bucket, nbytes=max(cfg.bytes_of(cfg.s3_gb), frag), prefix=name))
        kw: dict[str, Any] = {} if cfg.policy is None else {"policy": cfg.policy}
        self._digest = bool(cfg.pool_etcd)
        if cfg.pool_etcd:
            kw["remote"] = _pool_tier(cfg, frag, name)
        self.store = TieredStore(tiers, frag, **kw)
        try:
            self._reg = self.store.agent.register([kvx.RawRegion(a, n) for a, n in ranges])
            self._host = self.store.agent.prepare(DescList.from_arrays(
                kind=MemoryKind.HOST, addr=geom.host_addrs(), nbytes=geom.host_sizes()))
        except BaseException:
            self.store.close()
            raise
        self._lock = threading.Lock()
        self._keys: set[bytes] = set()

    def _fkeys(self, keys: list[str]) -> list[bytes]:
        nf = self.geom.nfrag
        fk = [f"{k}/{f}".encode() for k in keys for f in range(nf)]
        if self._digest:  # a pool keys blocks by at most 64 bytes: SGLang's keys are longer
            return [hashlib.blake2b(k, digest_size=32).digest() for k in fk]
        return fk

    def prefix(self, keys: list[str]) -> int:
        return self.store.lookup(self._fkeys(keys)).hits // self.geom.nfrag

    def put(self, keys: list[str], pages: np.ndarray, host: Any) -> list[bool]:
        fk = self._fkeys(keys)
        self.store.put(fk, self._host, self.geom.frag_index(pages), timeout=self.timeout)
        with self._lock:
            self._keys.update(fk)
        nf = self.geom.nfrag
        return [all(fk[i * nf + f] in self.store for f in range(nf)) for i in range(len(keys))]

    def get(self, keys: list[str], pages: np.ndarray, host: Any) -> list[bool]:
        n = self.prefix(keys)
        nf = self.geom.nfrag
        try:
            done = self.store.get(self._fkeys(keys[:n]), self._host, self.geom.frag_index(pages[:n]),
                                  timeout=self.timeout)
        except kvx.BlockNotFound as exc:
            done = int(exc.args[1]) if len(exc.args) > 1 else 0
        good = done // nf
        return [i < good for i in range(len(keys))]

    def clear(self) -> None:
        with self._lock:
            keys, self._keys = list(self._keys), set()
        self.store.delete(keys)

    def __len__(self) -> int:
        return len(self.store) // self.geom.nfrag

    def close(self) -> None:
        try:
            self._reg.release()
        finally:
            self.store.close()


class HiCacheKVX(HiCacheStorage):
    """SGLang HiCache L3 storage backend over kvx (see the module docstring).

    Parameters
    ----------
    storage_config
        SGLang's storage config; its ``extra_config`` holds the kvx settings
        (:class:`kvx_sglang.config.HiCacheKVXConfig`).
    kwargs
        What SGLang's factory passes along (unused).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.cfg = HiCacheKVXConfig.from_extra(storage_config.extra_config)
        model = "-".join((storage_config.model_name or "").split("/"))
        shard = f"_{storage_config.pp_size}_{storage_config.pp_rank}" if storage_config.pp_size > 1 else ""
        if storage_config.attn_cp_size > 1:
            shard += f"_cp{storage_config.attn_cp_rank}_{storage_config.attn_cp_size}"
        self.tp_config_suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}{shard}"
        # MLA KV is the same on every TP rank: one writer, one shared store (as SGLang's file backend)
        self.is_mla = bool(storage_config.is_mla_model)
        self.config_suffix = f"_{model}{shard}" if self.is_mla else self.tp_config_suffix
        self.writer = bool(storage_config.is_storage_writer)
        self.agent: kvx.Agent | None = None
        self.pages: Any = None
        self.geom: PageGeometry | None = None
        self._host: kvx.PreparedList | None = None
        self._reg: kvx.Registration | None = None
        self._fill_agent: kvx.Agent | None = None
        self._stats_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self._closed = False

    # ------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Register the host pool with kvx once and open the store for its page geometry."""
        super().register_mem_pool_host(mem_pool_host)
        if self.pages is not None:
            raise UsageError("HiCacheKVX serves one host pool; it is registered already")
        geom = PageGeometry.of(mem_pool_host)
        ranges = geom.ranges()
        name = "kvx" + "".join(c if c.isalnum() or c in "-_." else "_" for c in self.config_suffix)
        if self.cfg.store == "tiered":
            self.pages = _TieredPages(self.cfg, geom, ranges, name)
        else:
            options = {"posix": PosixOptions(direct=True)} if self.cfg.direct_io else {}
            self.agent = kvx.Agent(f"hicache-kvx-{os.getpid()}-{id(self):x}",
                                   kvx.AgentConfig(options=options, **self._inline()))
            try:
                self._reg = self.agent.register([kvx.RawRegion(a, n) for a, n in ranges])
                self._host = self.agent.prepare(DescList.from_arrays(
                    kind=MemoryKind.HOST, addr=geom.host_addrs(), nbytes=geom.host_sizes()))
                moved = None
                if not self.cfg.direct_io:  # checksums taken by the posix copy itself
                    moved = keep_digests(self.agent, self._host)
                view = _HostView(ranges, geom, moved)
                fill = None if self.cfg.direct_io or not self.writer else self._pwritev_writer(ranges, geom)
                capacity = max(1, self.cfg.bytes_of(self.cfg.capacity_gb) // geom.page_bytes)
                self.pages = SlabStore(self.agent, self.cfg.path, name, geom, capacity, view.digest,
                                       writer=self.writer, timeout=self.cfg.timeout_s, fsync=self.cfg.fsync,
                                       chunks=1 if view.fused else SlabStore.CHUNKS,
                                       prefault=0 if self.cfg.direct_io else self.cfg.bytes_of(self.cfg.prefault_gb),
                                       fill=fill)
            except BaseException:
                self.agent.close()
                self.agent = None
                if self._fill_agent is not None:
                    self._fill_agent.close()
                    self._fill_agent = None
                raise
        self.geom = geom
        log.info("HiCacheKVX: %s store, layout %s, %d fragment(s) of %s bytes per page", self.cfg.store,
                 geom.layout, geom.nfrag, ",".join(map(str, sorted(set(geom.sizes.tolist())))))

    def _pwritev_writer(self, ranges: list[tuple[int, int]], geom: PageGeometry) -> PwritevWriter:
        """A second agent that writes the slab's pages: posix with ``pwritev`` (no mapping)."""
        agent = kvx.Agent(f"hicache-kvx-fill-{os.getpid()}-{id(self):x}",
                          kvx.AgentConfig(backends=("posix",), options={"posix": PosixOptions(mmap=False)},
                                          **self._inline()))
        self._fill_agent = agent
        agent.register([kvx.RawRegion(a, n) for a, n in ranges])
        host = agent.prepare(DescList.from_arrays(kind=MemoryKind.HOST, addr=geom.host_addrs(),
                                                  nbytes=geom.host_sizes()))
        return PwritevWriter(agent, host, _HostView(ranges, geom, keep_digests(agent, host)).digest)

    def _inline(self) -> dict[str, Any]:
        """AgentConfig settings that run every buffered batch in the calling thread (``inline``)."""
        return {"inline_bytes": 1 << 50} if self.cfg.inline and not self.cfg.direct_io else {}

    def _ready(self) -> PageGeometry:
        if self._closed:
            raise UsageError("HiCacheKVX is closed")
        if self.geom is None:
            raise UsageError("HiCacheKVX has no host pool: call register_mem_pool_host first")
        return self.geom

    def _scoped(self, keys: list[str]) -> list[str]:
        s = self.config_suffix
        return [k + s for k in keys]

    # ------------------------------------------------------------------------------------
    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        geom = self._ready()
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # another rank writes this shared (MLA) cache
        pages = geom.pages_of(host_indices)
        if pages.size != len(keys):
            raise UsageError(f"{len(keys)} keys but {pages.size} pages of host indices")
        t0 = time.perf_counter()
        try:
            ok = self.pages.put(self._scoped(keys), pages, self._host)
        except kvx.KVXError:
            log.exception("HiCacheKVX: storing %d pages failed", len(keys))
            return [False] * len(keys)
        self._record(self._backup_pgs, self._backup_bw, sum(ok), t0)
        return ok

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        geom = self._ready()
        if not keys:
            return []
        pages = geom.pages_of(host_indices)
        if pages.size != len(keys):
            raise UsageError(f"{len(keys)} keys but {pages.size} pages of host indices")
        t0 = time.perf_counter()
        try:
            ok = self.pages.get(self._scoped(keys), pages, self._host)
        except kvx.KVXError:
            log.exception("HiCacheKVX: loading %d pages failed", len(keys))
            return [False] * len(keys)
        self._record(self._prefetch_pgs, self._prefetch_bw, sum(ok), t0)
        return ok

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        self._ready()
        return int(self.pages.prefix(self._scoped(keys)))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _record(self, pgs: list[int], bw: list[float], n: int, t0: float) -> None:
        if not self.storage_config.enable_storage_metrics or n == 0:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        with self._stats_lock:
            pgs.append(n)
            bw.append(n * self.geom.page_bytes / dt / 1e9)  # type: ignore[union-attr]

    # -- the deprecated copy interface: SGLang uses it only without interface_v1 -------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("HiCacheKVX is zero-copy only (interface_v1): use batch_get_v1")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("HiCacheKVX is zero-copy only (interface_v1): use batch_get_v1")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("HiCacheKVX is zero-copy only (interface_v1): use batch_set_v1")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("HiCacheKVX is zero-copy only (interface_v1): use batch_set_v1")

    # ------------------------------------------------------------------------------------
    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        m = StorageMetrics()
        with self._stats_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for lst in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                lst.clear()
        return m

    def clear(self) -> None:
        """Forget every stored page of this rank."""
        if self.pages is not None:
            self.pages.clear()

    def close(self) -> None:
        """Release the store, the registration and the agent (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.pages is not None:
                self.pages.close()
            if self._reg is not None:
                self._reg.release()
        finally:
            for agent in (self._fill_agent, self.agent):
                if agent is not None:
                    agent.close()
