"""The connector's real workers (``KVXWorker``, one per TP rank) and scheduler half across
deployment shapes, with vLLM's real configs and KV cache specs, no engine:

- MLA: a DeepSeek-V3-shaped model config (``use_mla``), ``MLAAttentionSpec`` caches of 576 values
  per token (bf16): the latent, replicated over TP ranks, is read whole from one prefill rank;
  unread prefill ranks free on notification;
- a hybrid model: two KV cache groups (full attention and ``SlidingWindowSpec``), per-group
  block ids; every group's blocks move;
- TP pairs both ways and block sizes where one divides the other (HND, as vLLM's CPU attention
  allocates, and planar NHD on the prefill side);
- a lease that ran out before the pull: the load fails.

Every decode rank's blocks are compared cell by cell with the request's KV.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import vllm_utils as U
from kvx_vllm.config import KVXConnectorConfig
from kvx_vllm.metadata import KVXConnectorMetadata, RecvSpec, SendSpec
from kvx_vllm.plan import heads_of
from kvx_vllm.scheduler import KVXScheduler
from kvx_vllm.worker import KVXWorker
from test_plan import cell_view
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

NB = 48
_MLA_MODEL: ModelConfig | None = None


def mla_model() -> ModelConfig:
    """A DeepSeek-V3-shaped config (kv_lora_rank 512 + rope 64 = 576 per token), dense layers."""
    global _MLA_MODEL
    if _MLA_MODEL is None:
        d = os.path.join(tempfile.mkdtemp(prefix="kvx-mla-"), "tiny-deepseek")
        os.makedirs(d)
        cfg = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
               "intermediate_size": 512, "moe_intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 4, "num_hidden_layers": 2, "first_k_dense_replace": 2, "vocab_size": 512,
               "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "rope_scaling": None}
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MLA_MODEL = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16", seed=0)
    return _MLA_MODEL


class Side:
    """One engine's workers (all TP ranks) with their caches."""

    def __init__(self, role: str, model: str, tp: int, bs: int, layout: str, hybrid: bool = False,
                 engine_id: str = "") -> None:
        self.model, self.tp, self.bs, self.layout, self.hybrid = model, tp, bs, layout, hybrid
        mla = model == "mla"
        mc = mla_model() if mla else U.model_config()
        kt = KVTransferConfig(kv_connector="KVXConnector", kv_connector_module_path="kvx_vllm", kv_role=role,
                              engine_id=engine_id or f"{role}-{tp}-{bs}")
        self.vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True),
                             scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024,
                                                              max_model_len=2048, is_encoder_decoder=False),
                             kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
        self.vc.parallel_config.tensor_parallel_size = tp
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        if mla:
            self.heads, self.dim, self.planes, dtype = 1, 576, 1, torch.bfloat16
            spec: Any = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=576, dtype=dtype)
            groups = [KVCacheGroupSpec(names, spec)]
        else:
            self.heads, self.dim, self.planes, dtype = U.NUM_KV_HEADS, U.HEAD_DIM, 2, torch.float32
            per_rank = max(1, U.NUM_KV_HEADS // tp)
            full = FullAttentionSpec(block_size=bs, num_kv_heads=per_rank, head_size=U.HEAD_DIM, dtype=dtype)
            if hybrid:
                swa = SlidingWindowSpec(block_size=bs, num_kv_heads=per_rank, head_size=U.HEAD_DIM, dtype=dtype,
                                        sliding_window=4 * bs)
                groups = [KVCacheGroupSpec(names[:1], full), KVCacheGroupSpec(names[1:], swa)]
            else:
                groups = [KVCacheGroupSpec(names, full)]
        self.kcc = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[], kv_cache_groups=groups)
        self.names = names
        self.group_of = {n: g for g, grp in enumerate(groups) for n in grp.layer_names}
        self.cfg = KVXConnectorConfig.from_extra({"load_timeout_s": 20})
        self.workers: list[KVXWorker] = []
        self.caches: list[dict[str, torch.Tensor]] = []
        self.h0: list[int] = []
        for r in range(tp):
            w = KVXWorker(self.vc, self.kcc, self.cfg, tp_rank=r)
            nh = 1 if mla else heads_of(self.heads, tp, r)[1]
            self.h0.append(0 if mla else heads_of(self.heads, tp, r)[0])
            caches = {}
            for n in names:
                if mla:
                    t = torch.zeros(NB, bs, 576, dtype=dtype)
                    caches[n] = t
                elif layout == "HND":
                    caches[n] = torch.zeros(NB, nh, bs, 2 * self.dim, dtype=dtype)
                else:  # planar NHD, as GPU flash attention allocates
                    caches[n] = torch.zeros(2, NB, bs, nh, self.dim, dtype=dtype)
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.caches.append(caches)

    def view(self, r: int, name: str) -> torch.Tensor:
        lay = "MLA" if self.model == "mla" else ("HND" if self.layout == "HND" else "NHD5")
        return cell_view(lay, self.caches[r][name], self.dim)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()


