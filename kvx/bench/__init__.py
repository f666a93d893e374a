"""``kvx bench``: side-by-side transfer benchmarks (kvx vs NIXL vs the raw ceiling).

Each backend has a runner module ``kvx.bench.<backend>`` with
``run(opts: BenchOptions, progress: Progress) -> list[dict]``; comparisons and the raw ceiling
are runners too. Rows are dicts with ``impl``, ``op``, ``block_bytes``, ``nblocks``,
``total_bytes``, ``iters``, ``seconds_median``, ``seconds_min``, ``gbps`` (1e9 bytes/s at
the median); latency rows carry ``lat_us_median`` and ``lat_us_p99`` instead.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .timing import WARMUP_S as WARMUP_S  # the runners take the timing helpers from here
from .timing import timed as timed
from .timing import warm as warm

__all__ = ["BenchError", "BenchOptions", "Progress", "parse_size", "header", "timed", "format_table", "plot", "run"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


class BenchError(RuntimeError):
    """The benchmark could not run to the end for a reason outside kvx's API (a helper process
    died or did not answer, an external tool failed); the message names the cause."""


def quit_child(proc: "subprocess.Popen[str]", kill_wait: float) -> None:
    """Stop a helper process of a benchmark that reads JSON commands on stdin: ``{"cmd": "quit"}``
    and up to 10 s for it to exit, else kill it and wait up to ``kill_wait`` seconds."""
    if proc.poll() is not None:
        return
    try:
        assert proc.stdin is not None
        proc.stdin.write('{"cmd": "quit"}\n')
        proc.stdin.flush()
        proc.wait(10)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait(kill_wait)


def parse_size(s: str | int) -> int:
    """``"4K"`` -> 4096, ``"256M"`` -> 268435456 (binary units)."""
    if isinstance(s, int):
        return s
    t = s.strip().upper()
    i = len(t)
    while i and not t[i - 1].isdigit():
        i -= 1
    num, unit = t[:i], t[i:]
    if not num or unit not in _UNITS:
        raise ValueError(f"not a size: {s!r} (use e.g. 4K, 256M, 2G)")
    return int(num) * _UNITS[unit]


def fmt_size(n: int) -> str:
    for u, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{u}"
    return str(n)


@dataclass
class BenchOptions:
    """Options of one ``kvx bench`` run."""

    backend: str = "host"
    ops: list[str] = field(default_factory=lambda: ["write", "read"])
    block_sizes: list[int] = field(default_factory=lambda: [4096, 32768, 262144, 2097152])
    total: int = 256 << 20
    iters: int = 5
    permute: bool = True
    seed: int = 0
    compare: list[str] = field(default_factory=list)
    mem: str = "alloc"  # host memory: alloc (kvx.alloc_host) or numpy
    seg: tuple[str, str] = ("dram", "dram")  # local, remote: dram | pinned | vram
    peer: str | None = None  # host:port of a remote bench target (tcp)
    latency_samples: int = 2000
    rounds: int = 1  # kvx and its comparisons run this many times, alternately; medians reported
    path: str | None = None  # directory for file benchmarks
    extra: dict[str, Any] = field(default_factory=dict)


class Progress:
    """Progress of a benchmark run on stderr, silent when ``quiet``.

    Where the stream is a terminal: a live bar (tqdm when installed). Anywhere else (a log
    file, a pipe, ``make bench > log 2>&1``): one plain line per step, ``[3/24] kvx write 4K``,
    never a carriage-return frame of a bar.
    """

    def __init__(self, total: int, quiet: bool = False, stream: Any = None) -> None:
        self.quiet = quiet
        self._stream = stream if stream is not None else sys.stderr
        self._bar: Any = None
        self._n = 0
        self._total = total
        self._desc = ""
        if not quiet and _is_terminal(self._stream):
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="step", file=self._stream, leave=False, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def step(self, desc: str) -> None:
        self._n += 1
        self._desc = desc
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.set_description(desc)
            self._bar.update(1)
        else:
            print(f"[{self._n}/{self._total}] {desc}", file=self._stream, flush=True)

    def add(self, n: int) -> None:
        self._total += n
        if self._bar is not None:
            self._bar.total = self._total
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
        return False


def row(impl: str, op: str, bs: int, n: int, iters: int, med: float, mn: float, **kw: Any) -> dict[str, Any]:
    return dict(impl=impl, op=op, block_bytes=bs, nblocks=n, total_bytes=n * bs, iters=iters, seconds_median=med,
                seconds_min=mn, gbps=n * bs / med / 1e9, **kw)


def permutation(n: int, opts: BenchOptions) -> np.ndarray:
    if not opts.permute:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng(opts.seed).permutation(n).astype(np.int64)


def header(opts: BenchOptions) -> dict[str, Any]:
    """System and version information printed above the table and stored in the JSON."""
    import kvx

    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "kvx": kvx.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "backend": opts.backend,
        "total": opts.total,
        "permute": opts.permute,
        "mem": opts.mem,
        "seg": list(opts.seg),
    }
    try:
        from ..compare.nixl import nixl_version

        info["nixl"] = nixl_version()
    except Exception:
        info["nixl"] = None
    from .. import config

    gpu = config.get("KVX_BENCH_GPU_NAME")
    if gpu:
        info["gpu"] = gpu
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per (op, block size), one GB/s column per impl, ratios vs the others."""
    bw = [r for r in rows if "gbps" in r]
    impls: list[str] = []
    for r in bw:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    lines = []
    if bw:
        kvx_impl = impls[0]
        cols = ["op", "block"] + [f"{i} GB/s" for i in impls] + [f"{kvx_impl}/{i}" for i in impls[1:]]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        keys: list[tuple[str, int]] = []
        for r in bw:
            k = (r["op"], r["block_bytes"])
            if k not in keys:
                keys.append(k)
        for op, bs in keys:
            vals = {r["impl"]: r["gbps"] for r in bw if r["op"] == op and r["block_bytes"] == bs}
            per_round = {r["impl"]: r.get("gbps_rounds") for r in bw if r["op"] == op and r["block_bytes"] == bs}
            cells = [op, fmt_size(bs)] + [f"{vals[i]:.2f}" if i in vals else "-" for i in impls]
            for i in impls[1:]:
                if kvx_impl in vals and i in vals and vals[i] > 0:
                    cells.append(f"{vals[kvx_impl] / vals[i]:.2f}x" + _spread(per_round[kvx_impl], per_round[i]))
                else:
                    cells.append("-")
            lines.append("| " + " | ".join(cells) + " |")
    lat = [r for r in rows if "lat_us_median" in r]
    if lat:
        lines.append("")
        lines.append("| latency | op | block | median us | p99 us |")
        lines.append("|---|---|---|---|---|")
        for r in lat:
            lines.append(f"| {r['impl']} | {r['op']} | {fmt_size(r['block_bytes'])} | {r['lat_us_median']:.1f} | "
                         f"{r['lat_us_p99']:.1f} |")
    return "\n".join(lines)


