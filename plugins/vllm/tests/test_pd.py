"""Prefill/decode end to end: a prefill engine in another process, a decode engine here.

Both run vLLM's real scheduler with a worker-side KVXConnector over CPU KV caches in vLLM
0.33's layout. The decode side pulls the prompt's blocks through kvx (the prefill worker's
metadata comes from its side channel), the bytes are compared, and the prefill side frees its
blocks once notified -- or when the lease runs out.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import vllm_utils as U
from vllm.v1.request import RequestStatus

HERE = os.path.dirname(os.path.abspath(__file__))


class PrefillProcess:
    def __init__(self, extra: dict[str, Any] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "prefill_proc.py"), json.dumps(extra or {})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read(120)

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while True:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not r:
                raise TimeoutError("prefill process did not answer")
            line = self.proc.stdout.readline()
            if not line:
                raise EOFError(f"prefill process exited ({self.proc.poll()})")
            if line.startswith("{"):
                return json.loads(line)

    def call(self, timeout: float = 60, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def wait_freed(self, timeout: float = 30) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            r = self.call(cmd="step", n=5, sleep=0.02)
            if r["free"] == r["initial"] or time.monotonic() > end:
                return r

    def close(self) -> None:
        try:
            self.call(cmd="quit", timeout=30)
            self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def prefill():
    p = PrefillProcess()
    yield p
    p.close()


def _digests(eng: U.Engine, rid: str, n: int) -> list[str]:
    ids = eng.scheduler.kv_cache_manager.get_block_ids(rid)[0][:n]
    return [hashlib.sha256(U.block_bytes(eng.caches, b)).hexdigest() for b in ids]


def test_decode_pulls_prefill_blocks_and_prefill_frees(prefill: PrefillProcess) -> None:
    r = prefill.call(cmd="prefill", id="req-1", tokens=40)
    params, digests = r["params"], r["digests"]
    assert len(digests) == 3 and r["free"] == prefill.hello["initial"] - 3
    eng = U.Engine(U.create_vllm_config("kv_consumer"), num_blocks=64)
    try:
        s = eng.scheduler
        req = U.create_request("dec-1", 40, max_tokens=3, kv_transfer_params=params)
        s.add_request(req)
        eng.step()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        eng.run_until(lambda: req.status == RequestStatus.RUNNING)
        assert _digests(eng, "dec-1", 3) == digests
        assert req.num_computed_tokens >= 39
        eng.run_until(lambda: "dec-1" not in s.requests)
        assert eng.free() == eng.initial_free
    finally:
        eng.close()
    r = prefill.wait_freed()
    assert r["free"] == r["initial"]


def test_local_prefix_hit_pulls_only_the_rest(prefill: PrefillProcess) -> None:
    eng = U.Engine(U.create_vllm_config("kv_consumer"), num_blocks=64)
    try:
        s = eng.scheduler
        # a local request computes the first 2 blocks of the same prompt (stays in the prefix cache)
        warm = U.create_request("warm", 32, max_tokens=1)
        s.add_request(warm)
        eng.run_until(lambda: "warm" not in s.requests)
        r = prefill.call(cmd="prefill", id="req-2", tokens=40)
        req = U.create_request("dec-2", 40, max_tokens=3, kv_transfer_params=r["params"])
        s.add_request(req)
        so = eng.step()
        (recv,) = so.kv_connector_metadata.recv
        # block 2 only is new locally; the prefill's blocks are all listed, paired by position
        assert recv.local_pos == [[2]]
        assert recv.remote_block_ids == [r["params"]["remote_block_ids"][0]]
        eng.run_until(lambda: req.status == RequestStatus.RUNNING)
        assert _digests(eng, "dec-2", 3)[2] == r["digests"][2]
        eng.run_until(lambda: "dec-2" not in s.requests)
        assert eng.free() == eng.initial_free
    finally:
        eng.close()
    assert prefill.wait_freed()["free"] == prefill.hello["initial"]


def test_unclaimed_blocks_expire_after_lease() -> None:
    p = PrefillProcess({"lease_s": 1.0})
    try:
        r = p.call(cmd="prefill", id="req-3", tokens=40)
        assert r["free"] == p.hello["initial"] - 3
        r = p.call(cmd="step", n=2)
        assert r["free"] == r["initial"] - 3  # still held within the lease
        time.sleep(1.2)
        r = p.wait_freed(timeout=10)
        assert r["free"] == r["initial"]
    finally:
        p.close()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_unreachable_prefill_is_a_load_failure(prefill: PrefillProcess, policy: str) -> None:
    r = prefill.call(cmd="prefill", id="req-4", tokens=40)
    params = dict(r["params"])
    # point the decode side at a port nobody listens on
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = sk.getsockname()[1]
    params["remote_agents"] = {k: [v[0], v[1], dead, v[3], v[4]] for k, v in params["remote_agents"].items()}
    eng = U.Engine(U.create_vllm_config("kv_consumer", {"load_timeout_s": 5}, failure_policy=policy), num_blocks=64)
    try:
        s = eng.scheduler
        req = U.create_request("dec-4", 40, max_tokens=2, kv_transfer_params=params)
        s.add_request(req)
        eng.step()
        eng.run_until(lambda: "dec-4" not in s.requests, max_steps=2000)
        want = RequestStatus.FINISHED_LENGTH_CAPPED if policy == "recompute" else RequestStatus.FINISHED_ERROR
        assert req.status == want
        assert eng.free() == eng.initial_free
    finally:
        eng.close()


def test_incompatible_prefill_is_refused(prefill: PrefillProcess) -> None:
    r = prefill.call(cmd="prefill", id="req-5", tokens=40)
    params = dict(r["params"])
    params["kvx_compat"] = {**params["kvx_compat"], "num_kv_heads": 99}
    eng = U.Engine(U.create_vllm_config("kv_consumer", failure_policy="recompute"), num_blocks=64)
    try:
        s = eng.scheduler
        req = U.create_request("dec-5", 40, max_tokens=1, kv_transfer_params=params)
        s.add_request(req)
        eng.run_until(lambda: "dec-5" not in s.requests)
        assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert all(x == 0 for x in eng.caches["model.layers.0.self_attn.attn"].flatten()[:10].tolist())
        assert eng.free() == eng.initial_free
    finally:
        eng.close()