def request_kv(side: Side, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens)
    return {n: (torch.rand(side.planes, tokens, side.heads, side.dim, generator=g) + 1).to(side.caches[0][n].dtype)
            for n in side.names}


def transfer(pre: Side, dec: Side, tokens: int, cached: int = 0, lease_s: float = 30.0,
             expire_first: bool = False, hold_s: float = 0.0, heartbeats: bool = False, wait_free: bool = True
             ) -> tuple[list[set[str]], list[set[int]], list[bool]]:
    """Fill ``pre``'s blocks with a request's KV, pull it into ``dec`` (its first ``cached``
    blocks are a local prefix hit); returns per decode rank (failed requests, load-error blocks)
    and per prefill rank whether it freed the request."""
    kv = request_kv(pre, tokens)
    ngroups = len(pre.kcc.kv_cache_groups)
    rng = np.random.default_rng(tokens)
    nrb, nlb = -(-tokens // pre.bs), -(-tokens // dec.bs)
    # per group block ids (different per group, as vLLM's one block pool hands them out)
    rperm, lperm = rng.permutation(np.arange(1, NB)), rng.permutation(np.arange(1, NB))
    rids = [[int(b) for b in rperm[g * nrb:(g + 1) * nrb]] for g in range(ngroups)]
    lids = [[int(b) for b in lperm[g * nlb:(g + 1) * nlb]] for g in range(ngroups)]
    for r in range(pre.tp):
        for n in pre.names:
            v, g = pre.view(r, n), pre.group_of[n]
            h0 = pre.h0[r]
            nh = v.shape[3]
            for t in range(tokens):
                v[rids[g][t // pre.bs], :, t % pre.bs] = kv[n][:, t, h0:h0 + nh]
    sched = KVXScheduler(pre.vc, pre.kcc, pre.cfg)
    sched.set_worker_metadata({r: w.handshake_metadata() for r, w in enumerate(pre.workers)})
    rid = f"req-{tokens}-{time.monotonic_ns()}"
    lease = sched._next_lease()
    sched.cfg = KVXConnectorConfig.from_extra({"lease_s": lease_s})
    params = sched._remote_params(SimpleNamespace(request_id=rid, num_computed_tokens=tokens), rids, lease)
    params = json.loads(json.dumps(params))  # as it travels through a proxy
    send = SendSpec(rid, lease_s, lease, [b for g in rids for b in g])
    for w in pre.workers:
        w.wait_for_save(KVXConnectorMetadata(send=[send]))
    freed = [False] * pre.tp
    if hold_s:
        # the decode request waits in its engine's queue: the decode scheduler half asks its
        # workers for heartbeats (or not), the prefill workers keep stepping
        dsched = KVXScheduler(dec.vc, dec.kcc, dec.cfg)
        req = SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(tokens)))
        if heartbeats:
            assert dsched.get_num_new_matched_tokens(req, 0) == (tokens, True)  # type: ignore[arg-type]
        end = time.monotonic() + hold_s
        beats = 0
        while time.monotonic() < end:
            meta = dsched.build_connector_meta(None)  # type: ignore[arg-type]
            beats += len(meta.heartbeat)
            for w in dec.workers:
                w.start_load_kv(meta)
            for r, w in enumerate(pre.workers):
                freed[r] = freed[r] or rid in w.get_transfer_results({rid})[0]
            time.sleep(0.02)
        assert beats >= (3 if heartbeats else 0) and (beats > 0) == heartbeats
    if expire_first:
        time.sleep(lease_s + 0.05)
        for r, w in enumerate(pre.workers):
            freed[r] = rid in w.get_transfer_results({rid})[0]
        assert all(freed)
    pos = [list(range(cached, nlb)) for _ in range(ngroups)]
    local = [[lids[g][p] for p in pos[g]] for g in range(ngroups)]
    recv = RecvSpec(rid, local, rids, params, pos)
    for w in dec.workers:
        w.start_load_kv(KVXConnectorMetadata(recv=[recv]))
    done = [False] * dec.tp
    failed: list[set[str]] = [set() for _ in range(dec.tp)]
    errors: list[set[int]] = [set() for _ in range(dec.tp)]
    end = time.monotonic() + 30
    while not (all(done) and (all(freed) or not wait_free)) and time.monotonic() < end:
        for r, w in enumerate(dec.workers):
            _s, recving, fail = w.get_transfer_results(set())
            if rid in recving:
                done[r] = True
            failed[r] |= fail
            errors[r] |= w.get_block_ids_with_load_errors()
        for r, w in enumerate(pre.workers):
            if rid in w.get_transfer_results({rid})[0]:
                freed[r] = True
        time.sleep(0.005)
    assert all(done), "a decode rank never finished its pull"
    if not any(failed) and not any(errors):
        for r in range(dec.tp):
            for n in dec.names:
                v, g = dec.view(r, n), dec.group_of[n]
                h0, nh = dec.h0[r], v.shape[3]
                for t in range(cached * dec.bs, tokens):
                    got = v[lids[g][t // dec.bs], :, t % dec.bs]
                    want = kv[n][:, t, h0:h0 + nh]
                    assert torch.equal(got, want), f"rank {r} layer {n} token {t}"
    return failed, errors, freed


@pytest.fixture
def sides():
    made: list[Side] = []

    def make(*a: Any, **kw: Any) -> Side:
        s = Side(*a, **kw)
        made.append(s)
        return s

    yield make
    for s in reversed(made):  # decode sides first: nothing of theirs waits on a closed prefill
        s.close()


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_mla_latent(sides: Any, tp_p: int, tp_d: int) -> None:
    """vLLM's MLAAttentionSpec caches ([blocks, 16, 576] bf16): every decode rank gets the whole
    latent; every prefill rank frees (the unread ones on notification alone)."""
    pre = sides("kv_producer", "mla", tp_p, 16, "HND")
    dec = sides("kv_consumer", "mla", tp_d, 16, "HND")
    failed, errors, freed = transfer(pre, dec, 70)
    assert not any(failed) and not any(errors)
    assert all(freed)


@pytest.mark.parametrize("bs_p,bs_d", [(16, 32), (32, 16)])
def test_mla_block_sizes_that_divide(sides: Any, bs_p: int, bs_d: int) -> None:
    pre = sides("kv_producer", "mla", 1, bs_p, "HND")
    dec = sides("kv_consumer", "mla", 2, bs_d, "HND")
    failed, errors, freed = transfer(pre, dec, 90, cached=1)
    assert not any(failed) and not any(errors) and all(freed)


@pytest.mark.parametrize("tp_p,tp_d,lay_p,bs_p,bs_d", [
    (1, 2, "HND", 16, 16), (2, 1, "HND", 16, 16), (2, 2, "NHD", 16, 16), (1, 2, "NHD", 8, 16), (2, 1, "HND", 32, 16),
    (1, 4, "HND", 16, 16), (4, 1, "NHD", 16, 16)])
def test_tp_layouts_block_sizes(sides: Any, tp_p: int, tp_d: int, lay_p: str, bs_p: int, bs_d: int) -> None:
    """The tiny Llama config (2 KV heads; TP 4 replicates them) with the workers of each rank."""
    pre = sides("kv_producer", "llama", tp_p, bs_p, lay_p)
    dec = sides("kv_consumer", "llama", tp_d, bs_d, "HND")
    failed, errors, freed = transfer(pre, dec, 77, cached=1)
    assert not any(failed) and not any(errors) and all(freed)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 1), (1, 2), (2, 1)])
