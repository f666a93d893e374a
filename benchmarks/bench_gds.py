"""GPU memory <-> file: the gds backend (kvikio/cuFile) beside the posix bounce path
(cuda backend GPU -> pinned host, then posix pinned host -> file), same bytes, one run.

Run on a GPU machine: python benchmarks/bench_gds.py [--total 256M] [--dir /tmp]
Prints a markdown table; every point is verified by reading the file back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import kvx
from kvx.backends.gds import GdsBackend
from kvx.bench import fmt_size, parse_size


def timed(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--total", default="256M")
    ap.add_argument("--sizes", default="32K,256K,2M")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    total = parse_size(a.total)
    why = GdsBackend.unavailable_reason()
    if why is not None:
        raise SystemExit(f"gds unavailable: {why}")
    mode = GdsBackend.mode()
    d = tempfile.mkdtemp(dir=a.dir, prefix="kvx-gds-")
    rows = []
    with kvx.Agent("gds-bench", kvx.AgentConfig(backends=("gds", "cuda", "posix", "host"))) as ag:
        host = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
        dev = cupy.asarray(host)
        pinned = kvx.alloc_host(total, pinned=True)
        f1 = ag.register(kvx.FileRegion(os.path.join(d, "gds.bin"), total))
        f2 = ag.register(kvx.FileRegion(os.path.join(d, "posix.bin"), total))
        rdev, rpin = ag.register(dev), ag.register(pinned)
        for bs in [parse_size(x) for x in a.sizes.split(",")]:
            n = total // bs
            perm = np.random.default_rng(bs).permutation(n)
            ar = np.arange(n)
            mdev = ag.prepare(kvx.DescList.blocks(rdev, bs))
            mpin = ag.prepare(kvx.DescList.blocks(rpin, bs))
            s1 = ag.prepare(kvx.DescList.blocks(f1, bs))
            s2 = ag.prepare(kvx.DescList.blocks(f2, bs))

            def gds_w() -> None:
                ag.write(mdev, ar, s1, perm, backend="gds").wait(120)

            def gds_r() -> None:
                ag.read(mdev, ar, s1, perm, backend="gds").wait(120)

            def bounce_w() -> None:
                ag.write(mdev, ar, mpin, ar, backend="cuda").wait(120)
                ag.write(mpin, ar, s2, perm, backend="posix").wait(120)

            def bounce_r() -> None:
                ag.read(mpin, ar, s2, perm, backend="posix").wait(120)
                ag.read(mdev, ar, mpin, ar, backend="cuda").wait(120)

            for op, g, b in (("write", gds_w, bounce_w), ("read", gds_r, bounce_r)):
                tg, tb = timed(g, a.iters), timed(b, a.iters)
                rows.append((op, bs, total / tg / 1e9, total / tb / 1e9))
            # verify both files hold the permuted blocks and the GPU got them back
            exp = np.empty_like(host)
            exp.reshape(n, bs)[perm] = host.reshape(n, bs)
            for name in ("gds.bin", "posix.bin"):
                with open(os.path.join(d, name), "rb") as fh:
                    assert fh.read() == exp.tobytes(), f"{name} at {bs}: wrong bytes"
            assert np.array_equal(cupy.asnumpy(dev), host), f"GPU buffer at {bs}: wrong bytes"
    print(f"gds mode: {mode}; total {fmt_size(total)}; permuted blocks; file dir {d}")
    print("| op | block | gds GB/s | posix bounce GB/s | gds/bounce |")
    print("|---|---|---|---|---|")
    for op, bs, g, b in rows:
        print(f"| {op} | {fmt_size(bs)} | {g:.2f} | {b:.2f} | {g / b:.2f}x |")


if __name__ == "__main__":
    main()
