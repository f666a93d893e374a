"""``kvx bench --backend cuda``: two processes on one machine, GPU memory and pinned host memory.

The initiator runs on GPU 0; the target process holds the remote buffer on GPU 1 when there are
two GPUs (else GPU 0). ``--seg LOCAL,REMOTE`` picks each side's memory: ``vram`` (GPU memory)
or ``pinned`` (``kvx.alloc_host(n, pinned=True)``). Every point is timed from the
``write``/``read`` call to completion (descriptor upload included), over permuted block ids,
for both copy paths side by side: ``kvx-kernel`` (the NVRTC gather/scatter kernel) and
``kvx-ce`` (``cuMemcpyBatchAsync`` on the copy engines). Ceiling rows: a 1 GiB peer copy
(``raw-peer``) for GPU<->GPU, a 1 GiB pinned<->GPU ``cudaMemcpyAsync`` (``raw-pcie``) otherwise.

This module is also the helper process of the GPU tests and of this benchmark
(``python -m kvx.bench.cuda target``): a kvx agent that registers GPU or pinned memory and
answers JSON lines (``register``, ``release``, ``digest``, ``fill``, ``zero``, ``peek``,
``put``, ``notifs``, ``meta``, ``quit``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvx

from .. import _native
from ..testing.procs import PeerProcess
from . import BenchOptions, Progress, iter_sizes, permutation, row, timed

__all__ = ["Helper", "digest", "pattern", "run"]

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)


def pattern(xp: Any, nbytes: int, seed: int) -> Any:
    """Deterministic bytes, identical from numpy and cupy (``xp``), so both sides can rebuild them."""
    n8 = (nbytes + 7) // 8
    x = xp.arange(n8, dtype=xp.uint64)
    x += xp.uint64((seed * 0x2545F4914F6CDD1D) % (1 << 64))
    x *= _K2
    x ^= x >> xp.uint64(31)
    x *= _K3
    x ^= x >> xp.uint64(29)
    return x.view(xp.uint8)[:nbytes]


def digest(xp: Any, a: Any) -> int:
    """A position-sensitive 64-bit checksum of a uint8 array (numpy or cupy; same value)."""
    n8 = a.size // 8
    s = 0
    if n8:
        w = a[: n8 * 8].view(xp.uint64)
        i = xp.arange(n8, dtype=xp.uint64)
        i *= _K1
        h = w ^ i
        h *= _K2
        h ^= h >> xp.uint64(31)
        s = int(h.sum(dtype=xp.uint64))
    tail = bytes(xp.asnumpy(a[n8 * 8:]) if hasattr(xp, "asnumpy") else a[n8 * 8:])
    return (s ^ int.from_bytes(tail.ljust(8, b"\0"), "little") ^ (a.size << 1)) & ((1 << 64) - 1)


def _xp(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return np
    import cupy

    return cupy


def _alloc(seg: str, nbytes: int, dev: int) -> tuple[Any, Any]:
    """(object to register, uint8 view to fill and check) for one memory segment."""
    if seg == "pinned":
        buf = kvx.alloc_host(nbytes, pinned=True)
        return buf, buf
    if seg == "vram":
        import cupy

        with cupy.cuda.Device(dev):
            buf = cupy.zeros(nbytes, dtype=cupy.uint8)
        return buf, buf
    if seg == "torch":  # a slice at an offset inside a caching-allocator block
        import cupy
        import torch

        big = torch.zeros(nbytes + 8192 + 16, dtype=torch.uint8, device=f"cuda:{dev}")
        t = big[4096 + 16: 4096 + 16 + nbytes]
        with cupy.cuda.Device(dev):  # from another device, cupy.asarray would copy
            return t, cupy.asarray(t)
    raise ValueError(f"unknown memory segment {seg!r} (vram, pinned, torch)")


# ---------------------------------------------------------------------------------------------
# The helper process


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.bench.cuda target")
    ap.add_argument("--name", default="gpu-target")
    ap.add_argument("--config", default="{}")
    a = ap.parse_args(argv)
    cfgd = json.loads(a.config)
    if "backends" in cfgd:
        cfgd["backends"] = tuple(cfgd["backends"])
    agent = kvx.Agent(a.name, kvx.AgentConfig(**cfgd))
    regs: dict[int, tuple[kvx.Registration, Any, Any]] = {}
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"meta": base64.b64encode(agent.metadata()).decode(), "pid": os.getpid()})
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c.get("cmd")
        try:
            with _on_device(regs.get(int(c.get("id", 0)), (None, None, None))[2]):
                _serve_one(c, cmd, agent, regs, say)
        except Exception as exc:  # report to the driver, keep serving
            say({"error": f"{type(exc).__name__}: {exc}"})
        if cmd == "quit":
            break
    agent.close()
    return 0


class _on_device:
    """Run on the GPU holding ``view`` (cupy launches on the current device)."""

    def __init__(self, view: Any) -> None:
        self.ctx: Any = None
        if view is not None and not isinstance(view, np.ndarray):
            import cupy

            self.ctx = cupy.cuda.Device(view.device.id)
        elif view is None:  # registering: make the new memory's initial fill visible too
            try:
                import cupy

                self.ctx = cupy.cuda.Device(cupy.cuda.runtime.getDevice())
            except ImportError:
                pass

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()  # the initiator's copies come from another process
            self.ctx.__exit__(*exc)


def _serve_one(c: dict[str, Any], cmd: Any, agent: kvx.Agent, regs: dict[int, Any], say: Any) -> None:
    nid = max(regs, default=0) + 1
    if cmd == "register":
        obj, view = _alloc(c["seg"], int(c["nbytes"]), int(c.get("dev", 0)))
        if not isinstance(view, np.ndarray):
            import cupy

            _sync_all(cupy)  # torch/cupy fills are asynchronous
        reg = agent.register(obj)
        regs[nid] = (reg, obj, view)
        say({"id": nid, "descs": base64.b64encode(reg.descs.to_bytes()).decode()})
    elif cmd == "release":
        regs[int(c["id"])][0].release()
        say({"ok": True})
    elif cmd == "free":
        regs.pop(int(c["id"]))[0].release()
        say({"ok": True})
    elif cmd == "digest":
        v = regs[int(c["id"])][2]
        say({"digest": str(digest(_xp(v), v))})
    elif cmd == "fill":
        v = regs[int(c["id"])][2]
        v[:] = pattern(_xp(v), v.size, int(c["seed"]))
        _settle(v)
        say({"ok": True})
    elif cmd == "zero":
        v = regs[int(c["id"])][2]
        v[:] = 0
        _settle(v)
        say({"ok": True})
    elif cmd == "peek":
        v = regs[int(c["id"])][2]
        off, n = int(c["off"]), int(c["n"])
        part = v[off: off + n]
        data = bytes(part) if isinstance(part, np.ndarray) else part.get().tobytes()
        say({"data": base64.b64encode(data).decode()})
    elif cmd == "put":
        v = regs[int(c["id"])][2]
        data = np.frombuffer(base64.b64decode(c["data"]), dtype=np.uint8)
        off = int(c["off"])
        xp = _xp(v)
        v[off: off + data.size] = data if xp is np else xp.asarray(data)
        _settle(v)
        say({"ok": True})
    elif cmd == "meta":
        say({"meta": base64.b64encode(agent.metadata()).decode()})
    elif cmd == "notifs":
        got = agent.notifications(timeout=float(c.get("wait", 0)) or None)
        say({"notifs": {k: [base64.b64encode(m).decode() for m in v] for k, v in got.items()}})
    elif cmd == "quit":
        say({"ok": True})
    else:
        say({"error": f"unknown command {cmd!r}"})


class Helper(PeerProcess):
    """A helper process (``python -m kvx.bench.cuda target``) driven over JSON lines, bounded."""

    ARGS = ("-m", "kvx.bench.cuda", "target")
    WHAT = "helper"
    QUIT_TIMEOUT = 30.0

    def __init__(self, name: str = "gpu-target", config: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, timeout: float = 120.0) -> None:
        super().__init__(name, config, env, timeout)

    def register(self, seg: str, nbytes: int, dev: int = 0) -> tuple[int, kvx.DescList]:  # type: ignore[override]
        res = self.call(cmd="register", seg=seg, nbytes=nbytes, dev=dev)
        return int(res["id"]), kvx.DescList.from_bytes(base64.b64decode(res["descs"]))

    def digest(self, rid: int) -> int:  # type: ignore[override]
        return int(self.call(cmd="digest", id=rid)["digest"])


# ---------------------------------------------------------------------------------------------
# The benchmark


def _segs(opts: BenchOptions) -> tuple[str, str]:
    segs = tuple("vram" if s in ("dram", "") else s for s in opts.seg)
    for s in segs:
        if s not in ("vram", "pinned"):
            raise SystemExit(f"kvx bench --backend cuda: --seg takes vram or pinned, not {s!r}")
    return segs[0], segs[1]


def _settle(view: Any) -> None:
    """Wait for the GPU work that just wrote ``view`` (cupy/torch kernels are asynchronous): the
    target answers only once its own fill is done, so no timed transfer shares the GPU with it."""
    if not isinstance(view, np.ndarray):
        import cupy

        _sync_all(cupy)


def _sync_all(cp: Any) -> None:
    for d in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


def _arm(cp: Any, op: str, view: Any, target: "Helper", rid: int, total: int, seed: int) -> None:
    """Before a measured point: the source holds ``pattern(seed)``, the destination zeros."""
    xp = _xp(view)
    if op == "write":
        view[:] = pattern(xp, total, seed)
        target.call(cmd="zero", id=rid)
    else:
        target.call(cmd="fill", id=rid, seed=seed)
        view[:] = 0
    _sync_all(cp)


def _verified(op: str, view: Any, target: "Helper", rid: int, total: int, n: int, bs: int, ri: np.ndarray,
              seed: int) -> bool:
    """After a measured point: the destination holds the armed source's blocks, permuted by ``ri``
    (local block i <-> remote block ri[i])."""
    xp = _xp(view)
    src = pattern(xp, total, seed)[: n * bs]
    exp = xp.zeros(total, dtype=xp.uint8)
    rix = ri if xp is np else xp.asarray(ri)
    if op == "write":
        exp[: n * bs].reshape(n, bs)[rix] = src.reshape(n, bs)
        return bool(target.digest(rid) == digest(xp, exp))
    exp[: n * bs].reshape(n, bs)[:] = src.reshape(n, bs)[rix]
    return bool(digest(xp, view) == digest(xp, exp))


def ceiling(opts: BenchOptions, prog: Progress, local_seg: str, remote_seg: str, rdev: int) -> list[dict[str, Any]]:
    """Raw copies of 1 GiB: GPU0<->GPU1 peer copy, or pinned<->GPU cudaMemcpyAsync."""
    import cupy as cp

    size = 1 << 30
    prog.step("raw ceiling")
    rt = cp.cuda.runtime
    out: list[dict[str, Any]] = []
    if local_seg == "vram" and remote_seg == "vram":
        with cp.cuda.Device(0):
            a = cp.ones(size, dtype=cp.uint8)
            s = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.Device(rdev):
            b = cp.zeros(size, dtype=cp.uint8)
        if rdev != 0:
            with cp.cuda.Device(0):
                try:
                    rt.deviceEnablePeerAccess(rdev)
                except rt.CUDARuntimeError:
                    pass
        fns = {"write": lambda: rt.memcpyPeerAsync(b.data.ptr, rdev, a.data.ptr, 0, size, s.ptr),
               "read": lambda: rt.memcpyPeerAsync(a.data.ptr, 0, b.data.ptr, rdev, size, s.ptr)}
        impl = "raw-peer"
    else:
        gdev = 0 if local_seg == "vram" else rdev
        h = kvx.alloc_host(size, pinned=True)
        with cp.cuda.Device(gdev):
            g = cp.zeros(size, dtype=cp.uint8)
            s = cp.cuda.Stream(non_blocking=True)
        d2h = lambda: rt.memcpyAsync(h.ctypes.data, g.data.ptr, size, 2, s.ptr)  # noqa: E731
        h2d = lambda: rt.memcpyAsync(g.data.ptr, h.ctypes.data, size, 1, s.ptr)  # noqa: E731
        # write moves local -> remote: GPU -> host when the GPU is local
        fns = {"write": d2h, "read": h2d} if local_seg == "vram" else {"write": h2d, "read": d2h}
        impl = "raw-pcie"
    for op in opts.ops:
        fn = fns[op]

        def once(fn: Any = fn) -> None:
            fn()
            s.synchronize()

        med, mn = timed(once, max(opts.iters, 5))
        for bs, n in iter_sizes(opts):
            out.append(row(impl, op, bs, n, opts.iters, med * (n * bs) / size, mn * (n * bs) / size,
                           ceiling_bytes=size))
    return out


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Both copy paths for every (op, block size); rows as in :mod:`kvx.bench`."""
    import cupy as cp

    from ..backends import cuda as kcuda

    local_seg, remote_seg = _segs(opts)
    ndev = cp.cuda.runtime.getDeviceCount()
    rdev = 1 if ndev > 1 else 0
    paths = [p for p in opts.extra.get("paths", ["kernel", "ce"])]
    prog.add(len(paths) * len(opts.ops) * len(opts.block_sizes))
    cfg = {"backends": ["cuda"]}
    target = Helper("bench-target", cfg)
    rows: list[dict[str, Any]] = []
    try:
        rid, rdescs = target.register(remote_seg, opts.total, rdev)
        with kvx.Agent("bench-initiator", kvx.AgentConfig(backends=("cuda",))) as agent:
            obj, view = _alloc(local_seg, opts.total, 0)
            reg = agent.register(obj)
            peer = agent.add_peer(target.meta)
            be = agent.backend("cuda")
            assert isinstance(be, kcuda.CudaBackend)
            for path in paths:
                if path == "ce" and not be.drv.has_batch:
                    continue
                be.mode = path
                impl = f"kvx-{path}"
                for op in opts.ops:
                    for bs, n in iter_sizes(opts):
                        prog.step(f"{impl} {op} {bs >> 10}K")
                        local = agent.prepare(kvx.DescList.blocks(reg, bs))
                        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
                        lidx = np.arange(n, dtype=np.int64)
                        ridx = permutation(n, opts)
                        fn = agent.write if op == "write" else agent.read
                        seed = opts.seed + bs + (7 if path == "ce" else 0)
                        _arm(cp, op, view, target, rid, opts.total, seed)

                        def once() -> None:
                            fn(local, lidx, remote, ridx).wait()

                        med, mn = timed(once, opts.iters)
                        if not _verified(op, view, target, rid, opts.total, n, bs, ridx, seed):
                            raise RuntimeError(f"{impl} {op} at {bs} bytes: destination bytes do not match")
                        rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True,
                                        seg=f"{local_seg}->{remote_seg}", gpus=f"0->{rdev}"))
            be.mode = kcuda.copy_mode()
            prog.step("latency")
            from .host import latency

            lat: Any = latency(agent, peer, reg, _Descs(rdescs), opts.latency_samples)  # type: ignore[arg-type]
            for r in lat if isinstance(lat, list) else [lat]:
                r["seg"] = f"{local_seg}->{remote_seg}"
                rows.append(r)
            reg.release()
    finally:
        target.close()
    return rows + ceiling(opts, prog, local_seg, remote_seg, rdev)


