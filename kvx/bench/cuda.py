"""``kvx bench --backend cuda``: two processes on one machine, GPU memory and pinned host memory.

The initiator runs on GPU 0; the target process (:class:`kvx.testing.gpu_peer.Helper`) holds the
remote buffer on GPU 1 when there are two GPUs (else GPU 0). ``--seg LOCAL,REMOTE`` picks each
side's memory: ``vram`` (GPU memory) or ``pinned`` (``kvx.alloc_host(n, pinned=True)``). Every
point is timed from the ``write``/``read`` call to completion (descriptor upload included), over
permuted block ids, for both copy paths side by side: ``kvx-kernel`` (the NVRTC gather/scatter
kernel) and ``kvx-ce`` (``cuMemcpyBatchAsync`` on the copy engines), each an agent with
``CudaOptions(copy=...)``. Ceiling rows: a 1 GiB peer copy (``raw-peer``) for GPU<->GPU, a 1 GiB
pinned<->GPU ``cudaMemcpyAsync`` (``raw-pcie``) otherwise.

The tuning sweeps that once lived here are ``benchmarks/gpu_tune.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import kvx

from ..testing.gpu_peer import Helper, alloc, array_module, digest, pattern, sync_all
from . import BenchOptions, Progress, iter_sizes, permutation, row, timed

__all__ = ["arm", "ceiling", "run", "verified"]


def _segs(opts: BenchOptions) -> tuple[str, str]:
    segs = tuple("vram" if s in ("dram", "") else s for s in opts.seg)
    for s in segs:
        if s not in ("vram", "pinned"):
            raise SystemExit(f"kvx bench --backend cuda: --seg takes vram or pinned, not {s!r}")
    return segs[0], segs[1]


def arm(cp: Any, op: str, view: Any, target: "Helper", rid: int, total: int, seed: int) -> None:
    """Before a measured point: the source holds ``pattern(seed)``, the destination zeros."""
    xp = array_module(view)
    if op == "write":
        view[:] = pattern(xp, total, seed)
        target.call(cmd="zero", id=rid)
    else:
        target.call(cmd="fill", id=rid, seed=seed)
        view[:] = 0
    sync_all(cp)


def verified(op: str, view: Any, target: "Helper", rid: int, total: int, n: int, bs: int, ri: np.ndarray,
              seed: int) -> bool:
    """After a measured point: the destination holds the armed source's blocks, permuted by ``ri``
    (local block i <-> remote block ri[i])."""
    xp = array_module(view)
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
    """Both copy paths for every (op, block size); rows as in :mod:`kvx.bench`. Each path is an
    agent of its own (``CudaOptions(copy=path)``); the latency rows come from one with the default
    options."""
    import cupy as cp

    from ..backends.cuda import CudaBackend, CudaOptions

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
        obj, view = alloc(local_seg, opts.total, 0)
        for path in [*paths, None]:
            options = {} if path is None else {"cuda": CudaOptions(copy=path)}
            with kvx.Agent(f"bench-initiator-{path or 'default'}",
                           kvx.AgentConfig(backends=("cuda",), options=options)) as agent:
                be = agent.backend("cuda")
                assert isinstance(be, CudaBackend)
                if path == "ce" and not be.drv.has_batch:
                    continue
                reg = agent.register(obj)
                peer = agent.add_peer(target.meta)
                if path is None:
                    prog.step("latency")
                    from .host import latency

                    lat: Any = latency(agent, peer, reg, _Descs(rdescs), opts.latency_samples)  # type: ignore[arg-type]
                    for r in lat if isinstance(lat, list) else [lat]:
                        r["seg"] = f"{local_seg}->{remote_seg}"
                        rows.append(r)
                    reg.release()
                    continue
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
                        arm(cp, op, view, target, rid, opts.total, seed)

                        def once() -> None:
                            fn(local, lidx, remote, ridx).wait()

                        med, mn = timed(once, opts.iters)
                        if not verified(op, view, target, rid, opts.total, n, bs, ridx, seed):
                            raise RuntimeError(f"{impl} {op} at {bs} bytes: destination bytes do not match")
                        rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True,
                                        seg=f"{local_seg}->{remote_seg}", gpus=f"0->{rdev}"))
                reg.release()
    finally:
        target.close()
    return rows + ceiling(opts, prog, local_seg, remote_seg, rdev)


class _Descs:
    """Adapter: host.latency() reads ``target.descs``."""

    def __init__(self, descs: kvx.DescList) -> None:
        self.descs = descs
