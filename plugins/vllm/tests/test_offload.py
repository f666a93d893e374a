"""Offloading end to end in one process: vLLM's scheduler + the worker-side connector + kvx.

A finished request's full blocks are saved to the worker's TieredStore (host tier, and a disk
tier below it); after the engine's own prefix cache is dropped, the same prompt is a kvx hit
and its blocks are loaded back into newly allocated blocks byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import vllm_utils as U
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

PROMPT = 72  # 4 full blocks + 8 tokens


def _engine(tmp_path, host_blocks: int = 64, disk: bool = False, policy: str | None = None) -> U.Engine:
    page = U.NUM_KV_HEADS * U.BLOCK_SIZE * 2 * U.HEAD_DIM * 4
    extra = {"offload_host_bytes": host_blocks * U.NUM_LAYERS * page, "staging_blocks": 3}
    if disk:
        extra.update(offload_disk_path=str(tmp_path / "kv"), offload_disk_bytes=64 * U.NUM_LAYERS * page)
    return U.Engine(U.create_vllm_config("kv_both", extra, failure_policy=policy), num_blocks=64, seed=3)


def _run(eng: U.Engine, rid: str, max_tokens: int = 2) -> None:
    req = U.create_request(rid, PROMPT, max_tokens=max_tokens)
    eng.scheduler.add_request(req)
    eng.run_until(lambda: req.status == RequestStatus.FINISHED_LENGTH_CAPPED)
    eng.run_until(lambda: rid not in eng.scheduler.requests)


def test_save_then_hit_loads_same_bytes(tmp_path) -> None:
    eng = _engine(tmp_path)
    try:
        s = eng.scheduler
        req = U.create_request("a", PROMPT, max_tokens=2)
        s.add_request(req)
        so = eng.step()
        first_blocks = s.kv_cache_manager.get_block_ids("a")[0][:4]
        want = [U.block_bytes(eng.caches, b) for b in first_blocks]
        eng.run_until(lambda: req.status == RequestStatus.FINISHED_LENGTH_CAPPED)
        # saving holds the blocks; when the save is done they are freed
        eng.run_until(lambda: "a" not in s.requests)
        assert eng.free() == eng.initial_free
        events = eng.events
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 4
        assert all(e.medium == "CPU" for e in stored)
        assert stored[0].block_hashes[0] == maybe_convert_block_hash(req.block_hashes[0])

        # forget the engine's own prefix cache and wipe the GPU blocks
        assert s.kv_cache_manager.reset_prefix_cache()
        for t in eng.caches.values():
            t.zero_()
        req2 = U.create_request("b", PROMPT, max_tokens=2)
        s.add_request(req2)
        so = eng.step()
        assert so.num_scheduled_tokens == {}
        assert req2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.run_until(lambda: req2.status == RequestStatus.RUNNING)
        got_blocks = s.kv_cache_manager.get_block_ids("b")[0][:4]
        assert [U.block_bytes(eng.caches, b) for b in got_blocks] == want
        # only the tail after the 4 loaded blocks is computed
        assert req2.num_computed_tokens >= 64
        eng.run_until(lambda: "b" not in s.requests)
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_eviction_to_disk_reports_events_and_still_hits(tmp_path) -> None:
    eng = _engine(tmp_path, host_blocks=4, disk=True)
    try:
        s = eng.scheduler
        _run(eng, "a")
        other = U.create_request("x", PROMPT, max_tokens=2, prompt=[(i * 7) % 900 + 1 for i in range(PROMPT)])
        s.add_request(other)
        eng.run_until(lambda: "x" not in s.requests)
        events = eng.events
        media = {(type(e).__name__, e.medium) for e in events}
        assert ("BlockStored", "CPU") in media
        assert ("BlockStored", "DISK") in media and ("BlockRemoved", "CPU") in media
        assert not any(isinstance(e, BlockRemoved) and e.medium == "DISK" for e in events)
        assert s.kv_cache_manager.reset_prefix_cache()
        req = U.create_request("a2", PROMPT, max_tokens=2)
        s.add_request(req)
        eng.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.run_until(lambda: "a2" not in s.requests)
        (st,) = eng.worker.worker._stores.values()
        tiers = st.store.stats().tiers
        assert tiers[1]["medium"] == "DISK" and tiers[1]["promoted"] >= 1  # came back from disk
        assert not eng.worker.worker._invalid
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_offload_load_failure_follows_policy(tmp_path, policy: str) -> None:
    eng = _engine(tmp_path, policy=policy)
    try:
        s = eng.scheduler
        _run(eng, "a")
        assert s.kv_cache_manager.reset_prefix_cache()
        # the store loses the blocks behind the scheduler's back
        for st in eng.worker.worker._stores.values():
            st.store.delete(list(st.store._where))
        req = U.create_request("b", PROMPT, max_tokens=2)
        s.add_request(req)
        eng.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.run_until(lambda: req.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                      and req.status != RequestStatus.WAITING)
        eng.run_until(lambda: "b" not in s.requests)
        want = RequestStatus.FINISHED_LENGTH_CAPPED if policy == "recompute" else RequestStatus.FINISHED_ERROR
        assert req.status == want
        assert eng.free() == eng.initial_free
        assert torch.count_nonzero(eng.caches["model.layers.0.self_attn.attn"]) > 0
    finally:
        eng.close()
