"""Build vLLM's real config, scheduler and requests on CPU from a local model config.

Modelled on vLLM's ``tests/v1/kv_connector/unit/utils.py`` (create_vllm_config,
create_scheduler, create_request, create_model_runner_output), written against 0.33.0's
classes. No model download: the model is a tiny llama-style ``config.json`` in a temp dir.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 16
EOS = 999

_MODEL_DIR: str | None = None
_MODEL_CONFIG: ModelConfig | None = None


def model_dir() -> str:
    """A local directory holding a tiny llama config (written once per process)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        d = os.path.join(tempfile.mkdtemp(prefix="kvx-vllm-"), "tiny-llama")
        os.makedirs(d)
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": NUM_KV_HEADS * 2 * HEAD_DIM,
               "intermediate_size": 256, "num_attention_heads": NUM_KV_HEADS * 2, "num_key_value_heads": NUM_KV_HEADS,
               "num_hidden_layers": NUM_LAYERS, "vocab_size": 1000, "max_position_embeddings": 4096,
               "rms_norm_eps": 1e-5, "torch_dtype": "float32", "head_dim": HEAD_DIM, "eos_token_id": EOS}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MODEL_DIR = d
    return _MODEL_DIR


def model_config() -> ModelConfig:
    global _MODEL_CONFIG
    if _MODEL_CONFIG is None:
        _MODEL_CONFIG = ModelConfig(model=model_dir(), skip_tokenizer_init=True, max_model_len=2048,
                                    dtype="float32", seed=0)
    return _MODEL_CONFIG


def create_vllm_config(kv_role: str = "kv_both", extra: dict[str, Any] | None = None,
                       block_size: int = BLOCK_SIZE, max_num_batched_tokens: int = 1024,
                       engine_id: str | None = None, failure_policy: str | None = None) -> VllmConfig:
    """A VllmConfig whose kv_transfer_config loads KVXConnector from kvx_vllm."""
    kt: dict[str, Any] = {"kv_connector": "KVXConnector", "kv_connector_module_path": "kvx_vllm",
                          "kv_role": kv_role, "kv_connector_extra_config": extra or {}}
    if engine_id:
        kt["engine_id"] = engine_id
    if failure_policy:
        kt["kv_load_failure_policy"] = failure_policy
    return VllmConfig(
        model_config=model_config(),
        cache_config=CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(**kt),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int, block_size: int = BLOCK_SIZE) -> KVCacheConfig:
    names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 64) -> Scheduler:
    """vLLM's real Scheduler (it builds the KVXConnector through KVConnectorFactory)."""
    bs = vllm_config.cache_config.block_size
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config(num_blocks, bs),
                     structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs,
                     log_stats=True)


_hash_ready = False


def create_request(request_id: str, num_tokens: int = 64, max_tokens: int = 16,
                   kv_transfer_params: dict[str, Any] | None = None, block_size: int = BLOCK_SIZE,
                   prompt: list[int] | None = None) -> Request:
    """A Request with vLLM's own block hasher (sha256, chained)."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=request_id,
                  prompt_token_ids=list(prompt) if prompt is not None else [i % 900 + 1 for i in range(num_tokens)],
                  sampling_params=sp, pooling_params=None,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = kv_transfer_params
    return req


def model_runner_output(reqs: list[Request], token: int = 7, finished_sending: set[str] | None = None,
                        finished_recving: set[str] | None = None, invalid_block_ids: set[int] | None = None,
                        failed_recving: set[str] | None = None, worker_meta: Any = None) -> ModelRunnerOutput:
    """One step's output: every scheduled request samples ``token``."""
    ids = [r.request_id for r in reqs]
    kco = None
    if finished_sending or finished_recving or invalid_block_ids or failed_recving or worker_meta is not None:
        kco = KVConnectorOutput(finished_sending=finished_sending or None, finished_recving=finished_recving or None,
                                invalid_block_ids=invalid_block_ids or set(), failed_recving=failed_recving or set(),
                                kv_connector_worker_meta=worker_meta)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] for _ in ids], kv_connector_output=kco)


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


# ---------------------------------------------------------------------------------------------
# worker side: KV tensors in vLLM 0.33's layout, and an engine step that runs both halves

