"""kvx_vllm.push: push mode with layer-wise writes, on real kvx agents (tcp: sockets, both ways).

The prefill half (LayerPusher) writes each group of layers into the decode side's blocks as
save_kv_layer reports them; the decode half (PushLanding) counts the parts and fails, aborts and
quiesces requests. A decode side that is a separate process killed mid-stream fails only its
own request on the prefill side.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.testing.procs import PeerProcess

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "plugins", "vllm"))

from kvx_vllm.push import (
    LayerPusher,
    PushDest,
    PushLanding,
    abort_note,
    aborted_note,
    parse_push_note,
    push_note,
)

L, B, BLK = 5, 8, 256  # layers, blocks per layer, bytes per block
NAMES = [f"model.layers.{i}.self_attn" for i in range(L)]


def cfg() -> kvx.AgentConfig:
    return kvx.AgentConfig(backends=("tcp",))


def layer_idx(src: list[int], dst: list[int]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Layer-major block tables: block ``b`` of layer ``l`` is descriptor ``l*B + b`` on both sides."""
    s, d = np.asarray(src, np.int64), np.asarray(dst, np.int64)
    return {n: (i * B + s, i * B + d) for i, n in enumerate(NAMES)}


class Pair:
    """A prefill agent with a patterned cache and a decode agent with a zeroed one."""

    def __init__(self) -> None:
        self.p = kvx.Agent("prefill", cfg())
        self.d = kvx.Agent("decode", cfg())
        self.src = np.random.default_rng(0).integers(1, 255, L * B * BLK, dtype=np.uint8)
        self.dst = np.zeros(L * B * BLK, np.uint8)
        self.ps = self.p.prepare(kvx.DescList.blocks(self.p.register(self.src), BLK))
        dd = kvx.DescList.blocks(self.d.register(self.dst), BLK)
        self.peer = self.p.add_peer(self.d.metadata())
        self.pd = self.p.prepare(dd, peer=self.peer)
        self.d.add_peer(self.p.metadata())

    def dest(self, src: list[int], dst: list[int]) -> PushDest:
        return PushDest(self.peer, self.ps, self.pd, layer_idx(src, dst))

    def landing(self, timeout: float = 10.0, quiesce_s: float = 5.0) -> PushLanding:
        return PushLanding(timeout, quiesce_s, self.d.notify)

    def block(self, buf: np.ndarray, layer: int, b: int) -> np.ndarray:
        o = (layer * B + b) * BLK
        return buf[o:o + BLK]

    def close(self) -> None:
        self.p.close()
        self.d.close()


@pytest.fixture
def pair():
    pr = Pair()
    yield pr
    pr.close()


def drain(agent: kvx.Agent, t: float = 0.2) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = {}
    end = time.monotonic() + t
    while time.monotonic() < end:
        for k, v in agent.notifications(timeout=0.05).items():
            out.setdefault(k, []).extend(v)
    return out


