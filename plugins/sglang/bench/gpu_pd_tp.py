"""The kvx SGLang PD transfer plan on two GPUs: prefill and decode of different attention-TP sizes.

SGLang itself cannot run on the GPU machine (it pins torch 2.14.1; the machine has 2.11), so this
drives the plan the backend uses (:mod:`kvx_sglang.pdplan`, no SGLang import) the way
``KVXKVManager._send`` does: per (prefill rank, decode rank) pair, ``plan_pair`` decides whole
pages, a head slice (per-token descriptor lists made once per peer) or nothing (a replica); per
request one ``agent.write`` per pair, all posted, then waited. Every rank is a kvx agent with
SGLang-shaped KV buffers on CUDA -- prefill ranks on GPU 0, decode ranks on GPU 1 -- one buffer per
layer and K/V (MHA, ``[tokens, heads on the rank, head_dim]``) or per layer (MLA,
``[tokens, 1, 576]``), 64-token pages:

- MHA, Qwen2.5-7B: 28 layers, 4 KV heads of 128, bf16 (3.5 MiB per page over all ranks);
- MLA, DeepSeek-V3: 61 layers, 576 values per token, bf16 (4.3 MiB per page per rank).

Shapes 1->2 and 2->1 against the same-TP plan (1->1, 2->2) in the same run, their requests
alternating. Bytes are verified:
each decode rank's pages equal the prefill page at the heads the rank holds (MLA: the latent),
other pages untouched. Pages/s counts request pages delivered to every decode rank; post, the
median time to post one request's writes (before waiting for them); GB/s the
bytes moved (MLA 1->2 moves each page twice: both decode ranks need the whole latent).

    python plugins/sglang/bench/gpu_pd_tp.py [--pages 512] [--batch 32] [--iters 100] [--json OUT]

(with the repository root and plugins/sglang on PYTHONPATH, after ``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvx
from kvx import DescList, MemoryKind

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kvx_sglang.pdplan import Mode, heads_held, page_rows, plan_pair, slice_descs

PAGE = 64
CPU = False  # --cpu: host memory, a check of the plan's logic where there is no GPU


def device(i: int) -> str:
    return "cpu" if CPU else f"cuda:{i}"


def mem_kind() -> MemoryKind:
    return MemoryKind.HOST if CPU else MemoryKind.CUDA


def dev_id(t: torch.Tensor) -> int:
    return 0 if CPU else int(t.device.index)


def sync() -> None:
    if not CPU:
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)


MODELS = {
    "mha": {"layers": 28, "heads": 4, "dim": 128},  # Qwen2.5-7B
    "mla": {"layers": 61, "heads": 1, "dim": 576},  # DeepSeek-V3 (kv_lora_rank 512 + rope 64)
}


@dataclass
class Rank:
    agent: kvx.Agent
    bufs: list[torch.Tensor]
    tp: int
    rank: int
    page_list: kvx.PreparedList
    page_base: np.ndarray

    @property
    def rows(self) -> list[tuple[int, int, int]]:
        return [(t.data_ptr(), t.numel() * t.element_size(), t.numel() * t.element_size() // (t.shape[0] // PAGE))
                for t in self.bufs]


def model_buffers(kind: str, pages: int, dev: int) -> list[torch.Tensor]:
    """The model-wide bytes of every KV buffer (int16 stands for bf16), reproducible by seed."""
    m = MODELS[kind]
    nbuf = 2 * m["layers"] if kind == "mha" else m["layers"]
    g = torch.Generator(device=device(dev)).manual_seed(1234)
    return [torch.randint(-30000, 30000, (pages * PAGE, m["heads"], m["dim"]), dtype=torch.int16,
                          device=device(dev), generator=g) for _ in range(nbuf)]


#: The agents' configuration (--cuda-option).
AGENT_CONFIG: kvx.AgentConfig | None = None

def make_rank(name: str, kind: str, tp: int, rank: int, pages: int, dev: int, full: list[torch.Tensor] | None) -> Rank:
    m = MODELS[kind]
    h0, n = heads_held(tp, rank, m["heads"]) if kind == "mha" else (0, 1)
    if full is not None:
        bufs = [t[:, h0:h0 + n].contiguous() for t in full]
    else:
        bufs = [torch.zeros((pages * PAGE, n, m["dim"]), dtype=torch.int16, device=device(dev)) for _ in
                range(2 * m["layers"] if kind == "mha" else m["layers"])]
    agent = kvx.Agent(name, AGENT_CONFIG)
    agent.register(bufs)
    r = Rank(agent, bufs, tp, rank, None, None)  # type: ignore[arg-type]
    rows = r.rows
    counts = [n_ // item for _, n_, item in rows]
    addr = np.concatenate([p + np.arange(c, dtype=np.int64) * item for (p, _, item), c in zip(rows, counts)])
    size = np.concatenate([np.full(c, item, dtype=np.int64) for (_, _, item), c in zip(rows, counts)])
    r.page_base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    r.page_list = agent.prepare(DescList.from_arrays(kind=mem_kind(), addr=addr, nbytes=size, dev=dev_id(bufs[0])))
    return r


def pairs_of(ptp: int, dtp: int, mla: bool) -> list[tuple[int, int]]:
    """(prefill rank, decode rank) pairs that SGLang's common receiver sets up (MLA prefill TP >
    decode TP: only the first prefill rank of each decode rank is real, the others dummies)."""
    out = []
    for d in range(dtp):
        if dtp >= ptp:
            out.append((d // (dtp // ptp), d))
        else:
            r = ptp // dtp
            targets = range(d * r, (d + 1) * r)
            out.extend((p, d) for p in (targets[:1] if mla else targets))
    return out


def build_plan(kind: str, pre: list[Rank], dec: list[Rank]) -> list[tuple[Any, ...]]:
    """Per pair: (prefill rank, decode rank, mode, src list, src base, dst list, dst base), lists made once."""
    mla = kind == "mla"
    heads = MODELS[kind]["heads"]
    plan = []
    for p, d in pairs_of(len(pre), len(dec), mla):
        a, b = pre[p], dec[d]
        peer = a.agent.add_peer(b.agent.metadata())
        pair = plan_pair(mla=mla, src_tp=a.tp, src_rank=a.rank, dst_tp=b.tp, dst_rank=b.rank, total_heads=heads,
                         page_size=PAGE, src_items=[r[2] for r in a.rows], dst_items=[r[2] for r in b.rows])
        dev_b = dev_id(b.bufs[0])
        if pair.mode is Mode.PAGES:
            dst = a.agent.prepare(DescList.from_bytes(b.page_list.descs.to_bytes()), peer=peer)
            plan.append((a, b, pair.mode, a.page_list, a.page_base, dst, b.page_base))
        elif pair.mode is Mode.SLICE:
            # one strided descriptor per page (PAGE token rows of the head run), as KVXKVManager does
            br = b.rows
            ddescs, dbase = slice_descs([r[0] for r in br], [r[1] for r in br], [r[2] for r in br], PAGE,
                                        pair.dst_off, pair.nbytes, kind=mem_kind(), dev=dev_b)
            dst = a.agent.prepare(DescList.from_bytes(ddescs.to_bytes()), peer=peer)
            ar = a.rows
            sdescs, sbase = slice_descs([r[0] for r in ar], [r[1] for r in ar], [r[2] for r in ar], PAGE,
                                        pair.src_off, pair.nbytes, kind=mem_kind(), dev=dev_id(a.bufs[0]))
            src = a.agent.prepare(sdescs)
            plan.append((a, b, pair.mode, src, sbase, dst, dbase))
        else:
            plan.append((a, b, pair.mode, None, None, None, None))
    return plan


def send(plan: list[tuple[Any, ...]], src_pages: np.ndarray, dst_pages: np.ndarray) -> float:
    """One request, as KVXKVManager._send moves it: one write per pair, all posted, then waited;
    returns the seconds the posting took."""
    t0 = time.perf_counter()
    xs = []
    for a, _b, mode, src, sbase, dst, dbase in plan:
        if mode is Mode.PAGES:
            xs.append(a.agent.write(src, page_rows(sbase, src_pages), dst, page_rows(dbase, dst_pages)))
        elif mode is Mode.SLICE:
            xs.append(a.agent.write(src, page_rows(sbase, src_pages), dst, page_rows(dbase, dst_pages)))
    posted = time.perf_counter() - t0
    for x in xs:
        x.wait(60.0)
    return posted


def moved_bytes(plan: list[tuple[Any, ...]], n: int) -> int:
    total = 0
    for _a, b, mode, src, sbase, _dst, _dbase in plan:
        if mode is Mode.PAGES:
            total += n * sum(r[2] for r in b.rows)
        elif mode is Mode.SLICE:
            total += n * PAGE * int(src.descs.nbytes[sbase].sum())
    return total


def verify(kind: str, full: list[torch.Tensor], dec: list[Rank], plan: list[tuple[Any, ...]], pages: int,
           rng: np.random.Generator, batch: int) -> bool:
    for r in dec:
        for t in r.bufs:
            t.zero_()
    src_pages = rng.choice(pages, batch, replace=False).astype(np.int64)
    dst_pages = rng.choice(pages, batch, replace=False).astype(np.int64)
    send(plan, src_pages, dst_pages)
    sync()
    heads = MODELS[kind]["heads"]
    others = torch.ones(pages, dtype=torch.bool)
    others[torch.from_numpy(dst_pages)] = False
    for r in dec:
        h0, n = heads_held(r.tp, r.rank, heads) if kind == "mha" else (0, 1)
        for t, f in zip(r.bufs, full):
            want = f[:, h0:h0 + n].to(t.device).view(pages, PAGE, n, -1)
            got = t.view(pages, PAGE, n, -1)
            if not torch.equal(got[torch.from_numpy(dst_pages)], want[torch.from_numpy(src_pages)]):
                return False
            if bool(got[others].any()):
                return False
    return True


class Shape:
    """One (prefill TP, decode TP) shape: its ranks, the plan made once, the bytes verified."""

    def __init__(self, kind: str, ptp: int, dtp: int, pages: int, batch: int, full: list[torch.Tensor],
                 rng: np.random.Generator) -> None:
        tag = f"{kind}-{ptp}to{dtp}-{time.monotonic_ns()}"
        self.kind, self.ptp, self.dtp, self.pages, self.batch = kind, ptp, dtp, pages, batch
        self.pre = [make_rank(f"p{r}-{tag}", kind, ptp, r, pages, 0, full) for r in range(ptp)]
        self.dec = [make_rank(f"d{r}-{tag}", kind, dtp, r, pages, 1, None) for r in range(dtp)]
        t0 = time.perf_counter()
        self.plan = build_plan(kind, self.pre, self.dec)
        self.plan_s = time.perf_counter() - t0
        self.ok = verify(kind, full, self.dec, self.plan, pages, rng, batch)
        self.times: list[float] = []
        self.posts: list[float] = []

    def step(self, rng: np.random.Generator, keep: bool) -> None:
        """One timed request of ``batch`` random pages."""
        sp = rng.choice(self.pages, self.batch, replace=False).astype(np.int64)
        dp = rng.choice(self.pages, self.batch, replace=False).astype(np.int64)
        t0 = time.perf_counter()
        post = send(self.plan, sp, dp)
        dt = time.perf_counter() - t0
        if keep:
            self.times.append(dt)
            self.posts.append(post)

    def result(self) -> dict[str, Any]:
        med = statistics.median(self.times)
        return {"kind": self.kind, "prefill_tp": self.ptp, "decode_tp": self.dtp,
                "modes": [m.value for _a, _b, m, *_ in self.plan], "bytes_ok": self.ok, "plan_s": self.plan_s,
                "median_s": med, "post_us": statistics.median(self.posts) * 1e6, "pages_per_s": self.batch / med,
                "GB_per_s": moved_bytes(self.plan, self.batch) / med / 1e9}

    def close(self) -> None:
        for r in self.pre + self.dec:
            r.agent.close()


def run_pair(kind: str, base: tuple[int, int], shape: tuple[int, int], pages: int, batch: int, iters: int,
             full: list[torch.Tensor], rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """A shape and its same-TP base, their requests alternating (after 3 warm-up requests each), so
    that the machine's drift during the run weighs on both alike."""
    shapes = [Shape(kind, *base, pages, batch, full, rng)]
    try:
        shapes.append(Shape(kind, *shape, pages, batch, full, rng))
        for i in range(iters + 3):
            for sh in shapes if i % 2 == 0 else shapes[::-1]:
                sh.step(rng, i >= 3)
        return shapes[0].result(), shapes[1].result()
    finally:
        for sh in shapes:
            sh.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=512, help="pages in each rank's pool")
    ap.add_argument("--batch", type=int, default=32, help="pages per request (32 x 64 = 2048 tokens)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu", action="store_true", help="host memory instead of two GPUs (checks the logic only)")
    ap.add_argument("--cuda-option", action="append", default=[], metavar="NAME=INT",
                    help="an integer CudaOptions field for every agent, e.g. strided_group=0 (a warp per "
                         "head-slice piece) or blocks_per_sm=8; repeatable")
    a = ap.parse_args()
    global CPU, AGENT_CONFIG
    CPU = a.cpu
    if a.cuda_option:
        from kvx.backends.cuda import CudaOptions

        kw = {}
        for o in a.cuda_option:
            k, _, v = o.partition("=")
            kw[k] = int(v)
        AGENT_CONFIG = kvx.AgentConfig(options={"cuda": CudaOptions(**kw)})
    if not CPU and torch.cuda.device_count() < 2:
        raise SystemExit("needs 2 GPUs")
    rng = np.random.default_rng(7)
    results = []
    for kind, pages in (("mha", a.pages), ("mla", a.pages // 2)):
        full = model_buffers(kind, pages, 0)
        for base, shape in (((1, 1), (1, 2)), ((2, 2), (2, 1))):
            rb, rs = run_pair(kind, base, shape, pages, a.batch, a.iters, full, rng)
            rs["vs_same_tp"] = rs["pages_per_s"] / rb["pages_per_s"]
            results += [rb, rs]
            for r in (rb, rs):
                print(f"{r['kind']} {r['prefill_tp']}->{r['decode_tp']}: {r['pages_per_s']:8.0f} pages/s "
                      f"{r['GB_per_s']:6.1f} GB/s  post {r['post_us']:4.0f} us  "
                      f"bytes {'ok' if r['bytes_ok'] else 'WRONG'}  plan {r['modes']} "
                      f"(made in {1e3 * r['plan_s']:.0f} ms)"
                      + (f"  = {r['vs_same_tp']:.2f}x same TP" if "vs_same_tp" in r else ""), flush=True)
        del full
        if not CPU:
            torch.cuda.empty_cache()
    where = "CPU (logic check)" if CPU else torch.cuda.get_device_name(0) + " x2"
    print(f"# {where}, batch {a.batch} pages of {PAGE} tokens, pools of {a.pages} pages "
          f"(MLA {a.pages // 2}), median of {a.iters}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if not all(r["bytes_ok"] for r in results):
        raise SystemExit("bytes differ")


if __name__ == "__main__":
    main()
