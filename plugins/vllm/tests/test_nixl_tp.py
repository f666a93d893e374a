"""The NIXL side of ``bench_tp_gpu.py --compare nixl`` (``e2e/nixl_tp.py``) on CPU: its descriptor
plan against vLLM's own NixlConnector code (``compute_tp_mapping``, ``_build_fa_local``,
``_build_fa_remote``, ``_build_local_splits_from_plan``, ``_compute_desc_ids`` of vLLM's worker,
called on a worker object that carries only the fields they read), the plan moving the right heads
of HND blocks (descriptors executed on byte buffers), and the script's argument checks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from nixl_tp import desc_ids, local_descs, local_split, remote_descs, tp_plan

#: (decode TP, prefill TP, KV heads): both directions, equal, replicated heads (TP > heads)
SHAPES = [(1, 1, 8), (2, 1, 8), (1, 2, 8), (2, 2, 8), (4, 2, 8), (2, 4, 8), (1, 8, 8), (8, 1, 8),
          (4, 1, 2), (1, 4, 2), (8, 2, 2), (2, 8, 2), (4, 8, 2), (8, 4, 4), (2, 1, 1), (1, 2, 1)]
BS, D, ELT, L = 16, 4, 2, 3  # block size, head dim, bf16 bytes, layers
NB_LOCAL, NB_REMOTE = 11, 7


def block_len(heads: int, tp: int) -> int:
    return max(1, heads // tp) * BS * 2 * D * ELT


def bases(seed: int, n: int) -> list[int]:
    return [int(x) for x in (np.random.default_rng(seed).integers(1, 1 << 20, n) << 16)]


def vllm_worker(tp: int, rank: int, heads: int) -> Any:
    """vLLM's NixlConnector worker for one attention group, HND, one region per layer, without its
    ``__init__`` (which needs NIXL and a whole engine): the fields the descriptor methods read."""
    from vllm.distributed.kv_transfer.kv_connector.utils import TransferTopology
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    w = object.__new__(NixlBaseConnectorWorker)
    blen = block_len(heads, tp)
    fields = dict(
        transfer_topo=TransferTopology(tp_rank=rank, tp_size=tp, block_size=BS, engine_id="d", is_mla=False,
                                       is_mamba=False, total_num_kv_heads=heads, attn_backends=[]),
        device_id=0, block_len_per_layer=[blen] * L, block_stride_per_layer=[blen] * L,
        region_num_blocks=[NB_LOCAL] * L, num_regions=L, _region_is_mla=[False] * L,
        _transfer_layer_region_indices=[], _transfer_layer_group_ids=[], _group_spec_types=(FullAttentionSpec,),
        region_group_ids=[0] * L, _uses_region_group_mapping=False, _has_mamba=False,
        _logical_num_blocks=NB_LOCAL, _ple_region_index=None,
    )
    for k, v in fields.items():
        setattr(w, k, v)
    return w


@pytest.mark.parametrize("tp,remote_tp,heads", SHAPES)
def test_descriptors_match_vllm_nixl_connector(tp: int, remote_tp: int, heads: int) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import compute_tp_mapping
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    mine_base = bases(tp, L)
    for rank in range(tp):
        w = vllm_worker(tp, rank, heads)
        vplan = compute_tp_mapping(w.transfer_topo, remote_tp, (FullAttentionSpec,))
        plan = tp_plan(tp, rank, remote_tp, heads)
        assert plan.source_ranks == vplan.source_ranks_per_group[0]
        assert plan.slots == {r: vplan.rank_to_attention_slot[r] for r in plan.source_ranks}
        assert plan.rank_offset_factor == vplan.rank_offset_factor
        assert plan.consumers == vplan.local_consumers

        blen = block_len(heads, tp)
        local = local_descs(mine_base, blen, blen, NB_LOCAL, 0)
        np.testing.assert_array_equal(local, w._build_fa_local(mine_base, 1))
        rblen = block_len(heads, remote_tp)
        for r in plan.source_ranks:
            meta = SimpleNamespace(kv_caches_base_addr=bases(100 + r, L), region_num_blocks=None,
                                   num_blocks=NB_REMOTE, device_id=1, block_strides=[rblen] * L)
            np.testing.assert_array_equal(
                remote_descs(meta.kv_caches_base_addr, blen, rblen, NB_REMOTE, 1, plan),
                w._build_fa_remote(vplan, meta, 1))
        if remote_tp > tp:  # vLLM splits the local list per source rank
            splits = list(w._build_local_splits_from_plan(vplan, local, len(local)))
            assert len(splits) == len(plan.source_ranks)
            for r, theirs in zip(plan.source_ranks, splits):
                np.testing.assert_array_equal(local_split(local, len(plan.source_ranks), plan.slots[r]),
                                              np.asarray(theirs, dtype=np.uint64))
        ids = np.random.default_rng(rank).permutation(NB_REMOTE)[:5]
        np.testing.assert_array_equal(desc_ids(ids, L, NB_REMOTE),
                                      w._compute_desc_ids([ids.tolist()], NB_REMOTE, None, 1))


def owner(heads: int, tp: int, head: int) -> tuple[int, int]:
    """The first rank of ``tp`` holding global head ``head``, and its index there."""
    from kvx_vllm.plan import heads_of

    r = next(r for r in range(tp) if heads_of(heads, tp, r)[0] <= head < sum(heads_of(heads, tp, r)))
    return r, head - heads_of(heads, tp, r)[0]


@pytest.mark.parametrize("tp,remote_tp,heads", SHAPES)
def test_plan_moves_each_decode_rank_its_heads(tp: int, remote_tp: int, heads: int) -> None:
    """Every (decode rank, source rank) pair's descriptors executed as byte copies between HND
    buffers ``[layer][block, heads, BS, 2*D]`` (addresses are offsets): each decode block then holds
    exactly its heads of the request's permuted prefill blocks, nothing else written."""
    from kvx_vllm.plan import heads_of

    rng = np.random.default_rng(tp * 100 + remote_tp * 10 + heads)
    nblk = 4
    rblocks = rng.permutation(NB_REMOTE)[:nblk]
    lblocks = rng.permutation(NB_LOCAL)[:nblk]
    # prefill rank r's caches: value = global head * 1e6 + layer * 1e4 + block * 100 + token-ish
    pre = []
    for r in range(remote_tp):
        h0, nh = heads_of(heads, remote_tp, r)
        v = np.zeros((L, NB_REMOTE, nh, BS, 2 * D), dtype=np.uint16)
        for h in range(nh):
            v[:, :, h] = ((h0 + h) * 4096 + np.arange(L)[:, None, None, None] * 512
                          + np.arange(NB_REMOTE)[None, :, None, None] * 32 + np.arange(BS)[None, None, :, None]) % 65521
        pre.append(v)
    for rank in range(tp):
        h0, nh = heads_of(heads, tp, rank)
        plan = tp_plan(tp, rank, remote_tp, heads)
        mine = np.zeros((L, NB_LOCAL, nh, BS, 2 * D), dtype=np.uint16)
        blen = mine[0, 0].nbytes
        local = local_descs([i * mine[0].nbytes for i in range(L)], blen, blen, NB_LOCAL, 0)
        dst = mine.reshape(-1).view(np.uint8)
        for r in plan.source_ranks:
            src_arr = pre[r]
            src = src_arr.reshape(-1).view(np.uint8)
            rd = remote_descs([i * src_arr[0].nbytes for i in range(L)], blen, src_arr[0, 0].nbytes, NB_REMOTE, 0,
                              plan)
            ld = local_split(local, len(plan.source_ranks), plan.slots[r]) if len(plan.source_ranks) > 1 else local
            for li, ri in zip(desc_ids(lblocks, L, NB_LOCAL), desc_ids(rblocks, L, NB_REMOTE)):
                (la, ln, _), (ra, rn, _) = ld[li].astype(np.int64), rd[ri].astype(np.int64)
                assert ln == rn
                dst[la:la + ln] = src[ra:ra + rn]
        for b_l, b_r in zip(lblocks, rblocks):
            for h in range(nh):
                r, hr = owner(heads, remote_tp, h0 + h)
                np.testing.assert_array_equal(mine[:, b_l, h], pre[r][:, b_r, hr])
        untouched = np.setdiff1d(np.arange(NB_LOCAL), lblocks)
        assert not mine[:, untouched].any()