@pytest.mark.parametrize("group,parts", [(1, 5), (2, 3), (5, 1)])
def test_layerwise_push_lands_the_right_bytes(pair: Pair, group: int, parts: int) -> None:
    src, dst = [1, 4, 6], [7, 0, 3]
    pusher = LayerPusher(pair.p, NAMES, group=group)
    assert pusher.parts == parts
    landing = pair.landing()
    landing.expect("r1", "prefill")
    pusher.add("r1", pair.dest(src, dst))
    seen = []
    for i, n in enumerate(NAMES):
        pusher.on_layer(n)
        seen.append(len(pusher._active["r1"].xfers))
    # a write went out as soon as each group was complete, before the later layers "computed"
    assert seen == [(i + 1) // group + (1 if i == L - 1 and (i + 1) % group else 0) for i in range(L)]
    done, failed = pusher.wait()
    assert done == {"r1"} and not failed and not pusher.active()
    landed, failed2, _, rest = landing.poll(drain(pair.d))
    assert landed == {"r1"} and not failed2 and not rest
    for layer in range(L):
        for s, d in zip(src, dst):
            assert np.array_equal(pair.block(pair.dst, layer, d), pair.block(pair.src, layer, s))
        for d in set(range(B)) - set(dst):  # nothing else written
            assert not pair.block(pair.dst, layer, d).any()
    pusher.close()


def test_two_requests_and_a_request_added_mid_pass(pair: Pair) -> None:
    pusher = LayerPusher(pair.p, NAMES, group=1)
    landing = pair.landing()
    landing.expect("a", "prefill")
    landing.expect("b", "prefill")
    pusher.add("a", pair.dest([0], [2]))
    pusher.on_layer(NAMES[0])
    pusher.add("b", pair.dest([1], [5]))  # joins the next pass, not this one's remaining layers
    for n in NAMES[1:]:
        pusher.on_layer(n)
    done, _ = pusher.wait()
    assert done == {"a"} and pusher.active() == {"b"}
    assert pusher._active["b"].posted == 0 and not pair.block(pair.dst, 4, 5).any()
    for n in NAMES:
        pusher.on_layer(n)
    done, _ = pusher.wait()
    assert done == {"b"}
    landed, *_ = landing.poll(drain(pair.d))
    assert landed == {"a", "b"}
    assert np.array_equal(pair.block(pair.dst, 4, 5), pair.block(pair.src, 4, 1))
    pusher.close()


def test_a_request_added_mid_pass_waits_for_the_next_pass_threaded(pair: Pair) -> None:
    """With the poster thread and groups of 2: a request added after layer 0 was reported (but
    before the poster posted anything) takes no part in this pass."""
    pusher = LayerPusher(pair.p, NAMES, group=2, threaded=True)
    pusher.add("a", pair.dest([0], [0]))
    evs = [FakeEvent() for _ in NAMES]
    pusher.on_layer(NAMES[0], evs[0])
    pusher.add("b", pair.dest([1], [1]))
    for n, ev in zip(NAMES[1:], evs[1:]):
        pusher.on_layer(n, ev)
    for ev in evs:
        ev.ready.set()
    done, failed = pusher.wait()
    assert done == {"a"} and not failed and pusher.active() == {"b"}
    assert not pair.block(pair.dst, 0, 1).any()
    pusher.close()


def test_layers_without_blocks_still_count(pair: Pair) -> None:
    """A request with nothing in some layers (another KV cache group) still sends every part."""
    pusher = LayerPusher(pair.p, NAMES, group=2)
    landing = pair.landing()
    landing.expect("r", "prefill")
    idx = layer_idx([5], [6])
    pusher.add("r", pair.dest([5], [6]))
    pusher._active["r"].dest.layers = {n: idx[n] for n in NAMES[:2]}  # layers 2-4: nothing to move
    for n in NAMES:
        pusher.on_layer(n)
    assert pusher.wait() == ({"r"}, {})
    landed, *_ = landing.poll(drain(pair.d))
    assert landed == {"r"}
    assert np.array_equal(pair.block(pair.dst, 1, 6), pair.block(pair.src, 1, 5))
    assert not pair.block(pair.dst, 2, 6).any()
    pusher.close()


def test_decode_gives_up_mid_stream(pair: Pair) -> None:
    """Decode aborts after two layers: the prefill stops posting, cancels, acknowledges; blocks
    are reusable only after the acknowledgement; parts arriving later never count."""
    pusher = LayerPusher(pair.p, NAMES, group=1)
    landing = pair.landing(quiesce_s=60.0)
    landing.expect("r", "prefill")
    pusher.add("r", pair.dest([0, 1], [0, 1]))
    pusher.on_layer(NAMES[0])
    pusher.on_layer(NAMES[1])
    assert pusher.handle_notes({"someone-else": [abort_note("r")]}) == []  # not its decode: ignored
    assert pusher.active() == {"r"}
    landing.give_up("r")
    landed, failed, quiesced, _ = landing.poll({})
    assert not landed and not quiesced and landing.pending() == {"r"}  # blocks still held
    rest = pusher.handle_notes(drain(pair.p))
    assert not rest and not pusher.active()
    for n in NAMES[2:]:
        pusher.on_layer(n)  # nothing more is posted for it
    assert pusher.wait() == (set(), {})
    landed, failed, quiesced, _ = landing.poll(drain(pair.d))
    assert quiesced == {"r"} and not landed and not landing.pending()
    assert not pair.block(pair.dst, 4, 0).any()  # layers after the abort never written
    pusher.close()


def test_prefill_dies_mid_stream(pair: Pair) -> None:
    """No parts after the first layers, no acknowledgement: failed at the deadline, blocks reusable
    after the quiesce bound."""
    now = [0.0]
    landing = PushLanding(timeout=2.0, quiesce_s=3.0, notify=pair.d.notify, clock=lambda: now[0])
    landing.expect("r", "prefill")
    pusher = LayerPusher(pair.p, NAMES, group=1)
    pusher.add("r", pair.dest([3], [3]))
    pusher.on_layer(NAMES[0])
    pusher.wait()
    pair.p.close()  # the prefill is gone
    assert landing.poll(drain(pair.d))[:3] == (set(), set(), set())
    now[0] = 2.5
    landed, failed, quiesced, _ = landing.poll({})
    assert failed == {"r"} and not quiesced and not landed
    now[0] = 5.0
    assert landing.poll({})[2] == set()  # 2.5 s since giving up: still held
    now[0] = 5.6
    assert landing.poll({})[2] == {"r"}


def test_decode_process_killed_mid_stream(pair: Pair) -> None:
    """One request goes to a decode process that is SIGKILLed after layer 0: that request fails
    on the prefill side within the bound; the other request is untouched."""
    with PeerProcess("decode-dies", {"backends": ["tcp"]}) as dying:
        rid, descs = dying.register("numpy", L * B * BLK)
        peer = pair.p.add_peer(dying.meta)
        remote = pair.p.prepare(kvx.DescList.blocks(descs, BLK), peer=peer)
        pusher = LayerPusher(pair.p, NAMES, group=1, timeout=10.0)
        pusher.add("ok", pair.dest([2], [2]))
        pusher.add("dies", PushDest(peer, pair.ps, remote, layer_idx([2], [2])))
        pusher.on_layer(NAMES[0])
        dying.kill()
        t = time.monotonic()
        for n in NAMES[1:]:
            pusher.on_layer(n)
        done, failed = pusher.wait()
        assert time.monotonic() - t < 15
        assert done == {"ok"} and set(failed) == {"dies"} and not pusher.active()
        assert np.array_equal(pair.block(pair.dst, 4, 2), pair.block(pair.src, 4, 2))
        pusher.close()


class FakeEvent:
    """Stands for a CUDA event: synchronize() blocks until the test releases it."""

    def __init__(self) -> None:
        self.ready = threading.Event()

    def synchronize(self) -> None:
        assert self.ready.wait(10)


def test_threaded_posting_waits_for_the_layer_event(pair: Pair) -> None:
    pusher = LayerPusher(pair.p, NAMES, group=1, threaded=True)
    pusher.add("r", pair.dest([0], [1]))
    evs = [FakeEvent() for _ in NAMES]
    for n, ev in zip(NAMES, evs):
        pusher.on_layer(n, ev)
    time.sleep(0.2)
    assert pusher._active["r"].posted == 0  # the first layer has not "executed" yet
    evs[0].ready.set()
    deadline = time.monotonic() + 5
    while pusher._active["r"].posted < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pusher._active["r"].posted == 1
    for ev in evs[1:]:
        ev.ready.set()
    done, failed = pusher.wait()
    assert done == {"r"} and not failed
    pusher.close()


def test_wait_waits_for_layers_still_with_the_poster(pair: Pair) -> None:
    """wait_for_save right after the forward pass: the last layer's event completes later; wait()
    returns only once that layer's write was posted and landed."""
    pusher = LayerPusher(pair.p, NAMES, group=2, threaded=True)
    pusher.add("r", pair.dest([3], [4]))
    evs = [FakeEvent() for _ in NAMES]
    for ev in evs[:-1]:
        ev.ready.set()
    for n, ev in zip(NAMES, evs):
        pusher.on_layer(n, ev)
    threading.Timer(0.3, evs[-1].ready.set).start()
    t = time.monotonic()
    done, failed = pusher.wait()
    assert done == {"r"} and not failed and time.monotonic() - t >= 0.25
    assert np.array_equal(pair.block(pair.dst, 4, 4), pair.block(pair.src, 4, 3))
    pusher.close()


def test_notes_are_validated(pair: Pair) -> None:
    assert parse_push_note(b"rid\n1") is None  # a pull note passes through
    assert parse_push_note(push_note("x", 2, 3)) == ("part", "x", 2, 3)
    assert parse_push_note(abort_note("x")) == ("abort", "x", 0, 0)
    assert parse_push_note(aborted_note("x")) == ("aborted", "x", 0, 0)
    for bad in (b"kvx-push\x00\xc1", push_note("x", 3, 3), push_note("x", 0, 1 << 20),
                b"kvx-push\x00" + b"\x95\x01\x00\xa1x\x00\xc3"):
        with pytest.raises(kvx.ProtocolError):
            parse_push_note(bad)
    landing = pair.landing()
    landing.expect("x", "prefill")
    landed, _, _, rest = landing.poll({"prefill": [b"kvx-push\x00junk", b"other", push_note("x", 0, 1)],
                                       "intruder": [push_note("y", 0, 1)]})
    assert landed == {"x"} and rest == [b"other"]
    with pytest.raises(kvx.UsageError):
        LayerPusher(pair.p, NAMES, group=0)
    pusher = LayerPusher(pair.p, NAMES)
    with pytest.raises(kvx.UsageError):
        pusher.add("r", PushDest("decode", pair.ps, pair.pd, {"nope": (np.zeros(1, np.int64),) * 2}))


@pytest.mark.parametrize("lay_d,bs_d,lay_p,bs_p", [("HND", 4, "HND", 4), ("NHD", 8, "HND", 4), ("NHD5", 4, "NHD", 8)])
def test_split_by_layer_matches_the_pull_plan(lay_d: str, bs_d: int, lay_p: str, bs_p: int) -> None:
    """Per-layer indices are exactly PeerTables.indices' (the pull plan, tested in test_plan.py),
    split by layer: push moves the same bytes to the same places, layer by layer."""
    torch = pytest.importorskip("torch")
    from kvx_vllm.plan import PeerTables, layer_geometry
    from kvx_vllm.push import split_by_layer

    def geoms(layout: str, bs: int, blocks: int) -> list:
        out = []
        for i in range(3):
            if layout == "HND":
                t = torch.zeros(blocks, 2, bs, 16)
            elif layout == "NHD":
                t = torch.zeros(blocks, bs, 2, 16).permute(0, 2, 1, 3)
            else:
                t = torch.zeros(2, blocks, bs, 2, 8)
            out.append((t, layer_geometry(f"l{i}", t, 0, bs, 2, 8, False)))
        return out

    d, p = geoms(lay_d, bs_d, 40), geoms(lay_p, bs_p, 40)
    h = kvx.MemoryKind.HOST
    tabs = PeerTables([g for _, g in d], [g for _, g in p], 0, 0, 2, h, 0, h, 0)
    tokens = 37
    nd, np_ = -(-tokens // bs_d), -(-tokens // bs_p)
    rng = np.random.default_rng(1)
    dids, pids = rng.permutation(40)[:nd], rng.permutation(40)[:np_]
    for skip in (0, 1):  # the decode already holds its first block (prefix hit): only new ones move
        groups = [(dids[skip:], np.arange(skip, nd), pids)]
        per = split_by_layer(tabs, groups)
        lidx, ridx, _ = tabs.indices(groups)
        assert list(per) == ["l0", "l1", "l2"]
        assert np.array_equal(np.concatenate([per[n][0] for n in per]), lidx)
        assert np.array_equal(np.concatenate([per[n][1] for n in per]), ridx)
        for n, (a, b) in per.items():  # each layer's descriptors lie in that layer's memory
            i = int(n[1:])
            base_d, base_p = d[i][1].base, p[i][1].base
            assert (tabs.local_descs.addr[a] >= base_d).all() and (tabs.remote_descs.addr[b] >= base_p).all()
            assert (tabs.local_descs.addr[a] < base_d + d[i][0].numel() * 4).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "tcp"])
