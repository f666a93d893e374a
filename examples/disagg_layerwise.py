"""Layer-wise KV streaming vs whole-request transfer: prefill on GPU 0 pushes its KV cache into
decode's memory on GPU 1 through kvx, measured as the time the transfer adds after prefill.

Two processes. The decode process (GPU 1) allocates one buffer per prompt length,
``[layer][k|v][batch, kv_heads, tokens, head_dim]``, registers it with kvx and hands the prefill
process (GPU 0) its metadata and one descriptor per layer. The prefill process runs a
Llama-architecture model (transformers, random weights built locally on the GPU from a fixed
seed: no downloads) over the prompt with a forward hook on every decoder layer that copies that
layer's fresh K and V into a registered staging buffer and records a CUDA event. Then, per mode:

- ``whole``: after the forward pass, one kvx write of every layer (today's pull/push of a
  finished request, the baseline);
- ``layer:G``: the vLLM connector's push engine (``kvx_vllm.push.LayerPusher``, the code
  ``save_kv_layer`` drives in the engine) gets each layer with its event; its poster thread posts a
  nonblocking kvx write of each group of ``G`` layers as soon as the group has executed, while
  later layers compute.

Every write carries a kvx notification; the decode process counts them with the connector's
decode half (``kvx_vllm.push.PushLanding``), and the KV has *landed* when the last one arrived.
The figures, each the median of ``--reps`` runs:

- prefill: the forward pass on GPU 0 (the prompt's first token included);
- transfer: in ``whole`` mode, from posting the write to the KV landed on GPU 1;
- exposed: from the end of the prefill to the KV landed (what a request's time-to-first-token
  pays for the transfer); goal for layer-wise: <= 15% of the whole-request transfer wherever that
  transfer is at least a tenth of the prefill.

After every run the decode process decodes ``--new-tokens`` greedy tokens from the KV it received
and checks them against generating the same prompt in one process (exit status 1 if any differ).
The clocks of both processes are ``time.perf_counter`` (CLOCK_MONOTONIC: one clock per machine).

On a machine with two GPUs (``cuda`` backend: GPU to GPU; ``tcp``: the cross-machine stand-in,
GPU memory staged through host buffers over a socket)::

    python setup.py build_ext --inplace
    PYTHONPATH=. python examples/disagg_layerwise.py --json $OUT/layerwise.json
    PYTHONPATH=. python examples/disagg_layerwise.py --shape 8b --prompt-lens 4096,16384

``--device cpu`` runs the same logic on CPU with a tiny fp32 shape and kvx's ``host`` and ``tcp``
backends (what tests/test_layerwise.py does).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

# the cuda backend shares registered GPU memory through CUDA IPC, which needs the caching
# allocator's classic segments (docs/benchmarks.md, examples/disagg_hf.py)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")

import msgpack
import numpy as np

import kvx

# the vLLM connector's push engine (kvx_vllm.push needs kvx, numpy and msgpack only, not vLLM)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "vllm"))

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B-like: 16 layers, 32 query heads of 64, 8 KV heads (GQA): 32 KiB of KV per token (bf16)
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
    # Llama-3.2-3B-like: 28 layers, 24 query heads of 128, 8 KV heads: 112 KiB per token
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "vocab_size": 32000},
    # Llama-3-8B-like: 32 layers, 32 query heads of 128, 8 KV heads: 128 KiB per token
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}

WAIT_S = 120.0  # bound on every wait for the other process or a transfer


class HarnessError(RuntimeError):
    """The other process failed, timed out, or sent something unexpected."""


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def recv(conn: Any, timeout: float = WAIT_S) -> Any:
    if not conn.poll(timeout):
        raise HarnessError(f"the other process sent nothing within {timeout:.0f} s")
    msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
    if isinstance(msg, dict) and "error" in msg:
        raise HarnessError(f"the other process failed: {msg['error']}")
    return msg


def build_model(shape: str, device: str, dtype: Any) -> Any:
    """The same random-weight model in every process: fixed seed, initialised on ``device`` (two
    GPUs of one kind draw the same numbers; checked through :func:`weights_digest`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=65536, initializer_range=0.1,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def weights_digest(model: Any) -> float:
    import torch

    with torch.inference_mode():
        return float(sum(p.float().sum().item() for p in model.parameters()))


def prompt_ids(n: int, vocab: int, device: str) -> Any:
    import torch

    g = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (1, n), generator=g).to(device)


def layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer ``i``'s key and value tensors ``[batch, kv_heads, tokens, head_dim]`` of a DynamicCache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def kv_shape(model: Any, tokens: int) -> tuple[int, ...]:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (c.num_hidden_layers, 2, 1, c.num_key_value_heads, tokens, head_dim)


def greedy(model: Any, cache: Any, first: int, n: int, pos: int, device: str) -> list[int]:
    """``first`` and ``n`` greedy tokens after it, from ``cache`` holding ``pos`` tokens."""
    import torch

    out = [int(first)]
    tok = torch.tensor([[first]], device=device)
    with torch.inference_mode():
        for i in range(n):
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos + i]], device=device)).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            out.append(int(tok))
    return out


def parse_mode(mode: str, layers: int) -> int:
    """Layers per write: all of them for ``whole``, ``G`` for ``layer:G``."""
    if mode == "whole":
        return layers
    if mode.startswith("layer:") and mode[6:].isdigit() and int(mode[6:]) > 0:
        return min(int(mode[6:]), layers)
    raise ValueError(f"mode must be 'whole' or 'layer:G' (G >= 1 layers per write), not {mode!r}")


# ---------------------------------------------------------------------------------------------
# prefill side

class Streamer:
    """Copies each layer's KV into the registered staging buffer as the layer finishes (a forward
    hook). In layer-wise mode the hook then hands the layer to the vLLM connector's push engine,
    :class:`kvx_vllm.push.LayerPusher` (what ``save_kv_layer`` drives in the engine): with a CUDA
    event recorded after the copies, its poster thread posts one nonblocking kvx write per group
    of layers once the group has executed, while later layers compute."""

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.cuda = device.startswith("cuda")
        self.layers = model.config.num_hidden_layers
        self.names = [f"layer{i}" for i in range(self.layers)]
        self.run: dict[str, Any] | None = None
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            r = self.run
            if r is None:
                return
            k, v = layer_kv(r["cache"], i)
            r["kv"][i, 0].copy_(k)
            r["kv"][i, 1].copy_(v)
            if r["pusher"] is not None:
                ev = None
                if self.cuda:
                    import torch

                    ev = torch.cuda.Event()
                    ev.record()
                r["pusher"].on_layer(self.names[i], ev)
        return hook

    def prefill(self, ids: Any, kv: Any, mode: str, agent: Any, local: Any, remote: Any, peer: str,
                rid: str) -> dict[str, Any]:
        import torch
        from kvx_vllm.push import LayerPusher, PushDest, push_note
        from transformers import DynamicCache

        group = parse_mode(mode, self.layers)
        pusher = None
        if mode != "whole":
            pusher = LayerPusher(agent, self.names, group=group, timeout=WAIT_S, threaded=self.cuda)
            pusher.add(rid, PushDest(peer, local, remote,
                                     {n: (np.array([i]), np.array([i])) for i, n in enumerate(self.names)}))
        cache = DynamicCache(config=self.model.config)
        r: dict[str, Any] = {"cache": cache, "kv": kv, "pusher": pusher}
        if self.cuda:
            torch.cuda.synchronize()
        self.run = r
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                first = out.logits[:, -1].argmax(-1)
            if self.cuda:
                end = torch.cuda.Event()
                end.record()
                end.synchronize()  # the compute stream only: not kvx's copies
            t_end = time.perf_counter()
            first_tok = int(first)
        finally:
            self.run = None
        if pusher is not None:
            try:
                done, failed = pusher.wait()
                posts, writes = pusher.post_times, len(pusher.post_times)
            finally:
                pusher.close()
            if failed or done != {rid}:
                raise HarnessError(f"layer-wise push failed: {failed or 'not finished'}")
        else:
            if self.cuda:
                torch.cuda.synchronize()  # the hooks' copies (all queued before t_end anyway)
            posts, writes = [time.perf_counter()], 1
            idx = list(range(self.layers))
            agent.write(local, idx, remote, idx, notify=push_note(rid, 0, 1)).wait(WAIT_S)
        t_done = time.perf_counter()
        return {"t0": t0, "t_end": t_end, "t_first_post": posts[0], "t_last_post": posts[-1],
                "t_done": t_done, "writes": writes, "first": first_tok, "backend": agent.config.backends[0]}


def prefill_proc(conn: Any, a: dict[str, Any]) -> None:
    try:
        _prefill_main(conn, a)
    except BaseException as e:
        conn.send_bytes(pack({"error": f"{type(e).__name__}: {e}"}))
        raise


