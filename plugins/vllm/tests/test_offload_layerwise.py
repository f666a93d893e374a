"""Layer-wise offload loads (``offload_layerwise``) with vLLM's real scheduler and the worker-side
connector: the request computes in the step its load starts, each layer's pages are in the
cache when that layer's ``wait_for_layer_load`` returns, later layers may still be moving, and a
part that fails or runs past the bound turns into invalid blocks (vLLM recomputes or fails the
request), never into wrong tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import vllm_utils as U
from kvx_vllm import KVXConnector
from kvx_vllm.config import KVXConnectorConfig
from vllm.v1.request import RequestStatus

import kvx

PROMPT = 72  # 4 full blocks + 8 tokens
FULL = PROMPT // U.BLOCK_SIZE
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(U.NUM_LAYERS)]


def _engine(policy: str | None = None, **extra: Any) -> U.Engine:
    page = U.NUM_KV_HEADS * U.BLOCK_SIZE * 2 * U.HEAD_DIM * 4
    cfg = {"offload_host_bytes": 64 * U.NUM_LAYERS * page, "staging_blocks": 8, "offload_layerwise": True, **extra}
    return U.Engine(U.create_vllm_config("kv_both", cfg, failure_policy=policy), num_blocks=64, seed=3)


def _saved(eng: U.Engine) -> list[list[bytes]]:
    """Compute and offload the prompt; returns its full blocks' pages, per layer, then drop the
    engine's prefix cache and zero the caches."""
    s = eng.scheduler
    req = U.create_request("a", PROMPT, max_tokens=2)
    s.add_request(req)
    eng.step()
    blocks = s.kv_cache_manager.get_block_ids("a")[0][:FULL]
    want = [[eng.caches[n][b].numpy().tobytes() for b in blocks] for n in LAYERS]
    eng.run_until(lambda: "a" not in s.requests)
    assert s.kv_cache_manager.reset_prefix_cache()
    for t in eng.caches.values():
        t.zero_()
    return want


def _pages(eng: U.Engine, rid: str, layer: str) -> list[bytes]:
    blocks = eng.scheduler.kv_cache_manager.get_block_ids(rid)[0][:FULL]
    return [eng.caches[layer][b].numpy().tobytes() for b in blocks]


def _gate_layer(eng: U.Engine, layer: int, action: Any) -> list[int]:
    """Make the worker's transfers into ``layer`` go through ``action`` first (on the load's
    thread); returns a list that records each such call."""
    w = eng.worker.worker
    real = w.agent.read
    (st,) = w._stores.values()
    lo = int(st.layer_offsets[layer])
    hi = lo + st.layers[layer].num_blocks
    calls: list[int] = []

    def read(local: Any, lidx: Any, remote: Any, ridx: Any, **kw: Any) -> Any:
        if remote is st.lw_pieces and len(lidx) and lo <= int(min(lidx)) < hi:
            calls.append(len(lidx))
            action()
        return real(local, lidx, remote, ridx, **kw)

    w.agent.read = read
    return calls