def test_layerwise_push_gpu_waits_for_each_layers_event(backend: str) -> None:
    """GPU 0 -> a decode process's GPU 1. Each layer's bytes are written by the GPU behind a queue
    of slow matmuls; the CUDA event recorded after them gates the write, so decode receives every
    layer's final bytes, never the stale ones the layer held when save_kv_layer was called."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    nbytes = L * B * BLK
    with kvx.Agent("prefill-gpu", kvx.AgentConfig(backends=(backend,))) as agent, \
            PeerProcess("decode-gpu", {"backends": [backend]}) as dec:
        rid, descs = dec.register("vram:1", nbytes)
        src = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
        local = agent.prepare(kvx.DescList.blocks(agent.register(src), BLK))
        peer = agent.add_peer(dec.meta)
        remote = agent.prepare(kvx.DescList.blocks(descs, BLK), peer=peer)
        pusher = LayerPusher(agent, NAMES, group=1, threaded=True)
        pusher.add("r", PushDest(peer, local, remote, layer_idx(list(range(B)), list(range(B)))))
        x = torch.randn(2048, 2048, device="cuda:0")
        for i, n in enumerate(NAMES):
            for _ in range(8):  # keep the stream busy: the fill below executes well after this call
                x = torch.tanh(x @ x)
            src[i * B * BLK:(i + 1) * B * BLK].fill_(i + 1)
            ev = torch.cuda.Event()
            ev.record()
            pusher.on_layer(n, ev)
        done, failed = pusher.wait()
        assert done == {"r"} and not failed
        landing = PushLanding(10.0, 10.0, notify=lambda *a: None)
        landing.expect("r", "prefill-gpu")
        landed: set[str] = set()
        end = time.monotonic() + 10
        while not landed and time.monotonic() < end:
            landed = landing.poll(dec.notifs(0.5))[0]
        assert landed == {"r"}
        for i in range(L):
            got = dec.peek(rid, i * B * BLK, B * BLK)
            assert got == bytes([i + 1]) * (B * BLK), f"layer {i}"
        pusher.close()


def _caches(torch: Any, layout: str, bs: int, blocks: int, fill: bool) -> list[tuple[Any, Any]]:
    """Three layers' (storage, the view vLLM hands the connector) with 2 KV heads of 8."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        if layout == "HND":
            st = torch.zeros(blocks, 2, bs, 16)
            view = st
        elif layout == "NHD":
            st = torch.zeros(blocks, bs, 2, 16)
            view = st.permute(0, 2, 1, 3)
        else:
            st = torch.zeros(2, blocks, bs, 2, 8)
            view = st
        if fill:
            st.copy_(torch.randn(st.shape, generator=g))
        out.append((st, view))
    return out


