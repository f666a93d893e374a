"""Push mode's failure semantics (issue 29, item 4) with vLLM's real scheduler and worker-side
KVXConnector on both sides: a prefill engine in another process (``prefill_proc.py``, whose
``push`` command can stall or die after a layer's writes), a decode engine here.

- the pushed bytes are the prefill's, written during its forward pass; both sides free;
- the prefill dies mid-stream (after its first layer's write): the decode request fails within
  its bound (``push_timeout_s``, then the same again for the confirmation that never comes) and
  is recomputed; its blocks are freed; a local request beside it is untouched;
- the decode aborts mid-stream: its blocks stay held until the prefill confirms that nothing of
  the request is in flight (the prefill's next layer lands after the abort, into blocks not yet
  reused), then are freed; the prefill frees its own; the next push is exact;
- the decode's bound passes mid-stream: the late write does not count; the request is
  recomputed after the prefill's confirmation; blocks freed on both sides.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import pytest
import vllm_utils as U
from kvx_vllm.proxy import push_params
from test_pd import PrefillProcess
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

TOKENS = 40  # 3 blocks of 16


def _prefill(layerwise: bool) -> PrefillProcess:
    return PrefillProcess({"transfer_mode": "push", "layerwise": layerwise, "push_wait_s": 10,
                           "push_timeout_s": 5, "lease_s": 1})


def _decode(timeout: float) -> U.Engine:
    return U.Engine(U.create_vllm_config("kv_consumer", {"transfer_mode": "push", "push_timeout_s": timeout},
                                         failure_policy="recompute"), num_blocks=64)


def _endpoint(prefill: PrefillProcess) -> dict:
    """The prefill's kvx endpoint from a pull answer (its blocks expire with the 1 s lease)."""
    return prefill.call(cmd="prefill", id=f"warm-{uuid.uuid4().hex[:6]}", tokens=TOKENS)["params"]


def _register(eng: U.Engine, rid: str, dec: dict) -> str:
    """Add a push request to the decode engine; step until its registration has been sent."""
    req = U.create_request(rid, TOKENS, max_tokens=2, kv_transfer_params=dec)
    eng.scheduler.add_request(req)
    landing = eng.worker.worker.push_decode.landing
    end = time.monotonic() + 30
    while dec["kvx_push"] not in landing.pending():
        assert time.monotonic() < end, "registration not sent"
        eng.step()
        time.sleep(0.01)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return dec["kvx_push"]


def _digests(eng: U.Engine, rid: str) -> list[str]:
    ids = eng.scheduler.kv_cache_manager.get_block_ids(rid)[0][:3]
    return [hashlib.sha256(U.block_bytes(eng.caches, b)).hexdigest() for b in ids]