def _prefill_main(conn: Any, a: dict[str, Any]) -> None:
    import torch

    cuda = a["device"] == "cuda"
    dev = "cuda:0" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(a["shape"], dev, dtype)
    streamer = Streamer(model, dev)
    # Every write is posted after its bytes are ready (a layer's CUDA event executed, or the whole
    # prefill synchronised), so the copies may run on a non-blocking stream ("caller" order): on the
    # default blocking stream a layer's copy would wait for the layers queued after it.
    opts: dict[str, Any] = {}
    if cuda and a["order"] == "caller":
        from kvx.backends.cuda import CudaOptions
        from kvx.backends.tcp import TcpOptions

        opts = {"cuda": CudaOptions(order="caller"), "tcp": TcpOptions(cuda_order="caller")}
    agents = {b: kvx.Agent(f"prefill-{b}", kvx.AgentConfig(backends=(b,), options={k: v for k, v in opts.items()
                                                                                  if k == b}))
              for b in a["backends"]}
    conn.send_bytes(pack({"weights": weights_digest(model)}))
    state: dict[str, Any] = {}
    try:
        while True:
            msg = recv(conn, 3600)
            if msg["op"] == "quit":
                return
            if msg["op"] == "length":
                for reg in state.get("regs", ()):
                    reg.release()
                tokens = msg["tokens"]
                kv = torch.empty(kv_shape(model, tokens), dtype=dtype, device=dev)
                layer_bytes = kv[0].numel() * kv.element_size()
                state = {"kv": kv, "ids": prompt_ids(tokens, model.config.vocab_size, dev), "regs": [], "lists": {}}
                for b, agent in agents.items():
                    reg = agent.register(kv)
                    state["regs"].append(reg)
                    peer = agent.add_peer(msg["meta"][b])
                    state["lists"][b] = (agent.prepare(kvx.DescList.blocks(reg, layer_bytes)),
                                         agent.prepare(kvx.DescList.from_bytes(msg["descs"][b]), peer=peer), peer)
                conn.send_bytes(pack({"ok": True}))
            elif msg["op"] == "run":
                b = msg["backend"]
                local, remote, peer = state["lists"][b]
                res = streamer.prefill(state["ids"], state["kv"], msg["mode"], agents[b], local, remote, peer,
                                       msg["rid"])
                conn.send_bytes(pack(res))
            else:
                raise HarnessError(f"unknown op {msg['op']!r}")
    finally:
        for reg in state.get("regs", ()):
            reg.release()
        for agent in agents.values():
            agent.close()


# ---------------------------------------------------------------------------------------------
# decode side (the parent process)

