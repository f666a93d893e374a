"""``KVXConnector``: vLLM's KV connector (``KVConnectorBase_V1``) on top of kvx.

Load it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVXConnector",
        "kv_connector_module_path": "kvx_vllm", "kv_role": "kv_producer"}'

vLLM builds one instance per role: in the scheduler (:class:`~kvx_vllm.scheduler.KVXScheduler`
does the work) and in every worker (:class:`~kvx_vllm.worker.KVXWorker`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from .config import KVXConnectorConfig
from .metadata import KVXConnectorMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from .scheduler import KVXScheduler
    from .worker import KVXWorker

__all__ = ["KVXConnector"]

log = logging.getLogger(__name__)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:
        return 0


class KVXConnector(KVConnectorBase_V1, SupportsHMA):
    """Prefill/decode disaggregation and KV offloading through kvx.

    Parameters
    ----------
    vllm_config
        The engine's configuration; ``kv_transfer_config.kv_connector_extra_config`` holds the
        :class:`~kvx_vllm.config.KVXConnectorConfig` keys.
    role
        ``KVConnectorRole.SCHEDULER`` or ``KVConnectorRole.WORKER``.
    kv_cache_config
        The engine's KV cache layout (groups, number of blocks).
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = KVXConnectorConfig.from_extra(extra)
        self.scheduler: KVXScheduler | None = None
        self.worker: KVXWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from .scheduler import KVXScheduler

            self.scheduler = KVXScheduler(vllm_config, kv_cache_config, self.cfg)
        else:
            from .worker import KVXWorker

            self.worker = KVXWorker(vllm_config, kv_cache_config, self.cfg, tp_rank=_tp_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        """Only a prefill instance hands blocks off that must reach their reader."""
        return bool(self._kv_transfer_config.is_kv_producer and self.cfg.pd_enabled(self._kv_transfer_config.kv_role))

    # ==============================================================================================
    # scheduler side
    def _sched(self) -> "KVXScheduler":
        if self.scheduler is None:
            raise RuntimeError("scheduler-side method called on the worker-side KVXConnector")
        return self.scheduler

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, [block_ids])

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._sched().update_connector_output(connector_output)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        return self._sched().take_events()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self.scheduler is not None:
            self.scheduler.set_worker_metadata(metadata)

    def reset_cache(self) -> bool | None:
        if self.scheduler is not None:
            return self.scheduler.reset_cache()
        return None

    # ==============================================================================================
    # worker side
    def _work(self) -> "KVXWorker":
        if self.worker is None:
            raise RuntimeError("worker-side method called on the scheduler-side KVXConnector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self._work().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake_metadata() if self.worker is not None else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVXConnectorMetadata)
        self._work().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise offload loads: wait for this layer's part. Other loads (pulls, whole offload
        loads) complete before their requests are scheduled: nothing to wait for."""
        if self.worker is not None:
            self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        """Push mode (prefill side): post the writes of the layers computed so far (layer-wise),
        or of the whole request after its last layer."""
        if self.worker is None or self.worker.push_prefill is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVXConnectorMetadata)
        self.worker.save_layer(meta, layer_name)

    def has_pending_push_work(self) -> bool:
        """Push mode: finished requests whose writes (prefill) or abort confirmations (decode)
        are still due keep the engine stepping."""
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise push and layer-wise offload loads run Python between layers: CUDA graphs
        must be piecewise."""
        try:
            cfg = KVXConnectorConfig.from_extra(extra_config)
        except ValueError:
            return False
        return (cfg.push and cfg.layerwise) or cfg.offload_layerwise

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVXConnectorMetadata)
        self._work().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        wait = meta.idle_wait_s if isinstance(meta, KVXConnectorMetadata) else 0.0
        sending, recving, failed = self._work().get_transfer_results(finished_req_ids, wait)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_worker_meta() if self.worker is not None else None

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
