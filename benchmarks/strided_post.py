"""Where a head-slice pull spends its CPU: plan indices, post, copy (host memory, one process).

The vLLM NHD plan (``kvx_vllm.plan.PeerTables``, planar ``[2, B, N, H, D]`` layers) and the SGLang
MHA plan (``kvx_sglang.pdplan``, per-layer K and V ``[tokens, heads, head_dim]``) move one
request's head slice between two host caches of one agent (loopback through the host backend's
native memcpy path), the same code the connectors run. Per shape it times, medians over rounds:

- ``index``: the request's descriptor indices from its block ids (the plan's numpy work);
- ``post``: ``agent.read`` until it returns (posting only: the copy runs in the pool threads), wall
  time, and ``post cpu``: the CPU time the posting thread spent in it (``time.thread_time``: on a
  loaded machine the wall time includes waits for a core while the copy threads run);
- ``total``: post and wait for the bytes;

and the number of descriptors posted, for both forms of the same plan in one run: ``strided``
(what the plans build: a strided descriptor per block and plane / per page) and ``pieces`` (the
same bytes as one plain descriptor per piece, i.e. per token: the plans before strided lists;
vLLM's lists flattened with ``DescList.flatten``, SGLang's from ``pdplan.token_descs``). Bytes are
checked once per shape (every byte of the destination's slice equals the source's). The copy is
the same number of bytes for both forms, so ``post`` is what a form costs. Run::

    PYTHONPATH=.:plugins/vllm:plugins/sglang python benchmarks/strided_post.py --tokens 4096,16384

(``--layers`` scales the cache: 4 layers of a Llama-3-8B-shaped NHD cache at 16K tokens are
256 MiB per side.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

import kvx

HEADS, HD, ES, BS = 8, 128, 2, 16  # Llama-3-8B: 8 KV heads of 128, bf16, 16-token blocks


def _geom(name: str, arr: np.ndarray, heads: int) -> Any:
    from kvx_vllm.plan import LayerGeom

    # planar NHD: [2, B, N, H, D] (bytes)
    _, b, n, h, d = arr.shape
    st = [s for s in arr.strides]
    return LayerGeom(name, 0, arr.ctypes.data, b, st[1], n, h, 2, d * arr.itemsize, st[0], st[2], st[3])


def vllm_case(agent: kvx.Agent, tokens: int, layers: int, tp_p: int, tp_d: int, rounds: int,
              form: str) -> dict[str, Any]:
    """One decode rank (rank 0 of ``tp_d``) pulls from prefill rank 0 of ``tp_p``."""
    from kvx_vllm.plan import PeerTables, read_plan

    from kvx.backends.base import piece_index

    nblocks = tokens // BS + 8
    hp, hd = HEADS // tp_p, HEADS // tp_d
    rng = np.random.default_rng(0)
    pre = [rng.integers(0, 255, (2, nblocks, BS, hp, HD * ES), dtype=np.uint8) for _ in range(layers)]
    dec = [np.zeros((2, nblocks, BS, hd, HD * ES), dtype=np.uint8) for _ in range(layers)]
    regs = [agent.register(a) for a in pre + dec]
    reads, _ = read_plan(HEADS, tp_d, 0, tp_p)
    p, lh0, rh0, nh = reads[0]
    t0 = time.perf_counter()
    tabs = PeerTables([_geom(f"l{i}", a, hd) for i, a in enumerate(dec)],
                      [_geom(f"l{i}", a, hp) for i, a in enumerate(pre)], lh0, rh0, nh,
                      kvx.MemoryKind.HOST, 0, kvx.MemoryKind.HOST, 0)
    ld, rd = tabs.local_descs, tabs.remote_descs
    if form == "pieces":
        ld, rd = ld.flatten(), rd.flatten()
    local, remote = agent.prepare(ld), agent.prepare(rd)
    build = time.perf_counter() - t0
    nb = tokens // BS
    lids = rng.permutation(nblocks)[:nb].astype(np.int64)
    rids = rng.permutation(nblocks)[:nb].astype(np.int64)
    groups = [(lids, np.arange(nb, dtype=np.int64), rids)]
    lc, rc = tabs.local_descs.count.astype(np.int64), tabs.remote_descs.count.astype(np.int64)
    lmap, rmap = (np.cumsum(lc) - lc, lc), (np.cumsum(rc) - rc, rc)

    def idx() -> tuple[np.ndarray, np.ndarray]:
        li, ri, _ = tabs.indices(groups)
        if form == "pieces":  # the per-piece plan: every piece its own index
            return piece_index(li, *lmap), piece_index(ri, *rmap)
        return li, ri

    out = _rounds(agent, rounds, idx, local, remote)
    # every byte of the slice arrived
    for a, b in zip(dec, pre):
        got = a[:, lids][:, :, :, lh0:lh0 + nh]
        want = b[:, rids][:, :, :, rh0:rh0 + nh]
        if not np.array_equal(got, want):
            raise SystemExit("vllm: bytes differ")
    for r in regs:
        r.release()
    out.update(build=build, bytes=layers * 2 * tokens * nh * HD * ES)
    return out


def sglang_case(agent: kvx.Agent, tokens: int, layers: int, tp_p: int, tp_d: int, rounds: int, form: str,
                page: int = 64) -> dict[str, Any]:
    """Prefill rank 0 of ``tp_p`` writes its slice of decode rank 0 of ``tp_d`` (MHA, K and V)."""
    from kvx_sglang import pdplan

    npages = tokens // page + 4
    hp, hd = HEADS // tp_p, HEADS // tp_d
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 255, (npages * page, hp, HD * ES), dtype=np.uint8) for _ in range(2 * layers)]
    dst = [np.zeros((npages * page, hd, HD * ES), dtype=np.uint8) for _ in range(2 * layers)]
    regs = [agent.register(a) for a in src + dst]
    si = [a.nbytes // npages for a in src]
    di = [a.nbytes // npages for a in dst]
    pair = pdplan.plan_pair(mla=False, src_tp=tp_p, src_rank=0, dst_tp=tp_d, dst_rank=0, total_heads=HEADS,
                            page_size=page, src_items=si, dst_items=di)
    assert pair.mode is pdplan.Mode.SLICE
    t0 = time.perf_counter()
    ptr_s, len_s = [a.ctypes.data for a in src], [a.nbytes for a in src]
    ptr_d, len_d = [a.ctypes.data for a in dst], [a.nbytes for a in dst]
    if form == "pieces":
        sa, ss, sbase = pdplan.token_descs(ptr_s, len_s, si, page, pair.src_off, pair.nbytes)
        da, ds, dbase = pdplan.token_descs(ptr_d, len_d, di, page, pair.dst_off, pair.nbytes)
        slocal, dremote = agent.prepare(_descs(sa, ss)), agent.prepare(_descs(da, ds))
    else:
        sd, sbase = pdplan.slice_descs(ptr_s, len_s, si, page, pair.src_off, pair.nbytes, kind=kvx.MemoryKind.HOST)
        dd, dbase = pdplan.slice_descs(ptr_d, len_d, di, page, pair.dst_off, pair.nbytes, kind=kvx.MemoryKind.HOST)
        slocal, dremote = agent.prepare(sd), agent.prepare(dd)
    build = time.perf_counter() - t0
    n = tokens // page
    sp = rng.permutation(npages)[:n].astype(np.int64)
    dp = rng.permutation(npages)[:n].astype(np.int64)

    def idx() -> tuple[np.ndarray, np.ndarray]:
        if form == "pieces":
            return pdplan.token_rows(dbase, dp, page), pdplan.token_rows(sbase, sp, page)
        return pdplan.page_rows(dbase, dp), pdplan.page_rows(sbase, sp)

    out = _rounds(agent, rounds, idx, dremote, slocal)
    lo_s, lo_d, nbb = pair.src_off[0], pair.dst_off[0], pair.nbytes[0]
    for a, b in zip(dst, src):
        got = a.reshape(npages, page, -1)[dp][:, :, lo_d:lo_d + nbb]
        want = b.reshape(npages, page, -1)[sp][:, :, lo_s:lo_s + nbb]
        if not np.array_equal(got, want):
            raise SystemExit("sglang: bytes differ")
    for r in regs:
        r.release()
    out.update(build=build, bytes=2 * layers * tokens * nbb)
    return out


def _descs(addr: Any, size: Any) -> kvx.DescList:
    if isinstance(addr, kvx.DescList):
        return addr
    return kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=addr.astype(np.uint64),
                                    nbytes=size.astype(np.uint64))


def _rounds(agent: kvx.Agent, rounds: int, idx: Any, local: Any, remote: Any) -> dict[str, Any]:
    ti, tp, tc, tt = [], [], [], []
    n = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        li, ri = idx()
        t1 = time.perf_counter()
        c1 = time.thread_time()
        x = agent.read(local, li, remote, ri)
        c2 = time.thread_time()
        t2 = time.perf_counter()
        x.wait(60.0)
        t3 = time.perf_counter()
        ti.append(t1 - t0)
        tp.append(t2 - t1)
        tc.append(c2 - c1)
        tt.append(t3 - t1)
        n = len(li)
    return {"index": statistics.median(ti), "post": statistics.median(tp), "cpu": statistics.median(tc),
            "total": statistics.median(tt), "descs": n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pairs", default="2to1,1to2,1to1", help="prefill TP to decode TP")
    ap.add_argument("--engines", default="vllm,sglang")
    ap.add_argument("--forms", default="pieces,strided")
    a = ap.parse_args(argv)
    print(f"{'engine':7} {'pair':5} {'tokens':>6} {'form':8} {'descs':>9} {'index ms':>9} {'post ms':>8} "
          f"{'post cpu ms':>11} {'total ms':>9} {'GB/s':>6} {'build ms':>9}")
    with kvx.Agent("strided-bench", kvx.AgentConfig(backends=("host",))) as agent:
        for eng in a.engines.split(","):
            for pair in a.pairs.split(","):
                tp_p, tp_d = (int(x) for x in pair.split("to"))
                if eng == "sglang" and tp_p == tp_d:
                    continue  # same TP moves whole pages there (no slice)
                for tokens in (int(t) for t in a.tokens.split(",")):
                    for form in a.forms.split(","):
                        f = vllm_case if eng == "vllm" else sglang_case
                        r = f(agent, tokens, a.layers, tp_p, tp_d, a.rounds, form)
                        print(f"{eng:7} {pair:5} {tokens:6d} {form:8} {r['descs']:9d} {r['index'] * 1e3:9.2f} "
                              f"{r['post'] * 1e3:8.2f} {r['cpu'] * 1e3:11.2f} {r['total'] * 1e3:9.2f} "
                              f"{r['bytes'] / r['total'] / 1e9:6.2f} {r['build'] * 1e3:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
