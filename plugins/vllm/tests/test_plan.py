"""Transfer planning across TP sizes, layouts and block sizes (kvx_vllm.plan), moved by real kvx
agents between host caches in vLLM's layouts, checked cell by cell against the tokens' KV.

The caches are torch tensors in the shapes vLLM allocates: HND ``[B, H, N, 2D]`` (CPU attention),
packed NHD (``[B, N, H, 2D]`` viewed as ``[B, H, N, 2D]``), planar NHD ``[2, B, N, H, D]`` and MLA
``[B, N, D]``. A request's tokens are written into a prefill TP's ranks (each its heads), its blocks
pulled by every decode rank with the plan's descriptor lists, and every decode rank's blocks read
back by plain tensor indexing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvx_vllm.plan import LayerGeom, PeerTables, heads_of, layer_geometry, plan_mismatch, read_plan

import kvx

D = 8
LAYERS = 2


def make_cache(layout: str, blocks: int, heads: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage tensor, the view vLLM hands the connector)."""
    if layout == "HND":
        t = torch.zeros(blocks, heads, bs, 2 * D)
        return t, t
    if layout == "NHD":
        t = torch.zeros(blocks, bs, heads, 2 * D)
        return t, t.permute(0, 2, 1, 3)
    if layout == "NHD5":
        t = torch.zeros(2, blocks, bs, heads, D)
        return t, t
    if layout == "MLA":
        t = torch.zeros(blocks, bs, D)
        return t, t
    raise ValueError(layout)


def cell_view(layout: str, t: torch.Tensor, d: int = D) -> torch.Tensor:
    """The cache as [blocks, planes, block_size, heads, d] (a view, indexing only)."""
    if layout == "HND":
        b, h, n, _ = t.shape
        return t.view(b, h, n, 2, d).permute(0, 3, 2, 1, 4)
    if layout == "NHD":
        b, n, h, _ = t.shape
        return t.view(b, n, h, 2, d).permute(0, 3, 1, 2, 4)
    if layout == "NHD5":
        return t.permute(1, 0, 2, 3, 4)
    return t[:, None, :, None, :]


class Rank:
    def __init__(self, name: str, layout: str, heads: int, bs: int, blocks: int, total: int, tp: int, rank: int):
        self.layout, self.bs, self.total, self.tp, self.rank = layout, bs, total, tp, rank
        self.h0, self.nh = heads_of(total, tp, rank) if layout != "MLA" else (0, 1)
        self.agent = kvx.Agent(name, kvx.AgentConfig(backends=("host",)))
        self.caches, self.geoms = [], []
        for i in range(LAYERS):
            st, view = make_cache(layout, blocks, self.nh, bs)
            self.caches.append(st)
            self.agent.register(st.numpy())
            self.geoms.append(layer_geometry(f"l{i}", view, 0, bs, self.nh, D, layout == "MLA"))

    def close(self) -> None:
        self.agent.close()


def kv_of(layer: int, planes: int, tokens: int, heads: int) -> torch.Tensor:
    """The request's KV: [planes, tokens, heads, D], distinct values everywhere."""
    g = torch.Generator().manual_seed(1000 + layer)
    return torch.rand(planes, tokens, heads, D, generator=g) + 1