def test_hybrid_groups(sides: Any, tp_p: int, tp_d: int) -> None:
    """Two KV cache groups (full attention + sliding window, vLLM's specs), block ids per group."""
    pre = sides("kv_producer", "llama", tp_p, 16, "HND", hybrid=True)
    dec = sides("kv_consumer", "llama", tp_d, 16, "HND", hybrid=True)
    assert len(dec.kcc.kv_cache_groups) == 2
    failed, errors, freed = transfer(pre, dec, 100)
    assert not any(failed) and not any(errors) and all(freed)


def test_expired_lease_fails_the_load(sides: Any) -> None:
    """The prefill workers ended the lease (and wrote the blocks' generations) before the pull:
    every decode rank reports its blocks failed."""
    pre = sides("kv_producer", "llama", 1, 16, "HND")
    dec = sides("kv_consumer", "llama", 2, 16, "HND")
    failed, errors, _freed = transfer(pre, dec, 50, lease_s=0.05, expire_first=True)
    assert all(len(e) == 4 for e in errors), errors  # 4 blocks per rank, all failed
    # a hybrid decode instance reports the whole request failed
    pre = sides("kv_producer", "llama", 1, 16, "HND", hybrid=True, engine_id="hp")
    dec = sides("kv_consumer", "llama", 1, 16, "HND", hybrid=True, engine_id="hd")
    failed, errors, _freed = transfer(pre, dec, 50, lease_s=0.05, expire_first=True)
    assert all(len(f) == 1 for f in failed)


