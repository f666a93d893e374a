"""Helpers shared by the two halves of the connector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["compat_info", "compat_mismatch", "remote_params"]


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
        "mla": bool(getattr(mc, "use_mla", False)),
        "dtype": str(mc.dtype).replace("torch.", ""),
        "cache_dtype": str(cc.cache_dtype),
        "block_size": int(cc.block_size),
        "tp_size": int(pc.tensor_parallel_size),
    }


#: compat keys that may differ between prefill and decode: the TP size (heads are split and
#: read per rank), the block size (where one divides the other) and the layout (not even sent)
FREE_KEYS = frozenset({"tp_size", "block_size"})


def compat_mismatch(ours: dict[str, Any], theirs: Any, check_model_name: bool = True) -> str | None:
    """Why a prefill instance's blocks cannot serve this decode instance (None: they can).

    Equal model (unless ``check_model_name`` is off), architecture, dtype, cache dtype, head size,
    number of layers, number of KV heads and MLA-ness are required; TP sizes must both split the
    KV heads (MLA latents are replicated: any TP) and block sizes must divide one another.
    """
    from .plan import plan_mismatch

    if not isinstance(theirs, dict):
        return "the prefill instance sent no compatibility information"
    for k, v in ours.items():
        if k == "model" and not check_model_name:
            continue
        if k not in theirs:
            return f"the prefill instance did not say its {k}"
        if k not in FREE_KEYS and theirs[k] != v:
            return f"{k} differs: prefill {theirs[k]!r}, decode {v!r}"
    bp, bd = theirs.get("block_size"), ours.get("block_size")
    if not isinstance(bp, int) or not isinstance(bd, int) or bp <= 0 or bd <= 0:
        return f"block sizes are not positive integers: prefill {bp!r}, decode {bd!r}"
    if max(bp, bd) % min(bp, bd):
        return f"block sizes do not divide one another: prefill {bp}, decode {bd}"
    tp, td, heads = theirs.get("tp_size"), ours.get("tp_size"), ours.get("num_kv_heads")
    if not all(isinstance(x, int) and x > 0 for x in (tp, td, heads)):
        return f"tp_size or num_kv_heads missing: prefill tp {tp!r}, decode tp {td!r}, {heads!r} KV heads"
    if not ours.get("mla"):
        why = plan_mismatch(int(heads), int(td), int(tp))  # type: ignore[arg-type]
        if why:
            return why
    return None


def remote_params(*, engine_id: str, request_id: str, block_ids: list[list[int]], workers: dict[int, Any],
                  num_tokens: int, tp_size: int, lease: int, compat: dict[str, Any], host: str, port: int,
                  lease_s: float = 0.0) -> dict[str, Any]:
    """The kv_transfer_params a prefill instance returns for a finished request (``workers``:
    tp rank -> :class:`~kvx_vllm.metadata.KVXHandshakeMetadata`)."""
    from .metadata import PARAMS_VERSION

    agents = {str(r): [w.agent_name, w.host, w.port, w.layout, w.compat] for r, w in sorted(workers.items())}
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_agents": agents,
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "kvx_version": PARAMS_VERSION,
        "kvx_lease": lease,
        "kvx_lease_s": lease_s,
        "kvx_compat": compat,
    }
