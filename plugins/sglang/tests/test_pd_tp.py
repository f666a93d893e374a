"""The kvx PD transfer backend between prefill and decode of different attention-TP sizes.

One process per rank (tests/tp_proc.py workers, reused across shapes), SGLang's own bootstrap server, managers, senders,
receivers and KV pools (MHA and MLA, on CPU). Every decode rank checks byte for byte that each
page holds what a prefill of its own TP size would have delivered (the prefill page's bytes at the
heads the decode rank holds; MLA: the whole latent), that no other page changed, and the aux
row; a second room aborted by decode fails on both sides. The plan itself and its refusals are
tested without processes in test_pd_plan.py.
"""

from __future__ import annotations

import json
import signal

import pytest
from test_pd import DEAD_PEER_BOUND, FAILED, SUCCESS, Proc, free_port

# (kind, prefill TP, decode TP, KV heads of the model, per prefill rank: its plan for each decode
# rank registered with it, and the (page, decode rank) pairs it wrote for room 1's 6 pages)
SHAPES = [
    ("mha", 1, 2, 2, [(["slice", "slice"], 12)]),  # each decode rank gets one of prefill's two heads
    ("mha", 2, 1, 2, [(["slice"], 6), (["slice"], 6)]),  # decode gathers one head from each prefill rank
    ("mha", 2, 4, 4, [(["slice", "slice"], 12), (["slice", "slice"], 12)]),
    ("mha", 2, 1, 1, [(["pages"], 6), (["skip"], 0)]),  # one head, replicated on both prefill ranks: sent once
    ("mla", 1, 2, 1, [(["pages", "pages"], 12)]),
    ("mla", 2, 1, 1, [(["pages"], 6), (["pages"], 0)]),  # prefill rank 1 is SGLang's dummy rank: no bytes
]


#: The world rank of each worker: a worker keeps its rank across shapes (SGLang's runtime context
#: is re-published per shape, its TP size changes, its rank does not); enough for 2 -> 4.
WORKER_RANKS = (0, 0, 1, 1, 2, 3)


def finish(ws: list) -> None:
    """Let each worker of a scenario reach its room 2 (decode's abort), then end the scenario."""
    for w in ws:
        while w.p.poll() is None and w.next(120).get("room") != 2:
            pass
    end(ws)


def end(ws: list) -> None:
    """End a scenario: each worker closes its manager, one after another in the order given
    (prefill ranks first: their agents stop writing before the decode ranks release their pools)."""
    for w in ws:
        if w.p.poll() is None:
            w.send("done")
            while w.p.poll() is None and w.next(60)["event"] != "closed":
                pass


class Worker(Proc):
    """A tp_proc.py worker: one rank per scenario, SGLang imported once."""

    def __init__(self, model: str, log: str) -> None:
        super().__init__("worker", 0, model, log, script="tp_proc.py")

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3,
           "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
           "head_dim": 16}
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(cfg))
    ws = [Worker(str(d / "model"), str(d / f"worker{i}.log")) for i in range(len(WORKER_RANKS))]
    try:
        for w in ws:
            assert w.next(600)["event"] == "imported"
        yield ws
    finally:
        for w in ws:
            w.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind,ptp,dtp,heads,modes", SHAPES, ids=[f"{k}-{p}to{d}-h{h}" for k, p, d, h, _ in SHAPES])
def test_different_tp_sizes(workers, kind, ptp, dtp, heads, modes):
    port = free_port()
    free = list(zip(WORKER_RANKS, workers))

    def take(rank: int) -> Worker:
        i = next(i for i, (r, _) in enumerate(free) if r == rank)
        return free.pop(i)[1]

    pre = [take(r) for r in range(ptp)]
    dec = [take(r) for r in range(dtp)]
    for role, ranks in (("prefill", pre), ("decode", dec)):
        for r, w in enumerate(ranks):
            w.send(json.dumps({"role": role, "port": port, "tp": len(ranks), "rank": r, "kind": kind,
                               "heads": heads}))
    try:
        for w in pre + dec:
            ev = w.next(120)
            assert ev["event"] == "ready", ev
        for r, w in enumerate(pre):
            ev = w.next(120)
            assert ev == {**ev, "room": 1, "state": SUCCESS}, ev
            assert (ev["modes"], ev["pages_sent"]) == modes[r], ev
        for w in dec:
            ev = w.next(120)
            assert ev == {**ev, "room": 1, "state": SUCCESS, "kv_ok": True, "aux_ok": True, "untouched": True}, ev
        for w in dec:
            ev = w.next(60)
            assert (ev["room"], ev["state"]) == (2, FAILED) and ev["reason"], ev
        for w in pre:
            ev = w.next(120)
            assert (ev["room"], ev["state"]) == (2, FAILED) and ev["reason"], ev
    finally:
        end(pre + dec)


