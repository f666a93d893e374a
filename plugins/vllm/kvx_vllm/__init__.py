"""kvx connector for vLLM: disaggregated prefill/decode and KV offloading through kvx.

``kv_connector_module_path: "kvx_vllm"`` with ``kv_connector: "KVXConnector"`` loads
:class:`kvx_vllm.connector.KVXConnector`. vLLM is imported only when the connector is, so
``kvx_vllm.proxy`` works without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVXConnector", "__version__"]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "KVXConnector":
        from .connector import KVXConnector

        return KVXConnector
    raise AttributeError(f"module 'kvx_vllm' has no attribute {name!r}")
