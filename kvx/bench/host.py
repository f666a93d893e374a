"""``kvx bench --backend host``: two processes on one machine, permuted blocks, plus the
single-threaded memcpy ceiling and the post-to-completion latency of one 4 KiB write."""

from __future__ import annotations

import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import kvx

from . import BenchError, BenchOptions, Progress, iter_sizes, permutation, quit_child, row, timed
from .target import alloc, digest, pattern


class Target:
    """A bench target process (``python -m kvx.bench.target``), bounded by timeouts.

    Its stderr goes to a temporary file; when it dies or does not answer, :class:`BenchError`
    carries the last line it wrote (the cause, e.g. a bad setting or a full disk).
    """

    def __init__(self, opts: BenchOptions, env: dict[str, str] | None = None, extra_args: list[str] | None = None):
        cmd = [sys.executable, "-m", "kvx.bench.target", "--mem", opts.mem, "--total", str(opts.total)]
        self._spawn(cmd + (extra_args or []), env)

    def _spawn(self, cmd: list[str], env: dict[str, str] | None) -> None:
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env={**os.environ, **(env or {})})
        hello = self._read(60.0)
        self.meta = base64.b64decode(hello["meta"])
        self.descs = kvx.DescList.from_bytes(base64.b64decode(hello["descs"]))

    def _last_words(self) -> str:
        try:
            self._err.seek(0)
            lines = [x for x in self._err.read()[-8192:].decode(errors="replace").splitlines() if x.strip()]
        except (OSError, ValueError):
            return ""
        return f": {lines[-1].strip()}" if lines else ""

    def _read(self, timeout: float) -> dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            self.close()
            raise BenchError(f"bench target did not answer in {timeout:g} s{self._last_words()}")
        line = self.proc.stdout.readline()
        if not line:
            try:
                rc = self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.close()
                rc = self.proc.returncode
            raise BenchError(f"bench target exited with {rc}{self._last_words()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def call(self, timeout: float = 120.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        quit_child(self.proc, 5)
        self._err.close()


def sweep(agent: kvx.Agent, peer: str, local_reg: kvx.Registration, local_buf: np.ndarray, target: Target,
          opts: BenchOptions, prog: Progress, impl: str = "kvx", backend: str | None = None) -> list[dict[str, Any]]:
    """Time every (op, block size) and verify the bytes; return rows."""
    rows = []
    for op in opts.ops:
        for bs, n in iter_sizes(opts):
            prog.step(f"{impl} {op} {bs >> 10}K")
            local = agent.prepare(kvx.DescList.blocks(local_reg, bs))
            remote = agent.prepare(kvx.DescList.blocks(target.descs, bs), peer=peer)
            lidx = np.arange(n, dtype=np.int64)
            ridx = permutation(n, opts)
            fn = agent.write if op == "write" else agent.read
            if op == "write":
                local_buf[: n * bs] = pattern(n * bs, opts.seed + bs)
                target.call(cmd="zero")
            else:
                target.call(cmd="fill", seed=opts.seed + bs)
                local_buf[:] = 0

            def once() -> None:
                fn(local, lidx, remote, ridx, backend=backend).wait()

            med, mn = timed(once, opts.iters)
            # verify what the timed transfers moved
            src = pattern(n * bs, opts.seed + bs) if op == "read" else local_buf[: n * bs]
            exp = np.zeros(opts.total if op == "write" else n * bs, dtype=np.uint8)
            if op == "write":
                exp[: n * bs].reshape(n, bs)[ridx] = src.reshape(n, bs)
                ok = target.call(cmd="digest")["digest"] == digest(exp)
            else:
                exp.reshape(n, bs)[:] = src.reshape(n, bs)[ridx]
                ok = digest(local_buf[: n * bs]) == digest(exp)
            if not ok:
                raise RuntimeError(f"{impl} {op} at {bs} bytes: destination bytes do not match")
            rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True))
    return rows


def latency(agent: kvx.Agent, peer: str, local_reg: kvx.Registration, target: Target, samples: int,
            impl: str = "kvx", backend: str | None = None) -> list[dict[str, Any]]:
    """Post-to-completion time of one 4 KiB write at the initiator, as NIXL's figure is taken
    (the same block posted again and again), two ways: ``agent.write`` with index lists (impl
    "kvx") and a ``make_transfer`` plan re-posted (impl "kvx-plan", the equivalent of NIXL's
    ``make_prepped_xfer`` handle). No rows for ``samples`` 0."""
    if samples <= 0:
        return []
    bs = 4096
    local = agent.prepare(kvx.DescList.blocks(local_reg, bs))
    remote = agent.prepare(kvx.DescList.blocks(target.descs, bs), peer=peer)
    k = int(np.random.default_rng(1).integers(0, len(remote)))
    pc = time.perf_counter_ns
    write = agent.write
    lidx, ridx = [0], [k]
    for _ in range(100):
        write(local, lidx, remote, ridx, backend=backend).wait()
    ts = []
    for _ in range(samples):
        t0 = pc()
        write(local, lidx, remote, ridx, backend=backend).wait()
        ts.append(pc() - t0)
    post = agent.make_transfer("write", local, lidx, remote, ridx, backend=backend).post
    for _ in range(100):
        post().wait()
    tp = []
    for _ in range(samples):
        t0 = pc()
        post().wait()
        tp.append(pc() - t0)
    out = []
    for name, t in ((impl, ts), (f"{impl}-plan", tp)):
        t.sort()
        out.append({"impl": name, "op": "write", "block_bytes": bs, "samples": samples,
                    "lat_us_median": statistics.median(t) / 1e3, "lat_us_p99": t[int(0.99 * (len(t) - 1))] / 1e3})
    return out


def memcpy_ceiling(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Single-threaded memcpy of the same bytes (one contiguous copy), per op and block size."""
    prog.step("memcpy ceiling")
    a = alloc(opts.mem, opts.total)
    b = alloc(opts.mem, opts.total)
    a[:] = 1
    b[:] = 2
    med, mn = timed(lambda: np.copyto(b, a), max(opts.iters, 5))
    return [row("memcpy", op, bs, n, opts.iters, med * (n * bs) / opts.total, mn * (n * bs) / opts.total)
            for op in opts.ops for bs, n in iter_sizes(opts)]


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    target = Target(opts)
    try:
        with kvx.Agent("bench-initiator") as agent:
            buf = alloc(opts.mem, opts.total)
            reg = agent.register(buf)
            peer = agent.add_peer(target.meta)
            rows = sweep(agent, peer, reg, buf, target, opts, prog)
            prog.step("latency")
            rows += latency(agent, peer, reg, target, opts.latency_samples)
            mode = agent.backend("host").path_to(peer)  # type: ignore[attr-defined]
            for r in rows:
                r["path"] = "shm" if opts.mem == "alloc" and str(kvx.config.get("KVX_HOST_PATH")) in (
                    "auto", "shm") else mode
    finally:
        target.close()
    return rows + memcpy_ceiling(opts, prog)