def _spread(ra: list[float] | None, rb: list[float] | None) -> str:
    """`` (lo-hi)``: the lowest and highest per-round ratio ra/rb where the point ran in rounds."""
    if not ra or not rb or len(ra) != len(rb) or len(ra) < 2:
        return ""
    q = [x / y for x, y in zip(ra, rb) if y > 0]
    return f" ({min(q):.2f}-{max(q):.2f})" if q else ""


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of several rounds as one set: per (impl, op, block) the median GB/s (every round's
    in ``gbps_rounds``, in round order) and the median of the latency figures."""
    if len(rounds) == 1:
        return rounds[0]
    out: list[dict[str, Any]] = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rows in rounds:
        for r in rows:
            k = (r["impl"], r["op"], r["block_bytes"], "gbps" in r)
            if k not in groups:
                groups[k] = []
                out.append(r)
            groups[k].append(r)
    merged = []
    for r in out:
        g = groups[(r["impl"], r["op"], r["block_bytes"], "gbps" in r)]
        m = dict(r)
        m["rounds"] = len(g)
        if "gbps" in r:
            m["gbps_rounds"] = [x["gbps"] for x in g]
            m["gbps"] = statistics.median(m["gbps_rounds"])
        for key in ("lat_us_median", "lat_us_p99"):
            if key in r:
                m[key] = statistics.median(x[key] for x in g)
        merged.append(m)
    return merged


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Bandwidth vs block size, one line per (impl, op)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if "gbps" in r:
            series.setdefault((r["impl"], r["op"]), []).append((r["block_bytes"], r["gbps"]))
    for (impl, op), pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} {op}",
                linestyle="-" if impl.startswith("kvx") else "--")
    ax.set_xscale("log", base=2)
    xs = sorted({r["block_bytes"] for r in rows if "gbps" in r})
    ax.set_xticks(xs)
    ax.set_xticklabels([fmt_size(x) for x in xs])
    ax.set_xlabel("block size")
    ax.set_ylabel("GB/s (1e9 bytes/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def runner(name: str) -> Callable[[BenchOptions, Progress], list[dict[str, Any]]]:
    """The run() function of ``kvx.bench.<name>``."""
    mod = importlib.import_module(f"kvx.bench.{name}")
    return mod.run  # type: ignore[no-any-return]


def run(opts: BenchOptions, quiet: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run the kvx benchmark, its comparisons and ceiling; return (header, rows)."""
    hdr = header(opts)
    steps = (len(opts.ops) * (len(opts.block_sizes) + 2 * len(opts.compare)) + 3) * max(1, opts.rounds)
    prog = Progress(steps, quiet)
    rounds = []
    try:
        for _ in range(max(1, opts.rounds)):
            rows = runner(opts.backend)(opts, prog)
            for c in opts.compare:
                rows += runner(f"compare_{c}")(opts, prog)
            rounds.append(rows)
    finally:
        prog.close()
    return hdr, merge_rounds(rounds)


def dump_json(path: str, hdr: dict[str, Any], rows: list[dict[str, Any]], opts: BenchOptions) -> None:
    with open(path, "w") as f:
        json.dump({"header": hdr, "options": asdict(opts), "rows": rows}, f, indent=1)


def iter_sizes(opts: BenchOptions) -> Iterator[tuple[int, int]]:
    """(block size, number of blocks) for each block size that fits ``total``."""
    for bs in opts.block_sizes:
        n = opts.total // bs
        if n >= 1:
            yield bs, n
