"""Tuning sweeps of the cuda backend (needs a GPU; two for the x-sweeps), variants side by side.

    .venv/bin/python benchmarks/gpu_tune.py tune    [--total 256M] [--block-sizes 4K,...] [--iters 5]
    .venv/bin/python benchmarks/gpu_tune.py xtune   [--exec initiator,owner] [--variants warp:8:14,...,ce:0:0]
    .venv/bin/python benchmarks/gpu_tune.py xtune2  [--exec initiator,pull] [--small ...] [--large ...]
    .venv/bin/python benchmarks/gpu_tune.py stamps  [--block-sizes 4K,32K] [--variants default,noroute]

Each variant is a set of :class:`kvx.backends.cuda.CudaOptions` (mostly its advanced fields) and
runs in an agent of its own, made with those options; the agents of one sweep live side by side,
so at every point the variants are measured one after the other (interleaved, as the drift of a
GPU between two points is larger than the differences measured). Nothing in kvx is patched.

- ``tune``: one process, loopback (GPU 0 <-> GPU 1, GPU <-> pinned host), CTAs per SM x work-item
  size of the kernel, and the copy engines.
- ``xtune``: two processes (the target holds GPU 1 memory), kernel variants ``kernel:ctas:shift``
  (``warp``, ``warpx``, ``warp16``, ``bulk``, ``pf``) and ``ce``, per executing-GPU policy.
- ``xtune2``: two processes, GPU 0 <-> GPU 1 (or the target's pinned memory with ``--rseg
  pinned``), the variants of :func:`variant_options` (``--small`` at blocks up to 32 KiB,
  ``--large`` above); ``--profile`` sizes also get the CPU time of one post (call to return) and the
  wall time (call to completion), measured around ``write``/``read`` and ``wait``, for the host
  paths of ``--profile-host`` (``new``: the defaults, ``old``: numpy staging, Python-level CUDA
  calls, index upload, a polling reaper).
- ``stamps``: where the time of one post goes, from outside: call -> return (the CPU time of the
  post) and return -> done, per block size and variant (``default``; ``noroute``: every post
  through the general path, not the pair's native route). Also times a few CUDA/cupy primitives.

Every variant's bytes are checked once per point (``(BAD)`` marks a mismatch). Before this file
existed these sweeps were ``python -m kvx.bench.cuda tune|xtune|xtune2|stamps`` and patched the
backend's module globals; the phase stamps inside ``post`` and the GPU-event split of upload and
kernel in ``--profile`` needed hooks in the hot path and are gone (``docs/history.md`` keeps what
they measured).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvx
from kvx import _native
from kvx.backends.cuda import CudaOptions
from kvx.bench import parse_size, timed
from kvx.bench.cuda import arm, verified
from kvx.testing.gpu_peer import Helper

#: the host path before the native one: numpy staging, three Python-level CUDA calls, the indices
#: uploaded, a reaper polling every 50 us
OLD = {"native_staging": False, "native_post": False, "reaper_poll": 5e-5, "index_zerocopy": False}


def variant_options(v: str, exec_on: str = "initiator") -> dict[str, Any]:
    """The :class:`CudaOptions` fields of an ``xtune2`` variant.

    ``kernel`` (defaults), ``ce`` (copy engines), ``splitF`` (fraction F on the copy engines while the
    kernel copies the rest), ``pf`` / ``zcpf`` (next item's descriptors prefetched), ``zc`` / ``upload``
    (indices read in place from the pinned slot / uploaded before the kernel), ``warp`` / ``warpx`` /
    ``bulk`` / ``warp16`` (kernel variants), ``eager`` (reaper woken by every post), ``i64`` (indices
    staged as int64), ``old`` (:data:`OLD`), ``npstage`` / ``pypost`` / ``pollreaper`` (one part of
    ``old``), ``kN`` / ``hN`` (N CTAs per SM; with host memory), ``tN`` (N threads per CTA), ``pipeN``
    (pieces of N pairs), ``cN`` (work items of 2**N bytes), ``mN`` (small transfers' items down to
    2**N bytes), ``nospin`` (waiters poll from Python), ``noroute`` (every post through the general
    path), ``onestage`` (the defaults; the native staging runs without helper threads).
    """
    o: dict[str, Any] = {"exec_on": exec_on}
    if v == "ce":
        return {**o, "copy": "ce"}
    if v.startswith("split"):
        return {**o, "copy": "split", "split_fraction": float(v[5:])}
    o["copy"] = "kernel"
    fixed: dict[str, dict[str, Any]] = {
        "kernel": {}, "onestage": {}, "nospin": {"spin_us": 0.0}, "noroute": {"route": False},
        "pf": {"kernel": "pf"}, "zcpf": {"kernel": "pf", "index_zerocopy": True}, "zc": {"index_zerocopy": True},
        "upload": {"index_zerocopy": False}, "warp": {"kernel": "warp"}, "warpx": {"kernel": "warpx"},
        "bulk": {"kernel": "bulk"}, "warp16": {"kernel": "warp16"}, "eager": {"reaper_lazy": 0.0},
        "i64": {"index_i32": False}, "old": OLD, "npstage": {"native_staging": False},
        "pypost": {"native_post": False}, "pollreaper": {"reaper_poll": 5e-5},
    }
    if v in fixed:
        return {**o, **fixed[v]}
    numbered = {"k": "blocks_per_sm", "t": "threads", "h": "blocks_per_sm_host", "pipe": "pipe_pairs",
                "c": "chunk_shift", "m": "chunk_shift_min"}
    for prefix in sorted(numbered, key=len, reverse=True):
        if v.startswith(prefix) and v[len(prefix):].isdigit():
            return {**o, numbered[prefix]: int(v[len(prefix):])}
    raise SystemExit(f"unknown variant {v!r}")


def _agent(stack: contextlib.ExitStack, name: str, label: str, fields: dict[str, Any]) -> kvx.Agent | None:
    """An agent whose cuda backend has these options (closed with ``stack``), or None (printed) where
    the variant cannot run here (``ce``/``split`` without cuMemcpyBatchAsync)."""
    try:
        ag = kvx.Agent(name, kvx.AgentConfig(backends=("cuda",), options={"cuda": CudaOptions(**fields)}))
    except kvx.BackendUnavailable as exc:
        print(f"  {label}: cannot run here ({exc}), skipped", flush=True)
        return None
    return stack.enter_context(ag)


@contextlib.contextmanager
def _stage_threads(v: str) -> Iterator[None]:
    """``onestage``: the native index staging without its helper threads (a setting of the native
    extension, not of kvx's Python code); restored after."""
    mode = _native.stage_parallel()
    _native.stage_parallel(0 if v == "onestage" else mode)
    try:
        yield
    finally:
        _native.stage_parallel(mode)


# ---- tune: one process, loopback ---------------------------------------------------------------


def tune(argv: list[str]) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(prog="benchmarks/gpu_tune.py tune")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M,64M")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    total = parse_size(a.total)
    sizes = [parse_size(x) for x in a.block_sizes.split(",")]
    ndev = cp.cuda.runtime.getDeviceCount()
    with cp.cuda.Device(0):
        g0 = cp.ones(total, dtype=cp.uint8)
    with cp.cuda.Device(1 if ndev > 1 else 0):
        g1 = cp.zeros(total, dtype=cp.uint8)
    h = kvx.alloc_host(total, pinned=True)
    knobs = [(b, sh) for b in (2, 4, 8) for sh in (13, 14, 16)]
    variants: list[tuple[str, int, int, dict[str, Any]]] = [
        ("kernel", b, sh, {"copy": "kernel", "blocks_per_sm": b, "blocks_per_sm_host": b, "chunk_shift": sh})
        for b, sh in knobs] + [("ce", 0, 0, {"copy": "ce"})]
    with contextlib.ExitStack() as stack:
        agents = []
        for i, (mode, b, sh, fields) in enumerate(variants):
            ag = _agent(stack, f"tune-{i}", mode, fields)
            if ag is None:
                continue
            agents.append((mode, b, sh, ag, ag.register(g0), ag.register(g1), ag.register(h)))
        # (name, remote registration: 0 = GPU 1's, 1 = pinned host, op)
        pairs = [("gpu0->gpu1", 0, "write"), ("gpu0<-gpu1", 0, "read"), ("gpu->pinned", 1, "write"),
                 ("pinned->gpu", 1, "read")]
        for name, which, op in pairs:
            for bs in sizes:
                n = total // bs
                li = np.arange(n, dtype=np.int64)
                ri = np.random.default_rng(0).permutation(n).astype(np.int64)
                res = []
                post_us = 0.0
                for mode, b, sh, ag, r0, r1, rh in agents:
                    rb = (r1, rh)[which]
                    lo = ag.prepare(kvx.DescList.blocks(r0, bs))
                    re = ag.prepare(kvx.DescList.blocks(rb, bs))
                    fn = ag.write if op == "write" else ag.read

                    def once(fn: Any = fn, lo: Any = lo, re: Any = re) -> None:
                        fn(lo, li, re, ri).wait()

                    med, _mn = timed(once, a.iters)
                    res.append((n * bs / med / 1e9, mode, b, sh))
                    if (mode, b, sh) == ("kernel", 4, 14):  # the defaults: CPU time of a post
                        t0 = time.perf_counter()
                        for _ in range(20):
                            x = fn(lo, li, re, ri)
                        post_us = (time.perf_counter() - t0) / 20 * 1e6
                        x.wait()
                res.sort(reverse=True)
                cells = " ".join(f"{m}:{b}/{sh}={g:.0f}" for g, m, b, sh in res)
                print(f"{name:12s} {bs >> 10:6d}K post={post_us:7.0f}us  {cells}", flush=True)
    return 0


# ---- the two-process sweeps -------------------------------------------------------------------


@dataclass
class _Point:
    """One variant at one (op, block size): GPU 0 buffer ``g0`` <-> the target's region, permuted
    remote ids."""

    label: str
    op: str
    bs: int
    n: int
    agent: kvx.Agent
    fn: Any
    lo: Any
    re: Any
    li: np.ndarray
    ri: np.ndarray
    g0: Any


class _Variants:
    """One agent per variant (its options), all registered on the same GPU 0 buffer and connected to
    the target; :meth:`points` gives, per (op, block size), every variant's point."""

    def __init__(self, stack: contextlib.ExitStack, cp: Any, target: Helper, rdescs: kvx.DescList, total: int,
                 variants: list[tuple[str, dict[str, Any]]], tag: str) -> None:
        with cp.cuda.Device(0):
            self.g0 = cp.zeros(total, dtype=cp.uint8)
        self.rdescs = rdescs
        self.total = total
        self.members: list[tuple[str, kvx.Agent, Any, Any]] = []
        for i, (label, fields) in enumerate(variants):
            ag = _agent(stack, f"{tag}-{i}", label, fields)
            if ag is None:
                continue
            self.members.append((label, ag, ag.register(self.g0), ag.add_peer(target.meta)))

    def points(self, op: str, bs: int) -> list[_Point]:
        n = self.total // bs
        li = np.arange(n, dtype=np.int64)
        ri = np.random.default_rng(0).permutation(n).astype(np.int64)
        return [_Point(label, op, bs, n, ag, ag.write if op == "write" else ag.read,
                       ag.prepare(kvx.DescList.blocks(reg, bs)),
                       ag.prepare(kvx.DescList.blocks(self.rdescs, bs), peer=peer), li, ri, self.g0)
                for label, ag, reg, peer in self.members]


def _measure(cp: Any, pt: _Point, target: Helper, rid: int, total: int, seed: int,
             iters: int) -> tuple[float, bool] | None:
    """Arm, time (median of ``iters``) and verify one variant at ``pt``: (GB/s, bytes right), or
    None (printed) if the variant cannot run here."""
    with cp.cuda.Device(0):
        arm(cp, pt.op, pt.g0, target, rid, total, seed)
    try:
        with _stage_threads(pt.label):
            med, _mn = timed(lambda: pt.fn(pt.lo, pt.li, pt.re, pt.ri).wait(), iters)
    except Exception as exc:  # a variant that cannot run here
        print(f"  {pt.op} {pt.bs} {pt.label} failed: {exc}", flush=True)
        return None
    with cp.cuda.Device(0):
        ok = verified(pt.op, pt.g0, target, rid, total, pt.n, pt.bs, pt.ri, seed)
    return pt.n * pt.bs / med / 1e9, ok


def xtune(argv: list[str]) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(prog="benchmarks/gpu_tune.py xtune")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--exec", default="initiator,owner")
    ap.add_argument("--variants", default="warp:8:14,warp:4:14,warp:8:16,warp16:4:14,warp16:4:16,bulk:4:14,"
                                          "bulk:6:14,bulk:8:14,bulk:6:16,ce:0:0")
    a = ap.parse_args(argv)
    total = parse_size(a.total)
    sizes = [parse_size(x) for x in a.block_sizes.split(",")]
    rdev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    target = Helper("xtune-target", {"backends": ["cuda"]})
    try:
        rid, rdescs = target.register("vram", total, rdev)
        for ex in a.exec.split(","):
            variants: list[tuple[str, dict[str, Any]]] = []
            for v in a.variants.split(","):
                kern, per_sm, sh = v.split(":")[0], int(v.split(":")[1]), int(v.split(":")[2])
                fields: dict[str, Any] = {"exec_on": ex, "copy": "ce"} if kern == "ce" else {
                    "exec_on": ex, "copy": "kernel", "kernel": kern, "blocks_per_sm": per_sm,
                    "blocks_per_sm_bulk": per_sm, "chunk_shift": sh}
                variants.append((v, fields))
            with contextlib.ExitStack() as stack:
                vs = _Variants(stack, cp, target, rdescs, total, variants, f"xtune-{ex}")
                for op in ("write", "read"):
                    for bs in sizes:
                        res = []
                        for pt in vs.points(op, bs):
                            per_sm, sh = (int(x) for x in pt.label.split(":")[1:])
                            got = _measure(cp, pt, target, rid, total, bs + per_sm + sh, a.iters)
                            if got is not None:
                                res.append((got[0], pt.label, got[1]))
                        res.sort(reverse=True)
                        cells = " ".join(f"{v}={g:.0f}{'' if ok else '(BAD)'}" for g, v, ok in res)
                        print(f"{ex:9s} {op:5s} {bs >> 10:6d}K  {cells}", flush=True)
    finally:
        target.close()
    return 0


def _post_and_wall(pt: _Point, iters: int) -> tuple[float, float]:
    """Median CPU time of a post (call to return) and wall time (call to completion), us."""
    posts, walls = [], []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        x = pt.fn(pt.lo, pt.li, pt.re, pt.ri)
        t1 = time.perf_counter()
        x.wait()
        t2 = time.perf_counter()
        if i:
            posts.append((t1 - t0) * 1e6)
            walls.append((t2 - t0) * 1e6)
    return float(np.median(posts)), float(np.median(walls))


def xtune2(argv: list[str]) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(prog="benchmarks/gpu_tune.py xtune2")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M,64M")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--exec", default="initiator,pull")
    ap.add_argument("--small", default="kernel,pf,k8,pipe16384,pipe4096,ce,split0.05")
    ap.add_argument("--large", default="kernel,ce,split0.1,split0.2,split0.3,split0.4,split0.5,split0.6")
    ap.add_argument("--profile", default="4K,32K")
    ap.add_argument("--profile-host", default="new,old")
    ap.add_argument("--rseg", default="vram", choices=["vram", "pinned"],
                    help="the target's memory: GPU 1 (vram) or its pinned host memory")
    a = ap.parse_args(argv)
    total = parse_size(a.total)
    sizes = [parse_size(x) for x in a.block_sizes.split(",")]
    prof_sizes = {parse_size(x) for x in a.profile.split(",") if x}
    hosts = [h for h in a.profile_host.split(",") if h]
    small, large = a.small.split(","), a.large.split(",")
    rdev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    target = Helper("xtune2-target", {"backends": ["cuda"]})
    try:
        rid, rdescs = target.register(a.rseg, total, rdev)
        for ex in a.exec.split(","):
            labels = list(dict.fromkeys(small + large + [f"host={h}" for h in hosts]))
            variants = [(v, variant_options("old" if v == "host=old" else "kernel" if v.startswith("host=") else v,
                                            ex)) for v in labels]
            with contextlib.ExitStack() as stack:
                vs = _Variants(stack, cp, target, rdescs, total, variants, f"xtune2-{ex}")
                for op in ("write", "read"):
                    for bs in sizes:
                        want = small if bs <= (32 << 10) else large
                        pts = {pt.label: pt for pt in vs.points(op, bs)}
                        res: list[tuple[str, float, bool]] = []
                        for v in want:
                            if v not in pts:
                                continue
                            got = _measure(cp, pts[v], target, rid, total, bs + len(res) + 3, a.iters)
                            if got is not None:
                                res.append((v, got[0], got[1]))
                        cells = " ".join(f"{v}={g:.0f}{'' if ok else '(BAD)'}" for v, g, ok in res)
                        print(f"{ex:9s} {op:5s} {bs >> 10:6d}K  {cells}", flush=True)
                        for hp in (hosts if bs in prof_sizes else []):
                            pt = pts.get(f"host={hp}")
                            if pt is None:
                                continue
                            post, wall = _post_and_wall(pt, a.iters)
                            print(f"  profile {ex} {op} {bs >> 10}K kernel host={hp}: wall {wall:.0f} us, "
                                  f"post() {post:.0f} us ({pt.n * pt.bs / wall / 1e3:.0f} GB/s)", flush=True)
    finally:
        target.close()
    return 0


def stamps(argv: list[str]) -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(prog="benchmarks/gpu_tune.py stamps")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default="default,noroute")
    ap.add_argument("--path", default="kernel", choices=["kernel", "ce"],
                    help="copy path (ce: cuMemcpyBatchAsync; its post time is the driver's CPU time per batch)")
    a = ap.parse_args(argv)
    total = parse_size(a.total)
    rdev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0

    def prim(name: str, fn: Any, k: int = 2000) -> None:
        fn()
        t0 = time.perf_counter_ns()
        for _ in range(k):
            fn()
        print(f"  primitive {name}: {(time.perf_counter_ns() - t0) / k / 1e3:.2f} us", flush=True)

    with cp.cuda.Device(0):
        e = cp.cuda.Event(block=True, disable_timing=True)
        e.record()
        e.synchronize()
        prim("cp.cuda.Event(block=True)", lambda: cp.cuda.Event(block=True, disable_timing=True))
        prim("event.done", lambda: e.done)

        def ctx() -> None:
            with cp.cuda.Device(0):
                pass
        prim("with cp.cuda.Device(0)", ctx)
    names = a.variants.split(",")
    unknown = [v for v in names if v not in ("default", "noroute")]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r} (default, noroute)")
    variants = [(v, {"copy": a.path, **({"route": False} if v == "noroute" else {})}) for v in names]
    target = Helper("stamps-target", {"backends": ["cuda"]})
    try:
        rid, rdescs = target.register("vram", total, rdev)
        with contextlib.ExitStack() as stack:
            vs = _Variants(stack, cp, target, rdescs, total, variants, "stamps")
            for bs in [parse_size(x) for x in a.block_sizes.split(",")]:
                for op in ("write", "read"):
                    for pt in vs.points(op, bs):
                        rows: dict[str, list[float]] = {"call->return": [], "return->done": []}
                        walls = []
                        for i in range(a.iters + 2):
                            t0 = time.perf_counter_ns()
                            x = pt.fn(pt.lo, pt.li, pt.re, pt.ri)
                            t1 = time.perf_counter_ns()
                            x.wait()
                            t2 = time.perf_counter_ns()
                            if i < 2:
                                continue
                            rows["call->return"].append((t1 - t0) / 1e3)
                            rows["return->done"].append((t2 - t1) / 1e3)
                            walls.append((t2 - t0) / 1e3)
                        med = float(np.median(walls))
                        cells = ", ".join(f"{k} {float(np.median(vs_)):.1f}" for k, vs_ in rows.items())
                        print(f"{op:5s} {bs >> 10:5d}K {pt.label:9s} wall {med:.0f} us "
                              f"({pt.n * pt.bs / med / 1e3:.0f} GB/s): {cells}", flush=True)
    finally:
        target.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    sweeps = {"tune": tune, "xtune": xtune, "xtune2": xtune2, "stamps": stamps}
    if not args or args[0] not in sweeps:
        print("usage: benchmarks/gpu_tune.py tune|xtune|xtune2|stamps [options]  (--help after the sweep's name)",
              file=sys.stderr)
        return 2
    return sweeps[args[0]](args[1:])


if __name__ == "__main__":
    sys.exit(main())
