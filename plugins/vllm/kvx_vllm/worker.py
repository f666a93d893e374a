"""The worker-side half of :class:`kvx_vllm.KVXConnector`: moves the bytes with kvx.

Every attention layer's cache is registered once with a kvx :class:`~kvx.Agent` (its backing
storage, so views and packed allocations work) and described by its cells' strides
(:mod:`kvx_vllm.plan`):

- pull (decode side): for each prefill rank holding some of this rank's KV heads, one
  ``agent.read`` of those heads of the request's blocks, all layers included, with descriptor
  lists built once per (prefill rank, head range); then the blocks' generation words, a read that
  carries the notification freeing the blocks (:mod:`kvx_vllm.pull`). Prefill workers' metadata
  comes from their side channels (:func:`kvx.discovery.fetch_metadata`);
- serve (prefill side): a finished request's blocks are held under a lease id until every decode
  rank that reads (or only notifies) this rank has notified, or the lease runs out; then their
  generation words are written, before vLLM may reuse them;
- offload: the pages of a block (block-outermost layouts) are gathered by one loopback transfer
  into a staging slot of ``sum(page)`` bytes, stored in a :class:`kvx.tiers.TieredStore` under the
  block's hash (and KV cache group), and scattered back the same way on a hit.

Transfers run on background threads; the forward pass never waits for them.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

import kvx
from kvx.tiers import DiskTier, HostTier, TieredStore
from kvx.tiers import events as kvx_events

from .config import KVXConnectorConfig
from .layerload import LayerLoad
from .metadata import (
    PARAMS_VERSION,
    KVXConnectorMetadata,
    KVXHandshakeMetadata,
    KVXWorkerMetadata,
    LayerLayout,
    LoadSpec,
    RecvSpec,
    SaveSpec,
)
from .plan import LayerGeom, PeerTables, layer_geometry, read_plan
from .pool import worker_pool_tier
from .pull import MAX_HOLD, Failed, Peer, Pull, note, parse_note
from .pushing import DecodePush, PrefillPush, split_notes
from .util import compat_info, compat_mismatch

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KVXWorker", "layer_layouts", "block_table"]

log = logging.getLogger(__name__)

_U64 = np.uint64


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def layer_layouts(kv_caches: dict[str, "torch.Tensor"], group_of: dict[str, int]) -> list[LayerLayout]:
    """Describe each layer's blocks: ``page`` bytes every ``stride`` bytes from ``base``.

    vLLM ≥ 0.30 packs K and V into a layer's page: the block dimension is outermost and a
    block's page is contiguous (``cache[b]``). Layers that share one tensor are listed once.
    """
    out: list[LayerLayout] = []
    seen: set[tuple[int, int]] = set()
    for name in sorted(kv_caches, key=_natural_key):
        t = kv_caches[name]
        if isinstance(t, (list, tuple)):
            raise NotImplementedError(f"layer {name}: state tuples (Mamba) are not supported by kvx_vllm yet")
        if t.dim() < 2:
            raise NotImplementedError(f"layer {name}: flat KV cache views are not supported by kvx_vllm yet")
        page_t = t[0]
        if not page_t.is_contiguous():
            raise NotImplementedError(f"layer {name}: a block's page is not contiguous (shape {tuple(t.shape)}, "
                                      f"stride {tuple(t.stride())}); kvx_vllm needs block-outermost layouts")
        key = (int(t.data_ptr()), int(t.shape[0]))
        if key in seen:
            continue
        seen.add(key)
        es = t.element_size()
        out.append(LayerLayout(name=name, base=int(t.data_ptr()), stride=int(t.stride(0)) * es,
                               page=int(page_t.numel()) * es, num_blocks=int(t.shape[0]),
                               group=int(group_of.get(name, 0))))
    return out


def block_table(layouts: list[LayerLayout], kind: kvx.MemoryKind, dev: int = 0
                ) -> tuple[kvx.DescList, dict[str, int]]:
    """All layers' pages as one DescList; returns it and each layer's first index in it."""
    addrs, lens, offsets = [], [], {}
    n = 0
    for lay in layouts:
        offsets[lay.name] = n
        b = np.arange(lay.num_blocks, dtype=_U64)
        addrs.append(_U64(lay.base) + b * _U64(lay.stride))
        lens.append(np.full(lay.num_blocks, lay.page, dtype=_U64))
        n += lay.num_blocks
    return (kvx.DescList.from_arrays(kind=kind, addr=np.concatenate(addrs), nbytes=np.concatenate(lens), dev=dev),
            offsets)


class _GroupStore:
    """The offload store of one KV cache group, with its staging slots."""

    def __init__(self, worker: "KVXWorker", group: int, layers: list[LayerLayout]) -> None:
        cfg = worker.cfg
        agent = worker.agent
        self.group = group
        self.layers = layers
        self.block_bytes = sum(lay.page for lay in layers)
        ngroups = max(1, len(worker.groups))
        tiers: list[Any] = [HostTier(nbytes=cfg.offload_host_bytes // ngroups)]
        if cfg.offload_disk_path:
            path = os.path.join(cfg.offload_disk_path, f"rank{worker.tp_rank}-group{group}")
            tiers.append(DiskTier(path, nbytes=cfg.offload_disk_bytes // ngroups))
        kw: dict[str, Any] = {"agent": agent}
        if cfg.offload_policy:
            kw["policy"] = cfg.offload_policy
        kw["remote"] = worker_pool_tier(worker, group, self.block_bytes)  # the cluster-wide pool, if any
        self.store = TieredStore(tiers, self.block_bytes, **kw)
        self.slots = max(1, cfg.staging_blocks)
        self.buf, self.reg, self.blocks, self.pieces = self._staging(agent)
        self.lw_reg: kvx.Registration | None = None
        if cfg.offload_layerwise and len(worker.kv_cache_config.kv_cache_groups) == 1:
            # a step's layer-wise loads, beside the background loads and saves (one KV cache
            # group only: see KVXScheduler.layerwise)
            self.lw_buf, self.lw_reg, self.lw_blocks, self.lw_pieces = self._staging(agent)
        self.layer_offsets = np.array([worker.offsets[lay.name] for lay in layers], dtype=np.int64)
        self._off = self.store.events.subscribe(worker._on_store_events)

    def _staging(self, agent: kvx.Agent) -> tuple[Any, kvx.Registration, kvx.PreparedList, kvx.PreparedList]:
        """``slots`` staging blocks: the buffer, its registration, the blocks, and every block's
        layer pages (block-major) as pieces."""
        layers = self.layers
        buf = kvx.alloc_host(self.slots * self.block_bytes)
        reg = agent.register(buf)
        blocks = agent.prepare(kvx.DescList.blocks(reg, self.block_bytes))
        base = int(reg.descs.addr[0])
        offs = np.cumsum([0] + [lay.page for lay in layers[:-1]]).astype(_U64)
        pages = np.array([lay.page for lay in layers], dtype=_U64)
        j = np.repeat(np.arange(self.slots, dtype=_U64), len(layers))
        pieces = agent.prepare(kvx.DescList.from_arrays(
            kind=kvx.MemoryKind.HOST, addr=_U64(base) + j * _U64(self.block_bytes) + np.tile(offs, self.slots),
            nbytes=np.tile(pages, self.slots)))
        return buf, reg, blocks, pieces

    def layer_idx(self, block_ids: list[int], slots: list[int], sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the KV block table and into the staging pieces of layers ``sel`` (indices
        into ``layers``) of ``block_ids`` staged in ``slots``: layer-major, block order within."""
        b = np.asarray(block_ids, dtype=np.int64)
        kv = (self.layer_offsets[sel][:, None] + b[None, :]).reshape(-1)
        pieces = (sel[:, None] + np.asarray(slots, dtype=np.int64)[None, :] * len(self.layers)).reshape(-1)
        return kv, pieces

    def _idx(self, block_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the KV block table and into the staging pieces, block-major."""
        b = np.asarray(block_ids, dtype=np.int64)
        kv = (b[:, None] + self.layer_offsets[None, :]).reshape(-1)
        pieces = np.arange(len(block_ids) * len(self.layers), dtype=np.int64)
        return kv, pieces

    def save(self, agent: kvx.Agent, table: kvx.PreparedList, keys: list[bytes], block_ids: list[int],
             timeout: float) -> int:
        stored = 0
        parent: bytes | None = None
        for s in range(0, len(keys), self.slots):
            ck, cb = keys[s:s + self.slots], block_ids[s:s + self.slots]
            kv, pieces = self._idx(cb)
            agent.write(table, kv, self.pieces, pieces).wait(timeout)
            stored += self.store.put(ck, self.blocks, np.arange(len(ck)), parent=parent, timeout=timeout)
            parent = ck[-1]
        return stored

    def load(self, agent: kvx.Agent, table: kvx.PreparedList, keys: list[bytes], block_ids: list[int],
             timeout: float) -> int:
        """Copy stored blocks into ``block_ids``; returns how many (a prefix) arrived."""
        done = 0
        for s in range(0, len(keys), self.slots):
            ck, cb = keys[s:s + self.slots], block_ids[s:s + self.slots]
            try:
                got = self.store.get(ck, self.blocks, np.arange(len(ck)), timeout=timeout)
            except kvx.BlockNotFound as exc:
                got = int(exc.args[1]) if len(exc.args) > 1 else 0
                log.warning("offload load: %s", exc.args[0] if exc.args else exc)
            if got:
                kv, pieces = self._idx(cb[:got])
                agent.read(table, kv, self.pieces, pieces).wait(timeout)
            done += got
            if got < len(ck):
                break
        return done

    def close(self) -> None:
        self._off()
        self.store.close()
        self.reg.release()
        if self.lw_reg is not None:
            self.lw_reg.release()


class KVXWorker:
    """Worker-side state of the connector (one per worker process)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 cfg: KVXConnectorConfig, tp_rank: int = 0) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.role = ktc.kv_role
        self.engine_id = str(ktc.engine_id)
        self.tp_rank = tp_rank
        self.pd = cfg.pd_enabled(self.role)
        self.offload = cfg.offload_enabled
        self.serves = self.pd and self.role in ("kv_producer", "kv_both")
        self.group_of: dict[str, int] = {}
        for g, grp in enumerate(kv_cache_config.kv_cache_groups):
            for name in grp.layer_names:
                self.group_of[name] = g
        self.groups = tuple(kv_cache_config.prefix_cacheable_group_ids) or (0,)
        self.compat = compat_info(vllm_config)
        name = f"kvx-vllm-{self.engine_id}-tp{tp_rank}-{os.getpid()}"
        listen = None
        if self.serves:
            port = cfg.side_channel_port + tp_rank if cfg.side_channel_port else 0
            listen = (cfg.side_channel_host, port)
        elif self.pd and cfg.push:  # prefill workers write into this one: it takes connections
            listen = (cfg.side_channel_host, 0)
        self.agent = kvx.Agent(name, kvx.AgentConfig(backends=tuple(cfg.backends), listen=listen,
                                                     handshake_timeout=cfg.handshake_timeout_s))
        self.side: Any = None
        self.host = ""
        self.port = 0
        if self.serves:
            from kvx.discovery import SideChannel

            assert listen is not None
            self.side = SideChannel(self.agent, *listen)
            self.host = cfg.advertised_host()
            self.port = int(self.side.address[1])
            log.info("kvx_vllm: worker %s serves blocks on %s:%d", name, self.host, self.port)
        self.layouts: list[LayerLayout] = []
        self.kind = kvx.MemoryKind.HOST
        self.dev = 0
        self.offsets: dict[str, int] = {}
        self.table: kvx.PreparedList | None = None
        self._regs: list[kvx.Registration] = []
        self._stores: dict[int, _GroupStore] = {}
        self._layer_of: dict[str, tuple[int, int]] = {}  # layer name -> (group, index in its store)
        self._lw: LayerLoad | None = None  # this step's layer-wise offload loads
        self._lw_prev: LayerLoad | None = None  # the previous step's (its thread may still read)
        self._peers: dict[str, Peer] = {}
        self._peer_lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}  # peer name -> held while connecting it
        self._pull_pool = ThreadPoolExecutor(4, thread_name_prefix="kvx-vllm-pull")
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvx-vllm-store")
        self._recv: dict[str, Future[list[int]]] = {}  # req -> future of failed block ids
        self._recv_blocks: dict[str, list[int]] = {}
        self._saves: dict[str, Future[Any]] = {}
        # prefill side: req -> [lease deadline, lease id, block ids, ranks heard from, ranks expected]
        self._sending: dict[str, list[Any]] = {}
        # notifications that came before their send spec: req -> [time, peers heard from, expected]
        self._early: dict[str, list[Any]] = {}
        self._gen_reg: kvx.Registration | None = None
        self._gen_view = np.zeros(0, dtype=_U64)  # prefill: block -> generation; decode: scratch
        self._gen_cnt = np.zeros(0, dtype=np.int64)  # prefill: leases holding each block
        self._gen_max = np.zeros(0, dtype=_U64)  # prefill: largest lease id of the holding
        self._gen_local: Any = None  # decode: the scratch slots, prepared
        self._gen_next = 0
        self._gen_lock = threading.Lock()
        self.geoms: list[LayerGeom] = []
        self._plans: dict[int, tuple[list[tuple[int, int, int, int]], dict[int, int]]] = {}
        self._done_send: set[str] = set()
        self._finished_seen: set[str] = set()
        self._invalid: set[int] = set()
        self._events_lock = threading.Lock()
        self._events: list[tuple[str, list[bytes], bytes | None, str]] = []
        # push mode (set up once the KV caches are registered)
        self.push_prefill: PrefillPush | None = None
        self.push_decode: DecodePush | None = None
        self._stash: dict[str, list[bytes]] = {}  # drained notifications that are not push messages
        self._push_notes: dict[str, list[bytes]] = {}  # decode: drained push messages
        #: counters since start: pulls and pulled blocks (decode side), their total seconds, the
        #: seconds of those spent posting their reads (index work and kvx posts, a new peer's
        #: descriptor lists the first time); offload blocks loaded, and blocks saved
        self.stats: dict[str, float] = {"pulls": 0, "pulled_blocks": 0, "pull_s": 0.0, "post_s": 0.0,
                                        "pull_failures": 0, "loaded_blocks": 0, "saved_blocks": 0,
                                        "layer_loads": 0, "layer_load_s": 0.0, "layer_wait_s": 0.0,
                                        "layer_load_failures": 0}
        #: layer-wise steps: (seconds from start_load_kv to the last wait_for_layer_load, seconds
        #: blocked in wait_for_layer_load) of the latest steps
        self.layer_steps: list[tuple[float, float]] = []
        #: whole offload loads: seconds from start_load_kv to the request's last block in place
        self.whole_loads: list[float] = []

    # ------------------------------------------------------------------------------------------
    def _spec_of(self, name: str) -> Any:
        g = self.group_of.get(name, 0)
        spec = self.kv_cache_config.kv_cache_groups[g].kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        return per_layer[name] if isinstance(per_layer, dict) and name in per_layer else spec

    def _geometries(self, kv_caches: dict[str, "torch.Tensor"]) -> list[LayerGeom]:
        out: list[LayerGeom] = []
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name in sorted(kv_caches, key=_natural_key):
            t = kv_caches[name]
            if isinstance(t, (list, tuple)):
                raise NotImplementedError(f"layer {name}: state tuples (Mamba) are not supported by kvx_vllm yet")
            key = (int(t.data_ptr()), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            spec = self._spec_of(name)
            mla = type(spec).__name__.startswith("MLA") or bool(self.compat.get("mla"))
            out.append(layer_geometry(name, t, self.group_of.get(name, 0), int(spec.block_size),
                                      int(getattr(spec, "num_kv_heads", 1)), int(spec.head_size), mla))
        return out

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """Register the KV caches' storage with kvx, describe every layer's cells for transfers
        (:mod:`kvx_vllm.plan`) and, for offloading, build the block table of pages."""
        if not kv_caches:
            raise ValueError("no KV cache layer to register")
        if self.pd:
            self.geoms = self._geometries(kv_caches)
        if self.offload:
            self.layouts = layer_layouts(kv_caches, self.group_of)
        t0 = next(iter(kv_caches.values()))
        kind = kvx.MemoryKind.CUDA if t0.device.type == "cuda" else kvx.MemoryKind.HOST
        dev = int(t0.device.index or 0) if kind == kvx.MemoryKind.CUDA else 0
        storages: dict[int, int] = {}
        for t in kv_caches.values():
            st = t.untyped_storage()
            storages.setdefault(int(st.data_ptr()), int(st.nbytes()))
        regions = [kvx.RawRegion(a, n, kind, dev) for a, n in sorted(storages.items())]
        self._regs.append(self.agent.register(regions))
        self._kv_refs = list(kv_caches.values())  # keep the memory alive while registered
        if self.layouts:
            descs, self.offsets = block_table(self.layouts, kind, dev)
            self.table = self.agent.prepare(descs)
        self.kind, self.dev = kind, dev
        nb = max([g.num_blocks for g in self.geoms] or [0])
        if self.serves and nb:
            # one generation word per block (published in the handshake): a decode worker reads
            # it after its pull to learn whether the block was released meanwhile
            buf = kvx.alloc_host(8 * nb)
            self._gen_view = np.frombuffer(buf, dtype=_U64, count=nb)
            self._gen_view[:] = 0
            self._gen_cnt = np.zeros(nb, dtype=np.int64)
            self._gen_max = np.zeros(nb, dtype=_U64)
            self._gen_buf = buf
            self._gen_reg = self.agent.register(buf)
        elif self.pd and not self.serves:
            n = 1 << 16
            buf = kvx.alloc_host(8 * n)
            self._gen_view = np.frombuffer(buf, dtype=_U64, count=n)
            self._gen_buf = buf
            self._gen_reg = self.agent.register(buf)
            base = _U64(int(self._gen_reg.descs.addr[0]))
            self._gen_local = self.agent.prepare(kvx.DescList.from_arrays(
                kind=kvx.MemoryKind.HOST, addr=base + np.arange(n, dtype=_U64) * _U64(8),
                nbytes=np.full(n, 8, dtype=_U64)))
        if self.offload:
            for g in self.groups:
                layers = [lay for lay in self.layouts if lay.group == g]
                if layers:
                    self._stores[g] = _GroupStore(self, g, layers)
                    pos = {lay.name: i for i, lay in enumerate(layers)}
                    first = {(int(kv_caches[n].data_ptr()), int(kv_caches[n].shape[0])): n for n in pos}
                    for name, t in kv_caches.items():  # layers sharing a tensor wait for its owner
                        owner = first.get((int(t.data_ptr()), int(t.shape[0])))
                        if owner is not None:
                            self._layer_of[name] = (g, pos[owner])
        if self.pd and self.cfg.push and self.geoms:
            if self.serves:
                self.push_prefill = PrefillPush(self)
            else:
                self.push_decode = DecodePush(self)
        log.info("kvx_vllm: registered %d layers with %s", len(kv_caches), self.agent)

    def handshake_metadata(self) -> KVXHandshakeMetadata | None:
        """What the scheduler puts into kv_transfer_params so decode instances can pull."""
        if not self.serves or not self.geoms or self._gen_reg is None:
            return None
        return KVXHandshakeMetadata(agent_name=self.agent.name, host=self.host, port=self.port,
                                    tp_rank=self.tp_rank, layout=[g.to_list() for g in self.geoms],
                                    compat={"kind": int(self.kind), "dev": self.dev,
                                            "gen": [int(self._gen_reg.descs.addr[0]), int(self._gen_view.size)]})

    # ------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVXConnectorMetadata) -> None:
        """Start this step's pulls and offload loads in the background."""
        if meta.announce:
            # what the stores hold (a disk tier recovered at start-up included) reaches the
            # scheduler with this step's worker metadata
            for st in self._stores.values():
                st.store.announce()
        for spec in meta.recv:
            if self.push_decode is not None and spec.params.get("kvx_push"):
                if spec.params.get("kvx_push_abort"):
                    self.push_decode.abort(spec)
                elif any(spec.local_block_ids):
                    self.push_decode.start(spec)
                continue
            ids = [b for g in spec.local_block_ids for b in g]
            self._recv_blocks[spec.req_id] = ids
            fut = self._start_pull(spec) if ids else self._pull_pool.submit(self._pull, spec)
            if ids:
                self._recv[spec.req_id] = fut  # type: ignore[assignment]
        for params in meta.heartbeat:
            self._pull_pool.submit(self._heartbeat, params)
        layerwise = []
        for lspec in meta.load:
            if lspec.layerwise:
                layerwise.append(lspec)
                continue
            self._recv_blocks[lspec.req_id] = [b for g in lspec.block_ids for b in g]
            self._recv[lspec.req_id] = self._store_pool.submit(self._load, lspec, time.monotonic())
        if layerwise and not all(st.lw_reg is not None for st in self._stores.values()):
            # scheduled as synchronous loads, which this worker cannot serve: recompute them
            log.error("kvx_vllm: layer-wise loads for a worker without layer-wise staging; %d requests "
                      "recompute", len(layerwise))
            self._invalid.update(b for sp in layerwise for ids in sp.block_ids for b in ids)
        elif layerwise:
            self._start_layer_load(layerwise)

    def _start_layer_load(self, specs: list[LoadSpec]) -> None:
        """Post this step's layer-wise loads (:mod:`kvx_vllm.layerload`)."""
        if self._lw is not None:  # a step that ended without reporting (never in vLLM)
            self._invalid.update(self._finish_layer_load())
        prev = self._lw_prev
        if prev is not None and not prev.join(self.cfg.load_timeout_s):
            # its tier read still fills the staging slots: this step's loads cannot use them
            log.error("kvx_vllm: a layer-wise load is still reading after its bound; %d requests recompute",
                      len(specs))
            self._invalid.update(b for sp in specs for ids in sp.block_ids for b in ids)
            return
        self._lw = LayerLoad(self, specs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise offload: wait (bounded) for this layer's pages of this step's loads."""
        lw = self._lw
        if lw is None:
            return
        where = self._layer_of.get(layer_name)
        if where is not None and where[0] in lw.parts:
            lw.wait(*where)

    def _finish_layer_load(self) -> set[int]:
        """End the step's layer-wise loads: the blocks that did not arrive for sure."""
        lw, self._lw = self._lw, None
        if lw is None:
            return set()
        self._lw_prev = lw
        bad = lw.finish()
        self._count(layer_loads=1, layer_load_s=lw.last_wait - lw.t0, layer_wait_s=lw.wait_s,
                    loaded_blocks=lw.loaded_blocks(bad), layer_load_failures=1 if bad else 0)
        self.layer_steps = self.layer_steps[-999:] + [(lw.last_wait - lw.t0, lw.wait_s)]
        return bad

    def save_layer(self, meta: KVXConnectorMetadata, layer_name: str) -> None:
        """``save_kv_layer``: push mode's writes of this layer (prefill side)."""
        if self.push_prefill is not None:
            self.push_prefill.on_layer(layer_name, meta.push)

    def _take_notes(self, wait: float = 0.0) -> None:
        """Drain the agent's notifications (waiting up to ``wait`` seconds for one): push
        messages go to push mode, the rest (lease notes) wait for :meth:`get_transfer_results`."""
        notes = self.agent.notifications(timeout=wait) if wait > 0 else self.agent.notifications()
        if not notes:
            return
        if self.push_prefill is not None or self.push_decode is not None:
            push, notes = split_notes(notes)
            if push and self.push_prefill is not None:
                self.push_prefill.handle(push)
            elif push:
                for peer, msgs in push.items():
                    self._push_notes.setdefault(peer, []).extend(msgs)
        for peer, msgs in notes.items():
            self._stash.setdefault(peer, []).extend(msgs)

    def wait_for_save(self, meta: KVXConnectorMetadata) -> None:
        """Queue this step's offload saves; start the leases of blocks kept for decode."""
        if self.push_prefill is not None:
            self.push_prefill.end_pass()
        for spec in meta.save:
            self._saves[spec.req_id] = self._store_pool.submit(self._save, spec)
        now = time.monotonic()
        for send in meta.send:
            ids = np.asarray(send.block_ids, dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < self._gen_cnt.size)]
            self._gen_cnt[ids] += 1
            self._gen_max[ids] = np.maximum(self._gen_max[ids], _U64(send.lease))
            # [deadline, lease id, blocks, decode peers heard from, expected, lease_s, latest deadline]
            st: list[Any] = [now + send.lease_s, send.lease, ids, set(), 1 << 30, send.lease_s,
                             now + MAX_HOLD * send.lease_s]
            early = self._early.pop(send.req_id, None)
            if early is not None:
                st[3], st[4] = early[1], early[2]
            self._sending[send.req_id] = st
            if send.push and self.push_prefill is not None:
                if self.push_prefill.finished(send):
                    self._release(send.req_id)
            elif len(st[3]) >= st[4]:
                self._release(send.req_id)

    def get_transfer_results(self, finished_req_ids: set[str], idle_wait_s: float = 0.0
                             ) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call; with
        ``idle_wait_s`` (push mode, a step that computes nothing) wait that long for a message."""
        self._finished_seen |= finished_req_ids
        self._take_notes(min(idle_wait_s, 0.05))
        now = time.monotonic()
        notes, self._stash = self._stash, {}
        for peer, msgs in notes.items():
            for m in msgs:
                parsed = parse_note(m)
                if parsed is None:
                    log.warning("kvx_vllm: malformed notification from %s ignored", peer)
                    continue
                rid, n = parsed
                st = self._sending.get(rid)
                if n == 0:  # a heartbeat: the decode instance still wants the blocks
                    if st is not None:
                        st[0] = min(max(st[0], now + float(st[5])), st[6])
                    continue
                if st is None:
                    st = self._early.setdefault(rid, [now, set(), n])
                    st[1].add(peer)
                    continue
                st[3].add(peer)
                st[4] = n
                if len(st[3]) >= n:
                    self._release(rid)
        if self.push_prefill is not None:
            for rid in self.push_prefill.poll():
                if rid in self._sending:
                    self._release(rid)
        for rid, st in list(self._sending.items()):
            if st[0] <= now:
                self._release(rid)
                log.warning("kvx_vllm: request %s: no decode instance read its blocks within the %.0f s "
                            "lease; freeing them", rid, self.cfg.lease_s)
        for rid, st in list(self._early.items()):
            if now - st[0] > 2 * self.cfg.lease_s:
                del self._early[rid]
        for rid, fut in list(self._saves.items()):
            if fut.done():
                del self._saves[rid]
                exc = fut.exception()
                if exc is not None:
                    log.warning("kvx_vllm: offloading request %s failed: %s", rid, exc)
                self._done_send.add(rid)
        sending = {r for r in self._done_send
                   if r in self._finished_seen and r not in self._sending and r not in self._saves}
        self._done_send -= sending
        self._finished_seen -= sending
        recving: set[str] = set()
        failed: set[str] = set()
        if self.push_decode is not None:
            pnotes, self._push_notes = self._push_notes, {}
            precv, pfailed, psend, pbad = self.push_decode.poll(pnotes)
            recving |= precv
            sending |= psend
            self._invalid.update(pbad)
            if len(self.kv_cache_config.kv_cache_groups) > 1:
                failed |= pfailed
        for rid, fut in list(self._recv.items()):
            if not fut.done():
                continue
            del self._recv[rid]
            recving.add(rid)
            blocks = self._recv_blocks.pop(rid, [])
            try:
                bad = fut.result()
            except Exception as exc:
                log.warning("kvx_vllm: loading request %s failed: %s", rid, exc)
                bad = blocks
            if bad:
                self._invalid.update(bad)
                if len(bad) == len(blocks) and len(self.kv_cache_config.kv_cache_groups) > 1:
                    failed.add(rid)
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (single KV cache group only); ends the
        step's layer-wise loads (called after the forward pass)."""
        self._invalid.update(self._finish_layer_load())
        bad, self._invalid = self._invalid, set()
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            return set()
        return bad

    def build_worker_meta(self) -> KVXWorkerMetadata | None:
        """The offload stores' events and the push registrations received since the last call."""
        with self._events_lock:
            ev, self._events = self._events, []
        reg = self.push_prefill.registered() if self.push_prefill is not None else []
        if not ev and not reg:
            return None
        return KVXWorkerMetadata({self.tp_rank: ev} if ev else {}, {self.tp_rank: reg} if reg else {})

    def _on_store_events(self, events: list[kvx_events.Event]) -> None:
        out: list[tuple[str, list[bytes], bytes | None, str]] = []
        for e in events:
            if isinstance(e, kvx_events.BlockStored):
                out.append(("stored", [bytes(k) for k in e.block_hashes],  # type: ignore[arg-type]
                            bytes(e.parent_block_hash) if e.parent_block_hash is not None else None,  # type: ignore[arg-type]
                            e.medium))
            elif isinstance(e, kvx_events.BlockRemoved):
                out.append(("removed", [bytes(k) for k in e.block_hashes], None, e.medium))  # type: ignore[arg-type]
        with self._events_lock:
            self._events.extend(out)

    def _count(self, **kw: float) -> None:
        with self._events_lock:
            for k, v in kw.items():
                self.stats[k] += v

    # ------------------------------------------------------------------------------------------
    def _release(self, rid: str) -> None:
        """End a request's lease: blocks no other lease holds get the largest lease id they were
        held under as their generation, before vLLM may reuse them."""
        st = self._sending.pop(rid)
        ids = st[2]
        self._gen_cnt[ids] -= 1
        free = ids[self._gen_cnt[ids] <= 0]
        self._gen_cnt[free] = 0
        self._gen_view[free] = self._gen_max[free]
        self._gen_max[free] = 0
        self._done_send.add(rid)

    def _heartbeat(self, params: dict[str, Any]) -> None:
        """Tell every prefill worker of a queued request to extend its lease."""
        try:
            spec = RecvSpec(str(params.get("remote_request_id")), [], [], params)
            reads, notify, payload = self._check_params(spec)
            rid = str(params["remote_request_id"])
            for e in [e for e, *_ in reads] + notify:
                self.agent.notify(self._peer(e).name, note(rid, 0))
        except Exception as exc:
            log.warning("kvx_vllm: heartbeat for %s failed: %s", params.get("remote_request_id"), exc)

    def _slots(self, n: int) -> int:
        """``n`` consecutive generation scratch slots (a ring; a pull holds them for milliseconds)."""
        size = self._gen_view.size
        if n > size:
            raise kvx.UsageError(f"a pull of {n} blocks from one worker exceeds the {size} generation slots")
        with self._gen_lock:
            if self._gen_next + n > size:
                self._gen_next = 0
            first = self._gen_next
            self._gen_next += n
        return first

    def _notify_all(self, peers: list[str], payload: dict[str, bytes]) -> None:
        for name in peers:
            try:
                self.agent.notify(name, payload[name])
            except Exception as exc:
                log.warning("kvx_vllm: notifying %s failed: %s", name, exc)

    def _peer(self, entry: list[Any]) -> Peer:
        """The prefill worker of ``entry``, connected once however many pulls ask for it at once.

        A burst of requests to a fresh decode instance starts several pulls from the same prefill
        worker together; the first connects (side channel, ``add_peer``, ``prepare``) while the
        others wait on that peer's lock and then share the connection.
        """
        from kvx.discovery import fetch_metadata

        name, host, port, layout, winfo = entry
        with self._peer_lock:
            p = self._peers.get(name)
            if p is not None:
                return p
            connecting = self._connecting.setdefault(name, threading.Lock())
        with connecting:
            with self._peer_lock:
                p = self._peers.get(name)
            if p is not None:
                return p
            winfo = winfo if isinstance(winfo, dict) else {}
            meta = fetch_metadata(host, int(port), timeout=min(self.cfg.handshake_timeout_s, self.cfg.load_timeout_s))
            pname = self.agent.add_peer(meta)
            if pname != name:
                raise kvx.ProtocolError(f"the side channel at {host}:{port} serves agent {pname!r}, not {name!r}")
            if not isinstance(layout, list) or len(layout) > 1 << 16:
                raise kvx.ProtocolError("malformed layer list from the prefill instance")
            geoms = [LayerGeom.from_list(v) for v in layout]
            gen = None
            g = winfo.get("gen")
            most = max([geo.num_blocks for geo in geoms] or [0])
            if (isinstance(g, list) and len(g) == 2 and all(isinstance(x, int) for x in g)
                    and 0 < g[0] < 1 << 62 and 0 < g[1] <= most):
                gen = self.agent.prepare(kvx.DescList.from_arrays(
                    kind=kvx.MemoryKind.HOST, addr=_U64(g[0]) + np.arange(g[1], dtype=_U64) * _U64(8),
                    nbytes=np.full(g[1], 8, dtype=_U64)), peer=pname)
            p = Peer(pname, geoms, kvx.MemoryKind(int(winfo.get("kind", int(self.kind)))), int(winfo.get("dev", 0)),
                      gen)
            with self._peer_lock:
                self._peers[name] = p
            return p

    def _tables(self, peer: Peer, lh0: int, rh0: int, nh: int) -> tuple[PeerTables, Any, Any]:
        key = (lh0, rh0, nh)
        t = peer.tables.get(key)
        if t is None:
            tabs = PeerTables(self.geoms, peer.geoms, lh0, rh0, nh, self.kind, self.dev, peer.kind, peer.dev)
            t = (tabs, self.agent.prepare(tabs.local_descs), self.agent.prepare(tabs.remote_descs, peer=peer.name))
            with self._peer_lock:
                peer.tables[key] = t
        return t

    def _forget_peer(self, name: str) -> None:
        with self._peer_lock:
            self._peers.pop(name, None)
        try:
            self.agent.remove_peer(name)
        except kvx.KVXError:
            log.debug("removing peer %s", name, exc_info=True)

    def _check_params(self, spec: RecvSpec
                      ) -> tuple[list[tuple[list[Any], int, int, int]], list[list[Any]], dict[str, bytes]]:
        """Check a request's kv_transfer_params; returns what to read (prefill worker entry and
        head range), the workers only to notify, and the notification payload (which carries how
        many decode workers each prefill worker hears from)."""
        params = spec.params
        if params.get("kvx_version") != PARAMS_VERSION:
            raise kvx.ProtocolError(f"kv_transfer_params of version {params.get('kvx_version')!r}, "
                                    f"expected {PARAMS_VERSION}")
        why = compat_mismatch(self.compat, params.get("kvx_compat"), self.cfg.check_model_name)
        if why:
            raise kvx.ProtocolError(f"prefill instance is incompatible: {why}")
        theirs = params["kvx_compat"]
        tp_remote = int(theirs["tp_size"])
        agents = params.get("remote_agents")
        if not isinstance(agents, dict):
            raise kvx.ProtocolError("remote_agents must be a dict")
        plan = self._plans.get(tp_remote)
        if plan is None:
            heads = 1 if self.compat.get("mla") else int(self.compat["num_kv_heads"])
            plan = self._plans[tp_remote] = read_plan(heads, int(self.compat["tp_size"]), self.tp_rank, tp_remote)
        reads, notify = plan

        def entry(r: int) -> list[Any]:
            e = agents.get(str(r))
            if not isinstance(e, (list, tuple)) or len(e) != 5:
                raise kvx.ProtocolError(f"the prefill instance lists no worker of rank {r}")
            return list(e)

        read_ranks = {r for r, *_ in reads}
        rid = str(params["remote_request_id"])
        # each prefill worker learns how many decode workers it will hear from for the request
        payload = {str(entry(r)[0]): note(rid, n) for r, n in notify.items()}
        return ([(entry(r), lh0, rh0, nh) for r, lh0, rh0, nh in reads],
                [entry(r) for r in sorted(notify) if r not in read_ranks], payload)

    def _groups(self, spec: RecvSpec) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        pos = spec.local_pos or [list(range(len(g))) for g in spec.local_block_ids]
        return [(np.asarray(lids, dtype=np.int64), np.asarray(lp, dtype=np.int64), np.asarray(rids, dtype=np.int64))
                for lids, lp, rids in zip(spec.local_block_ids, pos, spec.remote_block_ids)]

    def _post(self, spec: RecvSpec, reads: list[tuple[list[Any], int, int, int]], notify: list[list[Any]],
              payload: dict[str, bytes], connect: bool) -> "Pull | None":
        """Post a request's reads (None: a prefill worker is not connected and ``connect`` is off)."""
        groups = self._groups(spec)
        posted: list[tuple[Peer, Any, np.ndarray]] = []
        peers = []
        for e, lh0, rh0, nh in reads:
            with self._peer_lock:
                peer = self._peers.get(e[0])
            if peer is None:
                if not connect:
                    return None
                peer = self._peer(e)
            if not connect and (lh0, rh0, nh) not in peer.tables:
                return None  # its descriptor lists are built on a pool thread, not the engine's
            peers.append((peer, lh0, rh0, nh))
        others = []
        for e in notify:
            with self._peer_lock:
                peer = self._peers.get(e[0])
            if peer is None:
                if not connect:
                    return None
                peer = self._peer(e)
            others.append(peer.name)
        pull = Pull(self, spec, posted, others, payload)
        t0 = time.perf_counter()
        try:
            for peer, lh0, rh0, nh in peers:
                tabs, local, remote = self._tables(peer, lh0, rh0, nh)
                li, ri, rblocks = tabs.indices(groups)
                posted.append((peer, self.agent.read(local, li, remote, ri) if li.size else None, rblocks))
        except Exception as exc:
            pull._fail(exc)
        self._count(post_s=time.perf_counter() - t0)
        return pull

    def _pull_failed(self, spec: RecvSpec, exc: BaseException) -> None:
        params = spec.params
        log.error("kvx_vllm: pulling request %s from %s failed: %s", spec.req_id, params.get("remote_host"), exc)
        self._count(pull_failures=1)
        if isinstance(exc, kvx.PeerDisconnected):
            for e in (params.get("remote_agents") or {}).values():
                if isinstance(e, (list, tuple)) and e and isinstance(e[0], str):
                    self._forget_peer(e[0])

    def _start_pull(self, spec: RecvSpec) -> "Future[list[int]] | Pull | Failed":
        """Post the pull of a request whose prefill workers are connected already, here and now
        (nonblocking kvx reads that ``get_transfer_results`` polls: no thread hand-off); one whose
        workers are not all connected yet is connected on a pool thread, which then pulls."""
        local = [b for g in spec.local_block_ids for b in g]
        try:
            reads, notify, payload = self._check_params(spec)
            pull = self._post(spec, reads, notify, payload, connect=False)
        except Exception as exc:
            self._pull_failed(spec, exc)
            return Failed(local)
        if pull is None:
            return self._pull_pool.submit(self._pull, spec)
        return pull

    def _pull(self, spec: RecvSpec) -> list[int]:
        """Pull one request's blocks (connecting its prefill workers first if needed) and wait;
        returns the blocks that failed. With no local blocks, only notify."""
        local = [b for g in spec.local_block_ids for b in g]
        try:
            reads, notify, payload = self._check_params(spec)
            if not local:
                peers = [self._peer(e).name for e, *_ in reads] + [self._peer(e).name for e in notify]
                self._notify_all(peers, payload)
                return []
            pull = self._post(spec, reads, notify, payload, connect=True)
            assert pull is not None
        except Exception as exc:
            self._pull_failed(spec, exc)
            return local
        while not pull.done(block=True):  # done() fails the pull itself past its deadline
            pass
        return pull.result()

    def _load(self, spec: LoadSpec, t0: float | None = None) -> list[int]:
        assert self.table is not None
        bad: list[int] = []
        for g, keys, ids in zip(self.groups, spec.keys, spec.block_ids):
            st = self._stores.get(g)
            try:
                got = st.load(self.agent, self.table, keys, ids, self.cfg.load_timeout_s) if st else 0
            except Exception as exc:
                log.error("kvx_vllm: offload load of request %s failed: %s", spec.req_id, exc)
                got = 0
            bad.extend(ids[got:])
            self._count(loaded_blocks=got)
        if t0 is not None:
            with self._events_lock:
                self.whole_loads = self.whole_loads[-999:] + [time.monotonic() - t0]
        return bad

    def _save(self, spec: SaveSpec) -> int:
        assert self.table is not None
        n = 0
        for g, keys, ids in zip(self.groups, spec.keys, spec.block_ids):
            st = self._stores.get(g)
            if st is not None and keys:
                n += st.save(self.agent, self.table, keys, ids, self.cfg.load_timeout_s)
        self._count(saved_blocks=n)
        return n

    # ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the background threads and release everything kvx holds."""
        if self.push_prefill is not None:
            self.push_prefill.close()
        self._finish_layer_load()
        if self._lw_prev is not None:
            self._lw_prev.join(self.cfg.load_timeout_s)
        self._pull_pool.shutdown(wait=True, cancel_futures=True)
        self._store_pool.shutdown(wait=True, cancel_futures=True)
        for st in self._stores.values():
            try:
                st.close()
            except Exception:
                log.exception("closing an offload store")
        self._stores.clear()
        if self.side is not None:
            self.side.close()
            self.side = None
        for r in self._regs:
            r.release()
        self._regs.clear()
        if self._gen_reg is not None:
            self._gen_reg.release()
            self._gen_reg = None
        self.agent.close()