class _Descs:
    """Adapter: host.latency() reads ``target.descs``."""

    def __init__(self, descs: kvx.DescList) -> None:
        self.descs = descs


def _tune(argv: list[str]) -> int:
    """``python -m kvx.bench.cuda tune``: one process, loopback, sweep the kernel's launch knobs."""
    import cupy as cp

    from ..backends import cuda as kc

    ap = argparse.ArgumentParser(prog="python -m kvx.bench.cuda tune")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M,64M")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args(argv)
    from . import parse_size

    total = parse_size(a.total)
    sizes = [parse_size(x) for x in a.block_sizes.split(",")]
    ndev = cp.cuda.runtime.getDeviceCount()
    with kvx.Agent("tune", kvx.AgentConfig(backends=("cuda",))) as ag:
        be = ag.backend("cuda")
        with cp.cuda.Device(0):
            g0 = cp.ones(total, dtype=cp.uint8)
        with cp.cuda.Device(1 if ndev > 1 else 0):
            g1 = cp.zeros(total, dtype=cp.uint8)
        h = kvx.alloc_host(total, pinned=True)
        r0, r1, rh = ag.register(g0), ag.register(g1), ag.register(h)
        pairs = [("gpu0->gpu1", r0, r1, "write"), ("gpu0<-gpu1", r0, r1, "read"), ("gpu->pinned", r0, rh, "write"),
                 ("pinned->gpu", r0, rh, "read")]
        knobs = [(b, sh) for b in (2, 4, 8) for sh in (13, 14, 16)]
        for name, la, rb, op in pairs:
            for bs in sizes:
                n = total // bs
                lo = ag.prepare(kvx.DescList.blocks(la, bs))
                re = ag.prepare(kvx.DescList.blocks(rb, bs))
                li = np.arange(n, dtype=np.int64)
                ri = np.random.default_rng(0).permutation(n).astype(np.int64)
                fn = ag.write if op == "write" else ag.read
                res = []
                for mode, (blk, sh) in [("kernel", k) for k in knobs] + [("ce", (0, 0))]:
                    if mode == "ce" and not be.drv.has_batch:  # type: ignore[attr-defined]
                        continue
                    be.mode = mode  # type: ignore[attr-defined]
                    kc.BLOCKS_PER_SM = kc.BLOCKS_PER_SM_HOST = blk or 8
                    kc.CHUNK_SHIFT = sh or 14
                    def once(fn: Any = fn, lo: Any = lo, re: Any = re) -> None:
                        fn(lo, li, re, ri).wait()

                    med, _mn = timed(once, a.iters)
                    res.append((n * bs / med / 1e9, mode, blk, sh))
                t0 = time.perf_counter()
                for _ in range(20):
                    x = fn(lo, li, re, ri)
                post_us = (time.perf_counter() - t0) / 20 * 1e6
                x.wait()
                res.sort(reverse=True)
                cells = " ".join(f"{m}:{b}/{sh}={g:.0f}" for g, m, b, sh in res)
                print(f"{name:12s} {bs >> 10:6d}K post={post_us:7.0f}us  {cells}", flush=True)
    return 0


