"""``kvx bench --backend posix``: permuted blocks between host memory and one file.

What each row times (``total`` bytes per transfer, one warm-up, ``iters`` timed runs, median):

- ``kvx``: ``agent.write/read(mem, arange(n), file, perm)`` posted and waited to completion,
  through the page cache (``"cache": "warm"``: the file's pages stay cached between runs, as
  they do for NIXL's POSIX plugin in ``--compare nixl``). The page cache is dropped before the
  read phase where permitted (root), which only makes the warm-up read cold. Writes go through
  the file's shared mapping (``KVX_POSIX_MMAP``), so after the warm-up they find the pages
  dirty and already mapped writable: the best case of that path.
- ``kvx-clean`` (writes): the same write with an ``fsync`` of the file (not timed) before every
  timed run, so that its pages are clean and write-protected again, as they are once the kernel
  has written them back: every page takes a write fault. The mmap path's steady state when
  writeback keeps up; ``pwritev`` (NIXL) does not care.
- ``kvx-cold`` (reads, root only): the same read with the page cache dropped before every timed
  run (the drop itself is not timed): what the disk gives. The read phase registers the file
  anew first: pages the write phase dirtied through the mapping stay mapped into this process
  until its registration is released, and ``drop_caches`` does not evict mapped pages.
- ``python-pwrite`` / ``python-preadv``: the raw baseline -- a plain Python loop of
  ``os.pwrite`` / ``os.preadv``, one call per block in the same permuted order, on the same file.
- ``kvx-direct``: the kvx transfer with the file opened ``O_DIRECT`` (page-aligned memory, so
  the zero-copy path; no page cache involved).
- ``dd-direct`` (2 MiB only): ``dd bs=2M oflag=direct`` / ``iflag=direct`` over the same
  number of bytes, sequential and one request at a time; the time is dd's own report.

Every kvx row is verified: after the timed runs the file (writes) or the buffer (reads) is
compared with the expected permuted layout.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

import kvx

from ..backends.posix import PosixBackend, PosixOptions
from . import BenchError, BenchOptions, Progress, iter_sizes, permutation, row, timed

__all__ = ["run", "drop_caches"]

log = logging.getLogger(__name__)


def drop_caches() -> bool:
    """Write back and drop the page cache; False if not permitted (not root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _digest(a: Any) -> str:
    return hashlib.blake2b(memoryview(a), digest_size=16).hexdigest()


def _file_digest(path: str, nbytes: int) -> str:
    return _digest(np.fromfile(path, dtype=np.uint8, count=nbytes))


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sweep(agent: kvx.Agent, impl: str, buf: np.ndarray, path: str, opts: BenchOptions, prog: Progress,
           can_drop: bool, cache: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    mreg = agent.register(buf)
    sreg = agent.register(kvx.FileRegion(path, opts.total))
    try:
        disk: np.ndarray | None = None
        for op in opts.ops:
            if op == "read":
                if "write" not in opts.ops:
                    # a read-only run reads real bytes: a file never written is fallocated holes, whose
                    # reads return zeros without touching data (faster than any real read, and a
                    # zeroed destination would pass the check even if nothing moved)
                    _pattern(opts.total, opts.seed).tofile(path)
                    _fsync_path(path)
                # the writes went through the file's mapping (KVX_POSIX_MMAP): pages mapped into this
                # process survive drop_caches, which would make kvx-cold a warm read. A new
                # registration maps nothing until it writes (reads use preadv).
                sreg.release()
                sreg = agent.register(kvx.FileRegion(path, opts.total))
                disk = np.fromfile(path, dtype=np.uint8, count=opts.total)
                if can_drop and cache == "warm":
                    drop_caches()
            for bs, n in iter_sizes(opts):
                prog.step(f"{impl} {op} {bs >> 10}K")
                mem = agent.prepare(kvx.DescList.blocks(mreg, bs))
                sto = agent.prepare(kvx.DescList.blocks(sreg, bs))
                lidx = np.arange(n, dtype=np.int64)
                ridx = permutation(n, opts)
                fn = agent.write if op == "write" else agent.read
                if op == "write":
                    buf[: n * bs] = _pattern(n * bs, opts.seed + bs)
                else:
                    buf[:] = 0

                def once() -> None:
                    fn(mem, lidx, sto, ridx, backend="posix").wait()

                med, mn = timed(once, opts.iters)
                if op == "write":
                    exp = np.fromfile(path, dtype=np.uint8, count=opts.total)
                    exp[: n * bs].reshape(n, bs)[ridx] = buf[: n * bs].reshape(n, bs)
                    ok = _file_digest(path, opts.total) == _digest(exp)
                else:
                    assert disk is not None
                    ok = _digest(buf[: n * bs]) == _digest(disk[: n * bs].reshape(n, bs)[ridx])
                if not ok:
                    raise RuntimeError(f"{impl} {op} at {bs} bytes: destination bytes do not match")
                rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True, cache=cache))
                if op == "write" and cache == "warm":
                    # the same write with the pages clean (written back, write-protected): fsync first
                    ts = []
                    for _ in range(opts.iters):
                        _fsync_path(path)
                        t0 = time.perf_counter()
                        once()
                        ts.append(time.perf_counter() - t0)
                    if _file_digest(path, opts.total) != _digest(exp):
                        raise RuntimeError(f"{impl}-clean write at {bs} bytes: destination bytes do not match")
                    rows.append(row(f"{impl}-clean", op, bs, n, opts.iters, statistics.median(ts), min(ts),
                                    verified=True, cache="clean"))
                if op == "read" and cache == "warm" and can_drop:
                    # the same read from disk: drop the cache before each timed run (not timed)
                    ts = []
                    for _ in range(opts.iters):
                        drop_caches()
                        t0 = time.perf_counter()
                        once()
                        ts.append(time.perf_counter() - t0)
                    assert disk is not None
                    ok = _digest(buf[: n * bs]) == _digest(disk[: n * bs].reshape(n, bs)[ridx])
                    if not ok:
                        raise RuntimeError(f"{impl}-cold read at {bs} bytes: destination bytes do not match")
                    rows.append(row(f"{impl}-cold", op, bs, n, opts.iters, statistics.median(ts), min(ts),
                                    verified=True, cache="cold"))
    finally:
        sreg.release()
        mreg.release()
    return rows