def _in_thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = fn(*args, **kw)
        except BaseException as e:  # reported by the test
            box["e"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


@pytest.fixture(scope="module")
def lw_prefill():
    """One layer-wise push prefill process for the tests that keep it alive."""
    p = _prefill(True)
    yield p
    p.close()


def test_push_writes_the_prefill_bytes(lw_prefill: PrefillProcess) -> None:
    prefill = lw_prefill
    eng = _decode(10)
    try:
        pre, dec = push_params(_endpoint(prefill))
        _register(eng, "d1", dec)
        r = prefill.call(cmd="push", id="p1", tokens=TOKENS, params=pre, timeout=60)
        assert r["stats"]["pushed_in_pass"] == 1 and r["stats"]["push_failures"] == 0
        s = eng.scheduler
        eng.run_until(lambda: s.requests["d1"].status == RequestStatus.RUNNING, max_steps=500)
        assert _digests(eng, "d1") == r["digests"]
        assert eng.worker.worker.stats["pulls"] == 1
        eng.run_until(lambda: "d1" not in s.requests)
        assert eng.free() == eng.initial_free
        assert prefill.wait_freed()["free"] == prefill.hello["initial"]
    finally:
        eng.close()


def test_decode_aborts_mid_stream(lw_prefill: PrefillProcess) -> None:
    prefill = lw_prefill
    eng = _decode(20)
    try:
        pre, dec = push_params(_endpoint(prefill))
        pid = _register(eng, "d3", dec)
        landing = eng.worker.worker.push_decode.landing
        th, box = _in_thread(prefill.call, cmd="push", id="p3", tokens=TOKENS, params=pre, stall=[0, 2.0],
                             timeout=60)
        end = time.monotonic() + 30
        while not any(e.got for e in landing._expect[pid].values()):  # layer 0 landed; the prefill stalls
            assert time.monotonic() < end
            eng.step()
            time.sleep(0.01)
        s = eng.scheduler
        s.finish_requests("d3", RequestStatus.FINISHED_ABORTED)
        eng.step()
        held = eng.initial_free - eng.free()
        assert held == 3, "the aborted request's blocks must stay held until the prefill confirms"
        th.join(60)
        assert "e" not in box, box.get("e")
        # the prefill's next step sees the abort and confirms; then the decode frees the blocks
        prefill.call(cmd="step", n=2)
        end = time.monotonic() + 10
        while eng.free() != eng.initial_free:
            assert time.monotonic() < end, "blocks not freed after the prefill's confirmation"
            eng.step()
            time.sleep(0.01)
        assert eng.worker.worker.stats["pulls"] == 0
        assert prefill.wait_freed()["free"] == prefill.hello["initial"]
        # the next push (another request) is exact
        pre, dec = push_params(_endpoint(prefill))
        _register(eng, "d3b", dec)
        r = prefill.call(cmd="push", id="p3b", tokens=TOKENS, params=pre, timeout=60)
        eng.run_until(lambda: s.requests["d3b"].status == RequestStatus.RUNNING, max_steps=500)
        assert _digests(eng, "d3b") == r["digests"]
        eng.run_until(lambda: "d3b" not in s.requests)
        assert prefill.wait_freed()["free"] == prefill.hello["initial"]
    finally:
        eng.close()


def test_write_after_decode_gave_up(lw_prefill: PrefillProcess) -> None:
    prefill = lw_prefill
    eng = _decode(1.0)
    try:
        pre, dec = push_params(_endpoint(prefill))
        _register(eng, "d4", dec)
        th, box = _in_thread(prefill.call, cmd="push", id="p4", tokens=TOKENS, params=pre, stall=[0, 2.5],
                             timeout=60)
        s = eng.scheduler
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.8:  # past the decode's bound, while the prefill stalls
            eng.step()
            time.sleep(0.02)
        assert s.requests["d4"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert eng.initial_free - eng.free() == 3  # failed, but held: a write may still land
        th.join(60)  # the prefill writes layer 1 after the decode gave up
        assert "e" not in box, box.get("e")
        prefill.call(cmd="step", n=2)  # sees the abort note, confirms
        eng.run_until(lambda: "d4" not in s.requests, max_steps=3000)
        assert eng.outputs["d4"].finish_reason == FinishReason.LENGTH  # recomputed
        w = eng.worker.worker
        assert w.stats["pulls"] == 0 and w.stats["pull_failures"] == 0
        assert eng.free() == eng.initial_free
        assert prefill.wait_freed()["free"] == prefill.hello["initial"]
    finally:
        eng.close()


def test_prefill_dies_mid_stream(lw_prefill: PrefillProcess) -> None:
    """(Last: it kills the shared prefill process.)"""
    prefill = lw_prefill
    eng = _decode(2.0)
    try:
        pre, dec = push_params(_endpoint(prefill))
        _register(eng, "d2", dec)
        local = U.create_request("local", 24, max_tokens=3)
        eng.scheduler.add_request(local)
        t0 = time.monotonic()
        with pytest.raises(EOFError):
            prefill.call(cmd="push", id="p2", tokens=TOKENS, params=pre, die_after=0, timeout=60)
        s = eng.scheduler
        eng.run_until(lambda: "d2" not in s.requests, max_steps=3000)
        took = time.monotonic() - t0
        assert s.requests.get("local") is None and eng.outputs["local"].finished
        assert eng.outputs["d2"].finish_reason == FinishReason.LENGTH
        # recomputed (policy recompute): it ran to its length, no error
        assert eng.worker.worker.stats["pulls"] == 0 and eng.worker.worker.stats["pull_failures"] == 0
        assert took < 2 * 2.0 + 5, f"failed after {took:.1f} s"
        assert eng.free() == eng.initial_free
    finally:
        eng.close()
        prefill.proc.wait(10)