@dataclass
class _Point:
    """One (executing GPU policy, op, block size) of an x-sweep: GPU 0 buffer ``g0`` <-> the
    target's region on GPU 1, permuted remote ids."""

    ex: str
    op: str
    bs: int
    n: int
    be: Any
    fn: Any
    lo: Any
    re: Any
    li: np.ndarray
    ri: np.ndarray
    g0: Any


def _points(cp: Any, kc: Any, target: Helper, rdescs: kvx.DescList, total: int, sizes: list[int],
            execs: list[str], tag: str) -> Iterator[_Point]:
    """Every point of an x-sweep, exec policy by exec policy (``kc.EXEC_ON`` set; one agent each)."""
    for ex in execs:
        kc.EXEC_ON = ex
        with kvx.Agent(f"{tag}-{ex}", kvx.AgentConfig(backends=("cuda",))) as ag:
            be = ag.backend("cuda")
            with cp.cuda.Device(0):
                g0 = cp.zeros(total, dtype=cp.uint8)
            reg = ag.register(g0)
            peer = ag.add_peer(target.meta)
            for op in ("write", "read"):
                for bs in sizes:
                    n = total // bs
                    yield _Point(ex, op, bs, n, be, ag.write if op == "write" else ag.read,
                                 ag.prepare(kvx.DescList.blocks(reg, bs)),
                                 ag.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer),
                                 np.arange(n, dtype=np.int64),
                                 np.random.default_rng(0).permutation(n).astype(np.int64), g0)
            reg.release()


