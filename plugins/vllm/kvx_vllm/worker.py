"""The worker-side half of :class:`kvx_vllm.KVXConnector`: moves the bytes with kvx.

Every attention layer's cache is registered once with a kvx :class:`~kvx.Agent` (its backing
storage, so views and packed allocations work) and described as one block table: descriptor
``offset[layer] + block`` is that layer's page of ``block``. A request's blocks, all layers
included, then move in one kvx transfer:

- pull (decode side): ``agent.read(local_table, idx, remote_table, ridx, notify=request_id)``
  against the prefill worker, whose metadata comes from its side channel
  (:func:`kvx.discovery.fetch_metadata`); the notification tells it to free the blocks;
- offload: the pages of a block are gathered by one loopback transfer into a staging slot of
  ``sum(page)`` bytes, stored in a :class:`kvx.tiers.TieredStore` under the block's hash (and
  KV cache group), and scattered back the same way on a hit.

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


class _Peer:
    """A prefill worker this decode worker pulls from."""

    __slots__ = ("layouts", "name", "offsets", "table")

    def __init__(self, name: str, table: kvx.PreparedList, offsets: dict[str, int],
                 layouts: dict[str, LayerLayout]) -> None:
        self.name = name
        self.table = table
        self.offsets = offsets
        self.layouts = layouts


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
        self.store = TieredStore(tiers, self.block_bytes, **kw)
        self.slots = max(1, cfg.staging_blocks)
        self.buf = kvx.alloc_host(self.slots * self.block_bytes)
        self.reg = agent.register(self.buf)
        self.blocks = agent.prepare(kvx.DescList.blocks(self.reg, self.block_bytes))
        base = int(self.reg.descs.addr[0])
        offs = np.cumsum([0] + [lay.page for lay in layers[:-1]]).astype(_U64)
        pages = np.array([lay.page for lay in layers], dtype=_U64)
        j = np.repeat(np.arange(self.slots, dtype=_U64), len(layers))
        self.pieces = agent.prepare(kvx.DescList.from_arrays(
            kind=kvx.MemoryKind.HOST, addr=_U64(base) + j * _U64(self.block_bytes) + np.tile(offs, self.slots),
            nbytes=np.tile(pages, self.slots)))
        self.layer_offsets = np.array([worker.offsets[lay.name] for lay in layers], dtype=np.int64)
        self._off = self.store.events.subscribe(worker._on_store_events)

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


class _Posted:
    """A pull posted from the engine's thread: ``done``/``result`` like a Future, polled."""

    __slots__ = ("deadline", "local", "spec", "t0", "worker", "x")

    def __init__(self, x: Any, local: list[int], timeout: float, worker: "KVXWorker",
                 spec: RecvSpec | None = None) -> None:
        self.x, self.local, self.worker, self.spec = x, local, worker, spec
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout

    def done(self) -> bool:
        if self.x is None or self.x.done():
            return True
        if time.monotonic() > self.deadline:
            self.x.cancel()
            return True
        return False

    def result(self) -> list[int]:
        """The blocks that failed (none when the transfer is done)."""
        if self.x is None:
            return self.local
        if self.x.status is kvx.Status.DONE:
            self.worker._count(pulls=1, pulled_blocks=len(self.local), pull_s=time.monotonic() - self.t0)
            return []
        assert self.spec is not None
        self.worker._pull_failed(self.spec, self.x.error or kvx.TransferTimeout("pull timed out"))
        return self.local


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
        self.agent = kvx.Agent(name, kvx.AgentConfig(backends=tuple(cfg.backends), listen=listen))
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
        self._peers: dict[str, _Peer] = {}
        self._peer_lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}  # peer name -> held while connecting it
        self._pull_pool = ThreadPoolExecutor(4, thread_name_prefix="kvx-vllm-pull")
        self._store_pool = ThreadPoolExecutor(1, thread_name_prefix="kvx-vllm-store")
        self._recv: dict[str, Future[list[int]]] = {}  # req -> future of failed block ids
        self._recv_blocks: dict[str, list[int]] = {}
        self._saves: dict[str, Future[Any]] = {}
        self._sending: dict[str, float] = {}  # req -> lease deadline
        self._early: dict[str, float] = {}  # notifications that came before their send spec
        self._done_send: set[str] = set()
        self._finished_seen: set[str] = set()
        self._invalid: set[int] = set()
        self._events_lock = threading.Lock()
        self._events: list[tuple[str, list[bytes], bytes | None, str]] = []
        #: counters since start: pulls and pulled blocks (decode side), their total seconds;
        #: offload blocks loaded, and blocks saved
        self.stats: dict[str, float] = {"pulls": 0, "pulled_blocks": 0, "pull_s": 0.0, "pull_failures": 0,
                                        "loaded_blocks": 0, "saved_blocks": 0}

    # ------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """Register the KV caches' storage with kvx and build the block table."""
        self.layouts = layer_layouts(kv_caches, self.group_of)
        if not self.layouts:
            raise ValueError("no KV cache layer to register")
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
        descs, self.offsets = block_table(self.layouts, kind, dev)
        self.table = self.agent.prepare(descs)
        self.kind, self.dev = kind, dev
        self.compat = {**compat_info(self.vllm_config), "pages": {lay.name: lay.page for lay in self.layouts}}
        if self.offload:
            for g in self.groups:
                layers = [lay for lay in self.layouts if lay.group == g]
                if layers:
                    self._stores[g] = _GroupStore(self, g, layers)
        log.info("kvx_vllm: registered %d layers (%d blocks each, %d bytes a page) with %s",
                 len(self.layouts), self.layouts[0].num_blocks, self.layouts[0].page, self.agent)

    def handshake_metadata(self) -> KVXHandshakeMetadata | None:
        """What the scheduler puts into kv_transfer_params so decode instances can pull."""
        if not self.serves or not self.layouts:
            return None
        return KVXHandshakeMetadata(agent_name=self.agent.name, host=self.host, port=self.port,
                                    tp_rank=self.tp_rank, layout=[lay.to_list() for lay in self.layouts],
                                    compat={"pages": {lay.name: lay.page for lay in self.layouts},
                                            "kind": int(self.kind), "dev": self.dev})

    # ------------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVXConnectorMetadata) -> None:
        """Start this step's pulls and offload loads in the background."""
        if meta.announce:
            # what the stores hold (a disk tier recovered at start-up included) reaches the
            # scheduler with this step's worker metadata
            for st in self._stores.values():
                st.store.announce()
        for spec in meta.recv:
            ids = [b for g in spec.local_block_ids for b in g]
            self._recv_blocks[spec.req_id] = ids
            fut = self._start_pull(spec) if ids else self._pull_pool.submit(self._pull, spec)
            if ids:
                self._recv[spec.req_id] = fut  # type: ignore[assignment]
        for spec in meta.load:
            self._recv_blocks[spec.req_id] = [b for g in spec.block_ids for b in g]
            self._recv[spec.req_id] = self._store_pool.submit(self._load, spec)

    def wait_for_save(self, meta: KVXConnectorMetadata) -> None:
        """Queue this step's offload saves; start the leases of blocks kept for decode."""
        for spec in meta.save:
            self._saves[spec.req_id] = self._store_pool.submit(self._save, spec)
        now = time.monotonic()
        for send in meta.send:
            if self._early.pop(send.req_id, None) is not None:
                self._done_send.add(send.req_id)
            else:
                self._sending[send.req_id] = now + send.lease_s

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        self._finished_seen |= finished_req_ids
        now = time.monotonic()
        for _peer, msgs in self.agent.notifications().items():
            for m in msgs:
                rid = m.decode(errors="replace")
                if self._sending.pop(rid, None) is not None:
                    self._done_send.add(rid)
                else:
                    self._early[rid] = now
        for rid, deadline in list(self._sending.items()):
            if deadline <= now:
                del self._sending[rid]
                self._done_send.add(rid)
                log.warning("kvx_vllm: request %s: no decode instance read its blocks within the %.0f s "
                            "lease; freeing them", rid, self.cfg.lease_s)
        for rid, t in list(self._early.items()):
            if now - t > 2 * self.cfg.lease_s:
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
        """Blocks whose load failed since the last call (single KV cache group only)."""
        bad, self._invalid = self._invalid, set()
        if len(self.kv_cache_config.kv_cache_groups) > 1:
            return set()
        return bad

    def build_worker_meta(self) -> KVXWorkerMetadata | None:
        """The offload stores' events since the last call."""
        with self._events_lock:
            ev, self._events = self._events, []
        return KVXWorkerMetadata({self.tp_rank: ev}) if ev else None

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
    def _peer(self, name: str, host: str, port: int, layout: list[Any], winfo: dict[str, Any]) -> _Peer:
        """The prefill worker ``name``, connected once however many pulls ask for it at once.

        A burst of requests to a fresh decode instance starts several pulls from the same prefill
        worker together; the first connects (side channel, ``add_peer``, ``prepare``) while the
        others wait on that peer's lock and then share the connection.
        """
        from kvx.discovery import fetch_metadata

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
            meta = fetch_metadata(host, int(port), timeout=min(10.0, self.cfg.load_timeout_s))
            pname = self.agent.add_peer(meta)
            if pname != name:
                raise kvx.ProtocolError(f"the side channel at {host}:{port} serves agent {pname!r}, not {name!r}")
            layouts = [LayerLayout.from_list(v) for v in layout]
            descs, offsets = block_table(layouts, kvx.MemoryKind(int(winfo.get("kind", int(self.kind)))),
                                         int(winfo.get("dev", 0)))
            table = self.agent.prepare(descs, peer=pname)
            p = _Peer(pname, table, offsets, {lay.name: lay for lay in layouts})
            with self._peer_lock:
                self._peers[name] = p
            return p

    def _forget_peer(self, name: str) -> None:
        with self._peer_lock:
            self._peers.pop(name, None)
        try:
            self.agent.remove_peer(name)
        except kvx.KVXError:
            log.debug("removing peer %s", name, exc_info=True)

    def _check_params(self, spec: RecvSpec) -> tuple[list[Any], bytes]:
        """Check a request's kv_transfer_params; returns its prefill worker's entry and the
        notification payload."""
        params = spec.params
        if params.get("kvx_version") != PARAMS_VERSION:
            raise kvx.ProtocolError(f"kv_transfer_params of version {params.get('kvx_version')!r}, "
                                    f"expected {PARAMS_VERSION}")
        why = compat_mismatch({k: v for k, v in self.compat.items() if k != "pages"}, params.get("kvx_compat"),
                              self.cfg.check_model_name)
        if why:
            raise kvx.ProtocolError(f"prefill instance is incompatible: {why}")
        entry = params["remote_agents"].get(str(self.tp_rank))
        if entry is None:
            raise kvx.ProtocolError(f"the prefill instance lists no worker of rank {self.tp_rank}")
        pages = (entry[4] or {}).get("pages", {})
        if pages != self.compat.get("pages"):
            raise kvx.ProtocolError(f"KV page layout differs: prefill {pages}, decode {self.compat.get('pages')}")
        return list(entry), str(params["remote_request_id"]).encode()

    def _indices(self, spec: RecvSpec, peer: _Peer) -> tuple[np.ndarray, np.ndarray] | None:
        """Indices into the local and the peer's block tables (None: nothing to pull)."""
        lidx, ridx = [], []
        for g, (lids, rids) in enumerate(zip(spec.local_block_ids, spec.remote_block_ids)):
            if not lids:
                continue
            lb = np.asarray(lids, dtype=np.int64)
            rb = np.asarray(rids, dtype=np.int64)
            for lay in self.layouts:
                if lay.group != g:
                    continue
                rl = peer.layouts.get(lay.name)
                if rl is None:
                    raise kvx.ProtocolError(f"the prefill instance has no layer {lay.name!r}")
                if rb.size and int(rb.max()) >= rl.num_blocks:
                    raise kvx.ProtocolError("remote block id out of range")
                lidx.append(self.offsets[lay.name] + lb)
                ridx.append(peer.offsets[lay.name] + rb)
        if not lidx:
            return None
        return np.concatenate(lidx), np.concatenate(ridx)

    def _pull_failed(self, spec: RecvSpec, exc: BaseException) -> None:
        params = spec.params
        log.error("kvx_vllm: pulling request %s from %s failed: %s", spec.req_id, params.get("remote_host"), exc)
        self._count(pull_failures=1)
        entry = (params.get("remote_agents") or {}).get(str(self.tp_rank))
        if isinstance(exc, (kvx.PeerDisconnected, kvx.TransferError)) and entry:
            self._forget_peer(entry[0])

    def _start_pull(self, spec: RecvSpec) -> "Future[list[int]] | _Posted":
        """Post the pull of a request whose prefill worker is connected already, here and now (a
        nonblocking kvx read that ``get_transfer_results`` polls: no thread hand-off); a worker
        not connected yet is connected on a pool thread, which then pulls."""
        local = [b for g in spec.local_block_ids for b in g]
        try:
            entry, payload = self._check_params(spec)
            with self._peer_lock:
                peer = self._peers.get(entry[0])
            if peer is None:
                return self._pull_pool.submit(self._pull, spec)
            idx = self._indices(spec, peer)
            if idx is None:
                return self._pull_pool.submit(self._pull, spec)
            assert self.table is not None
            x = self.agent.read(self.table, idx[0], peer.table, idx[1], notify=payload)
        except Exception as exc:
            self._pull_failed(spec, exc)
            return _Posted(None, local, 0.0, self)
        return _Posted(x, local, self.cfg.load_timeout_s, self, spec)

    def _pull(self, spec: RecvSpec) -> list[int]:
        """Pull one request's blocks from its prefill worker (connecting it first if needed);
        returns the blocks that failed."""
        local = [b for g in spec.local_block_ids for b in g]
        try:
            entry, payload = self._check_params(spec)
            name, host, port, layout, wcompat = entry
            peer = self._peer(name, host, port, layout, wcompat or {})
            idx = self._indices(spec, peer)
            if idx is None:
                self.agent.notify(peer.name, payload)
                return []
            assert self.table is not None
            t0 = time.monotonic()
            x = self.agent.read(self.table, idx[0], peer.table, idx[1], notify=payload)
            x.wait(self.cfg.load_timeout_s)
            self._count(pulls=1, pulled_blocks=len(local), pull_s=time.monotonic() - t0)
            return []
        except Exception as exc:
            self._pull_failed(spec, exc)
            return local

    def _load(self, spec: LoadSpec) -> list[int]:
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
        self.agent.close()