def run_case(tp_p: int, tp_d: int, total: int, lay_p: str, lay_d: str, bs_p: int, bs_d: int, tokens: int,
             cached_blocks: int = 0) -> dict[int, int]:
    mla = lay_p == "MLA"
    eff = 1 if mla else total
    planes = 1 if mla else 2
    nb_p, nb_d = 64, 64
    pre = [Rank(f"p{r}", lay_p, 0, bs_p, nb_p, eff, tp_p, r) for r in range(tp_p)]
    dec = [Rank(f"d{r}", lay_d, 0, bs_d, nb_d, eff, tp_d, r) for r in range(tp_d)]
    rng = np.random.default_rng(tp_p * 100 + tp_d)
    nrb = -(-tokens // bs_p)
    nlb = -(-tokens // bs_d)
    rids = rng.permutation(nb_p)[:nrb]
    lids_all = rng.permutation(nb_d)[:nlb]
    kv = [kv_of(i, planes, tokens, eff) for i in range(LAYERS)]
    # prefill: every rank writes its heads of the request's tokens
    for p in pre:
        for i, c in enumerate(p.caches):
            v = cell_view(lay_p, c)
            for t in range(tokens):
                v[rids[t // bs_p], :, t % bs_p, :, :] = kv[i][:, t, p.h0:p.h0 + p.nh, :]
    # decode: the first cached_blocks blocks are local already (prefix hit), the rest pulled
    lpos = np.arange(cached_blocks, nlb)
    notified: dict[int, int] = {}
    expect: dict[int, int] = {}
    try:
        for d in dec:
            reads, notify = read_plan(eff, tp_d, d.rank, tp_p)
            for p, n in notify.items():
                notified[p] = notified.get(p, 0) + 1
                expect.setdefault(p, n)
                assert expect[p] == n  # every notifier of p says the same count
            for p, lh0, rh0, nh in reads:
                peer = d.agent.add_peer(pre[p].agent.metadata())
                tabs = PeerTables(d.geoms, pre[p].geoms, lh0, rh0, nh, kvx.MemoryKind.HOST, 0, kvx.MemoryKind.HOST, 0)
                li, ri, _ = tabs.indices([(lids_all[lpos], lpos, rids)])
                local = d.agent.prepare(tabs.local_descs)
                remote = d.agent.prepare(tabs.remote_descs, peer=peer)
                d.agent.read(local, li, remote, ri).wait(10)
        for d in dec:
            for i, c in enumerate(d.caches):
                v = cell_view(lay_d, c)
                for t in range(cached_blocks * bs_d, tokens):
                    got = v[lids_all[t // bs_d], :, t % bs_d, :, :]
                    want = kv[i][:, t, d.h0:d.h0 + d.nh, :]
                    assert torch.equal(got, want), (d.rank, i, t)
                if cached_blocks:  # untouched
                    assert float(v[lids_all[0]].abs().sum()) == 0.0
    finally:
        for r in pre + dec:
            r.close()
    assert notified == expect  # each prefill rank hears from exactly as many ranks as it waits for
    return notified


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (8, 2), (1, 8)])
@pytest.mark.parametrize("lay_p,lay_d", [("HND", "HND"), ("NHD", "NHD"), ("NHD5", "HND"), ("HND", "NHD5")])
def test_tp_pairs_and_layouts(tp_p: int, tp_d: int, lay_p: str, lay_d: str) -> None:
    """Every dividing TP pair, 4 KV heads (TP 8 replicates them), any layout on either side."""
    notified = run_case(tp_p, tp_d, 4, lay_p, lay_d, 4, 4, tokens=13, cached_blocks=1)
    assert sorted(notified) == list(range(tp_p))  # every prefill rank is told to free


@pytest.mark.parametrize("bs_p,bs_d", [(2, 8), (8, 2), (4, 4)])
@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1)])
def test_block_sizes_that_divide(bs_p: int, bs_d: int, tp_p: int, tp_d: int) -> None:
    run_case(tp_p, tp_d, 2, "HND", "NHD", bs_p, bs_d, tokens=21, cached_blocks=1)
    run_case(tp_p, tp_d, 2, "NHD5", "HND", bs_p, bs_d, tokens=16)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_mla_latent_read_once(tp_p: int, tp_d: int) -> None:
    """MLA: every decode rank reads the whole latent from one prefill rank; unread prefill ranks
    are only notified, each by exactly one decode rank."""
    notified = run_case(tp_p, tp_d, 1, "MLA", "MLA", 4, 4, tokens=11)
    assert notified == {p: max(1, tp_d // tp_p) for p in range(tp_p)}
    for d in range(tp_d):
        reads, _ = read_plan(1, tp_d, d, tp_p)
        assert len(reads) == 1 and reads[0][0] == d % tp_p


def test_replicated_heads_are_read_once() -> None:
    """2 KV heads at prefill TP 4 (each head on two ranks): a decode rank at TP 1 reads each head
    from one rank only; the two ranks left unread are notified by it."""
    reads, notify = read_plan(2, 1, 0, 4)
    assert [(r[0], r[3]) for r in reads] == [(0, 1), (2, 1)]
    assert notify == {0: 1, 1: 1, 2: 1, 3: 1}
    # decode TP 4 over prefill TP 1: two decode ranks read the same head of the one prefill rank
    plans = [read_plan(2, 4, d, 1) for d in range(4)]
    assert [p[0] for p in plans] == [[(0, 0, 0, 1)], [(0, 0, 0, 1)], [(0, 0, 1, 1)], [(0, 0, 1, 1)]]
    assert all(p[1] == {0: 4} for p in plans)  # the prefill rank waits for all four


def test_pieces_per_layout() -> None:
    """Same geometry: one piece per block (HND) / plane (NHD5); head slices: one per head range
    (HND) or one strided piece (a run per token) per block (packed NHD) and plane (NHD5)."""
    def geoms(layout: str, heads: int, bs: int = 16) -> LayerGeom:
        _, view = make_cache(layout, 4, heads, bs)
        return layer_geometry("l", view, 0, bs, heads, D, False)

    h = kvx.MemoryKind.HOST
    assert PeerTables([geoms("HND", 4)], [geoms("HND", 4)], 0, 0, 4, h, 0, h, 0).pieces == 1
    assert PeerTables([geoms("NHD5", 4)], [geoms("NHD5", 4)], 0, 0, 4, h, 0, h, 0).pieces == 2
    assert PeerTables([geoms("HND", 2)], [geoms("HND", 4)], 0, 2, 2, h, 0, h, 0).pieces == 1
    nhd = PeerTables([geoms("NHD", 2)], [geoms("NHD", 4)], 0, 2, 2, h, 0, h, 0)
    assert nhd.pieces == 1 and nhd.local_descs.is_strided
    tp = nhd.templates[0]
    # 16 tokens of 2 heads x (K, V) x 8 floats; 2 heads apart locally, 4 remotely
    assert (int(tp.count[0]), int(tp.nbytes[0]), int(tp.lstride[0]), int(tp.rstride[0])) == (16, 128, 128, 256)
    assert PeerTables([geoms("NHD5", 2)], [geoms("NHD5", 4)], 0, 2, 2, h, 0, h, 0).pieces == 2
    # same TP stays plain (short runs are not made strided)
    assert not PeerTables([geoms("NHD5", 4)], [geoms("NHD5", 4)], 0, 0, 4, h, 0, h, 0).local_descs.is_strided
    # prefill blocks of 8 into decode blocks of 16: two pieces per head (2 heads)
    assert PeerTables([geoms("HND", 2, 16)], [geoms("HND", 4, 8)], 0, 0, 2, h, 0, h, 0).pieces == 4


def test_mismatches_are_named() -> None:
    assert plan_mismatch(4, 2, 8) is None
    assert plan_mismatch(4, 3, 1) is not None and "decode tp_size 3" in plan_mismatch(4, 3, 1)
    assert "prefill tp_size 6" in (plan_mismatch(4, 2, 6) or "")
    h = kvx.MemoryKind.HOST
    a = layer_geometry("l", make_cache("HND", 4, 2, 12)[1], 0, 12, 2, D, False)
    b = layer_geometry("l", make_cache("HND", 4, 2, 8)[1], 0, 8, 2, D, False)
    with pytest.raises(kvx.ProtocolError, match="block sizes do not divide"):
        PeerTables([a], [b], 0, 0, 2, h, 0, h, 0)
    with pytest.raises(kvx.ProtocolError):
        LayerGeom.from_list(["l", 0, 0, 1, 1, 1 << 20, 1, 2, 8, 0, 0, 0])
    with pytest.raises(kvx.ProtocolError):
        LayerGeom.from_list(["l", 0, -1, 1, 1, 1, 1, 2, 8, 0, 0, 0])
    with pytest.raises(kvx.ProtocolError):  # a peer claiming 2^25 blocks is refused before any allocation
        LayerGeom.from_list(["l", 0, 0, 1 << 25, 1, 1, 1, 2, 8, 0, 0, 0])


def test_no_python_loop_per_block() -> None:
    """Planning a 16K-token request over a Llama-3-8B-shaped NHD cache (32 layers, 4 of 8 heads)
    is index arithmetic: well under a second."""
    import time

    def g(heads: int, blocks: int) -> list[LayerGeom]:
        es = 2
        out = []
        for i in range(32):
            base = (i + 1) << 36
            plane = blocks * 16 * heads * 128 * es
            out.append(LayerGeom(f"l{i}", 0, base, blocks, 16 * heads * 128 * es, 16, heads, 2, 128 * es, plane,
                                 heads * 128 * es, 128 * es))
        return out

    h = kvx.MemoryKind.HOST
    tabs = PeerTables(g(4, 1100), g(8, 1100), 0, 4, 4, h, 0, h, 0)
    ids = np.arange(1024)
    t0 = time.perf_counter()
    li, ri, _ = tabs.indices([(ids, ids, ids)])
    dt = time.perf_counter() - t0
    # a strided piece per block and plane (16 tokens each), not a piece per token
    assert li.size == ri.size == 32 * 1024 * 2
    assert int(tabs.local_descs.piece_bytes[li].sum()) == 32 * 1024 * 16 * 2 * 4 * 128 * 2
    assert dt < 1.0


def _indices_by_loops(tabs: PeerTables, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                      ) -> tuple[set[tuple[int, int]], set[int]]:
    """PeerTables.indices spelt out: every layer, super block and piece, one at a time."""
    from kvx_vllm.plan import pair_blocks

    pairs: set[tuple[int, int]] = set()
    used: set[int] = set()
    for lg, rg, tp, lo, ro in zip(tabs.layers, tabs.remote, tabs.templates, tabs.loffs, tabs.roffs):
        if lg.group >= len(groups) or not len(groups[lg.group][0]):
            continue
        lblock, rblock = pair_blocks(*groups[lg.group], lg.block_size, rg.block_size)
        for s in range(lblock.shape[0]):
            for j in range(len(tp)):
                lb, rb = int(lblock[s, tp.lsub[j]]), int(rblock[s, tp.rsub[j]])
                if lb >= 0 and rb >= 0:
                    pairs.add((lo + lb * len(tp) + j, ro + rb * len(tp) + j))
                    used.add(rb)
    return pairs, used


@pytest.mark.parametrize("bs_l,bs_r", [(16, 16), (16, 32), (32, 16)])
@pytest.mark.parametrize("cached", [0, 3])
def test_indices_match_a_loop_per_piece(bs_l: int, bs_r: int, cached: int) -> None:
    """The vectorised request indices (layers grouped into sets indexed alike, one broadcast add)
    pair the same descriptors as a loop over every piece: two KV cache groups, layers of unequal
    block counts (several sets), a prefix already local, head slices on both sides."""
    es = 2

    def g(heads: int, bs: int, counts: list[int], base: int) -> list[LayerGeom]:
        out = []
        for i, nb in enumerate(counts):
            plane = nb * bs * heads * D * es
            out.append(LayerGeom(f"l{i}", i % 2, base + i * (1 << 30), nb, bs * heads * D * es, bs, heads, 2, D * es,
                                 plane, heads * D * es, D * es))
        return out

    counts_l, counts_r = [40, 40, 40, 40, 44, 44], [50, 50, 50, 50, 50, 52]  # sets of 2, 2, 1 and 1 layers
    rng = np.random.default_rng(bs_l * 100 + bs_r + cached)
    for lh0, rh0, nh, hl, hr in ((0, 4, 4, 4, 8), (2, 0, 2, 4, 2), (0, 0, 4, 4, 4)):
        tabs = PeerTables(g(hl, bs_l, counts_l, 1 << 40), g(hr, bs_r, counts_r, 1 << 44), lh0, rh0, nh,
                          kvx.MemoryKind.HOST, 0, kvx.MemoryKind.HOST, 0)
        groups = []
        for _ in range(2):
            tokens = int(rng.integers(bs_l * (cached + 1), 30 * 16))
            nl, nr = -(-tokens // bs_l), -(-tokens // bs_r)
            lids, rids = rng.permutation(40)[:nl], rng.permutation(50)[:nr]
            lpos = np.arange(cached, nl)
            groups.append((lids[lpos].astype(np.int64), lpos, rids.astype(np.int64)))
        li, ri, used = tabs.indices(groups)
        want, want_used = _indices_by_loops(tabs, groups)
        assert li.size == ri.size == len(want)
        assert set(zip(li.tolist(), ri.tolist())) == want
        assert used.tolist() == sorted(want_used)
