"""The ``kvx`` console script: ``kvx bench``, ``kvx replay``, ``kvx info``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from .errors import UsageError

if TYPE_CHECKING:
    from .bench import BenchOptions

__all__ = ["main"]


def _sizes(s: str) -> list[int]:
    from .bench import parse_size

    try:
        return [parse_size(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(s: str) -> int:
    from .bench import parse_size

    try:
        return parse_size(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``kvx bench: error: ...``) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(x: object) -> str:
    return " ".join(str(x).split())


def bench_options(a: argparse.Namespace) -> BenchOptions:
    """The :class:`kvx.bench.BenchOptions` of parsed ``kvx bench`` arguments, checked
    (:func:`kvx.bench.checks.check`): raises UsageError if the run cannot start."""
    from . import bench
    from .bench import checks

    seg = [x.strip() for x in a.seg.split(",")]
    if len(seg) > 2:
        raise UsageError(f"--seg takes LOCAL or LOCAL,REMOTE, not {a.seg!r}")
    opts = bench.BenchOptions(
        backend=a.backend,
        ops=["write", "read"] if a.op == "both" else [a.op],
        block_sizes=a.block_sizes,
        total=a.total,
        iters=a.iters,
        permute=not a.no_permute,
        seed=a.seed,
        compare=[c.strip() for c in (a.compare or "").split(",") if c.strip()],
        mem=a.mem,
        seg=(seg[0], seg[-1]),
        peer=a.peer,
        latency_samples=a.latency_samples,
        rounds=a.rounds,
        path=a.path,
    )
    checks.check(opts, json_path=a.json, plot_path=a.plot)
    return opts


def cmd_bench(a: argparse.Namespace) -> int:
    from . import bench

    if a.backend == "pool":  # the cluster-wide pool: its own workload (kvx.bench.pool)
        from .bench import pool

        sizes = None if a.block_sizes == _sizes("4K,32K,256K,2M") else a.block_sizes
        compare = [c.strip() for c in (a.compare or "").split(",") if c.strip()]
        return pool.cmd(sizes, max(a.iters, 30), compare, a.json, a.quiet, a.rounds)

    opts = bench_options(a)
    hdr, rows = bench.run(opts, quiet=a.quiet or a.json == "-")
    title = (f"kvx bench --backend {opts.backend} ({', '.join(opts.ops)}), {bench.fmt_size(opts.total)}, "
             f"{'permuted' if opts.permute else 'contiguous'} blocks; {hdr['cpu']}, {hdr['date']}")
    if a.json == "-":
        print(json.dumps({"header": hdr, "rows": rows}))
    else:  # the table first: a file that cannot be written after all loses no figures
        print("# " + title)
        print("# " + ", ".join(f"{k}={v}" for k, v in hdr.items() if k not in ("date",)))
        print(bench.format_table(rows), flush=True)
        if a.json:
            bench.dump_json(a.json, hdr, rows, opts)
    if a.plot:
        bench.plot(rows, a.plot, title)
    return 0


def cmd_info(a: argparse.Namespace) -> int:
    import kvx

    from .backends import registry

    out: dict[str, Any] = {"kvx": kvx.__version__, "backends": {}}
    for name in registry.names():
        try:
            cls = registry.get(name)
            reason = cls.unavailable_reason()
        except kvx.KVXError as exc:
            reason = str(exc)
        state = "available" if reason is None else f"unavailable: {reason}"
        if reason is None and name == "gds":
            state += f" ({cls.mode()} mode)"  # type: ignore[attr-defined]
        out["backends"][name] = state
    out["host_paths"] = _host_paths()
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"kvx {out['kvx']}")
        for k, v in out["backends"].items():
            print(f"  {k:6s} {v}")
        print("  same-node host paths: " + ", ".join(f"{k}={v}" for k, v in out["host_paths"].items()))
    return 0


def _host_paths() -> dict[str, str]:
    """Which same-node host paths work here, probed against a real child process."""
    import subprocess

    from . import _native

    res = {"shm": "yes (memfd + SCM_RIGHTS)" if hasattr(os, "memfd_create") else "no"}
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        import ctypes

        v = ctypes.c_uint64(0)
        # probe an address that exists in every CPython child: our own variable is not, so read
        # the child's auxiliary vector via /proc only for the address, then CMA-read it
        with open(f"/proc/{child.pid}/maps") as f:
            first = int(f.readline().split("-")[0], 16)
        _native.cma_probe(child.pid, first)
        res["cma"] = "yes"
        del v
    except OSError as exc:
        res["cma"] = f"no ({exc.strerror})"
    finally:
        child.kill()
        child.wait()
    res["uds"] = "yes"
    from . import config

    res["default"] = str(config.get("KVX_HOST_PATH"))
    return res


def cmd_replay(a: argparse.Namespace) -> int:
    from .tiers import replay

    return replay.main(a)


def build_parser() -> argparse.ArgumentParser:
    from .bench.checks import BACKENDS as BENCH_BACKENDS

    ap = _Parser(prog="kvx", description="Move KV cache blocks between GPUs, host memory, "
                                 "files and object storage.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bench", help="measure transfer bandwidth and latency (two processes)")
    b.add_argument("--backend", default="host", help=", ".join((*BENCH_BACKENDS, "pool")) + " (default host)")
    b.add_argument("--op", default="both", choices=["read", "write", "both"])
    b.add_argument("--block-sizes", type=_sizes, default=_sizes("4K,32K,256K,2M"))
    b.add_argument("--total", type=_size, default=256 << 20, help="bytes per buffer (default 256M)")
    b.add_argument("--iters", type=int, default=5,
                   help="timed transfers per point (median), after a warm-up of at least 20 ms")
    b.add_argument("--rounds", type=int, default=1,
                   help="run kvx and each --compare this many times, alternately, and report medians "
                        "(ratios with their per-round range): for noisy, shared machines (default 1)")
    b.add_argument("--no-permute", action="store_true", help="contiguous block ids (default: permuted)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--compare", default="",
                   help="comma list of comparisons: nixl, mooncake (tcp), mooncake-store (pool)")
    b.add_argument("--mem", default="alloc", choices=["alloc", "numpy"],
                   help="host memory: kvx.alloc_host (shared mappings) or plain numpy (CMA)")
    b.add_argument("--seg", default="dram", help="cuda: local,remote memory: vram, pinned or dram")
    b.add_argument("--peer", default=None, help="tcp: host:port of a remote `kvx bench-target`")
    b.add_argument("--path", default=None, help="posix/gds: directory for the test file")
    b.add_argument("--latency-samples", type=int, default=2000,
                   help="single 4 KiB writes timed post to completion (default 2000; 0: no latency test)")
    b.add_argument("--json", default=None, help="write results as JSON to FILE ('-' for stdout only)")
    b.add_argument("--plot", default=None, help="write a PNG plot of bandwidth vs block size")
    b.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (a live bar on a terminal, else one line per step)")
    b.set_defaults(fn=cmd_bench)

    r = sub.add_parser("replay", help="replay a Mooncake trace through a TieredStore")
    r.add_argument("trace")
    r.add_argument("--capacity", type=int, required=True, help="host tier capacity in blocks")
    r.add_argument("--disk", type=int, default=0, help="disk tier capacity in blocks")
    r.add_argument("--s3", type=int, default=0, help="object tier capacity in blocks")
    r.add_argument("--policy", default=None)
    r.add_argument("--block-bytes", type=int, default=64)
    r.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    r.add_argument("--json", action="store_true", help="last stdout line is a JSON summary")
    r.add_argument("--progress", action="store_true",
                   help="live bar on stderr with the hit rate so far (default: when stderr is a terminal)")
    r.set_defaults(fn=cmd_replay)

    i = sub.add_parser("info", help="show backends and same-node paths available here")
    i.add_argument("--json", action="store_true")
    i.set_defaults(fn=cmd_info)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the ``kvx`` command line; returns the exit status.

    A usage error, a kvx error or an OS error (a full disk, a file that cannot be written) ends
    the command with one line on stderr naming the cause and exit status 2.
    """
    from .bench import BenchError
    from .errors import KVXError

    a = build_parser().parse_args(argv)
    try:
        return int(a.fn(a))
    except (KVXError, BenchError, OSError) as exc:
        print(f"kvx {a.cmd}: {_one_line(exc) or type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvx {a.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