@pytest.mark.parametrize("lay_d,bs_d,lay_p,bs_p,skip", [("HND", 4, "NHD", 8, 0), ("NHD", 8, "HND", 4, 1),
                                                         ("NHD5", 4, "NHD5", 4, 1)])
def test_push_from_a_registration_moves_what_a_pull_moves(lay_d: str, bs_d: int, lay_p: str, bs_p: int,
                                                          skip: int) -> None:
    """Decode registers its blocks (a registration note through the parser), the prefill builds the
    destination and pushes layer by layer; the decode cache ends byte-identical to the same
    request pulled with the pull plan into a twin cache."""
    torch = pytest.importorskip("torch")
    from kvx_vllm.plan import PeerTables, layer_geometry
    from kvx_vllm.push import parse_registration, push_dest, registration_note

    def geoms(c: list[tuple[Any, Any]], bs: int) -> list[Any]:
        return [layer_geometry(f"l{i}", v, 0, bs, 2, 8, False) for i, (_, v) in enumerate(c)]

    blocks = 24
    pc = _caches(torch, lay_p, bs_p, blocks, True)
    ac, bc = _caches(torch, lay_d, bs_d, blocks, False), _caches(torch, lay_d, bs_d, blocks, False)
    h = kvx.MemoryKind.HOST
    with kvx.Agent("prefill", cfg()) as P, kvx.Agent("decode", cfg()) as D:
        P.register([st.numpy() for st, _ in pc])
        D.register([st.numpy() for st, _ in ac + bc])
        dpeer, ppeer = P.add_peer(D.metadata()), D.add_peer(P.metadata())
        tokens = 41
        nd, npf = -(-tokens // bs_d), -(-tokens // bs_p)
        rng = np.random.default_rng(3)
        dids, pids = rng.permutation(blocks)[:nd], rng.permutation(blocks)[:npf]
        pos = np.arange(skip, nd)
        # push: the prefill's side
        ta = PeerTables(geoms(ac, bs_d), geoms(pc, bs_p), 0, 0, 2, h, 0, h, 0)
        reg = parse_registration(registration_note("r", [(list(dids[skip:]), list(pos))], 1, 0))
        assert reg is not None and reg.rid == "r"
        dest = push_dest(ta, reg, [list(pids)], dpeer, P.prepare(ta.remote_descs),
                         P.prepare(ta.local_descs, peer=dpeer))
        pusher = LayerPusher(P, ["l0", "l1", "l2"], group=1)
        pusher.add("r", dest)
        for n in ("l0", "l1", "l2"):
            pusher.on_layer(n)
        assert pusher.wait() == ({"r"}, {})
        pusher.close()
        # pull: the same request into the twin cache, by the pull plan
        tb = PeerTables(geoms(bc, bs_d), geoms(pc, bs_p), 0, 0, 2, h, 0, h, 0)
        li, ri, _ = tb.indices([(dids[skip:], pos, pids)])
        D.read(D.prepare(tb.local_descs), li, D.prepare(tb.remote_descs, peer=ppeer), ri).wait(10)
        for (a, _), (b, _) in zip(ac, bc):
            assert torch.equal(a, b)
            assert a.abs().sum() > 0
        if skip:  # the block decode already held was not written
            first = dids[0]
            view = ac[0][1]
            assert not (view[:, first] if lay_d == "NHD5" else view[first]).any()


def test_registrations_are_validated() -> None:
    from kvx_vllm.push import parse_registration, registration_note

    assert parse_registration(push_note("r", 0, 1)) is None
    good = registration_note("r", [([3, 4], [0, 1])], 2, 1)
    reg = parse_registration(good)
    assert reg is not None and reg.tp_size == 2 and reg.tp_rank == 1
    assert [list(x) for x in reg.groups[0]] == [[3, 4], [0, 1]]
    for bad in (registration_note("r", [([3, 3], [0, 1])], 1, 0),  # a block twice
                registration_note("r", [([3, 4], [1, 1])], 1, 0),  # a position twice
                registration_note("r", [([3, 4], [0, 1])], 1, 1),  # rank outside the TP size
                registration_note("r", [], 1, 0),
                good[:-3],
                b"kvx-push-reg\x00" + b"\x95\x01\xa1r\x01\x00\x91\x92\xc4\x03abc\xc4\x03abc"):  # not whole u32s
        with pytest.raises(kvx.ProtocolError):
            parse_registration(bad)


def test_landing_with_several_writers() -> None:
    """A decode rank written by two prefill ranks (prefill TP larger than decode TP): landed only
    when both writers' parts are in; a part from a third peer or a repeat never counts; given up,
    both writers are told and the blocks quiesce when both acknowledged, or at the bound."""
    now = [0.0]
    sent: list[tuple[str, bytes]] = []
    landing = PushLanding(timeout=5.0, quiesce_s=10.0, notify=lambda p, m: sent.append((p, m)),
                          clock=lambda: now[0])
    landing.expect("r", ["p0", "p1"])
    with pytest.raises(kvx.UsageError):
        landing.expect("r2", ["p0", "p0"])
    with pytest.raises(kvx.UsageError):
        landing.expect("r", "p0")  # already expected
    landed, failed, quiesced, _ = landing.poll({"p0": [push_note("r", 0, 2), push_note("r", 1, 2)],
                                                "x": [push_note("r", 0, 1)]})
    assert (landed, failed, quiesced) == (set(), set(), set()) and landing.pending() == {"r"}
    landed, *_ = landing.poll({"p0": [push_note("r", 1, 2)], "p1": [push_note("r", 0, 2)]})
    assert not landed  # p1 has one part of two; p0's repeat changed nothing
    landed, *_ = landing.poll({"p1": [push_note("r", 1, 2)]})
    assert landed == {"r"} and not landing.pending()
    # given up (deadline): both writers told, quiesced once both acknowledged
    landing.expect("s", ["p0", "p1"])
    now[0] = 6.0
    landed, failed, quiesced, _ = landing.poll({"p0": [push_note("s", 0, 1)]})
    assert failed == {"s"} and not landed and not quiesced
    assert sorted(p for p, m in sent if m == abort_note("s")) == ["p0", "p1"]
    assert landing.poll({"p0": [aborted_note("s")]})[2] == set()  # one of two
    assert landing.poll({"p1": [aborted_note("s")]})[2] == {"s"} and not landing.pending()
    # a writer that never acknowledges: the quiesce bound frees the blocks
    landing.expect("t", ["p0", "p1"])
    landing.give_up("t")
    landing.poll({"p0": [aborted_note("t")]})
    now[0] = 6.0 + 10.0
    assert landing.poll({})[2] == {"t"} and not landing.pending()