def test_tp_plan_refuses_what_cannot_split() -> None:
    with pytest.raises(ValueError, match="do not divide"):
        tp_plan(3, 0, 2, 8)
    with pytest.raises(ValueError, match="bad TP shape"):
        tp_plan(2, 2, 1, 8)


def test_bench_arguments() -> None:
    from bench_tp_gpu import arguments

    a = arguments(["--device", "cpu"])
    assert (a.tokens, a.layers, a.head_dim, a.latent) == ("512,2048", 4, 32, 96)
    a = arguments(["--device", "cpu", "--tokens", "64", "--layers", "2"])
    assert (a.tokens, a.layers) == ("64", 2)  # given values are kept
    a = arguments(["--compare", "nixl"])
    assert (a.tokens, a.layers, a.head_dim, a.latent, a.compare) == ("4096,16384", 32, 128, 576, "nixl")
    for bad in (["--compare", "nixl", "--layouts", "NHD"], ["--compare", "mooncake"], ["--cases", "3to1"],
                ["--layouts", "XYZ"], ["--tokens", "0"], ["--tokens", "x"], ["--heads", "3"]):
        with pytest.raises(SystemExit):
            arguments(bad)


def test_a_failing_rank_is_reported_at_once() -> None:
    """A rank that raises (here: NIXL asked for NHD) makes the parent raise its error, not wait."""
    import multiprocessing as mp
    import time

    from bench_tp_gpu import Rank

    t = time.monotonic()
    r = Rank(mp.get_context("spawn"), "nixl", role="kv_consumer", engine="d1", tp=1, rank=0, gpu=0, device="cpu",
             layout="NHD", layers=1, heads=2, head_dim=4, latent=8, block=16, blocks=4)
    try:
        with pytest.raises(RuntimeError, match="kv_consumer rank 0 of TP 1 .NHD. failed: ValueError: NixlConnector "
                                               "plans TP mismatch for HND only"):
            r.ready()
        assert time.monotonic() - t < 120
    finally:
        r.close()
