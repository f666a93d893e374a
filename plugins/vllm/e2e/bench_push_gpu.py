"""Push through the connector's worker on GPUs: how much of the transfer a layer-wise push hides.

Two processes run the real ``kvx_vllm.worker.KVXWorker`` in push mode (vLLM's configs replaced by
the few fields the worker reads, as in ``bench_tp_gpu.py``; vLLM's CUDA build does not run on our
GPU machine): a prefill worker on GPU 0 and a decode worker on GPU 1, each holding a
Llama-3-8B-shaped KV cache (32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks, vLLM's HND
layout). Per request:

1. the decode worker gets the request as vLLM's scheduler hands a push request over
   (``start_load_kv`` with a ``RecvSpec`` carrying ``kvx_push``), which registers its blocks with
   the prefill worker (hello and registration notes through kvx);
2. the prefill worker runs a stand-in forward pass once the registration is in (the prefill
   scheduler's ``push_wait_s`` hold): per layer, the GEMMs, RMS norms and causal attention of a
   Llama-3-8B layer over the prompt (bf16; random weights, one set shared by the layers), the
   layer's K and V written into its blocks, then ``save_kv_layer`` (``KVXWorker.save_layer``, which records a CUDA
   event behind the layer and hands it to the pusher's poster thread); then ``wait_for_save``;
3. the decode worker polls ``get_transfer_results`` until the request is reported received
   (waiting up to 10 ms for a notification per call, as the connector does in the steps of an
   engine with nothing to compute).

Times (one clock for both processes): **prefill** from the pass's start to its last kernel having
executed (``torch.cuda.synchronize()`` after the last layer), **exposed** from there to the decode
worker seeing the request received, and **whole-request transfer** = the exposed time of the mode
that writes the whole request after the last layer (``layerwise`` off). Modes: ``whole``;
``layer-wise`` (``layerwise``, ``--group`` layers per write) with kvx's default blocking copy
stream (``KVX_CUDA_ORDER=legacy``); ``layer-wise caller`` with ``KVX_CUDA_ORDER=caller`` (the
copies on a non-blocking stream, ordered by the per-layer events). Every request's blocks are
compared with the prefill's (an exact checksum of their bits per layer, on each GPU). Backends:
``cuda`` (NVLink, the same machine) and ``tcp`` (through host memory: the stand-in for two
machines).

Run on a machine with 2 GPUs (after ``python setup.py build_ext --inplace``)::

    PYTHONPATH=.:plugins/vllm python plugins/vllm/e2e/bench_push_gpu.py

``--device cpu`` runs the same on host memory with a small shape (a check of the script). The exit
status is 1 when a request did not land or moved wrong bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_tp_gpu import Rank, cells, token_places, worker_configs  # noqa: E402


def checksum(t: Any) -> int:
    """An exact, position-weighted checksum of a tensor's bits (equal bits, equal sums)."""
    import torch

    bits = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).reshape(-1).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return int((bits * weights).sum())


MODES = {"whole": (False, "legacy"), "layer-wise": (True, "legacy"), "layer-wise caller": (True, "caller")}


