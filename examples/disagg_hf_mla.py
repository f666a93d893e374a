"""Disaggregated prefill/decode of an MLA model (transformers DeepseekV3), the latent cache moved by kvx.

DeepSeek-V3's multi-head latent attention caches, per token and layer, one latent shared by all
heads: the normalised compressed KV (``kv_lora_rank`` 512 values) and the rotary key (``qk_rope_head_dim``
64), 576 values. transformers keeps exactly that in its ``DynamicCache`` (layer ``i``: ``keys``
``[batch, 1, tokens, 512]``, ``values`` ``[batch, 1, tokens, 64]``); vLLM keeps it paged, one
``[num_blocks, block_size, 576]`` tensor per layer. This example moves it the way the kvx vLLM
connector does:

1. a prefill process (GPU 0) runs a randomly initialised DeepseekV3 (fixed seed; dense layers, or a
   few MoE layers with ``--moe``) over the prompt and writes the latents into a vLLM-shaped paged
   cache, the request's blocks scattered (permuted block ids), ``--prefill-block`` tokens a block;
2. a decode process (GPU 1) with a paged cache of its own (``--decode-block`` tokens a block, another
   permutation) builds the descriptor lists with the connector's planning code
   (``kvx_vllm.plan``: ``layer_geometry`` and ``PeerTables``, the MLA latent as one head), pulls the
   request with one kvx read (and a notification that frees the prefill's blocks), rebuilds a
   ``DynamicCache`` from its blocks and decodes greedily;
3. the tokens are compared with the same prompt generated in one process on GPU 1.

Run on a machine with two GPUs (after ``python setup.py build_ext --inplace``)::

    python examples/disagg_hf_mla.py                    # DeepSeek-V3-latent model, bf16, GPU 0 -> GPU 1
    python examples/disagg_hf_mla.py --moe --prompt-len 8192

``--device cpu`` runs the same on CPU (both processes, fp32, kvx's ``host`` backend, a tiny shape),
as the tests do. Exit status 0 when the tokens are identical, 1 when not.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

import kvx

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    from kvx_vllm.plan import LayerGeom, PeerTables, layer_geometry
except ImportError:  # a source checkout without the plugin installed
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "plugins", "vllm"))
    from kvx_vllm.plan import LayerGeom, PeerTables, layer_geometry

from disagg_hf import greedy, prompt_ids, sync  # noqa: E402  (the Llama example's helpers)

KV_LORA, ROPE = 512, 64  # DeepSeek-V3's latent: 512 + 64 = 576 values per token and layer
SHAPES: dict[str, dict[str, Any]] = {
    # ~0.22 B parameters: DeepSeek-V3's latent (512 + 64) and head dims (128 + 64) at a smaller width and depth
    "small": {"hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 512, "num_hidden_layers": 8,
              "num_attention_heads": 16, "q_lora_rank": 384, "qk_nope_head_dim": 128, "v_head_dim": 128,
              "vocab_size": 32000},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_hidden_layers": 3,
             "num_attention_heads": 4, "q_lora_rank": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
             "vocab_size": 512},
}


def build_model(shape: str, moe: bool, device: str, dtype: Any) -> Any:
    """The same random-weight DeepseekV3 in every process (fixed seed, initialised on the CPU)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    s = SHAPES[shape]
    cfg = DeepseekV3Config(**s, num_key_value_heads=s["num_attention_heads"], kv_lora_rank=KV_LORA,
                           qk_rope_head_dim=ROPE, first_k_dense_replace=1 if moe else s["num_hidden_layers"],
                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           max_position_embeddings=32768, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(cfg).to(dtype).to(device).eval()


def latent(cache: Any, i: int) -> tuple[Any, Any]:
    """Layer ``i``'s latent of a DynamicCache: ``(kv_nope [b, 1, T, 512], k_rot [b, 1, T, 64])``."""
    layer = cache.layers[i]
    k, v = layer.keys, layer.values
    if k.shape[1] != 1 or k.shape[-1] != KV_LORA or v.shape[-1] != ROPE:
        raise RuntimeError(f"transformers cached layer {i} as {tuple(k.shape)} / {tuple(v.shape)}, not the MLA "
                           f"latent [b, 1, T, {KV_LORA}] / [b, 1, T, {ROPE}] this example moves")
    return k, v


def paged(layers: int, blocks: int, block: int, device: str, dtype: Any) -> list[Any]:
    """vLLM's MLA cache: per layer ``[num_blocks, block_size, 576]``."""
    import torch

    return [torch.zeros(blocks, block, KV_LORA + ROPE, dtype=dtype, device=device) for _ in range(layers)]


def places(ids: np.ndarray, tokens: int, block: int, device: str) -> tuple[Any, Any]:
    """(block id, slot) of every token of a request laid out in blocks ``ids``."""
    import torch

    t = torch.arange(tokens, device=device)
    return torch.as_tensor(ids, device=device)[t // block], t % block


def geometries(caches: list[Any], block: int) -> list[LayerGeom]:
    return [layer_geometry(f"model.layers.{i}.self_attn", t, 0, block, 1, KV_LORA + ROPE, mla=True)
            for i, t in enumerate(caches)]


def kind_of(device: str) -> tuple[kvx.MemoryKind, int]:
    return (kvx.MemoryKind.HOST, 0) if device == "cpu" else (kvx.MemoryKind.CUDA, int(device.split(":")[1]))


def prefill_proc(conn: Any, a: argparse.Namespace) -> None:
    import torch

    dev = "cpu" if a.device == "cpu" else "cuda:0"
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    model = build_model(a.shape, a.moe, dev, dtype)
    ids = prompt_ids(a.prompt_len, model.config.vocab_size).to(dev)
    with torch.inference_mode():
        model(input_ids=ids[:, :16], use_cache=True)  # warm-up (kernels, allocator)
        sync(dev)
        t = time.perf_counter()
        res = model(input_ids=ids, use_cache=True)
        first = res.logits[:, -1].argmax(-1)
        sync(dev)
        prefill_s = time.perf_counter() - t
        n = a.prompt_len
        nblk = -(-n // a.prefill_block)
        blocks = np.random.default_rng(1).permutation(nblk + 8)[:nblk]  # the request's blocks, scattered
        caches = paged(model.config.num_hidden_layers, nblk + 8, a.prefill_block, dev, dtype)
        blk, pos = places(blocks, n, a.prefill_block, dev)
        for i, c in enumerate(caches):
            k, v = latent(res.past_key_values, i)
            c[blk, pos, :KV_LORA] = k[0, 0]
            c[blk, pos, KV_LORA:] = v[0, 0]
        sync(dev)
    kind, gpu = kind_of(dev)
    backends = ("host",) if a.device == "cpu" else (a.backend,)
    with kvx.Agent("prefill-0", kvx.AgentConfig(backends=backends)) as agent:
        reg = agent.register(caches)
        conn.send_bytes(agent.metadata())
        conn.send_bytes(json.dumps({"layers": [g.to_list() for g in geometries(caches, a.prefill_block)],
                                    "kind": kind.name, "dev": gpu, "blocks": blocks.tolist(), "first": int(first),
                                    "prefill_s": prefill_s}).encode())
        # the blocks stay registered until the decode side says it has read them
        end = time.monotonic() + 300
        while time.monotonic() < end and not agent.notifications(timeout=1.0):
            pass
        reg.release()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: small on cuda, tiny on cpu")
    ap.add_argument("--moe", action="store_true", help="MoE layers after the first (default: dense layers)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default: 4096 on cuda, 100 on cpu")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prefill-block", type=int, default=16)
    ap.add_argument("--decode-block", type=int, default=32)
    ap.add_argument("--backend", default="cuda", help="kvx backend for GPU memory (cuda, or a cross-machine one)")
    a = ap.parse_args()
    a.shape = a.shape or ("tiny" if a.device == "cpu" else "small")
    a.prompt_len = a.prompt_len or (100 if a.device == "cpu" else 4096)
    small, big = sorted((a.prefill_block, a.decode_block))
    if small <= 0 or big % small or a.prompt_len < 17 or a.new_tokens < 1:
        ap.error("block sizes must be positive and the smaller must divide the larger; --prompt-len > 16, "
                 "--new-tokens >= 1")
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
        model = build_model(a.shape, a.moe, dev, dtype)
        layers = model.config.num_hidden_layers
        if not parent.poll(600):
            raise TimeoutError(f"the prefill process sent nothing within 600 s (exit code {p.exitcode})")
        meta = parent.recv_bytes()
        info = json.loads(parent.recv_bytes())
        remote_geoms = [LayerGeom.from_list(g) for g in info["layers"]]
        n = a.prompt_len
        nblk = -(-n // a.decode_block)
        mine = np.random.default_rng(2).permutation(nblk + 8)[:nblk]
        caches = paged(layers, nblk + 8, a.decode_block, dev, dtype)
        kind, gpu = kind_of(dev)
        backends = ("host",) if a.device == "cpu" else (a.backend,)
        with kvx.Agent("decode-0", kvx.AgentConfig(backends=backends)) as agent:
            peer = agent.add_peer(meta)
            agent.register(caches)
            # the connector's plan: the latent is one head held by every rank; lists built once per peer
            tables = PeerTables(geometries(caches, a.decode_block), remote_geoms, 0, 0, 1, kind, gpu,
                                kvx.MemoryKind[info["kind"]], int(info["dev"]))
            local = agent.prepare(tables.local_descs)
            remote = agent.prepare(tables.remote_descs, peer=peer)
            li, ri, _used = tables.indices([(mine, np.arange(nblk), np.asarray(info["blocks"]))])
            agent.read(local, li, remote, ri).wait(60)  # connection and path warm-up
            t = time.perf_counter()
            x = agent.read(local, li, remote, ri, notify=b"done")
            x.wait(60)
            xfer_s = time.perf_counter() - t
            via = x.backend
        from transformers import DynamicCache

        cache = DynamicCache()
        blk, pos = places(mine, n, a.decode_block, dev)
        for i, c in enumerate(caches):
            rows = c[blk, pos]
            cache.update(rows[None, None, :, :KV_LORA].contiguous(), rows[None, None, :, KV_LORA:].contiguous(), i)
        got, step1 = greedy(model, cache, torch.tensor([info["first"]]), a.new_tokens, n, dev)
        # the reference: the same prompt generated in this one process, on this one device
        with torch.inference_mode():
            ids = prompt_ids(n, model.config.vocab_size).to(dev)
            res = model(input_ids=ids, use_cache=True)
            want, _ = greedy(model, res.past_key_values, res.logits[:, -1].argmax(-1), a.new_tokens, n, dev)
        nbytes = (KV_LORA + ROPE) * caches[0].element_size() * layers * n
        n_params = sum(t.numel() for t in model.parameters())
        print(f"model      : DeepseekV3 {a.shape} shape ({'MoE' if a.moe else 'dense'}), {n_params / 1e9:.2f} B "
              f"parameters, {dtype}, MLA latent {KV_LORA}+{ROPE} per token x {layers} layers; {a.device}")
        print(f"prefill    : {n} tokens in {info['prefill_s'] * 1e3:.1f} ms (process 0), "
              f"{a.prefill_block}-token blocks")
        print(f"KV latent  : {nbytes / 2**20:.2f} MiB into {a.decode_block}-token blocks, {len(li)} pieces "
              f"(kvx_vllm.plan.PeerTables)")
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
