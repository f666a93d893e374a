"""What the kernel charges for each way of moving one HiCache batch into and out of a slab file.

One batch is 128 pages of 768 KiB (64-token pages of Qwen2.5-0.5B, two 384 KiB fragments each),
96 MiB, in a preallocated file (``posix_fallocate``, as kvx's posix backend makes it) mapped
``MAP_SHARED``. Each step is timed in thread CPU time (``time.thread_time``: the calling
thread's user and kernel time, which other load on a shared machine disturbs far less than
wall time); the median of ``--rounds`` rounds, each on fresh slots, is printed per step.
Only numpy, ``mmap`` and ``os``: the mechanisms kvx's posix ``OP_MMREAD``/``OP_MMWRITE`` and
the slab's ``pwritev`` writer use, without kvx.

    python bench/slab_paths.py [--dir DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import time
from collections import defaultdict

import numpy as np

PAGE = 768 << 10
N = 128
BATCH = N * PAGE
SLOTS_PER_ROUND = 5  # batches of slots each round uses
POPULATE_READ, POPULATE_WRITE = 22, 23  # madvise advice (Linux 5.14)


def _measure(m: mmap.mmap, fd: int, rounds: int) -> dict[str, list[float]]:
    libc = ctypes.CDLL(None, use_errno=True)
    view = np.frombuffer(m, dtype=np.uint8)
    base = view.ctypes.data
    page = np.random.default_rng(0).integers(0, 255, PAGE, dtype=np.uint8)
    frags = [page[: PAGE // 2].tobytes(), page[PAGE // 2:].tobytes()]
    src = np.tile(page, N)
    dst = np.zeros(BATCH, dtype=np.uint8)
    vec = np.zeros((4 << 20) // mmap.PAGESIZE, dtype=np.uint8)
    t: dict[str, list[float]] = defaultdict(list)
    clock = time.thread_time

    def timed(name: str, fn: object) -> None:
        t0 = clock()
        fn()  # type: ignore[operator]
        t[name].append(1e3 * (clock() - t0))

    def fill(off: int) -> None:  # the slab's first fill: one pwritev per page, alternate slots
        for i in list(range(0, N, 2)) + list(range(1, N, 2)):
            os.pwritev(fd, frags, off + i * PAGE)

    def mincore(off: int) -> None:
        for x in range(off, off + BATCH, 4 << 20):
            libc.mincore(ctypes.c_void_p(base + x), ctypes.c_size_t(4 << 20), ctypes.c_void_p(vec.ctypes.data))

    def rng(off: int) -> slice:
        return slice(off, off + BATCH)

    for r in range(rounds):
        b = [(r * SLOTS_PER_ROUND + k) * BATCH for k in range(SLOTS_PER_ROUND)]
        timed("mincore, never-written slots", lambda: mincore(b[0]))
        timed("pwritev per page, never-written slots (first fill)", lambda: fill(b[0]))
        for x in b[1:]:
            fill(x)
        # reads of a first-filled batch
        timed("mincore, cached, not mapped", lambda: mincore(b[0]))
        timed("read: copy out of the mapping, faulting (not mapped)", lambda: np.copyto(dst, view[rng(b[0])]))
        timed("mincore, cached and mapped", lambda: mincore(b[0]))
        timed("read: copy out of the mapping, mapped", lambda: np.copyto(dst, view[rng(b[0])]))
        timed("MADV_POPULATE_READ, cached, not mapped", lambda: m.madvise(POPULATE_READ, b[1], BATCH))
        timed("MADV_POPULATE_READ, mapped already", lambda: m.madvise(POPULATE_READ, b[1], BATCH))
        timed("read: preadv, cached", lambda: os.preadv(fd, [dst], b[2]))
        # rewrites
        timed("rewrite: copy into the mapping, cached, not mapped", lambda: view.__setitem__(rng(b[2]), src))
        timed("MADV_POPULATE_WRITE, mapped writable already", lambda: m.madvise(POPULATE_WRITE, b[2], BATCH))
        timed("rewrite: copy into the mapping, mapped writable", lambda: view.__setitem__(rng(b[2]), src))
        m.madvise(POPULATE_READ, b[3], BATCH)
        m.madvise(POPULATE_READ, b[4], BATCH)
        timed("rewrite: MADV_POPULATE_WRITE + copy, mapped read-only (read back)",
              lambda: (m.madvise(POPULATE_WRITE, b[3], BATCH), view.__setitem__(rng(b[3]), src)))
        timed("rewrite: pwritev per page, mapped read-only (read back)", lambda: fill(b[4]))
        os.fsync(fd)
        timed("rewrite: copy into the mapping after writeback (clean)", lambda: view.__setitem__(rng(b[2]), src))
        timed("rewrite: pwritev per page after writeback (clean)", lambda: fill(b[1]))
        assert bytes(view[b[4] + 5 * PAGE: b[4] + 6 * PAGE]) == page.tobytes()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="directory of the slab file (default: a temp dir)")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    size = a.rounds * SLOTS_PER_ROUND * BATCH
    d = tempfile.mkdtemp(prefix="kvx-slab-paths-", dir=a.dir)
    path = os.path.join(d, "slab")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    m = mmap.mmap(fd, size, mmap.MAP_SHARED)
    try:
        t = _measure(m, fd, a.rounds)
    finally:
        m.close()
        os.close(fd)
        os.unlink(path)
        os.rmdir(d)
    print(f"# one batch: {N} pages of {PAGE >> 10} KiB = {BATCH >> 20} MiB; thread CPU ms, median of {a.rounds} "
          f"rounds (min-max)")
    for name, v in t.items():
        print(f"{statistics.median(v):8.2f}  ({min(v):.2f}-{max(v):.2f})  {name}")


if __name__ == "__main__":
    main()