def push_rank(conn: Any, o: dict[str, Any]) -> None:
    """A prefill or decode worker in push mode (run by ``bench_tp_gpu._serve`` with impl ``push``)."""
    os.environ["KVX_CUDA_ORDER"] = o["order"]  # read when kvx's backends are configured
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    from kvx_vllm.config import KVXConnectorConfig
    from kvx_vllm.metadata import KVXConnectorMetadata, PushSpec, RecvSpec, SendSpec
    from kvx_vllm.proxy import push_params
    from kvx_vllm.util import compat_info, remote_params
    from kvx_vllm.worker import KVXWorker

    cuda = o["device"] == "cuda"
    dev = torch.device("cuda", o["gpu"]) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    L, H, D, bs, nb = o["layers"], o["heads"], o["head_dim"], o["block"], o["blocks"]
    names, vc, kcc = worker_configs(o, L, H, D, H, False, 1)
    cfg = KVXConnectorConfig.from_extra({"transfer_mode": "push", "layerwise": o["layerwise"],
                                         "push_group": o["group"], "backends": [o["backend"]],
                                         "push_timeout_s": 120, "load_timeout_s": 120, "lease_s": 3600})
    w = KVXWorker(vc, kcc, cfg, tp_rank=0)  # type: ignore[arg-type]
    dt = torch.bfloat16 if cuda else torch.float32
    caches = {n: torch.zeros(nb, H, bs, 2 * D, dtype=dt, device=dev) for n in names}
    w.register_kv_caches(caches)
    hidden, inter, qh = o["hidden"], o["inter"], o["q_heads"]
    if o["role"] == "kv_producer":
        g = torch.Generator(device=dev).manual_seed(1)
        s = hidden ** -0.5
        wq = torch.randn(hidden, (qh + 2 * H) * D, generator=g, device=dev, dtype=torch.float32).to(dt) * s
        wo = torch.randn(qh * D, hidden, generator=g, device=dev, dtype=torch.float32).to(dt) * s
        w13 = torch.randn(hidden, 2 * inter, generator=g, device=dev, dtype=torch.float32).to(dt) * s
        w2 = torch.randn(inter, hidden, generator=g, device=dev, dtype=torch.float32).to(dt) * inter ** -0.5

    def norm(x: Any) -> Any:  # RMSNorm without a weight
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    def layer(x: Any) -> tuple[Any, Any]:
        """One Llama layer's GEMMs and causal attention; returns (output, its K and V
        ``[tokens, 2, heads, D]``)."""
        n = x.shape[0]
        qkv = norm(x) @ wq
        q = qkv[:, :qh * D].view(n, qh, D).transpose(0, 1)
        k = qkv[:, qh * D:(qh + H) * D].view(n, H, D)
        v = qkv[:, (qh + H) * D:].view(n, H, D)
        att = torch.nn.functional.scaled_dot_product_attention(
            q[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        x = x + att[0].transpose(0, 1).reshape(n, qh * D) @ wo
        gu = norm(x) @ w13
        x = x + (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w2
        return x, torch.stack([k, v], dim=1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    hs = w.handshake_metadata()
    conn.send_bytes(json.dumps({"ready": True, "hs": hs.__dict__ if hs is not None else None}).encode())
    while True:
        cmd = json.loads(conn.recv_bytes())
        c = cmd["cmd"]
        if c == "endpoint":  # prefill: what the proxy learns from a first answer (kv_transfer_params)
            from kvx_vllm.metadata import KVXHandshakeMetadata

            p = remote_params(engine_id=o["engine"], request_id="endpoint", block_ids=[[0]],
                              workers={0: KVXHandshakeMetadata(**cmd["hs"])}, num_tokens=bs, tp_size=1, lease=2,
                              compat=compat_info(vc), host="127.0.0.1", port=0)  # type: ignore[arg-type]
            conn.send_bytes(json.dumps({"params": p}).encode())
        elif c == "expect":  # decode: the request arrives (its blocks register with the prefill);
            # then poll until it has landed (bounded) and answer with the blocks' checksums
            _pre, dparams = push_params(cmd["endpoint"], cmd["push"])
            lids, rid = cmd["blocks"], cmd["rid"]
            recv = RecvSpec(rid, [lids], [[]], dparams, [list(range(len(lids)))])
            w.start_load_kv(KVXConnectorMetadata(recv=[recv]))
            conn.send_bytes(b'{"ok": true}')
            end = time.monotonic() + 120
            landed = None
            while time.monotonic() < end:
                # as vLLM's decode steps while the request waits: up to IDLE_WAIT_S (10 ms, the
                # scheduler's) waiting for a notification, the GIL free (a loop spinning in Python
                # here would hold it from kvx's transfer threads: ~20 ms per tcp frame)
                _s, recving, _f = w.get_transfer_results(set(), 0.01)
                if rid in recving:
                    landed = time.perf_counter()
                    break
            bad = sorted(w.get_block_ids_with_load_errors())
            blk, pos = token_places(lids, cmd["tokens"], bs, dev)
            sums = [checksum(cells("HND", caches[n], D)[blk, :, pos]) for n in names]
            w.get_transfer_results({rid})  # the decode finishes the request
            conn.send_bytes(json.dumps({"landed": landed, "sums": sums, "failed": bad}).encode())
        elif c == "prefill":  # prefill: wait for the registration, run the pass, push
            push, rid, n = cmd["push"], cmd["rid"], cmd["tokens"]
            end = time.monotonic() + 60
            while True:
                w.get_transfer_results(set())
                meta = w.build_worker_meta()
                if meta is not None and push in meta.registered.get(0, []):
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"no registration of {push} within 60 s")
                time.sleep(0.0005)
            blk, pos = token_places(cmd["blocks"], n, bs, dev)
            x = torch.randn(n, hidden, generator=torch.Generator(device=dev).manual_seed(cmd["seed"]),
                            device=dev, dtype=torch.float32).to(dt) * 0.1
            pmeta = KVXConnectorMetadata(push=[PushSpec(rid, push, [cmd["blocks"]])])
            sync()
            t0 = time.perf_counter()
            for name in names:
                x, kv = layer(x)
                cells("HND", caches[name], D)[blk, :, pos] = kv
                w.save_layer(pmeta, name)
            sync()  # the pass's last kernel has executed (the poster thread goes on meanwhile)
            t_end = time.perf_counter()
            w.wait_for_save(pmeta)
            t_saved = time.perf_counter()
            # the request finishes: its blocks are freed at once (pushed in the pass)
            w.wait_for_save(KVXConnectorMetadata(send=[SendSpec(rid, 120.0, cmd["lease"], cmd["blocks"], push=push,
                                                                groups=[cmd["blocks"]])]))
            sums = [checksum(cells("HND", caches[n], D)[blk, :, pos]) for n in names]
            conn.send_bytes(json.dumps({"t0": t0, "t_end": t_end, "t_saved": t_saved, "sums": sums,
                                        "stats": w.push_prefill.stats if w.push_prefill else {}}).encode())
        elif c == "quit":
            w.shutdown()
            conn.send_bytes(b"{}")
            return


def run_mode(ctx: Any, a: argparse.Namespace, backend: str, mode: str, tokens: list[int],
             common: dict[str, Any]) -> list[dict[str, Any]]:
    import numpy as np

    layerwise, order = MODES[mode]
    o = dict(common, backend=backend, layerwise=layerwise, order=order, group=a.group, tp=1, rank=0,
             layout="HND")
    gpus = (0, 1) if a.device == "cuda" else (0, 0)
    pre = Rank(ctx, "push", role="kv_producer", engine="p", gpu=gpus[0], **o)
    dec = Rank(ctx, "push", role="kv_consumer", engine="d", gpu=gpus[1], **o)
    rows = []
    try:
        pre.ready()
        dec.ready()
        endpoint = pre.call(cmd="endpoint", hs=pre.hello["hs"])["params"]
        rng = np.random.default_rng(0)
        lease = int(time.time_ns() // 1000) * 2
        for n in tokens:
            pf, ex, ok = [], [], True
            for it in range(a.iters + 1):  # the first: a warm-up (connects, builds the lists)
                nblk = -(-n // a.block)
                rb = [int(b) for b in rng.permutation(common["blocks"])[:nblk]]
                lb = [int(b) for b in rng.permutation(common["blocks"])[:nblk]]
                rid, push = f"{backend}-{mode}-{n}-{it}", f"push-{backend}-{mode.replace(' ', '-')}-{n}-{it}"
                lease += 2
                dec.call(cmd="expect", rid=rid + "-d", push=push, blocks=lb, tokens=n, endpoint=endpoint)
                pr = pre.call(cmd="prefill", rid=rid, push=push, blocks=rb, tokens=n, seed=it + 3, lease=lease)
                dr = dec.recv()
                if dr["landed"] is None or dr["failed"] or dr["sums"] != pr["sums"]:
                    ok = False
                    print(f"  {backend} {mode} {n} tokens #{it}: landed={dr['landed'] is not None} "
                          f"bytes equal={dr['sums'] == pr['sums']} failed blocks={dr['failed'][:4]}", flush=True)
                    continue
                if it:
                    pf.append(pr["t_end"] - pr["t0"])
                    ex.append(max(0.0, dr["landed"] - pr["t_end"]))
            row = {"backend": backend, "mode": mode, "tokens": n, "group": a.group if layerwise else None,
                   "prefill_ms": float(np.median(pf)) * 1e3 if pf else None,
                   "exposed_ms": float(np.median(ex)) * 1e3 if ex else None, "verified": ok,
                   "GB": n * 2 * common["heads"] * common["head_dim"] * (2 if a.device == "cuda" else 4)
                   * common["layers"] / 1e9}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pre.close()
        dec.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", default=None, help="default: 4096,16384,32768 (cuda), 256,1024 (cpu)")
    ap.add_argument("--backends", default="cuda,tcp", help="default: cuda,tcp (cuda), host,tcp (cpu)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--group", type=int, default=2, help="layers per write in the layer-wise modes")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    tokens = [int(t) for t in (a.tokens or ("4096,16384,32768" if cuda else "256,1024")).split(",")]
    backends = a.backends.split(",") if cuda or a.backends != "cuda,tcp" else ["host", "tcp"]
    common = dict(device=a.device, block=a.block, blocks=-(-max(tokens) // a.block) + 16,
                  layers=32 if cuda else 4, heads=8 if cuda else 2, head_dim=128 if cuda else 32,
                  hidden=4096 if cuda else 256, inter=14336 if cuda else 512, q_heads=32 if cuda else 8)
    import torch

    if cuda and torch.cuda.device_count() < 2:
        sys.exit(f"needs two GPUs, found {torch.cuda.device_count()} (--device cpu checks the script on CPU)")
    where = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if cuda else "CPU"
    print(f"== {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{common['layers']} layers, {common['heads']} KV heads of {common['head_dim']}, "
          f"group {a.group}", flush=True)
    rows: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    for backend in backends:
        for mode in a.modes.split(","):
            rows += run_mode(ctx, a, backend, mode, tokens, common)
    print()
    print("| backend | tokens | GB | prefill ms | whole transfer ms | " + " | ".join(
        f"{m} exposed ms (% of whole)" for m in a.modes.split(",") if m != "whole") + " |")
    for backend in backends:
        for n in tokens:
            rs = {r["mode"]: r for r in rows if r["backend"] == backend and r["tokens"] == n}
            whole = rs.get("whole", {}).get("exposed_ms")
            pf = rs.get("whole", next(iter(rs.values()), {})).get("prefill_ms")
            cells_ = []
            for m in a.modes.split(","):
                if m == "whole":
                    continue
                e = rs.get(m, {}).get("exposed_ms")
                cells_.append("-" if e is None else f"{e:.1f}" + (f" ({100 * e / whole:.0f}%)" if whole else "")
                              + f", prefill {rs[m]['prefill_ms']:.0f}")
            gb = next(iter(rs.values()))["GB"] if rs else 0
            print(f"| {backend} | {n} | {gb:.2f} | {pf:.1f} | {whole:.1f} | " + " | ".join(cells_) + " |"
                  if pf is not None and whole is not None else f"| {backend} | {n} | - |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": rows}, fh, indent=1)
    if not all(r["verified"] for r in rows):
        sys.exit("some requests did not land or moved wrong bytes")


if __name__ == "__main__":
    main()