def _python_loop(buf: np.ndarray, path: str, opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """One os.pwrite / os.preadv per block, in the permuted order: the raw baseline."""
    rows: list[dict[str, Any]] = []
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, opts.total)
        mv = memoryview(buf.data)
        for op in opts.ops:
            for bs, n in iter_sizes(opts):
                prog.step(f"python {op} {bs >> 10}K")
                offs = (permutation(n, opts) * bs).tolist()
                if op == "write":
                    buf[: n * bs] = _pattern(n * bs, opts.seed + bs)

                    def once() -> None:
                        pw = os.pwrite
                        for i, off in enumerate(offs):
                            pw(fd, mv[i * bs:(i + 1) * bs], off)
                else:

                    def once() -> None:
                        pr = os.preadv
                        for i, off in enumerate(offs):
                            pr(fd, [mv[i * bs:(i + 1) * bs]], off)

                med, mn = timed(once, opts.iters)
                rows.append(row("python-pwrite" if op == "write" else "python-preadv", op, bs, n, opts.iters, med,
                                mn, cache="warm"))
    finally:
        os.close(fd)
    return rows


_DD_RE = re.compile(r"(\d+) bytes .*? copied, ([0-9.]+) s")


def _dd(path: str, opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """``dd`` with O_DIRECT at 2 MiB blocks over ``total`` bytes (sequential, one request at a time)."""
    if shutil.which("dd") is None:
        return []
    bs = 2 << 20
    n = opts.total // bs
    if n < 1:
        return []
    rows: list[dict[str, Any]] = []
    cmds = {"write": ["dd", "if=/dev/zero", f"of={path}", "bs=2M", f"count={n}", "oflag=direct", "conv=notrunc"],
            "read": ["dd", f"if={path}", "of=/dev/null", "bs=2M", f"count={n}", "iflag=direct"]}
    for op in opts.ops:
        prog.step(f"dd {op}")
        ts = []
        for _ in range(opts.iters + 1):
            r = subprocess.run(cmds[op], capture_output=True, text=True, timeout=600, env={**os.environ, "LC_ALL": "C"})
            m = _DD_RE.search(r.stderr)
            if r.returncode != 0 or m is None or int(m.group(1)) != n * bs:
                raise BenchError(f"dd failed: {r.stderr.strip()[-300:]}")
            ts.append(float(m.group(2)))
        ts = ts[1:]  # the first run is the warm-up
        rows.append(row("dd-direct", op, bs, n, opts.iters, statistics.median(ts), min(ts), cache="direct",
                        timing="dd's own report"))
    return rows


def _posix(agent: kvx.Agent) -> PosixBackend:
    b = agent.backend("posix")
    assert isinstance(b, PosixBackend)
    return b


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Run the posix benchmark (see the module docstring); return its rows."""
    own = opts.path is None
    base = tempfile.mkdtemp(prefix="kvx-bench-posix-", dir="/tmp") if own else str(opts.path)
    prog.add(len(opts.ops) * len(opts.block_sizes) * 2 + len(opts.ops))
    can_drop = drop_caches()
    rows: list[dict[str, Any]] = []
    mm, buf = _aligned(opts.total)
    paths = [os.path.join(base, f"kvx-bench-{k}.bin") for k in ("kvx", "py", "direct")]
    try:
        with kvx.Agent("bench-posix", kvx.AgentConfig(backends=("host", "posix"),
                                                    options={"posix": PosixOptions(direct=False)})) as agent:
            rows += _sweep(agent, "kvx", buf, paths[0], opts, prog, can_drop, "warm")
        rows += _python_loop(buf, paths[1], opts, prog)
        with kvx.Agent("bench-posix-direct", kvx.AgentConfig(backends=("host", "posix"),
                                                           options={"posix": PosixOptions(direct=True)})) as agent:
            rows += _sweep(agent, "kvx-direct", buf, paths[2], opts, prog, can_drop, "direct")
        rows += _dd(paths[2], opts, prog)
    finally:
        del buf
        try:
            mm.close()
        except BufferError:
            pass
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass
        if own:
            shutil.rmtree(base, ignore_errors=True)
    for r in rows:
        r.setdefault("path", base)
        r["threads"] = kvx.config.get("KVX_POSIX_THREADS")
        r["cache_drop"] = can_drop
    return rows
