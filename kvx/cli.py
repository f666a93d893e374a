"""The ``kvx`` console script: ``kvx bench``, ``kvx replay``, ``kvx info``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

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


BENCH_BACKENDS = ("host", "cuda", "tcp", "posix", "gds", "s3")


def _bench_unavailable(name: str) -> str | None:
    """Why ``kvx bench --backend name`` cannot run here, or None."""
    import kvx

    from .backends import registry

    if name not in BENCH_BACKENDS:
        return f"unknown backend {name!r} (choose from {', '.join(BENCH_BACKENDS)})"
    try:
        reason = registry.get(name).unavailable_reason()
    except kvx.KVXError as exc:
        reason = str(exc)
    if reason is not None:
        return f"the {name} backend is not available here: {reason}"
    return None


def cmd_bench(a: argparse.Namespace) -> int:
    import kvx

    from . import bench

    opts = bench.BenchOptions(
        backend=a.backend,
        ops=["write", "read"] if a.op == "both" else [a.op],
        block_sizes=a.block_sizes,
        total=a.total,
        iters=a.iters,
        permute=not a.no_permute,
        seed=a.seed,
        compare=[c for c in (a.compare or "").split(",") if c],
        mem=a.mem,
        seg=tuple(a.seg.split(",")) if "," in a.seg else (a.seg, a.seg),  # type: ignore[arg-type]
        peer=a.peer,
        latency_samples=a.latency_samples,
        path=a.path,
    )
    if opts.latency_samples < 0 or opts.iters < 1 or opts.total <= 0:
        print("kvx bench: --latency-samples must be >= 0, --iters >= 1 and --total > 0", file=sys.stderr)
        return 2
    if opts.path is not None and not os.path.isdir(opts.path):
        print(f"kvx bench: --path {opts.path}: not an existing directory", file=sys.stderr)
        return 2
    for bs in opts.block_sizes:
        if bs <= 0 or bs > opts.total:
            print(f"kvx bench: block size {bs} must be in 1..--total ({opts.total})", file=sys.stderr)
            return 2
    why = _bench_unavailable(opts.backend)
    if why is not None:
        print(f"kvx bench: {why}", file=sys.stderr)
        return 2
    try:
        hdr, rows = bench.run(opts, quiet=a.quiet or a.json == "-")
    except kvx.BackendUnavailable as exc:
        print(f"kvx bench: {exc}", file=sys.stderr)
        return 2
    title = (f"kvx bench --backend {opts.backend} ({', '.join(opts.ops)}), {bench.fmt_size(opts.total)}, "
             f"{'permuted' if opts.permute else 'contiguous'} blocks; {hdr['cpu']}, {hdr['date']}")
    if a.json:
        if a.json == "-":
            print(json.dumps({"header": hdr, "rows": rows}))
        else:
            bench.dump_json(a.json, hdr, rows, opts)
    if a.json != "-":
        print("# " + title)
        print("# " + ", ".join(f"{k}={v}" for k, v in hdr.items() if k not in ("date",)))
        print(bench.format_table(rows))
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
    ap = argparse.ArgumentParser(prog="kvx", description="Move KV cache blocks between GPUs, host memory, "
                                 "files and object storage.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("bench", help="measure transfer bandwidth and latency (two processes)")
    b.add_argument("--backend", default="host", help=", ".join(BENCH_BACKENDS) + " (default host)")
    b.add_argument("--op", default="both", choices=["read", "write", "both"])
    b.add_argument("--block-sizes", type=_sizes, default=_sizes("4K,32K,256K,2M"))
    b.add_argument("--total", type=_size, default=256 << 20, help="bytes per buffer (default 256M)")
    b.add_argument("--iters", type=int, default=5,
                   help="timed transfers per point (median), after a warm-up of at least 20 ms")
    b.add_argument("--no-permute", action="store_true", help="contiguous block ids (default: permuted)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--compare", default="", help="comma list of comparisons: nixl")
    b.add_argument("--mem", default="alloc", choices=["alloc", "numpy"],
                   help="host memory: kvx.alloc_host (shared mappings) or plain numpy (CMA)")
    b.add_argument("--seg", default="dram", help="cuda: local,remote memory: vram, pinned or dram")
    b.add_argument("--peer", default=None, help="tcp: host:port of a remote `kvx bench-target`")
    b.add_argument("--path", default=None, help="posix/gds: directory for the test file")
    b.add_argument("--latency-samples", type=int, default=2000,
                   help="single 4 KiB writes timed post to completion (default 2000; 0: no latency test)")
    b.add_argument("--json", default=None, help="write results as JSON to FILE ('-' for stdout only)")
    b.add_argument("--plot", default=None, help="write a PNG plot of bandwidth vs block size")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
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
    a = build_parser().parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
