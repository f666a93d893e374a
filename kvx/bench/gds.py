"""``kvx bench --backend gds``: GPU memory <-> one file through the ``gds`` backend (kvikio/cuFile),
beside kvx's own bounce path over the same bytes, in one run.

What each row times (``total`` bytes per transfer, one warm-up, ``iters`` timed runs, median):

- ``kvx-gds``: ``agent.write/read(gpu, arange(n), file, perm, backend="gds")`` to completion.
- ``kvx-bounce``: the same blocks through pinned host memory: the ``cuda`` backend GPU -> pinned
  (``arange`` on both sides), then the ``posix`` backend pinned -> file (permuted); reads the
  reverse. Both steps are timed.

Every point is verified: after the writes each file must hold the permuted blocks; before the
reads the GPU buffer (and the pinned buffer) is zeroed, after them it must hold the data again.
On a machine without GPUDirect Storage kvikio runs in compat mode (``KVX_GDS_COMPAT=1``): what is
timed then is kvikio's own POSIX bounce, and the row says so (``gds_mode``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import numpy as np

import kvx

from . import BenchOptions, Progress, iter_sizes, permutation, row, timed

__all__ = ["run"]


def _check_file(path: str, exp: np.ndarray, what: str) -> None:
    got = np.fromfile(path, dtype=np.uint8, count=exp.size)
    if not np.array_equal(got, exp):
        raise RuntimeError(f"{what}: the file does not hold the permuted blocks")


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """kvx-gds and kvx-bounce rows for every (op, block size)."""
    from ..backends.gds import GdsBackend

    why = GdsBackend.unavailable_reason()
    if why is not None:
        raise kvx.BackendUnavailable(f"the gds backend is not available here: {why}")
    import cupy

    mode = GdsBackend.mode()
    total = opts.total
    d = tempfile.mkdtemp(dir=opts.path, prefix="kvx-bench-gds-")
    rows: list[dict[str, Any]] = []
    try:
        with kvx.Agent("bench-gds", kvx.AgentConfig(backends=("gds", "cuda", "posix", "host"))) as ag:
            host = np.random.default_rng(opts.seed).integers(0, 256, total, dtype=np.uint8)
            dev = cupy.asarray(host)
            pinned = kvx.alloc_host(total, pinned=True)
            pview = pinned.reshape(-1).view(np.uint8)
            paths = {"kvx-gds": os.path.join(d, "gds.bin"), "kvx-bounce": os.path.join(d, "bounce.bin")}
            fg = ag.register(kvx.FileRegion(paths["kvx-gds"], total))
            fb = ag.register(kvx.FileRegion(paths["kvx-bounce"], total))
            rdev, rpin = ag.register(dev), ag.register(pinned)
            for bs, n in iter_sizes(opts):
                perm = permutation(n, opts)
                ar = np.arange(n, dtype=np.int64)
                mdev = ag.prepare(kvx.DescList.blocks(rdev, bs))
                mpin = ag.prepare(kvx.DescList.blocks(rpin, bs))
                sg = ag.prepare(kvx.DescList.blocks(fg, bs))
                sb = ag.prepare(kvx.DescList.blocks(fb, bs))
                exp = np.zeros(total, dtype=np.uint8)
                exp[: n * bs].reshape(n, bs)[perm] = host[: n * bs].reshape(n, bs)

                def gds_w() -> None:
                    ag.write(mdev, ar, sg, perm, backend="gds").wait(120)

                def gds_r() -> None:
                    ag.read(mdev, ar, sg, perm, backend="gds").wait(120)

                def bounce_w() -> None:
                    ag.write(mdev, ar, mpin, ar, backend="cuda").wait(120)
                    ag.write(mpin, ar, sb, perm, backend="posix").wait(120)

                def bounce_r() -> None:
                    ag.read(mpin, ar, sb, perm, backend="posix").wait(120)
                    ag.read(mdev, ar, mpin, ar, backend="cuda").wait(120)

                for op in opts.ops:
                    for impl, fn in (("kvx-gds", gds_w if op == "write" else gds_r),
                                     ("kvx-bounce", bounce_w if op == "write" else bounce_r)):
                        prog.step(f"{impl} {op} {bs >> 10}K")
                        if op == "read":
                            if "write" not in opts.ops:  # the file must hold the blocks first
                                (gds_w if impl == "kvx-gds" else bounce_w)()
                            dev.fill(0)
                            pview[:] = 0
                            cupy.cuda.runtime.deviceSynchronize()
                        med, mn = timed(fn, opts.iters)
                        if op == "write":
                            _check_file(paths[impl], exp[: n * bs], f"{impl} write at {bs} bytes")
                        elif not np.array_equal(cupy.asnumpy(dev[: n * bs]), host[: n * bs]):
                            raise RuntimeError(f"{impl} read at {bs} bytes: the GPU buffer is wrong")
                        rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True, gds_mode=mode))
            for r in (fg, fb, rdev, rpin):
                r.release()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return rows