@pytest.mark.timeout(600)
def test_pools_that_do_not_pair_fail_their_rooms_with_the_reason(workers):
    """MHA 2 -> 1 where decode's heads are of another size: refused when decode registers, and the
    room fails on every rank with the reason (never a partial transfer)."""
    port = free_port()
    free = list(zip(WORKER_RANKS, workers))
    p0, p1 = (next(w for r, w in free if r == k) for k in (0, 1))
    d0 = next(w for r, w in free if r == 0 and w is not p0)
    base = {"port": port, "kind": "mha", "heads": 2}
    p0.send(json.dumps({**base, "role": "prefill", "tp": 2, "rank": 0}))
    p1.send(json.dumps({**base, "role": "prefill", "tp": 2, "rank": 1}))
    d0.send(json.dumps({**base, "role": "decode", "tp": 1, "rank": 0, "dim": 8}))
    try:
        for w in (p0, p1, d0):
            assert w.next(120)["event"] == "ready"
        for w in (p0, p1):
            ev = w.next(120)
            assert (ev["room"], ev["state"], ev["pages_sent"]) == (1, FAILED, 0), ev
            assert "cannot take this prefill's KV" in ev["reason"] and "do not split" in ev["reason"], ev
        ev = d0.next(120)
        assert (ev["room"], ev["state"]) == (1, FAILED) and "cannot take" in ev["reason"], ev
        assert ev["unchanged"], ev  # not one byte of the decode pool was written
    finally:
        finish([p0, p1, d0])


@pytest.mark.timeout(600)
def test_a_dead_decode_rank_fails_the_room_within_the_bound(workers):
    """MHA 1 -> 2: decode rank 1 dies after sending its page list; the prefill's transfer fails and
    both the prefill room and decode rank 0's room reach Failed, with a reason, within the bound.
    (Runs last: it kills a worker.)"""
    port = free_port()
    free = list(zip(WORKER_RANKS, workers))
    pre = next(w for r, w in free if r == 0)
    d0 = next(w for r, w in free if r == 0 and w is not pre)
    d1 = next(w for r, w in free if r == 1)
    base = {"port": port, "kind": "mha", "heads": 2}
    pre.send(json.dumps({**base, "role": "prefill", "tp": 1, "rank": 0, "hold": True}))
    d0.send(json.dumps({**base, "role": "decode", "tp": 2, "rank": 0}))
    d1.send(json.dumps({**base, "role": "decode", "tp": 2, "rank": 1, "victim": True}))
    for w in (pre, d0, d1):
        assert w.next(120)["event"] == "ready"
    ev = d1.next(120)
    assert (ev["event"], ev["room"]) == ("waiting", 1), ev
    ev = pre.next(120)
    assert (ev["event"], ev["room"]) == ("waiting", 1), ev
    d1.p.send_signal(signal.SIGKILL)
    d1.p.wait(timeout=30)
    pre.send("send")
    ev = pre.next(DEAD_PEER_BOUND + 30)
    assert (ev["room"], ev["state"]) == (1, FAILED) and ev["reason"] and ev["seconds"] < DEAD_PEER_BOUND, ev
    ev = d0.next(DEAD_PEER_BOUND + 30)
    assert (ev["room"], ev["state"]) == (1, FAILED) and ev["reason"] and ev["seconds"] < DEAD_PEER_BOUND, ev
