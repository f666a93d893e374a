"""Disaggregated prefill/decode with PyTorch + transformers, the KV cache moved by kvx.

A prefill process on GPU 0 runs a Llama-architecture model (built locally with random weights:
a ~1B-parameter shape, bf16, grouped-query attention) over a long prompt, copies the resulting KV
cache into one registered buffer and hands kvx metadata to a decode process on GPU 1. The decode
process pulls the whole cache through kvx (the ``cuda`` backend: GPU to GPU), continues greedy
decoding from it, and checks the tokens against generating the same prompt in one process. It
prints the prefill time, the KV bytes, the transfer time and rate, and the first decode step.

Run on a machine with two GPUs::

    python examples/disagg_hf.py                      # ~1B shape, bf16, GPU 0 -> GPU 1
    python examples/disagg_hf.py --prompt-len 8192    # more KV

``--device cpu`` runs the same logic on CPU with a tiny fp32 shape and kvx's ``host`` backend
(what the tests do on machines without a GPU). Exit status 0 when the tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from typing import Any

import kvx

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B-like: 16 layers, 32 query heads of 64, 8 KV heads (GQA), ~1.2B parameters
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
}


def build_model(shape: str, device: str, dtype: Any) -> Any:
    """The same random-weight model in every process (fixed seed, initialised on the CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=32768, initializer_range=0.1,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).to(device).eval()
    return model


def prompt_ids(n: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (1, n), generator=g)


def layer_kv(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer ``i``'s key and value tensors ``[batch, kv_heads, tokens, head_dim]`` of a DynamicCache."""
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[i].keys, cache.layers[i].values
    return cache.key_cache[i], cache.value_cache[i]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def greedy(model: Any, cache: Any, first: Any, n: int, pos: int, device: str) -> tuple[list[int], float]:
    """``n`` greedy tokens after ``first`` from ``cache`` (holding ``pos`` tokens); returns the
    tokens (``first`` included) and the first decode step's seconds."""
    import torch

    out = [int(first)]
    tok = first.view(1, 1).to(device)
    step1 = 0.0
    with torch.inference_mode():
        for i in range(n):
            t = time.perf_counter()
            logits = model(input_ids=tok, past_key_values=cache, use_cache=True,
                           position_ids=torch.tensor([[pos + i]], device=device)).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            sync(device)
            if i == 0:
                step1 = time.perf_counter() - t
            out.append(int(tok))
    return out, step1


def prefill_proc(conn: Any, a: argparse.Namespace) -> None:
    import torch

    dev = "cpu" if a.device == "cpu" else "cuda:0"
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    model = build_model(a.shape, dev, dtype)
    ids = prompt_ids(a.prompt_len, model.config.vocab_size).to(dev)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], use_cache=True)  # warm-up (kernels, allocator)
        sync(dev)
        t = time.perf_counter()
        res = model(input_ids=ids, use_cache=True)
        first = res.logits[:, -1].argmax(-1)
        sync(dev)
        prefill_s = time.perf_counter() - t
        layers = model.config.num_hidden_layers
        k0, _ = layer_kv(res.past_key_values, 0)
        # the whole cache in one buffer: [layer][k|v][batch, kv_heads, tokens, head_dim]
        kv = torch.empty((layers, 2, *k0.shape), dtype=k0.dtype, device=dev)
        for i in range(layers):
            k, v = layer_kv(res.past_key_values, i)
            kv[i, 0].copy_(k)
            kv[i, 1].copy_(v)
        sync(dev)
    backends = ("host",) if a.device == "cpu" else (a.backend,)
    with kvx.Agent("prefill-0", kvx.AgentConfig(backends=backends)) as agent:
        reg = agent.register(kv)
        conn.send_bytes(agent.metadata())
        conn.send_bytes(reg.descs.to_bytes())
        conn.send_bytes(json.dumps({"shape": list(kv.shape), "first": int(first), "prefill_s": prefill_s}).encode())
        # keep the cache registered until the decode side says it has read it
        end = time.monotonic() + 300
        while time.monotonic() < end and not agent.notifications(timeout=1.0):
            pass
        reg.release()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1b on cuda, tiny on cpu")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 4096 on cuda, 100 on cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--backend", default="cuda", help="kvx backend for GPU memory (cuda, or a cross-machine one)")
    a = ap.parse_args()
    a.shape = a.shape or ("tiny" if a.device == "cpu" else "1b")
    a.prompt_len = a.prompt_len or (100 if a.device == "cpu" else 4096)
    import torch

    if a.device == "cuda" and torch.cuda.device_count() < 2:
        print("needs two GPUs (prefill on GPU 0, decode on GPU 1); --device cpu runs the logic on CPU",
              file=sys.stderr)
        return 2
    dev = "cpu" if a.device == "cpu" else "cuda:1"
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=prefill_proc, args=(child, a))
    p.start()
    try:
        model = build_model(a.shape, dev, dtype)
        if not parent.poll(600):
            raise TimeoutError("the prefill process sent nothing within 600 s")
        meta, descs = parent.recv_bytes(), parent.recv_bytes()
        info = json.loads(parent.recv_bytes())
        kv = torch.empty(info["shape"], dtype=dtype, device=dev)
        backends = ("host",) if a.device == "cpu" else (a.backend,)
        with kvx.Agent("decode-0", kvx.AgentConfig(backends=backends)) as agent:
            peer = agent.add_peer(meta)
            local = agent.prepare(agent.register(kv).descs)
            remote = agent.prepare(kvx.DescList.from_bytes(descs), peer=peer)
            agent.read(local, [0], remote, [0]).wait(60)  # connection and path warm-up
            t = time.perf_counter()
            x = agent.read(local, [0], remote, [0], notify=b"done")
            x.wait(60)
            xfer_s = time.perf_counter() - t
            via = x.backend
        from transformers import DynamicCache

        cache = DynamicCache()
        for i in range(kv.shape[0]):
            cache.update(kv[i, 0], kv[i, 1], i)
        first = torch.tensor([info["first"]])
        got, step1 = greedy(model, cache, first, a.new_tokens, a.prompt_len, dev)
        # the reference: the same prompt generated in this one process
        with torch.inference_mode():
            ids = prompt_ids(a.prompt_len, model.config.vocab_size).to(dev)
            res = model(input_ids=ids, use_cache=True)
            want, _ = greedy(model, res.past_key_values, res.logits[:, -1].argmax(-1), a.new_tokens,
                             a.prompt_len, dev)
        nbytes = kv.numel() * kv.element_size()
        n_params = sum(t.numel() for t in model.parameters())
        print(f"model      : Llama {a.shape} shape, {n_params / 1e9:.2f} B parameters, {dtype}, "
              f"{model.config.num_key_value_heads} KV heads; {a.device}")
        print(f"prefill    : {a.prompt_len} tokens in {info['prefill_s'] * 1e3:.1f} ms (process 0)")
        print(f"KV cache   : {nbytes / 2**20:.1f} MiB")
        print(f"transfer   : {xfer_s * 1e3:.2f} ms via kvx backend {via!r}, {nbytes / xfer_s / 1e9:.2f} GB/s")
        print(f"decode     : first step {step1 * 1e3:.2f} ms (process 1)")
        print(f"tokens     : {got}")
        same = got == want
        print("token-identical to single-process generation" if same
              else f"DIFFERENT from single-process generation: {want}")
        return 0 if same else 1
    finally:
        p.join(60)
        if p.is_alive():
            p.kill()


if __name__ == "__main__":
    sys.exit(main())
