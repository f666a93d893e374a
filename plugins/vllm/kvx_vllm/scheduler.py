"""The scheduler-side half of :class:`kvx_vllm.KVXConnector`.

It decides, per request, what the workers move:

- **decode side** (``kv_transfer_params["do_remote_prefill"]``): every prompt token not found in
  the local prefix cache is pulled asynchronously from the prefill instance named in the params;
- **prefill side** (``"do_remote_decode"``): a finished request's blocks are kept (delay-free)
  and described in the returned kv_transfer_params until the decode instance has read them or
  the lease runs out;
- **push mode** (``transfer_mode: push``, :mod:`kvx_vllm.pushing`): a decode instance allocates a
  request's blocks at once and its workers register them with the prefill workers, which write
  the KV into them (during the forward pass when the registration came first, whole afterwards
  otherwise); a prefill instance holds a push request up to ``push_wait_s`` for that registration;
- **offloading**: finished requests' full blocks are stored in the workers' kvx TieredStores
  under vLLM's block hashes; later prompts whose prefix is stored load it back asynchronously.
  The scheduler mirrors what the stores hold from the events the workers report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from .config import KVXConnectorConfig
from .metadata import (
    KVXConnectorMetadata,
    KVXHandshakeMetadata,
    KVXWorkerMetadata,
    LoadSpec,
    PushSpec,
    RecvSpec,
    SaveSpec,
    SendSpec,
)
from .pool import PoolLookup
from .util import compat_info, remote_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVXScheduler", "REQUIRED_REMOTE_KEYS"]

log = logging.getLogger(__name__)

#: kv_transfer_params keys a decode instance needs to pull a request's blocks.
#: longest wait of an idle engine step for a push message (a message ends it at once)
IDLE_WAIT_S = 0.01

REQUIRED_REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                        "remote_port", "remote_agents")


class KVXScheduler:
    """Scheduler-side state of the connector (one per engine)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig",
                 cfg: KVXConnectorConfig) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.engine_id = str(ktc.engine_id)
        self.role = ktc.kv_role
        self.block_size = int(vllm_config.cache_config.block_size)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.pd = cfg.pd_enabled(self.role)
        self.offload = cfg.offload_enabled
        hbs = getattr(kv_cache_config, "hash_block_size", None)
        if self.offload and hbs not in (None, self.block_size):
            log.warning("kvx offloading is off: hash block size %s differs from block size %s",
                        hbs, self.block_size)
            self.offload = False
        self.groups = tuple(kv_cache_config.prefix_cacheable_group_ids) or (0,)
        # layer-wise offload loads are synchronous: vLLM maps a failed one back to its request
        # only through block ids, which are unique in a single KV cache group
        self.layerwise = self.offload and cfg.offload_layerwise
        if self.layerwise and len(kv_cache_config.kv_cache_groups) > 1:
            log.warning("offload_layerwise is off: %d KV cache groups (offloaded blocks load whole)",
                        len(kv_cache_config.kv_cache_groups))
            self.layerwise = False
        self._lw_budget = cfg.staging_blocks  # blocks this step may still load layer-wise
        self.compat = compat_info(vllm_config)
        #: the cluster-wide pool below the workers' stores: asked for what they do not hold
        self.pool = PoolLookup(cfg.pool, self.tp_size, self.groups) if self.offload and cfg.pool else None
        # tp_rank -> handshake metadata of the workers of this engine
        self.workers: dict[int, KVXHandshakeMetadata] = {}
        # step state, cleared by build_connector_meta
        self._recv: list[RecvSpec] = []
        self._load: list[LoadSpec] = []
        self._save: list[SaveSpec] = []
        self._send: list[SendSpec] = []
        # offload: key -> medium -> ranks whose store holds it there
        self._stored: dict[bytes, dict[str, set[int]]] = {}
        # request id -> (first block index, keys per group, layer-wise) planned by
        # get_num_new_matched_tokens
        self._planned: dict[str, tuple[int, list[list[bytes]], bool]] = {}
        self._events: list[KVCacheEvent] = []
        self._saving: set[str] = set()
        # ask the workers what their stores hold at the first step (the events of what a disk
        # tier recovered at start-up are drained by vLLM's warm-up runs before any real step)
        self._announce = True
        self._lease = 0
        # decode side: request id -> [kv_transfer_params, last heartbeat] while it waits for blocks
        self._waiting: dict[str, list[Any]] = {}
        # push mode. prefill side: request id -> push id; push id -> ranks that have its
        # registration; request id -> when it first asked to be scheduled; requests finished
        # whose writes are due. Decode side: request id -> push id while its writes are due.
        self.push = cfg.push and self.pd
        self._push_of: dict[str, str] = {}
        self._registered: dict[str, set[int]] = {}
        self._push_seen: dict[str, float] = {}
        self._push_sending: set[str] = set()
        self._push_recv: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------
    # handshake
    def set_worker_metadata(self, metadata: dict[int, Any]) -> None:
        """Workers' :class:`KVXHandshakeMetadata`, keyed by tensor-parallel rank."""
        for rank, meta in metadata.items():
            if isinstance(meta, KVXHandshakeMetadata):
                self.workers[int(rank)] = meta
            else:
                log.warning("ignoring handshake metadata of type %s from rank %s", type(meta).__name__, rank)

    # ------------------------------------------------------------------------------------------
    def _keys(self, request: "Request", first: int, n: int) -> list[list[bytes]]:
        hashes = request.block_hashes[first:first + n]
        return [[make_block_hash_with_group_id(h, g) for h in hashes] for g in self.groups]

    def _is_stored(self, keys: list[bytes]) -> bool:
        """Every rank holds every key (in some tier)."""
        want = self.tp_size
        for k in keys:
            media = self._stored.get(k)
            if not media:
                return False
            if want > 1 and len(set().union(*media.values())) < want:
                return False
        return True

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector can load, and whether async."""
        params = request.kv_transfer_params
        if self.push and params and params.get("kvx_push") and params.get("do_remote_decode"):
            if self._hold_for_registration(request.request_id, str(params["kvx_push"])):
                return None, False  # type: ignore[return-value]  # vLLM: ask again next step
        elif self.pd and params and params.get("do_remote_prefill"):
            if not all(k in params for k in REQUIRED_REMOTE_KEYS):
                log.warning("request %s asks for a remote prefill without the kvx parameters %s; "
                            "computing it locally", request.request_id, REQUIRED_REMOTE_KEYS)
                return 0, False
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if not params.get("kvx_push"):
                # queued until its blocks are allocated: heartbeats keep the prefill's lease alive
                self._waiting.setdefault(request.request_id, [params, time.monotonic()])
            return (count, True) if count > 0 else (0, False)
        self._planned.pop(request.request_id, None)
        if not self.offload or request.skip_reading_prefix_cache:
            return 0, False
        bs = self.block_size
        first = num_computed_tokens // bs
        # never cover the last prompt token: the model must compute at least one
        limit = max(0, (request.num_tokens - 1) // bs)
        n = 0
        end = min(limit, len(request.block_hashes))
        for i in range(first, end):
            if not self._is_stored([make_block_hash_with_group_id(request.block_hashes[i], g)
                                    for g in self.groups]):
                break
            n += 1
        if self.pool is not None and first + n < end:
            n += self.pool.lookup(self._keys(request, first + n, end - first - n))
        if n == 0:
            return 0, False
        # layer-wise: loaded in this step's forward pass, into staging slots the step shares
        sync = self.layerwise and n <= self._lw_budget
        if sync:
            self._lw_budget -= n
        self._planned[request.request_id] = (first, self._keys(request, first, n), sync)
        return (first + n) * bs - num_computed_tokens, not sync

    def _hold_for_registration(self, rid: str, push_id: str) -> bool:
        """Prefill side: whether a push request should wait (another step) for its decode
        workers' registration, so that its KV can be written during its forward pass."""
        self._push_of[rid] = push_id
        first = self._push_seen.setdefault(rid, time.monotonic())
        if len(self._registered.get(push_id, ())) >= self.tp_size:
            return False
        return time.monotonic() - first < self.cfg.push_wait_s

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Record the blocks allocated for a load planned by ``get_num_new_matched_tokens``."""
        params = request.kv_transfer_params
        rid = request.request_id
        self._waiting.pop(rid, None)
        if self.pd and params and params.get("do_remote_prefill"):
            if not all(k in params for k in REQUIRED_REMOTE_KEYS):
                return
            remote = _as_groups(params["remote_block_ids"])
            if params.get("kvx_push"):  # the prefill's blocks are its own business
                remote = [[] for _ in blocks.get_block_ids()]
                if num_external_tokens > 0:
                    self._push_recv[rid] = str(params["kvx_push"])
            local: list[list[int]] = [[] for _ in remote]
            pos: list[list[int]] = [[] for _ in remote]
            if num_external_tokens > 0:
                all_ids = blocks.get_block_ids()
                unhashed = blocks.get_unhashed_block_ids_all_groups()
                for g, (ids, new) in enumerate(zip(all_ids, unhashed)):
                    if g >= len(remote):
                        break
                    newset = set(new)
                    for p, bid in enumerate(ids):
                        if bid in newset:
                            local[g].append(bid)
                            pos[g].append(p)
            self._recv.append(RecvSpec(rid, local, remote, dict(params), pos))
            # a second call (after the load) must not pull again
            params["do_remote_prefill"] = False
            return
        plan = self._planned.pop(rid, None)
        if plan is None or num_external_tokens <= 0:
            return
        first, keys, sync = plan
        n = min(num_external_tokens // self.block_size, len(keys[0]))
        ids = blocks.get_block_ids()
        block_ids = [list(ids[g][first:first + n]) for g in self.groups]
        if any(len(b) != n for b in block_ids):
            log.warning("request %s: allocated blocks do not cover the planned load; skipped", rid)
            return
        self._load.append(LoadSpec(rid, [k[:n] for k in keys], block_ids, sync))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVXConnectorMetadata:
        """This step's work for the workers; resets the step state."""
        meta = KVXConnectorMetadata(recv=self._recv, load=self._load, save=self._save, send=self._send,
                                    announce=self._announce and self.offload, heartbeat=self._heartbeats(),
                                    push=self._push_specs(scheduler_output),
                                    idle_wait_s=self._idle_wait(scheduler_output))
        self._recv, self._load, self._save, self._send = [], [], [], []
        self._lw_budget = self.cfg.staging_blocks
        self._announce = False
        return meta

    def _push_specs(self, out: "SchedulerOutput") -> list[PushSpec]:
        """Prefill side: push requests whose whole prompt is computed in this step."""
        if not self._push_of:
            return []
        specs = []
        for new in out.scheduled_new_reqs:
            push_id = self._push_of.get(new.req_id)
            if push_id is None or new.prompt_token_ids is None:
                continue
            n = out.num_scheduled_tokens.get(new.req_id, 0)
            if new.num_computed_tokens + n >= len(new.prompt_token_ids):
                specs.append(PushSpec(new.req_id, push_id, [list(b) for b in new.block_ids]))
        return specs

    def _idle_wait(self, out: "SchedulerOutput") -> float:
        """How long the workers may wait for a push message in this step: only when nothing is
        computed and a push message is awaited (a request held for its registration, a finished
        one whose writes are due, a decode request waiting for its writes)."""
        if not self.push or out.total_num_scheduled_tokens:
            return 0.0
        return IDLE_WAIT_S if (self._push_seen or self._push_sending or self._push_recv) else 0.0

    def has_pending_push_work(self) -> bool:
        """Push requests finished here whose writes or abort confirmations are still due."""
        return bool(self._push_sending) or bool(self._push_recv)

    # ------------------------------------------------------------------------------------------
    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...] | list[list[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep blocks for a decode instance and/or save them to the offload stores."""
        params = request.kv_transfer_params
        rid = request.request_id
        self._planned.pop(rid, None)
        self._waiting.pop(rid, None)
        push_id = self._push_of.pop(rid, None)
        self._push_seen.pop(rid, None)
        if push_id is not None:
            self._registered.pop(push_id, None)
        recv_push = self._push_recv.get(rid)
        if recv_push is not None and params is not None:
            # decode side, aborted while its writes are due: keep the blocks until the prefill
            # confirms that nothing of it is in flight (or the bound passes)
            self._recv.append(RecvSpec(rid, [], [], {**params, "kvx_push": recv_push, "kvx_push_abort": True}))
            return True, None
        if self.pd and params and params.get("do_remote_prefill"):
            if params.get("kvx_push"):  # aborted before its blocks were allocated: nothing registered
                params["do_remote_prefill"] = False
                return False, None
            # aborted before it was scheduled: tell the prefill instance to free its blocks
            if all(k in params for k in REQUIRED_REMOTE_KEYS):
                self._recv.append(RecvSpec(rid, [], [], dict(params)))
            params["do_remote_prefill"] = False
            return False, None
        groups = [list(b) for b in block_ids]
        finished_ok = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        delay = False
        out: dict[str, Any] | None = None
        if self.offload and request.status != RequestStatus.FINISHED_ERROR:
            delay = self._plan_save(request, groups)
        if self.pd and params and params.get("do_remote_decode") and finished_ok and any(groups):
            lease = self._next_lease()
            out = self._remote_params(request, groups, lease)
            if push_id is not None:
                self._send.append(SendSpec(rid, self.cfg.push_timeout_s, lease, [b for g in groups for b in g],
                                           push=push_id, groups=groups))
                self._push_sending.add(rid)
            else:
                self._send.append(SendSpec(rid, self.cfg.lease_s, lease, [b for g in groups for b in g]))
            delay = True
        return delay, out

    def _plan_save(self, request: "Request", groups: list[list[int]]) -> bool:
        bs = self.block_size
        n = min(len(request.block_hashes), request.num_computed_tokens // bs)
        n = min([n] + [len(groups[g]) for g in self.groups if g < len(groups)])
        if n <= 0:
            return False
        keys = self._keys(request, 0, n)
        # skip the stored prefix; store the rest (chained from the prefix's last key)
        first = 0
        while first < n and self._is_stored([k[first] for k in keys]):
            first += 1
        if first == n:
            return False
        self._save.append(SaveSpec(request.request_id,
                                   [k[max(first - 1, 0):n] for k in keys],
                                   [groups[g][max(first - 1, 0):n] for g in self.groups]))
        self._saving.add(request.request_id)
        return True

    def _heartbeats(self) -> list[dict[str, Any]]:
        """kv_transfer_params of queued remote-prefill requests due a heartbeat (a third of
        their prefill's lease since the last one)."""
        if not self._waiting:
            return []
        now = time.monotonic()
        out = []
        for st in self._waiting.values():
            params, last = st
            lease_s = params.get("kvx_lease_s")
            every = float(lease_s) / 3 if isinstance(lease_s, (int, float)) and lease_s > 0 else 10.0
            if now - last >= every:
                st[1] = now
                out.append(params)
        return out

    def _next_lease(self) -> int:
        """A lease id larger than every one this engine gave before (also across restarts: it
        starts from the clock), even (the prefill workers keep odd ones for nothing)."""
        self._lease = max(self._lease + 2, (time.time_ns() // 1000) * 2)
        return self._lease

    def _remote_params(self, request: "Request", groups: list[list[int]], lease: int) -> dict[str, Any]:
        w0 = self.workers.get(0)
        if w0 is None:
            log.warning("no handshake metadata from the workers yet: decode instances cannot pull "
                        "request %s", request.request_id)
        return remote_params(engine_id=self.engine_id, request_id=request.request_id, block_ids=groups,
                             workers=self.workers, num_tokens=request.num_computed_tokens, tp_size=self.tp_size,
                             lease=lease, compat=self.compat, host=w0.host if w0 else self.cfg.advertised_host(),
                             port=w0.port if w0 else self.cfg.side_channel_port, lease_s=self.cfg.lease_s)

    # ------------------------------------------------------------------------------------------
    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Mirror the workers' store events; forget finished saves."""
        for rid in output.finished_sending or ():
            self._saving.discard(rid)
            self._push_sending.discard(rid)
            self._push_recv.pop(rid, None)
        for rid in output.finished_recving or ():
            self._push_recv.pop(rid, None)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, KVXWorkerMetadata):
            return
        for rank, ids in meta.registered.items():
            for push_id in ids:
                self._registered.setdefault(push_id, set()).add(rank)
        while len(self._registered) > 4096:  # registrations of requests that never came here
            del self._registered[next(iter(self._registered))]
        want = self.tp_size
        for rank, events in meta.events.items():
            for kind, keys, parent, medium in events:
                changed = []
                for k in keys:
                    media = self._stored.setdefault(k, {})
                    ranks = media.setdefault(medium, set())
                    was = len(ranks) >= want
                    if kind == "stored":
                        ranks.add(rank)
                    else:
                        ranks.discard(rank)
                        if not ranks:
                            del media[medium]
                            if not media:
                                del self._stored[k]
                    if was != (len(ranks) >= want):
                        changed.append(k)
                if not changed:
                    continue
                hashes = [maybe_convert_block_hash(k[:-4]) for k in changed]  # type: ignore[arg-type]
                group = int.from_bytes(changed[0][-4:], "big")
                if kind == "stored":
                    self._events.append(BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=maybe_convert_block_hash(parent[:-4]) if parent else None,  # type: ignore[arg-type]
                        token_ids=[], block_size=self.block_size, lora_id=None, medium=medium, lora_name=None,
                        group_idx=group))
                else:
                    self._events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events (offload store stored/removed, with medium) since the last call."""
        ev, self._events = self._events, []
        yield from ev

    def reset_cache(self) -> bool:
        """Forget the mirrored offload index (the stores keep their blocks; the next step asks
        the workers to report them again)."""
        self._stored.clear()
        self._announce = True
        return True

    def shutdown(self) -> None:
        """Close the pool clients."""
        if self.pool is not None:
            self.pool.close()

    def has_pending_work(self) -> bool:
        """Whether saves are still in flight."""
        return bool(self._saving)


def _as_groups(v: Any) -> list[list[int]]:
    """kv_transfer_params' block ids: a list per group (or one flat list: one group)."""
    if not isinstance(v, (list, tuple)):
        raise ValueError("remote_block_ids must be a list")
    if v and all(isinstance(x, int) for x in v):
        return [list(v)]
    return [[int(b) for b in g] for g in v]


def now() -> float:
    return time.monotonic()