def _measure(cp: Any, pt: _Point, target: Helper, rid: int, total: int, seed: int, iters: int,
             label: str) -> tuple[float, bool] | None:
    """Arm, time (median of ``iters``) and verify one variant at ``pt``: (GB/s, bytes right), or
    None (printed) if the variant cannot run here."""
    with cp.cuda.Device(0):
        _arm(cp, pt.op, pt.g0, target, rid, total, seed)
    try:
        med, _mn = timed(lambda: pt.fn(pt.lo, pt.li, pt.re, pt.ri).wait(), iters)
    except Exception as exc:  # a variant that cannot run here
        print(f"  {pt.ex} {pt.op} {pt.bs} {label} failed: {exc}", flush=True)
        return None
    with cp.cuda.Device(0):
        ok = _verified(pt.op, pt.g0, target, rid, total, pt.n, pt.bs, pt.ri, seed)
    return pt.n * pt.bs / med / 1e9, ok


def _xtune(argv: list[str]) -> int:
    """``python -m kvx.bench.cuda xtune``: two processes (target on GPU 1), sweep kernel variants.

    For each executing GPU (``initiator``: GPU 0 pushes writes and pulls reads; ``owner``: GPU 1,
    which holds the target's memory, pulls writes and pushes reads), each kernel variant and launch
    knob, and the copy engines: GB/s of permuted write/read transfers, every variant's bytes checked once.
    """
    import cupy as cp

    from ..backends import cuda as kc
    from . import parse_size

    ap = argparse.ArgumentParser(prog="python -m kvx.bench.cuda xtune")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--exec", default="initiator,owner")
    ap.add_argument("--variants", default="warp:8:14,warp:4:14,warp:8:16,warp16:4:14,warp16:4:16,bulk:4:14,"
                                          "bulk:6:14,bulk:8:14,bulk:6:16,ce:0:0")
    a = ap.parse_args(argv)
    total = parse_size(a.total)
    sizes = [parse_size(x) for x in a.block_sizes.split(",")]
    variants = [(v.split(":")[0], int(v.split(":")[1]), int(v.split(":")[2])) for v in a.variants.split(",")]
    rdev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    defaults = (kc.KERNEL, kc.BLOCKS_PER_SM, kc.CHUNK_SHIFT)
    target = Helper("xtune-target", {"backends": ["cuda"]})
    try:
        rid, rdescs = target.register("vram", total, rdev)
        for pt in _points(cp, kc, target, rdescs, total, sizes, a.exec.split(","), "xtune"):
            res = []
            for kern, per_sm, sh in variants:
                if kern == "ce":
                    if not pt.be.drv.has_batch:
                        continue
                    pt.be.mode = "ce"
                else:
                    pt.be.mode = "kernel"
                    kc.KERNEL = kern
                    kc.BLOCKS_PER_SM = kc.BLOCKS_PER_SM_BULK = per_sm
                    kc.CHUNK_SHIFT = sh
                label = f"{kern}:{per_sm}:{sh}"
                got = _measure(cp, pt, target, rid, total, pt.bs + per_sm + sh, a.iters, label)
                if got is not None:
                    res.append((got[0], label, got[1]))
            res.sort(reverse=True)
            cells = " ".join(f"{v}={g:.0f}{'' if ok else '(BAD)'}" for g, v, ok in res)
            print(f"{pt.ex:9s} {pt.op:5s} {pt.bs >> 10:6d}K  {cells}", flush=True)
    finally:
        kc.KERNEL, kc.BLOCKS_PER_SM, kc.CHUNK_SHIFT = defaults
        target.close()
    return 0


