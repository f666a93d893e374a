"""The PD transfer plan (kvx_sglang.pdplan) and the manager's refusals, without processes.

The plan is checked against a brute-force model: for every pair of (prefill, decode) attention-TP
sizes and head counts, moving each pair's runs per the plan, from prefill ranks holding their
heads of a model-wide page, must rebuild every decode rank's heads exactly, with every byte
written once (replicated heads read once).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kvx_sglang.pdplan import Mode, PlanError, heads_held, plan_pair, token_descs, token_rows

import kvx

PAGE, DIM = 4, 8  # tokens per page, bytes per head per token


def _targets(ptp: int, dtp: int, d: int) -> list[int]:
    """The prefill ranks SGLang's common receiver pairs with decode rank ``d``."""
    if dtp >= ptp:
        return [d // (dtp // ptp)]
    r = ptp // dtp
    return list(range(d * r, (d + 1) * r))


SIZES = (1, 2, 4, 8)


@pytest.mark.parametrize("ptp,dtp,heads", list(itertools.product(SIZES, SIZES, SIZES)))
def test_plan_rebuilds_every_decode_rank_exactly_once(ptp, dtp, heads):
    rng = np.random.default_rng(ptp * 100 + dtp * 10 + heads)
    model = rng.integers(0, 255, (PAGE, heads, DIM), dtype=np.uint8)  # one page of one buffer
    for d in range(dtp):
        d0, dn = heads_held(dtp, d, heads)
        got = np.zeros((PAGE, dn * DIM), dtype=np.uint8)
        writes = np.zeros(got.shape, dtype=np.int64)
        for p in _targets(ptp, dtp, d):
            s0, sn = heads_held(ptp, p, heads)
            src = model[:, s0:s0 + sn].reshape(PAGE, -1)
            pair = plan_pair(mla=False, src_tp=ptp, src_rank=p, dst_tp=dtp, dst_rank=d, total_heads=heads,
                             page_size=PAGE, src_items=[src.size], dst_items=[got.size])
            if pair.mode is Mode.SKIP:
                continue
            if pair.mode is Mode.PAGES:
                assert src.shape == got.shape
                got[:] = src
                writes += 1
                continue
            so, do, nb = pair.src_off[0], pair.dst_off[0], pair.nbytes[0]
            got[:, do:do + nb] = src[:, so:so + nb]
            writes[:, do:do + nb] += 1
        assert np.array_equal(got, model[:, d0:d0 + dn].reshape(PAGE, -1))
        assert (writes == 1).all(), "a byte written twice or never: replicated heads must be read once"


def test_same_tp_and_mla_move_whole_pages():
    for mla, (p, d) in itertools.product((False, True), ((2, 2), (1, 2), (2, 1))):
        if not mla and p != d:
            continue
        pair = plan_pair(mla=mla, src_tp=p, src_rank=0, dst_tp=d, dst_rank=0, total_heads=2, page_size=PAGE,
                         src_items=[640, 640], dst_items=[640, 640])
        assert pair.mode is Mode.PAGES


@pytest.mark.parametrize("kw,match", [
    ({"src_items": [64, 64], "dst_items": [64]}, "KV buffers"),
    ({"mla": True, "src_tp": 1, "dst_tp": 2, "src_items": [640], "dst_items": [320]}, "other sizes"),
    ({"src_tp": 2, "dst_tp": 2, "src_items": [64], "dst_items": [32]}, "other sizes"),
    ({"src_tp": 1, "dst_tp": 3, "total_heads": 2}, "do not shard"),
    ({"src_tp": 1, "dst_tp": 2, "src_items": [2 * PAGE * 16], "dst_items": [PAGE * 8]}, "do not split"),
    ({"src_tp": 2, "dst_tp": 1, "src_rank": 1, "dst_rank": 0, "total_heads": 4, "src_items": [3], "dst_items": [6]},
     "do not split"),
    ({"src_tp": 4, "src_rank": 3, "dst_tp": 2, "dst_rank": 0, "total_heads": 4}, "share no KV head"),
])
def test_plan_refusals(kw, match):
    args = {"mla": False, "src_tp": 1, "src_rank": 0, "dst_tp": 2, "dst_rank": 0, "total_heads": 2,
            "page_size": PAGE, "src_items": [2 * PAGE * 16], "dst_items": [PAGE * 16], **kw}
    with pytest.raises(PlanError, match=match):
        plan_pair(**args)
    assert issubclass(PlanError, kvx.UsageError)


def test_token_descriptors_address_each_tokens_head_run():
    # two buffers of 3 pages, 2 heads of 8 bytes per token: the run of head 1
    item = PAGE * 2 * DIM
    addr, size, base = token_descs([1000, 9000], [3 * item, 3 * item], [item, item], PAGE, [DIM, DIM], [DIM, DIM])
    assert base.tolist() == [0, 3 * PAGE]
    assert size.tolist() == [DIM] * (6 * PAGE)
    assert addr[:3].tolist() == [1000 + DIM, 1000 + DIM + 2 * DIM, 1000 + DIM + 4 * DIM]
    rows = token_rows(base, np.array([2, 0]), PAGE)
    want = [2 * PAGE + t for t in range(PAGE)] + list(range(PAGE))
    assert rows.tolist() == want + [3 * PAGE + r for r in want]
    assert addr[3 * PAGE + 2 * PAGE] == 9000 + 2 * item + DIM


def test_state_pools_are_refused_when_the_manager_is_built():
    from kvx_sglang.pd import KVXKVManager
    from sglang.srt.disaggregation.base.conn import KVArgs, StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    args = KVArgs()
    args.state_types = [StateType.MAMBA]
    args.state_data_ptrs = [[1 << 20]]
    with pytest.raises(kvx.UsageError, match="not state pools.*mamba"):
        KVXKVManager(args, DisaggregationMode.PREFILL, None, False)
