"""Push mode, prefill side: a decode worker's registration that arrives before its introduction
(notifications to one peer can overtake each other over kvx's tcp backend, which spreads them over
several streams) is kept until the introduction comes, within a bound of time and count, with
real workers on both sides."""

from __future__ import annotations

import logging
import time

import pytest
import vllm_utils as U
from kvx_vllm import pushing
from kvx_vllm.push import hello_note, registration_note


@pytest.fixture()
def pair():
    pre = U.Engine(U.create_vllm_config("kv_producer", {"transfer_mode": "push", "push_timeout_s": 1}), num_blocks=32)
    dec = U.Engine(U.create_vllm_config("kv_consumer", {"transfer_mode": "push"}), num_blocks=32)
    try:
        yield pre.worker.worker, dec.worker.worker
    finally:
        dec.close()
        pre.close()


def _notes(dw, push_id: str) -> tuple[bytes, bytes]:
    hello = hello_note(dw.agent.metadata(), [g.to_list() for g in dw.geoms], int(dw.kind), dw.dev)
    return hello, registration_note(push_id, [([3, 4], [0, 1])], 1, 0)


def test_registration_before_introduction_is_kept(pair) -> None:
    pw, dw = pair
    push = pw.push_prefill
    hello, reg = _notes(dw, "p-early")
    push.handle({dw.agent.name: [reg]})  # overtook the hello
    assert push.registered() == [] and "p-early" not in push._regs
    push.handle({dw.agent.name: [hello]})
    assert push.registered() == ["p-early"]
    assert dw.agent.name in push._regs["p-early"]
    # in order, as before
    _h, reg2 = _notes(dw, "p-next")
    push.handle({dw.agent.name: [reg2]})
    assert push.registered() == ["p-next"]


def test_registrations_of_a_peer_that_never_introduces_itself_expire(pair, caplog) -> None:
    pw, dw = pair
    push = pw.push_prefill
    _hello, reg = _notes(dw, "p-orphan")
    push.handle({dw.agent.name: [reg]})
    assert push._unintroduced
    time.sleep(1.2)  # push_timeout_s 1
    with caplog.at_level(logging.WARNING, logger="kvx_vllm.pushing"):
        push.poll()
    assert not push._unintroduced
    assert "never introduced itself" in caplog.text
    assert push.registered() == []


def test_held_registrations_are_bounded(pair, caplog, monkeypatch) -> None:
    pw, dw = pair
    push = pw.push_prefill
    monkeypatch.setattr(pushing, "MAX_HELD_PER_PEER", 3)
    with caplog.at_level(logging.WARNING, logger="kvx_vllm.pushing"):
        push.handle({dw.agent.name: [_notes(dw, f"p{i}")[1] for i in range(5)]})
    assert len(push._unintroduced[dw.agent.name]) == 3
    assert caplog.text.count("has not introduced itself (3 held already)") == 2
    push.handle({dw.agent.name: [_notes(dw, "x")[0]]})
    assert sorted(push.registered()) == ["p0", "p1", "p2"]


def test_held_registrations_are_bounded_in_bytes(pair, caplog, monkeypatch) -> None:
    pw, dw = pair
    push = pw.push_prefill
    regs = [_notes(dw, f"b{i}")[1] for i in range(3)]
    monkeypatch.setattr(pushing, "MAX_HELD_BYTES_PER_PEER", len(regs[0]) + len(regs[1]))
    with caplog.at_level(logging.WARNING, logger="kvx_vllm.pushing"):
        push.handle({dw.agent.name: regs})
    assert len(push._unintroduced[dw.agent.name]) == 2
    assert caplog.text.count("has not introduced itself (2 held already)") == 1
    push.handle({dw.agent.name: [_notes(dw, "x")[0]]})
    assert sorted(push.registered()) == ["b0", "b1"]

