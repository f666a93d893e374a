"""Helpers shared by the two halves of the connector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["compat_info", "compat_mismatch"]


def compat_info(vllm_config: "VllmConfig") -> dict[str, Any]:
    """What must be equal between a prefill and a decode instance for their blocks to match."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    hf = getattr(mc, "hf_config", None)
    name = str(mc.served_model_name if isinstance(mc.served_model_name, str) else mc.model)
    return {
        # the last path component: a local copy of "org/model" in /models/model matches it
        "model": name.rstrip("/").rsplit("/", 1)[-1],
        "architectures": list(getattr(hf, "architectures", None) or []),
        "num_layers": int(mc.get_num_layers(pc)),
        "num_kv_heads": int(mc.get_total_num_kv_heads()),
        "head_size": int(mc.get_head_size()),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "tp_size": int(pc.tensor_parallel_size),
    }


def compat_mismatch(ours: dict[str, Any], theirs: Any, check_model_name: bool = True) -> str | None:
    """Describe the first difference between two :func:`compat_info` dicts, or None."""
    if not isinstance(theirs, dict):
        return "the prefill instance sent no compatibility information"
    for k, v in ours.items():
        if k == "model" and not check_model_name:
            continue
        if k not in theirs:
            return f"the prefill instance did not say its {k}"
        if theirs[k] != v:
            return f"{k} differs: prefill {theirs[k]!r}, decode {v!r}"
    return None
