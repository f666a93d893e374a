"""Real SGLang host pools on CPU (no model, no GPU) for the plugin's tests and benchmark."""

from __future__ import annotations

import json
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

#: Every layout SGLang's MHA host pool offers; the page-unified one has no zero-copy page meta.
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def mha_pool(layout: str, page_size: int = 16, pages: int = 64, layers: int = 4, heads: int = 2,
             head_dim: int = 32, dtype: torch.dtype = torch.bfloat16) -> MHATokenToKVPoolHost:
    """An MHA host pool of ``pages`` pages over tiny CPU 'device' buffers."""
    dev_tokens = 2 * page_size
    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                          layout=KVBufferLayout.NHD),
        page_size=page_size, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                host_token_capacity=pages * page_size)


def mla_pool(layout: str, page_size: int = 16, pages: int = 64, layers: int = 3, lora: int = 64,
             rope: int = 16, dtype: torch.dtype = torch.bfloat16) -> MLATokenToKVPoolHost:
    dev_tokens = 2 * page_size
    bufs = tuple(torch.zeros(dev_tokens, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page_size,
                         kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=dtype,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=dev_tokens, start_layer=0, end_layer=layers,
                                target_layer_num=layers, host_token_capacity=pages * page_size)


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   model: str = "org/model-x") -> HiCacheStorageConfig:
    """SGLang's storage config, with the extra config parsed from CLI-style JSON as SGLang does."""
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=True, model_name=model,
                                extra_config=json.loads(json.dumps(extra)))


def fill(pool: Any, seed: int) -> None:
    """Random bytes in every page of the pool."""
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    raw = buf.view(torch.uint8) if buf.is_contiguous() else None
    assert raw is not None
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_bytes(pool: Any, page: int) -> bytes:
    """The bytes of one host page, fragment by fragment (what a storage backend must keep)."""
    import ctypes

    idx = torch.arange(page * pool.page_size, (page + 1) * pool.page_size, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return b"".join(ctypes.string_at(p, n) for p, n in zip(ptrs, sizes))


def token_indices(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size, dtype=torch.int64) for p in pages])