def test_incompatible_prefill_is_refused_with_both_values(sides: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Block sizes that do not divide: the load fails, and the log names both sizes."""
    pre = sides("kv_producer", "llama", 1, 24, "HND")
    dec = sides("kv_consumer", "llama", 1, 16, "HND")
    with caplog.at_level("ERROR", logger="kvx_vllm.worker"):
        failed, errors, _freed = transfer(pre, dec, 40, wait_free=False)  # the lease frees them
    assert errors[0] == set(range(1, NB)) & errors[0] and len(errors[0]) == 3
    assert "block sizes do not divide one another: prefill 24, decode 16" in caplog.text


def test_compat_refuses_what_cannot_work_and_names_both_values() -> None:
    """compat_info of a real VllmConfig against a prefill record changed in one field each."""
    from kvx_vllm.util import compat_info, compat_mismatch

    ours = compat_info(U.create_vllm_config("kv_consumer"))
    ours["tp_size"] = 2
    assert compat_mismatch(ours, dict(ours)) is None
    ok = [{"tp_size": 1}, {"tp_size": 4}, {"block_size": 32}, {"block_size": 8}, {"tp_size": 1, "block_size": 64}]
    for change in ok:
        assert compat_mismatch(ours, {**ours, **change}) is None, change
    bad = {"model": "other-model", "dtype": "bfloat16", "head_size": 128, "num_layers": 3, "num_kv_heads": 4,
           "cache_dtype": "fp8", "mla": True, "architectures": ["MistralForCausalLM"]}
    for k, v in bad.items():
        why = compat_mismatch(ours, {**ours, k: v})
        assert why and k in why and repr(v) in why and repr(ours[k]) in why, (k, why)
    assert compat_mismatch(ours, {**ours, "model": "other"}, check_model_name=False) is None
    why = compat_mismatch(ours, {**ours, "block_size": 24})
    assert why and "prefill 24" in why and "decode 16" in why
    why = compat_mismatch(ours, {**ours, "tp_size": 3})
    assert why and "2 KV heads" in why and "prefill tp_size 3" in why
    ours3 = {**ours, "tp_size": 3}
    assert "decode tp_size 3" in (compat_mismatch(ours3, {**ours, "tp_size": 1}) or "")


def test_heartbeats_keep_the_lease(sides: Any) -> None:
    """A lease of 0.6 s; the decode request waits 1.5 s in its queue while its scheduler half
    sends heartbeats (every lease/3): the prefill keeps the blocks and the pull succeeds. The same
    wait without heartbeats: the lease runs out and the load fails."""
    pre = sides("kv_producer", "llama", 2, 16, "HND")
    dec = sides("kv_consumer", "llama", 1, 16, "HND")
    failed, errors, freed = transfer(pre, dec, 60, lease_s=0.6, hold_s=1.5, heartbeats=True)
    assert not any(failed) and not any(errors) and all(freed)
    failed, errors, _freed = transfer(pre, dec, 61, lease_s=0.6, hold_s=1.5, heartbeats=False)
    assert errors[0] and len(errors[0]) == 4