def _xtune2(argv: list[str]) -> int:
    """``python -m kvx.bench.cuda xtune2``: two processes (target on GPU 1), GPU0<->GPU1.

    Executing GPU ``initiator`` (write pushes, read pulls) or ``pull`` (every copy on its
    destination's GPU). Variants: ``kernel`` (warp kernel, 4 CTAs/SM), ``pf`` (next item's
    descriptors prefetched), ``kN`` / ``hN`` (N CTAs/SM; hN: with host memory), ``tN`` (N threads per
    CTA, <= 256), ``bulk`` / ``warp16`` (TMA bulk copies / 16 loads in flight per lane), ``pipeN``
    (indices uploaded and launched in pieces of N pairs), ``ce`` (copy engines), ``splitF`` (fraction F
    of the bytes on the copy engines while the kernel copies the rest), ``i64`` (indices staged as
    int64 instead of int32), ``zc`` / ``zcpf`` (the warp / prefetching kernel reads the indices
    from the pinned staging slot, no upload),
    ``old`` (the kernel with the earlier host path: numpy index staging, three Python-level CUDA
    calls, a reaper polling every 50 us), ``upload`` (indices uploaded before the kernel instead of read
    in place), ``eager`` (the reaper woken by every post), ``warp`` / ``warpx`` (block-major /
    chunk-major work items), ``cN`` (work items of 2**N bytes instead of 2**14),
    ``mN`` (small transfers' work items halved down to 2**N bytes instead of 2**12; ``m14``: never),
    ``npstage`` / ``pypost`` / ``pollreaper`` (only that one
    part of the earlier host path), ``nospin`` (waiters poll from Python, no native spin), ``noroute``
    (every post through ``post()`` instead of the pair's native route), ``onestage`` (large index
    arrays staged by the posting thread alone, no helper threads).
    Every variant's bytes are checked once. With ``--profile``,
    the kernel's time at the small sizes is split into CPU post, index upload and kernel (GPU
    events), for each host path of ``--profile-host`` (``new`` = the defaults, ``old`` as above),
    with ``post()`` also timed without the profile's events.
    """
    import cupy as cp

    from ..backends import cuda as kc
    from . import parse_size

    ap = argparse.ArgumentParser(prog="python -m kvx.bench.cuda xtune2")
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
    rdev = 1 if cp.cuda.runtime.getDeviceCount() > 1 else 0
    target = Helper("xtune2-target", {"backends": ["cuda"]})
    knobs = ("KERNEL", "BLOCKS_PER_SM", "BLOCKS_PER_SM_HOST", "THREADS", "PIPE_PAIRS", "SPLIT_FRACTION",
             "INDEX_ZEROCOPY", "_I32_MAX", "NATIVE_STAGING", "NATIVE_POST", "REAPER_POLL", "CHUNK_SHIFT",
             "CHUNK_SHIFT_MIN", "REAPER_LAZY", "SPIN_WAIT", "ROUTE")
    defaults = {k: getattr(kc, k) for k in knobs}
    stage_mode = _native.stage_parallel()

    def reset() -> None:
        for k, v0 in defaults.items():
            setattr(kc, k, v0)

    def setv(be: Any, v: str) -> None:
        reset()
        if v == "nospin":  # the waiter's earlier Python loop (no native spin on the event)
            kc.SPIN_WAIT = 0.0
        if v == "noroute":  # every post through post() (no native route of the pair)
            kc.ROUTE = False
        _native.stage_parallel(0 if v == "onestage" else stage_mode)  # onestage: no helper threads staging
        if v == "ce":
            be.mode = "ce"
        elif v.startswith("split"):
            be.mode, kc.SPLIT_FRACTION = "split", float(v[5:])
        else:
            be.mode = "kernel"
            if v in ("pf", "zcpf"):
                kc.KERNEL = "pf"
            if v in ("zc", "zcpf"):
                kc.INDEX_ZEROCOPY = True
            elif v == "upload":  # the indices uploaded before the kernel (the default before zero copy)
                kc.INDEX_ZEROCOPY = False
            elif v in ("warp", "warpx", "bulk", "warp16"):  # block-/chunk-major items, TMA bulk, 16 loads
                kc.KERNEL = v
            elif v == "eager":  # the reaper woken by every post (the default before the lazy reaper)
                kc.REAPER_LAZY = 0.0
            elif v == "i64":
                kc._I32_MAX = 0
            elif v == "old":
                kc.NATIVE_STAGING, kc.NATIVE_POST, kc.REAPER_POLL = False, False, 5e-5
                kc.INDEX_ZEROCOPY = False
            elif v == "npstage":  # one part of the host path back at a time, to attribute the gain
                kc.NATIVE_STAGING = False
            elif v == "pypost":
                kc.NATIVE_POST = False
            elif v == "pollreaper":
                kc.REAPER_POLL = 5e-5
            elif v[:1] == "k" and v[1:].isdigit():  # kN: N CTAs per SM
                kc.BLOCKS_PER_SM = int(v[1:])
            elif v[:1] == "t" and v[1:].isdigit():  # tN: N threads per CTA (at most 256)
                kc.THREADS = int(v[1:])
            elif v[:1] == "h" and v[1:].isdigit():  # hN: N CTAs per SM when host memory is involved
                kc.BLOCKS_PER_SM_HOST = int(v[1:])
            elif v.startswith("pipe"):
                kc.PIPE_PAIRS = int(v[4:])
            elif v[:1] == "c" and v[1:].isdigit():  # cN: work items of 2**N bytes
                kc.CHUNK_SHIFT = int(v[1:])
            elif v[:1] == "m" and v[1:].isdigit():  # mN: small transfers' work items down to 2**N bytes
                kc.CHUNK_SHIFT_MIN = int(v[1:])

    try:
        rid, rdescs = target.register(a.rseg, total, rdev)
        for pt in _points(cp, kc, target, rdescs, total, sizes, a.exec.split(","), "xtune2"):
            ex, op, bs, n, be, fn, lo, re, li, ri = pt.ex, pt.op, pt.bs, pt.n, pt.be, pt.fn, pt.lo, pt.re, pt.li, pt.ri
            res: list[tuple[str, float, bool]] = []
            for v in (a.small if bs <= (32 << 10) else a.large).split(","):
                if v in ("ce",) or v.startswith("split"):
                    if not be.drv.has_batch:
                        continue
                setv(be, v)
                got = _measure(cp, pt, target, rid, total, bs + len(res) + 3, a.iters, v)
                if got is not None:
                    res.append((v, got[0], got[1]))
            cells = " ".join(f"{v}={g:.0f}{'' if ok else '(BAD)'}" for v, g, ok in res)
            print(f"{ex:9s} {op:5s} {bs >> 10:6d}K  {cells}", flush=True)
            for hp in (a.profile_host.split(",") if bs in prof_sizes else []):
                setv(be, "old" if hp == "old" else "kernel")
                time.sleep(0.01)  # a polling reaper of "old" is running again
                bare = []  # post() alone, no profile events
                for i in range(a.iters + 1):
                    t0 = time.perf_counter()
                    x = fn(lo, li, re, ri)
                    t1 = time.perf_counter()
                    x.wait()
                    if i:
                        bare.append((t1 - t0) * 1e6)
                kc.PROFILE = []
                posts, walls = [], []
                for i in range(a.iters + 1):
                    t0 = time.perf_counter()
                    x = fn(lo, li, re, ri)
                    t1 = time.perf_counter()
                    x.wait()
                    t2 = time.perf_counter()
                    if i:
                        posts.append((t1 - t0) * 1e6)
                        walls.append((t2 - t0) * 1e6)
                recs = kc.PROFILE[1:]
                kc.PROFILE = None
                el = cp.cuda.get_elapsed_time
                up = [sum(el(e0, e1) for e0, e1, _ in r["events"]) * 1e3 for r in recs]
                kt = [el(r["events"][0][1], r["events"][-1][2]) * 1e3 for r in recs]
                gpu = [el(r["events"][0][0], r["events"][-1][2]) * 1e3 for r in recs]
                lau = [r["cpu_launch_us"] for r in recs]
                stg = [r.get("cpu_stage_us", 0.0) for r in recs]
                med_ = lambda xs: float(np.median(xs))  # noqa: E731
                print(f"  profile {ex} {op} {bs >> 10}K kernel host={hp}: wall {med_(walls):.0f} us, "
                      f"post() {med_(posts):.0f} (unprofiled {med_(bare):.0f})"
                      f" (of which staging+launch {med_(lau):.0f}, index staging {med_(stg):.0f}), "
                      f"upload {med_(up):.0f}, kernel "
                      f"{med_(kt):.0f}, gpu first-upload..end {med_(gpu):.0f} us; kernel-only "
                      f"{n * bs / med_(kt) / 1e3:.0f} GB/s", flush=True)
    finally:
        reset()
        _native.stage_parallel(stage_mode)
        target.close()
    return 0


