"""Prefill/decode on two real CPU engines: KVXConnector vs vLLM's NixlConnector, side by side.

For each connector, a prefill engine (core 0) and a decode engine (core 1) with a larger
random-weight Llama than the tests' (``--hidden``, ``--layers``), fp32; ``--requests`` prompts of
``--prompt-len`` tokens, one at a time: the prefill engine runs each with ``max_tokens=1`` and
``do_remote_decode``, the decode engine pulls the KV and produces the first token. Reported:

- **pull** (decode side, per request): from the worker-side connector's ``start_load_kv`` for the
  request to the step whose ``get_transfer_results`` reports it received -- the same hooks for
  both connectors (``engine_proc._time_pulls``);
- **TTFT**: prefill leg + decode leg as the driver sees them (what a proxy adds is HTTP);
- **decode leg**: the decode engine's ``generate`` call alone.

The first request of each pair (connection set-up) is not counted. Run with ``make bench-vllm``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from typing import Any

from engines import EngineProcess
from tinymodel import build_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_pair(name: str, model: str, a: argparse.Namespace, logdir: str) -> dict[str, Any]:
    common = {"model": model, "block_size": 32, "num_blocks": a.blocks, "max_model_len": a.prompt_len + 64,
              "max_num_batched_tokens": max(2048, a.prompt_len + 64)}
    if name == "kvx":
        conn = {"connector": "KVXConnector", "module": "kvx_vllm"}
    else:
        conn = {"connector": "NixlConnector", "module": "", "kv_buffer_device": "cpu"}
    # NixlConnector's side channel listens on VLLM_NIXL_SIDE_CHANNEL_PORT (5600 by default):
    # one free port per engine on one machine
    pf = EngineProcess({**common, **conn, "role": "kv_producer", "engine_id": f"{name}-prefill"}, core=0,
                       log=os.path.join(logdir, f"{name}-prefill.log"),
                       env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    dc = EngineProcess({**common, **conn, "role": "kv_consumer", "engine_id": f"{name}-decode"}, core=1,
                       log=os.path.join(logdir, f"{name}-decode.log"),
                       env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
    try:
        pf.ready(300)
        dc.ready(300)
        ttft, legs = [], []
        for i in range(a.requests + 1):
            p = [3 + (i * 7919 + j * 31) % (a.vocab - 3) for j in range(a.prompt_len)]
            t0 = time.perf_counter()
            first = pf.generate([p], 1, [{"do_remote_decode": True}])["outputs"][0]
            t1 = time.perf_counter()
            out = dc.generate([p], 1, [first["kv_transfer_params"]])["outputs"][0]
            t2 = time.perf_counter()
            if out["finish"] != "length":
                raise RuntimeError(f"{name}: request {i} ended with {out['finish']!r}")
            if i:
                ttft.append(t2 - t0)
                legs.append(t2 - t1)
        pulls = list(dc.call(cmd="stats")["pull_s"].values())  # in request order
        pulls = pulls[-a.requests:]  # the warm-up request's pull (connection set-up) left out
        return {"pull": pulls, "ttft": ttft, "leg": legs}
    finally:
        pf.close()
        dc.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--connectors", default="kvx,nixl")
    ap.add_argument("--workdir", default="")
    a = ap.parse_args()
    a.vocab = 512
    work = a.workdir or tempfile.mkdtemp(prefix="kvx-bench-vllm-")
    heads = a.hidden // 64
    shape = {"hidden_size": a.hidden, "intermediate_size": 2 * a.hidden, "num_attention_heads": heads,
             "num_key_value_heads": max(1, heads // 2), "num_hidden_layers": a.layers, "vocab_size": a.vocab}
    model = build_model(os.path.join(work, f"llama-{a.hidden}x{a.layers}"), **shape)
    kv_per_token = a.layers * 2 * shape["num_key_value_heads"] * 64 * 4
    print(f"model: hidden {a.hidden}, {a.layers} layers, {heads} query / {shape['num_key_value_heads']} KV heads "
          f"of 64, fp32; prompt {a.prompt_len} tokens = {kv_per_token * a.prompt_len / 2**20:.1f} MiB of KV; "
          f"{a.requests} requests one at a time (logs in {work})", flush=True)
    rows = []
    for name in a.connectors.split(","):
        try:
            r = run_pair(name, model, a, work)
        except Exception as exc:
            print(f"{name}: FAILED: {exc}", flush=True)
            continue
        ms = {k: [x * 1e3 for x in v] for k, v in r.items()}
        rows.append((name, ms))
        print(f"{name:5s} pull median {statistics.median(ms['pull']):8.2f} ms  p99 {pct(ms['pull'], .99):8.2f} ms | "
              f"TTFT median {statistics.median(ms['ttft']):8.1f} ms  p99 {pct(ms['ttft'], .99):8.1f} ms | "
              f"decode leg median {statistics.median(ms['leg']):7.1f} ms   (n={len(ms['pull'])})", flush=True)
    if len(rows) == 2:
        (n0, m0), (n1, m1) = rows
        print(f"ratio {n0}/{n1}: pull median {statistics.median(m0['pull']) / statistics.median(m1['pull']):.2f}, "
              f"p99 {pct(m0['pull'], .99) / pct(m1['pull'], .99):.2f}; TTFT median "
              f"{statistics.median(m0['ttft']) / statistics.median(m1['ttft']):.2f}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