def test_loads_layer_by_layer_in_the_same_step() -> None:
    eng = _engine()
    try:
        want = _saved(eng)
        w = eng.worker.worker
        seen: dict[str, list[bytes]] = {}
        eng.after_layer = lambda name: seen.setdefault(name, _pages(eng, "b", name))
        req = U.create_request("b", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        so = eng.step()
        # a synchronous load: computed in the step its load started, from block 4 on
        assert so.num_scheduled_tokens == {"b": PROMPT - FULL * U.BLOCK_SIZE}
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens == PROMPT  # 64 loaded + 8 computed
        # when each layer's wait returned, its pages were there, byte for byte
        assert [seen[n] for n in LAYERS] == want
        assert w.stats["loaded_blocks"] == FULL and w.stats["layer_loads"] == 1
        assert w.stats["layer_load_failures"] == 0
        eng.run_until(lambda: "b" not in eng.scheduler.requests)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_first_layer_returns_while_a_later_one_is_pending() -> None:
    eng = _engine()
    try:
        want = _saved(eng)
        w = eng.worker.worker
        gate = threading.Event()
        calls = _gate_layer(eng, 1, lambda: gate.wait(30))
        state: dict[str, Any] = {}

        def after(name: str) -> None:
            if "layer1" in state:  # the later steps
                return
            if name == LAYERS[0]:
                part = w._lw.part_of(0, 1)
                # layer 0 is in place while layer 1's transfer is held back
                state["layer0"] = _pages(eng, "b", LAYERS[0])
                state["layer1_posted"] = part.posted.is_set()
                state["layer1_pages"] = _pages(eng, "b", LAYERS[1])
                gate.set()
            else:
                state["layer1"] = _pages(eng, "b", LAYERS[1])

        eng.after_layer = after
        req = U.create_request("b", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        eng.step()
        assert state["layer0"] == want[0]
        assert state["layer1_posted"] is False
        assert state["layer1_pages"] == [bytes(len(p)) for p in want[1]]
        assert state["layer1"] == want[1]
        assert calls == [FULL]
        assert w.stats["layer_load_failures"] == 0
        eng.run_until(lambda: "b" not in eng.scheduler.requests)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        eng.close()


@pytest.mark.parametrize("staging", [9, 8])
def test_two_requests_in_one_step(staging: int) -> None:
    # 4 + 5 blocks to load: with 8 staging blocks the second request loads whole, in the background
    eng = _engine(staging_blocks=staging)
    try:
        s = eng.scheduler
        other = [(i * 7) % 900 + 1 for i in range(PROMPT + 16)]  # 5 full blocks
        want = {}
        for rid, p in (("a", None), ("x", other)):
            req = U.create_request(rid, PROMPT, max_tokens=2, prompt=p)
            s.add_request(req)
            eng.step()
            n = (len(req.prompt_token_ids) - 1) // U.BLOCK_SIZE
            want[rid] = [[eng.caches[name][b].numpy().tobytes() for b in s.kv_cache_manager.get_block_ids(rid)[0][:n]]
                         for name in LAYERS]
            eng.run_until(lambda rid=rid: rid not in s.requests)
        assert s.kv_cache_manager.reset_prefix_cache()
        for t in eng.caches.values():
            t.zero_()
        seen: dict[str, dict[str, list[bytes]]] = {}

        def after(name: str) -> None:  # the pages a request computes with: seen in a step that runs it
            for rid, n in (("b", 4), ("y", 5)):
                if rid in s.requests and s.requests[rid].status == RequestStatus.RUNNING:
                    ids = s.kv_cache_manager.get_block_ids(rid)[0][:n]
                    seen.setdefault(rid, {}).setdefault(name, [eng.caches[name][b].numpy().tobytes() for b in ids])

        eng.after_layer = after
        s.add_request(U.create_request("b", PROMPT, max_tokens=2))
        s.add_request(U.create_request("y", PROMPT, max_tokens=2, prompt=other))
        so = eng.step()
        w = eng.worker.worker
        assert [seen["b"][n] for n in LAYERS] == want["a"]
        if staging == 9:
            assert set(so.num_scheduled_tokens) == {"b", "y"}  # both computed in the step of their load
            assert w.stats["layer_loads"] == 1 and w.stats["loaded_blocks"] == 9
        else:
            assert set(so.num_scheduled_tokens) == {"b"}
            y = s.requests["y"]
            assert y.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            eng.run_until(lambda: y.status == RequestStatus.RUNNING)
            assert w.stats["layer_loads"] == 1 and w.stats["loaded_blocks"] == 9
        assert [seen["y"][n] for n in LAYERS] == want["x"]
        eng.run_until(lambda: not s.requests)
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_layer_groups_one_transfer_each() -> None:
    eng = _engine(offload_layer_group=2)
    try:
        want = _saved(eng)
        calls = _gate_layer(eng, 0, lambda: None)
        seen: dict[str, list[bytes]] = {}
        eng.after_layer = lambda name: seen.setdefault(name, _pages(eng, "b", name))
        eng.scheduler.add_request(U.create_request("b", PROMPT, max_tokens=2))
        eng.step()
        assert calls == [FULL * U.NUM_LAYERS]  # both layers' pages in one transfer
        assert [seen[n] for n in LAYERS] == want
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_layer_part_is_never_served(policy: str) -> None:
    eng = _engine(policy)
    try:
        _saved(eng)
        w = eng.worker.worker

        def boom() -> None:
            raise kvx.TransferError("injected: layer 1's transfer failed")

        _gate_layer(eng, 1, boom)
        req = U.create_request("b", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        eng.step()
        assert w.stats["layer_load_failures"] == 1
        if policy == "recompute":
            # the step's output was dropped; the request recomputes from the first bad block
            assert req.num_computed_tokens == 0 and req.num_output_tokens == 0
        eng.run_until(lambda: "b" not in eng.scheduler.requests)
        want = RequestStatus.FINISHED_LENGTH_CAPPED if policy == "recompute" else RequestStatus.FINISHED_ERROR
        assert req.status == want
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_missing_blocks_and_the_bound() -> None:
    eng = _engine("recompute", load_timeout_s=0.5)
    try:
        _saved(eng)
        w = eng.worker.worker
        # a layer part that does not land within load_timeout_s: the wait returns at the bound
        gate = threading.Event()
        _gate_layer(eng, 1, lambda: gate.wait(30))
        req = U.create_request("b", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        t0 = time.monotonic()
        eng.step()
        assert time.monotonic() - t0 < 10
        gate.set()
        assert w.stats["layer_load_failures"] == 1
        assert req.num_computed_tokens == 0  # recomputed, not served
        eng.run_until(lambda: "b" not in eng.scheduler.requests)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED

        # the store loses the blocks behind the scheduler's back
        assert eng.scheduler.kv_cache_manager.reset_prefix_cache()
        for st in w._stores.values():
            st.store.delete(list(st.store._where))
        failures = w.stats["layer_load_failures"]
        req = U.create_request("c", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        eng.step()
        assert w.stats["layer_load_failures"] == failures + 1
        assert req.num_computed_tokens == 0
        eng.run_until(lambda: "c" not in eng.scheduler.requests)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_past_the_staging_budget_loads_whole() -> None:
    eng = _engine(staging_blocks=3)  # 4 blocks to load: not layer-wise this step
    try:
        want = _saved(eng)
        req = U.create_request("b", PROMPT, max_tokens=2)
        eng.scheduler.add_request(req)
        so = eng.step()
        assert so.num_scheduled_tokens == {}
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.run_until(lambda: req.status == RequestStatus.RUNNING)
        assert [_pages(eng, "b", n) for n in LAYERS] == want
        assert eng.worker.worker.stats["layer_loads"] == 0
    finally:
        eng.close()


def test_config() -> None:
    with pytest.raises(ValueError, match="offload_layerwise needs offloading"):
        KVXConnectorConfig.from_extra({"offload_layerwise": True})
    with pytest.raises(ValueError, match="offload_layer_group"):
        KVXConnectorConfig.from_extra({"offload_host_gb": 1, "offload_layer_group": 0})
    cfg = KVXConnectorConfig.from_extra({"offload_host_gb": 1, "offload_layerwise": "true"})
    assert cfg.offload_layerwise and cfg.offload_layer_group == 1
    assert KVXConnector.requires_piecewise_for_cudagraph({"offload_host_gb": 1, "offload_layerwise": True})
    assert not KVXConnector.requires_piecewise_for_cudagraph({"offload_host_gb": 1})


def test_several_kv_cache_groups_load_whole(caplog: Any) -> None:
    """A hybrid model (full attention + sliding window: two KV cache groups, vLLM's real hybrid
    scheduler) turns ``offload_layerwise`` off with a warning: a stored prefix is loaded whole,
    asynchronously, in every group, and the request computes in a later step."""
    import logging

    import torch
    from kvx_vllm.metadata import KVXWorkerMetadata
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.structured_output import StructuredOutputManager

    page = U.NUM_KV_HEADS * U.BLOCK_SIZE * 2 * U.HEAD_DIM * 4
    vc = U.create_vllm_config("kv_both", {"offload_host_bytes": 64 * U.NUM_LAYERS * page, "offload_layerwise": True})
    vc.cache_config.num_gpu_blocks = 64
    full = FullAttentionSpec(block_size=U.BLOCK_SIZE, num_kv_heads=U.NUM_KV_HEADS, head_size=U.HEAD_DIM,
                             dtype=torch.float32)
    swa = SlidingWindowSpec(block_size=U.BLOCK_SIZE, num_kv_heads=U.NUM_KV_HEADS, head_size=U.HEAD_DIM,
                            dtype=torch.float32, sliding_window=4 * U.BLOCK_SIZE)
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(LAYERS[:1], full), KVCacheGroupSpec(LAYERS[1:], swa)])
    with caplog.at_level(logging.WARNING, logger="kvx_vllm.scheduler"):
        s = Scheduler(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=U.BLOCK_SIZE, log_stats=True)
    ks = s.connector.scheduler
    assert ks.layerwise is False
    assert "offload_layerwise is off: 2 KV cache groups" in caplog.text
    assert ks.groups == (0, 1)
    req = U.create_request("h", PROMPT, max_tokens=2)
    # the workers report the prompt's full blocks stored (every group's keys), as vLLM passes
    # their metadata on
    keys = [make_block_hash_with_group_id(h, g) for h in req.block_hashes[:FULL] for g in ks.groups]
    ks.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=KVXWorkerMetadata(
        {0: [("stored", keys, None, "cpu")]}, {})))
    s.add_request(req)
    so = s.schedule()
    # an asynchronous (whole) load: nothing computed in this step, the request waits for its KV
    assert so.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = so.kv_connector_metadata
    (load,) = meta.load
    assert load.layerwise is False
    assert len(load.block_ids) == len(ks.groups) and all(len(b) == FULL for b in load.block_ids)
