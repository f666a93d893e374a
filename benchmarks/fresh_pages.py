"""What a first write into new page cache costs on this machine, with no store involved.

Writes ``--files`` fresh files of ``--mib`` MiB each with one buffered ``pwrite`` (dirty pages
written back every 4 files, outside the timing, as ``bench_hicache.py`` does), keeps them, and
prints the milliseconds of each write; then deletes them, waits ``--pause`` seconds and does it
again. The kernel allocates a page-cache page per 4 KiB written, which is what every buffered
HiCache store (kvx's slab, HiCacheNixl, HiCacheFile) pays in a first fill. On a bare machine a
96-MiB write takes ~15-30 ms whatever came before. On a VM whose host backs guest memory on
demand and takes freed guest pages back, a write into memory the host has to provide again costs
~10 us per page (~250 ms per 96 MiB), and pages freed a moment ago are cheap only until the host
has taken them back: the times step between the two as the run goes.

    python benchmarks/fresh_pages.py [--dir /tmp] [--files 48] [--mib 96] [--pause 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np


def one_pass(d: str, files: int, nbytes: int, buf: bytes) -> list[float]:
    ts = []
    for i in range(files):
        fd = os.open(os.path.join(d, f"f{i}"), os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            t = time.perf_counter()
            n = os.pwrite(fd, buf, 0)
            ts.append(time.perf_counter() - t)
        finally:
            os.close(fd)
        if n != nbytes:
            raise RuntimeError(f"short write: {n} of {nbytes} bytes")
        if i % 4 == 3:
            os.sync()
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--files", type=int, default=48)
    ap.add_argument("--mib", type=int, default=96)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between the two passes")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.files < 1 or a.mib < 1:
        raise SystemExit("--files and --mib must be positive")
    nbytes = a.mib << 20
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    out = []
    for p in range(2):
        d = tempfile.mkdtemp(prefix="kvx-fresh-pages-", dir=a.dir)
        try:
            ts = one_pass(d, a.files, nbytes, buf)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        ms = [round(t * 1e3, 1) for t in ts]
        out.append(ms)
        print(f"pass {p + 1}: ms per {a.mib}-MiB write of a fresh file, in order: {' '.join(f'{x:.0f}' for x in ms)}")
        print(f"        min {min(ms):.0f}, median {float(np.median(ms)):.0f}, max {max(ms):.0f} ms "
              f"({min(ms) * 1e3 / (nbytes >> 12):.1f} .. {max(ms) * 1e3 / (nbytes >> 12):.1f} us per 4 KiB page)")
        if p == 0:
            time.sleep(a.pause)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"mib": a.mib, "files": a.files, "pause_s": a.pause, "ms": out}, f, indent=1)


if __name__ == "__main__":
    main()