def make_kv_caches(num_blocks: int, block_size: int = BLOCK_SIZE, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Per-layer CPU caches as vLLM ≥ 0.30 allocates them: [num_blocks, H, N, C] with K and V
    packed into C (the CPU backend's LBHNC layout), block dimension outermost."""
    caches = {}
    for i in range(NUM_LAYERS):
        t = torch.zeros(num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_DIM, dtype=torch.float32)
        if seed is not None:
            g = torch.Generator().manual_seed(seed * 1000 + i)
            t.copy_(torch.rand(t.shape, generator=g))
        caches[f"model.layers.{i}.self_attn.attn"] = t
    return caches


def block_bytes(caches: dict[str, torch.Tensor], block_id: int) -> bytes:
    """Every layer's page of one block, concatenated."""
    return b"".join(t[block_id].contiguous().numpy().tobytes() for t in caches.values())


class Engine:
    """One vLLM engine: the real Scheduler and a worker-side KVXConnector sharing its steps.

    ``step()`` does what EngineCore + the model runner do around a forward pass: schedule,
    bind the connector metadata, start loads, (no model) wait_for_save, collect the transfer
    results and worker metadata, and feed them back through ``update_from_output``.
    """

    def __init__(self, vllm_config: VllmConfig, num_blocks: int = 64, seed: int | None = None,
                 worker: bool = True) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.config = vllm_config
        self.scheduler = create_scheduler(vllm_config, num_blocks)
        self.initial_free = free_blocks(self.scheduler)
        self.worker = None
        self.caches: dict[str, torch.Tensor] = {}
        if worker:
            self.worker = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                              self.scheduler.kv_cache_config)
            self.caches = make_kv_caches(num_blocks, vllm_config.cache_config.block_size, seed)
            self.worker.register_kv_caches(self.caches)
            hs = self.worker.get_handshake_metadata()
            if hs is not None:
                self.scheduler.connector.set_xfer_handshake_metadata({0: hs})
        self.outputs: dict[str, Any] = {}
        #: called after each layer's wait_for_layer_load and save_kv_layer in a forward pass
        #: (tests stall, kill or look at the layer there)
        self.after_layer: Any = None
        # the scheduler drains the connector's KV events in update_from_output (to publish
        # them); record what it takes
        self.events: list[Any] = []
        conn = self.scheduler.connector
        orig = conn.take_events

        def take_events() -> list[Any]:
            ev = list(orig())
            self.events.extend(ev)
            return ev

        conn.take_events = take_events

    def step(self, token: int = 7, invalid: set[int] | None = None, before_output: Any = None) -> Any:
        s = self.scheduler
        so = s.schedule()
        kco = KVConnectorOutput()
        if self.worker is not None:
            w = self.worker
            w.bind_connector_metadata(so.kv_connector_metadata)
            w.start_load_kv(None)
            if so.total_num_scheduled_tokens:  # a forward pass: each layer's wait_for_layer_load
                for name, t in self.caches.items():  # (the layer computes) and save_kv_layer
                    w.wait_for_layer_load(name)
                    w.save_kv_layer(name, t, None)
                    if self.after_layer is not None:
                        self.after_layer(name)
            w.wait_for_save()
            if before_output is not None:
                before_output(so)
            res = w.get_transfer_results(so.finished_req_ids)
            kco.finished_sending = res.finished_sending or None
            kco.finished_recving = res.finished_recving or None
            kco.failed_recving = res.failed_recving
            kco.invalid_block_ids = w.get_block_ids_with_load_errors() | (invalid or set())
            kco.kv_connector_worker_meta = w.build_connector_worker_meta()
            w.clear_connector_metadata()
        elif invalid:
            kco.invalid_block_ids = set(invalid)
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[token] for _ in ids], kv_connector_output=kco)
        eco = s.update_from_output(so, out)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs[o.request_id] = o
        return so

    def run_until(self, cond: Any, max_steps: int = 200, sleep: float = 0.01) -> None:
        import time

        for _ in range(max_steps):
            if cond():
                return
            self.step()
            time.sleep(sleep)
        raise AssertionError("condition not reached")

    def free(self) -> int:
        return free_blocks(self.scheduler)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