def wait_landed(agent: Any, peer: str, rid: str, parts: int) -> float:
    """The time the last part of request ``rid`` arrived (kvx_vllm.push.PushLanding: what the
    decode worker of the vLLM connector runs)."""
    from kvx_vllm.push import PushLanding

    landing = PushLanding(timeout=WAIT_S, quiesce_s=WAIT_S, notify=agent.notify)
    landing.expect(rid, peer, parts)
    while True:
        landed, failed, _, _ = landing.poll(agent.notifications(timeout=1.0))
        if landed:
            return time.perf_counter()
        if failed:
            raise HarnessError(f"request {rid} did not land within {WAIT_S:.0f} s")


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1b on cuda, tiny on cpu")
    ap.add_argument("--prompt-lens", default=None, help="comma-separated; default 4096,8192,16384,32768 (cpu: 64,256)")
    ap.add_argument("--backends", default=None, help="comma-separated kvx backends; default cuda,tcp (cpu: host,tcp)")
    ap.add_argument("--modes", default=None,
                    help="comma-separated: whole, layer:G (G layers per write); default whole,layer:1,layer:2,layer:4")
    ap.add_argument("--order", choices=("caller", "legacy"), default="caller",
                    help="stream order of the prefill's GPU copies (KVX_CUDA_ORDER): caller, a non-blocking stream "
                         "(the writes are posted once their layer's event executed); legacy, a blocking stream "
                         "(each copy also waits for the layers queued after it)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--json", default=None,
                    help="write the results here (default: $OUT/disagg-layerwise.json if OUT is set)")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    a.shape = a.shape or ("tiny" if cpu else "1b")
    lens = [int(x) for x in (a.prompt_lens or ("64,256" if cpu else "4096,8192,16384,32768")).split(",")]
    backends = (a.backends or ("host,tcp" if cpu else "cuda,tcp")).split(",")
    modes = (a.modes or "whole,layer:1,layer:2,layer:4").split(",")
    layers = SHAPES[a.shape]["num_hidden_layers"]
    for m in modes:
        try:
            parse_mode(m, layers)
        except ValueError as e:
            ap.error(str(e))
    if "whole" not in modes:
        modes.insert(0, "whole")
    if a.reps < 1 or a.new_tokens < 0 or min(lens) < 2:
        ap.error("--reps >= 1, --new-tokens >= 0, prompt lengths >= 2")
    json_path = a.json or (os.path.join(os.environ["OUT"], "disagg-layerwise.json") if os.environ.get("OUT") else None)
    import torch

    if not cpu and torch.cuda.device_count() < 2:
        print("needs two GPUs (prefill on GPU 0, decode on GPU 1); --device cpu runs the logic on CPU",
              file=sys.stderr)
        return 2
    dev = "cpu" if cpu else "cuda:1"
    if not cpu:
        torch.cuda.set_device(1)
    dtype = torch.float32 if cpu else torch.bfloat16
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=prefill_proc, args=(child, {"device": a.device, "shape": a.shape, "backends": backends,
                                                        "order": a.order}))
    p.start()
    results: list[dict[str, Any]] = []
    all_same = True
    agents: dict[str, Any] = {}
    try:
        model = build_model(a.shape, dev, dtype)
        theirs = recv(parent, 900)["weights"]
        mine = weights_digest(model)
        if theirs != mine:
            raise HarnessError(f"the two processes built different weights ({theirs} vs {mine})")
        agents = {b: kvx.Agent(f"decode-{b}", kvx.AgentConfig(backends=(b,))) for b in backends}
        run_no = 0
        for tokens in lens:
            kv = torch.empty(kv_shape(model, tokens), dtype=dtype, device=dev)
            nbytes = kv.numel() * kv.element_size()
            layer_bytes = nbytes // layers
            regs = {b: ag.register(kv) for b, ag in agents.items()}
            parent.send_bytes(pack({"op": "length", "tokens": tokens,
                                    "meta": {b: ag.metadata() for b, ag in agents.items()},
                                    "descs": {b: kvx.DescList.blocks(regs[b], layer_bytes).to_bytes()
                                              for b in backends}}))
            recv(parent)
            # the reference: the same prompt generated in this one process
            ids = prompt_ids(tokens, model.config.vocab_size, dev)
            with torch.inference_mode():
                ref = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                want = greedy(model, ref.past_key_values, int(ref.logits[:, -1].argmax(-1)), a.new_tokens, tokens, dev)
            del ref
            for b in backends:
                for rep in range(-1, a.reps):  # rep -1: warm-up (first-use costs, connections), not counted
                    for mode in modes:
                        run_no += 1
                        rid = f"run{run_no}"
                        kv.zero_()
                        if not cpu:
                            torch.cuda.synchronize()
                        parent.send_bytes(pack({"op": "run", "backend": b, "mode": mode, "rid": rid}))
                        n = -(-layers // parse_mode(mode, layers))
                        t_landed = wait_landed(agents[b], f"prefill-{b}", rid, n)
                        res = recv(parent)
                        from transformers import DynamicCache

                        cache = DynamicCache(config=model.config)
                        for i in range(layers):
                            cache.update(kv[i, 0], kv[i, 1], i)
                        got = greedy(model, cache, res["first"], a.new_tokens, tokens, dev)
                        del cache
                        same = got == want
                        all_same &= same
                        if not same:
                            print(f"DIFFERENT tokens: {b} {mode} {tokens} tokens: {got} vs {want}", file=sys.stderr)
                        if rep < 0:
                            continue
                        results.append({
                            "backend": b, "via": res["backend"], "mode": mode, "prompt_tokens": tokens, "rep": rep,
                            "kv_bytes": nbytes, "writes": res["writes"],
                            "prefill_ms": (res["t_end"] - res["t0"]) * 1e3,
                            "transfer_ms": (t_landed - res["t_first_post"]) * 1e3,
                            # landed before the prefill ended (the lm head ran after the last layer): nothing exposed
                            "exposed_ms": max(0.0, t_landed - res["t_end"]) * 1e3,
                            "landed_after_end_ms": (t_landed - res["t_end"]) * 1e3,
                            "first_post_before_end_ms": (res["t_end"] - res["t_first_post"]) * 1e3,
                            "writes_done_ms": (res["t_done"] - res["t_end"]) * 1e3,
                            "identical": same})
            for reg in regs.values():
                reg.release()
            del kv
        parent.send_bytes(pack({"op": "quit"}))
    finally:
        for ag in agents.values():
            ag.close()
        p.join(60)
        if p.is_alive():
            p.kill()
    summary = summarize(results, lens, backends, modes)
    print_table(summary, a, dtype)
    doc = {"shape": a.shape, "config": SHAPES[a.shape], "device": a.device, "dtype": str(dtype),
           "gpus": [torch.cuda.get_device_name(i) for i in range(2)] if not cpu else [],
           "reps": a.reps, "order": a.order, "new_tokens": a.new_tokens,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                        "kvx": getattr(kvx, "__version__", "?")},
           "env": {k: v for k, v in os.environ.items() if k.startswith("KVX_") or k == "PYTORCH_CUDA_ALLOC_CONF"},
           "identical": all_same, "summary": summary, "runs": results}
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {json_path}")
    print("tokens identical to single-process generation in every run" if all_same
          else "DIFFERENT tokens in some run (above)")
    return 0 if all_same else 1


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def summarize(results: list[dict[str, Any]], lens: list[int], backends: list[str],
              modes: list[str]) -> list[dict[str, Any]]:
    """One row per (backend, prompt length): medians, the best layer-wise mode and the goal."""
    rows = []
    for b in backends:
        for tokens in lens:
            by = {m: [r for r in results if r["backend"] == b and r["prompt_tokens"] == tokens and r["mode"] == m]
                  for m in modes}
            whole = by["whole"]
            row: dict[str, Any] = {
                "backend": b, "prompt_tokens": tokens, "kv_bytes": whole[0]["kv_bytes"] if whole else 0,
                "prefill_ms": median([r["prefill_ms"] for r in whole]),
                "transfer_ms": median([r["transfer_ms"] for r in whole]),
                "exposed_whole_ms": median([r["exposed_ms"] for r in whole]),
                "layerwise": {m: {"exposed_ms": median([r["exposed_ms"] for r in rs]),
                                  "prefill_ms": median([r["prefill_ms"] for r in rs]),
                                  "writes": rs[0]["writes"] if rs else 0}
                              for m, rs in by.items() if m != "whole"},
                "identical": all(r["identical"] for rs in by.values() for r in rs)}
            lw = row["layerwise"]
            if lw:
                best = min(lw, key=lambda m: lw[m]["exposed_ms"])
                row["best_mode"] = best
                row["exposed_layerwise_ms"] = lw[best]["exposed_ms"]
                row["prefill_layerwise_ms"] = lw[best]["prefill_ms"]
                row["exposed_ratio"] = (row["exposed_layerwise_ms"] / row["transfer_ms"]
                                        if row["transfer_ms"] > 0 else None)
                row["goal_applies"] = row["transfer_ms"] >= row["prefill_ms"] / 10
                row["goal_met"] = (row["exposed_ratio"] is not None and row["exposed_ratio"] <= 0.15) \
                    if row["goal_applies"] else None
            rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], a: argparse.Namespace, dtype: Any) -> None:
    print(f"Llama {a.shape} shape ({SHAPES[a.shape]['num_hidden_layers']} layers), {dtype}, {a.device}; "
          f"medians of {a.reps} runs; times in ms")
    hdr = ("backend", "tokens", "KV MiB", "prefill", "transfer", "exposed whole", "best layer-wise",
           "exposed lw", "lw/transfer", "prefill lw", "goal", "tokens")
    print(" | ".join(hdr))
    for r in rows:
        ratio = r.get("exposed_ratio")
        goal = "n/a" if not r.get("goal_applies") else ("met" if r.get("goal_met") else "MISSED")
        print(" | ".join([
            r["backend"], str(r["prompt_tokens"]), f"{r['kv_bytes'] / 2**20:.0f}", f"{r['prefill_ms']:.1f}",
            f"{r['transfer_ms']:.2f}", f"{r['exposed_whole_ms']:.2f}", r.get("best_mode", "-"),
            f"{r.get('exposed_layerwise_ms', float('nan')):.2f}",
            f"{ratio * 100:.0f}%" if ratio is not None else "-",
            f"{r.get('prefill_layerwise_ms', float('nan')):.1f}", goal,
            "identical" if r["identical"] else "DIFFERENT"]))


if __name__ == "__main__":
    sys.exit(main())