def _stamps(argv: list[str]) -> int:
    """``python -m kvx.bench.cuda stamps``: where the CPU time of one kernel (or ``--path ce``) post goes.

    Two processes (target on GPU 1), GPU0 -> GPU1 writes and reads of ``--total`` in permuted
    blocks; ``kvx.backends.cuda.STAMPS`` collects a clock stamp at each phase of ``post()``; the
    median time between consecutive stamps is printed per block size and variant (``default``,
    ``noreaper``: transfers not handed to the completion reaper, the waiter retires them; ``noroute``:
    every post through ``post()``, not the pair's native route). Also
    times a few CUDA/cupy primitives the post uses.
    """
    import cupy as cp

    from ..backends import cuda as kc
    from . import parse_size

    ap = argparse.ArgumentParser(prog="python -m kvx.bench.cuda stamps")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--block-sizes", default="4K,32K")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default="default,noroute")
    ap.add_argument("--path", default="kernel", choices=["kernel", "ce"],
                    help="copy path (ce: cuMemcpyBatchAsync; its stamps show the driver's CPU time per batch)")
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
    target = Helper("stamps-target", {"backends": ["cuda"]})
    route = kc.ROUTE
    try:
        rid, rdescs = target.register("vram", total, rdev)
        with kvx.Agent("stamps", kvx.AgentConfig(backends=("cuda",))) as ag:
            be = ag.backend("cuda")
            be.mode = a.path  # type: ignore[attr-defined]
            with cp.cuda.Device(0):
                g0 = cp.zeros(total, dtype=cp.uint8)
            reg = ag.register(g0)
            peer = ag.add_peer(target.meta)
            real_add = be._reaper.add  # type: ignore[attr-defined]
            for bs in [parse_size(x) for x in a.block_sizes.split(",")]:
                n = total // bs
                lo = ag.prepare(kvx.DescList.blocks(reg, bs))
                re = ag.prepare(kvx.DescList.blocks(rdescs, bs), peer=peer)
                li = np.arange(n, dtype=np.int64)
                ri = np.random.default_rng(0).permutation(n).astype(np.int64)
                for op in ("write", "read"):
                    fn = ag.write if op == "write" else ag.read
                    for v in a.variants.split(","):
                        be._reaper.add = (lambda r: None) if v == "noreaper" else real_add  # type: ignore
                        kc.ROUTE = route and v != "noroute"
                        rows: dict[str, list[float]] = {}
                        walls = []
                        for i in range(a.iters + 2):
                            kc.STAMPS = st = [("call", time.perf_counter_ns())]
                            x = fn(lo, li, re, ri)
                            st.append(("return", time.perf_counter_ns()))
                            x.wait()
                            st.append(("done", time.perf_counter_ns()))
                            kc.STAMPS = None
                            if i < 2:
                                continue
                            for (l0, t0), (l1, t1) in zip(st, st[1:]):
                                rows.setdefault(f"{l0}->{l1}", []).append((t1 - t0) / 1e3)
                            walls.append((st[-1][1] - st[0][1]) / 1e3)
                        be._reaper.add = real_add  # type: ignore[attr-defined]
                        med = float(np.median(walls))
                        cells = ", ".join(f"{k} {float(np.median(vs)):.1f}" for k, vs in rows.items())
                        print(f"{op:5s} {bs >> 10:5d}K {v:9s} wall {med:.0f} us ({n * bs / med / 1e3:.0f} GB/s): "
                              f"{cells}", flush=True)
            be._reaper.add = real_add  # type: ignore[attr-defined]
            reg.release()
    finally:
        kc.STAMPS = None
        kc.ROUTE = route
        target.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["target"]:
        return _serve(args[1:])
    if args[:1] == ["tune"]:
        return _tune(args[1:])
    if args[:1] == ["xtune"]:
        return _xtune(args[1:])
    if args[:1] == ["xtune2"]:
        return _xtune2(args[1:])
    if args[:1] == ["stamps"]:
        return _stamps(args[1:])
    print("usage: python -m kvx.bench.cuda target [--name N] [--config JSON]  (or: kvx bench --backend cuda)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    t0 = time.monotonic()
    sys.exit(main())
