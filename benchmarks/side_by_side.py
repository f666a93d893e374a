"""The CPU benchmarks of an older commit and of this tree, side by side in one run.

    .venv/bin/python benchmarks/side_by_side.py [--ref 27cdcfb] [--new main] [--rounds 3]
    make bench-side REF=27cdcfb [NEW=main] [ROUNDS=3]

The tracked files of ``--ref`` are extracted (``git archive``) into a temporary directory and its
native extensions are built there in place with this environment's Python (the same compiler
flags as ``make venv``: ``setup.py build_ext --inplace``), so the older code runs with its own
``kvx`` package *and* its own ``kvx._native``; every other package (numpy, NIXL, ...) is this
virtual environment's. The new side is this working tree with its in-place build (or, with
``--new REF``, another commit extracted and built the same way). Each side runs
as ``python -m kvx.cli bench ...`` with ``PYTHONPATH`` pointing at its tree and a neutral working
directory; before timing anything the script checks which files ``import kvx`` and
``kvx._native`` load on each side.

Each of ``kvx bench --backend host|tcp|posix --compare nixl`` runs for OLD and NEW alternately,
``--rounds`` times, the order flipped every round (old-new, new-old, ...) so that neither side
always runs second on a machine whose load drifts. Per benchmark, implementation, direction and
block size the table gives each side's median over the rounds and its min-max spread, the ratio
new/old of the medians and a verdict: ``within spread`` when the new median lies inside the old
code's min-max, else ``faster`` / ``slower`` (GB/s: higher is faster; latency: lower), with
``(ranges overlap)`` added when the two min-max ranges still intersect. Rows of code that is the
same on both sides (NIXL, the memcpy and raw-TCP ceilings) are controls: their spread shows the
machine's noise during the run.

Defaults: 64 MiB per buffer (the CLI's default is 256 MiB), block sizes 4K,32K,256K,2M, the
CLI's defaults otherwise (5 timed transfers per point after a warm-up, 2,000 latency samples).
On the 2-core dev machine one round of the three benchmarks takes about 100 s per side, so the
default three rounds take about 10-11 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCHMARKS = ("host", "tcp", "posix")
DEFAULT_REF = "27cdcfb"
BUILD_TIMEOUT_S = 900.0
BENCH_TIMEOUT_S = 1800.0

WITHIN = "within spread"
FASTER = "faster"
SLOWER = "slower"
OVERLAP = " (ranges overlap)"
ALL_BLOCKS = 0  # Key.block_bytes of a figure measured once for every block size


class SideBySideError(Exception):
    """The run cannot go on (a bad ref, a failed build, a tree that loads the wrong code)."""


@dataclass(frozen=True)
class Config:
    """What each ``kvx bench`` run is asked (the same for both sides)."""

    benchmarks: tuple[str, ...] = BENCHMARKS
    rounds: int = 3
    total: str = "64M"
    block_sizes: str = "4K,32K,256K,2M"
    iters: int | None = None  # None: the CLI's default
    latency_samples: int | None = None  # None: the CLI's default
    compare: str = "nixl"

    def bench_args(self, backend: str) -> list[str]:
        args = ["bench", "--backend", backend, "--total", self.total, "--block-sizes", self.block_sizes, "--quiet"]
        if self.compare:
            args += ["--compare", self.compare]
        if self.iters is not None:
            args += ["--iters", str(self.iters)]
        if self.latency_samples is not None:
            args += ["--latency-samples", str(self.latency_samples)]
        return args


@dataclass
class Side:
    """One code under test: a tree whose ``kvx`` package and native build are used."""

    name: str  # "old" or "new"
    label: str  # e.g. "27cdcfb" or "this tree (b4af9a6)"
    tree: str
    loaded: dict[str, str] = field(default_factory=dict)  # module -> file it was loaded from


@dataclass(frozen=True)
class Key:
    """One figure of a benchmark: a bandwidth (GB/s) or a latency median (us)."""

    bench: str
    impl: str
    op: str
    block_bytes: int
    unit: str  # "GB/s" or "us"


@dataclass
class Line:
    """One row of the side-by-side table."""

    key: Key
    old: list[float]
    new: list[float]
    verdict: str

    @property
    def old_median(self) -> float | None:
        return statistics.median(self.old) if self.old else None

    @property
    def new_median(self) -> float | None:
        return statistics.median(self.new) if self.new else None

    @property
    def ratio(self) -> float | None:
        o, n = self.old_median, self.new_median
        return n / o if o and n is not None else None


# ---------------------------------------------------------------- the two trees


def _git(*args: str) -> str:
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=120)
    if r.returncode:
        raise SideBySideError(f"git {' '.join(args)}: {' '.join(r.stderr.split()) or 'failed'}")
    return r.stdout.strip()


def resolve(ref: str, option: str = "--ref") -> str:
    """The full commit id of ``ref``; SideBySideError if it names no commit."""
    if not ref or ref.startswith("-"):
        raise SideBySideError(f"{option} {ref!r} is not a git revision")
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except SideBySideError:
        raise SideBySideError(f"{option} {ref!r} names no commit in {ROOT}") from None


def extract(commit: str, into: str) -> str:
    """The tracked files of ``commit`` under ``into``, with kvx's native extensions built in place."""
    arch = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", commit], capture_output=True,
                          timeout=300)
    if arch.returncode:
        raise SideBySideError(f"git archive {commit}: {arch.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=arch.stdout, check=True, timeout=300)
    log = os.path.join(into, "build-native.log")
    with open(log, "wb") as f:
        r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=into, stdout=f,
                           stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    if r.returncode:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise SideBySideError(f"native build of {commit[:12]} failed (exit {r.returncode}):\n{tail}")
    return into


def _env(tree: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=tree)


def check_loads(side: Side, cwd: str) -> None:
    """Which files ``import kvx`` / ``kvx._native`` load with ``side``'s PYTHONPATH; SideBySideError
    unless both come from ``side.tree``."""
    code = "import json, kvx, kvx._native as n; print(json.dumps({'kvx': kvx.__file__, 'kvx._native': n.__file__}))"
    r = subprocess.run([sys.executable, "-c", code], env=_env(side.tree), cwd=cwd, capture_output=True, text=True,
                       timeout=120)
    if r.returncode:
        raise SideBySideError(f"{side.label}: import kvx failed: {r.stderr.strip().splitlines()[-1:]}")
    side.loaded = json.loads(r.stdout.strip().splitlines()[-1])
    tree = os.path.realpath(side.tree) + os.sep
    for mod, path in side.loaded.items():
        if not os.path.realpath(path).startswith(tree):
            raise SideBySideError(f"{side.label}: {mod} loads from {path}, not from {side.tree}")


def this_tree_label() -> str:
    try:
        head = _git("rev-parse", "--short=7", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except SideBySideError:
        return "this tree"
    return f"this tree ({head}{', with uncommitted changes' if dirty else ''})"


# ---------------------------------------------------------------- running and reading the benchmarks


def run_bench(side: Side, backend: str, cfg: Config, json_path: str, cwd: str) -> dict[str, Any]:
    """One ``kvx bench`` run of ``side``: its JSON (``header``: machine and versions, ``rows``)."""
    cmd = [sys.executable, "-m", "kvx.cli", *cfg.bench_args(backend), "--json", json_path]
    r = subprocess.run(cmd, env=_env(side.tree), cwd=cwd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SideBySideError(f"{side.label}: kvx bench --backend {backend} exited {r.returncode}: {last}")
    with open(json_path) as f:
        out: dict[str, Any] = json.load(f)
    if not isinstance(out.get("rows"), list) or not isinstance(out.get("header"), dict):
        raise SideBySideError(f"{side.label}: kvx bench --backend {backend} wrote no rows to {json_path}")
    return out


def figures(bench: str, rows: Sequence[dict[str, Any]]) -> dict[Key, float]:
    """The figures of one run: bandwidth rows in GB/s, latency rows as their median in us."""
    out: dict[Key, float] = {}
    for r in rows:
        if "gbps" in r:
            out[Key(bench, r["impl"], r["op"], int(r["block_bytes"]), "GB/s")] = float(r["gbps"])
        elif "lat_us_median" in r:
            out[Key(bench, r["impl"], r["op"], int(r["block_bytes"]), "us")] = float(r["lat_us_median"])
    return out


def verdict(old: Sequence[float], new: Sequence[float], higher_is_better: bool) -> str:
    """``within spread`` when the new median lies in the old values' [min, max]; else ``faster`` or
    ``slower``, with `` (ranges overlap)`` when the two [min, max] ranges still intersect."""
    if not old:
        return "new only"
    if not new:
        return "old only"
    lo, hi, med = min(old), max(old), statistics.median(new)
    if lo <= med <= hi:
        return WITHIN
    better = med > hi if higher_is_better else med < lo
    v = FASTER if better else SLOWER
    return v + OVERLAP if min(new) <= hi and max(new) >= lo else v


def summarize(results: dict[str, list[dict[Key, float]]]) -> list[Line]:
    """Lines of the table from each side's per-round figures (``results['old']``, ``results['new']``)."""
    keys: list[Key] = []
    for side in ("old", "new"):
        for run in results.get(side, []):
            keys += [k for k in run if k not in keys]
    lines: list[Line] = []
    seen: dict[tuple[Any, ...], int] = {}  # one measurement reported under several keys -> its line
    for k in keys:
        old = [run[k] for run in results.get("old", []) if k in run]
        new = [run[k] for run in results.get("new", []) if k in run]
        # a ceiling measured once per run (memcpy, raw-tcp) is repeated on every row of its impl:
        # one line for it, "all" blocks (and both ops where they share it)
        same = (k.bench, k.impl, k.unit, tuple(old), tuple(new))
        if same in seen and len(old) + len(new) > 1:
            i = seen[same]
            prev = lines[i].key
            ops = prev.op if k.op in prev.op.split("+") else f"{prev.op}+{k.op}"
            lines[i].key = Key(k.bench, k.impl, ops, ALL_BLOCKS, k.unit)
            continue
        seen[same] = len(lines)
        lines.append(Line(k, old, new, verdict(old, new, higher_is_better=k.unit == "GB/s")))
    return lines


def is_kvx(impl: str) -> bool:
    """Rows of kvx's own code (``kvx``, ``kvx-plan``, ``kvx-clean``, ...); the rest are controls."""
    return impl == "kvx" or impl.startswith("kvx-")


# ---------------------------------------------------------------- the table


def fmt_block(n: int) -> str:
    if n == ALL_BLOCKS:
        return "all"
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _spread(xs: Sequence[float]) -> str:
    return f"{_num(min(xs))}-{_num(max(xs))}" if xs else "-"


COLUMNS = ("benchmark", "impl", "op", "block", "unit", "old median", "old min-max", "new median", "new min-max",
           "new/old", "verdict")


def table(lines: Sequence[Line]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for ln in lines:
        k = ln.key
        ratio = f"{ln.ratio:.2f}" if ln.ratio is not None else "-"
        cells = [k.bench, k.impl, k.op, fmt_block(k.block_bytes), k.unit, _num(ln.old_median), _spread(ln.old),
                 _num(ln.new_median), _spread(ln.new), ratio, ln.verdict]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def tally(lines: Sequence[Line]) -> str:
    """How many of ``lines`` got each verdict."""
    counts: dict[str, int] = {}
    for ln in lines:
        counts[ln.verdict] = counts.get(ln.verdict, 0) + 1
    return ", ".join(f"{v}: {n}" for v, n in sorted(counts.items())) or "no rows"


def report(old: Side, new: Side, cfg: Config, lines: Sequence[Line], meta: dict[str, Any]) -> str:
    kvx = [ln for ln in lines if is_kvx(ln.key.impl)]
    ctl = [ln for ln in lines if not is_kvx(ln.key.impl)]
    ctl_impls = sorted({ln.key.impl for ln in ctl})
    head = [
        f"## Side by side: {old.label} (old) vs {new.label} (new)",
        "",
        f"- machine: {meta.get('cpu', platform.processor())}, {meta.get('cpus', os.cpu_count())} CPUs, "
        f"{meta.get('platform', platform.platform())}; NIXL {meta.get('nixl') or '-'}",
        f"- date: {meta['start']} - {meta['end']}; load average at start / end: {meta['load_start']} / "
        f"{meta['load_end']}",
        f"- command: `{meta['command']}`",
        f"- each side: `kvx {' '.join(cfg.bench_args('BACKEND'))}` for BACKEND in "
        f"{', '.join(cfg.benchmarks)}; {cfg.rounds} round(s), old and new alternating, the order flipped "
        f"every round",
        f"- old loads {old.loaded.get('kvx._native', '?')}; new loads {new.loaded.get('kvx._native', '?')}",
        f"- verdicts of the {len(kvx)} kvx rows: {tally(kvx)}",
        f"- verdicts of the {len(ctl)} control rows (code that is not kvx's: {', '.join(ctl_impls) or 'none'}; "
        f"what lands outside the spread there is the machine's noise): {tally(ctl)}",
        "",
        "GB/s rows: higher is faster; us rows (latency of one 4 KiB write, median of its samples): lower is "
        "faster. Each median and min-max is over the rounds.",
        "",
    ]
    body = []
    for bench in dict.fromkeys(ln.key.bench for ln in lines):
        body += [f"### kvx bench --backend {bench}", "", table([ln for ln in lines if ln.key.bench == bench]), ""]
    fails = meta.get("failures") or []
    if fails:
        body += ["Failed runs (left out of the figures):", "", *[f"- {x}" for x in fails], ""]
    return "\n".join(head + body)


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="side_by_side.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default=DEFAULT_REF, help=f"the older commit (default {DEFAULT_REF})")
    ap.add_argument("--new", default=None,
                    help="the newer commit, extracted and built like --ref (default: this working tree as it is)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each benchmark per side (default 3)")
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS), help="comma list of: " + ", ".join(BENCHMARKS))
    ap.add_argument("--total", default="64M", help="kvx bench --total (default 64M)")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M")
    ap.add_argument("--iters", type=int, default=None, help="kvx bench --iters (default: the CLI's)")
    ap.add_argument("--latency-samples", type=int, default=None,
                    help="kvx bench --latency-samples (default: the CLI's)")
    ap.add_argument("--compare", default="nixl", help="kvx bench --compare ('' or none: no comparison)")
    ap.add_argument("--out", default=os.path.join("out", "side-by-side.md"), help="markdown report")
    ap.add_argument("--json", default=os.path.join("out", "side-by-side.json"), help="every figure of every run")
    ap.add_argument("--keep", action="store_true", help="keep the extracted trees and the runs' JSON files")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="print the report of an earlier run from its --json file (runs nothing)")
    return ap.parse_args(argv)


def config_of(a: argparse.Namespace) -> Config:
    benches = tuple(b.strip() for b in a.benchmarks.split(",") if b.strip())
    bad = [b for b in benches if b not in BENCHMARKS]
    if bad or not benches:
        raise SideBySideError(f"--benchmarks takes a comma list of {', '.join(BENCHMARKS)}, not {a.benchmarks!r}")
    if not 1 <= a.rounds <= 100:
        raise SideBySideError(f"--rounds must be in 1..100, not {a.rounds}")
    compare = "" if a.compare.strip().lower() in ("", "none") else a.compare.strip()
    return Config(benches, a.rounds, a.total, a.block_sizes, a.iters, a.latency_samples, compare)


def _check_writable(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    if not os.access(d, os.W_OK):
        raise SideBySideError(f"cannot write {path}")


def _side_of(name: str, ref: str, commit: str, tmp: str) -> Side:
    """``commit`` extracted and built under ``tmp/name``."""
    tree = os.path.join(tmp, name)
    os.makedirs(tree)
    print(f"building {ref} ({commit[:12]}) in {tree} ...", file=sys.stderr, flush=True)
    extract(commit, tree)
    return Side(name, ref if commit.startswith(ref) else f"{ref} ({commit[:7]})", tree)


def results_of(runs: Sequence[dict[str, Any]]) -> dict[str, list[dict[Key, float]]]:
    """Each side's figures, one dict per round, from the runs' records (``round``, ``bench``,
    ``side``, ``rows``)."""
    per_round: dict[str, dict[int, dict[Key, float]]] = {"old": {}, "new": {}}
    for r in runs:
        per_round[r["side"]].setdefault(int(r["round"]), {}).update(figures(r["bench"], r["rows"]))
    return {name: [per_round[name][i] for i in sorted(per_round[name])] for name in ("old", "new")}


def render(path: str) -> str:
    """The report of an earlier run, from the JSON file it wrote (``--render``)."""
    try:
        with open(path) as f:
            data = json.load(f)
        cfg = Config(**{**data["config"], "benchmarks": tuple(data["config"]["benchmarks"])})
        old, new = (Side(n, data["sides"][n]["label"], "", data["sides"][n]["loaded"]) for n in ("old", "new"))
        return report(old, new, cfg, summarize(results_of(data["runs"])), data["meta"])
    except OSError as exc:
        raise SideBySideError(f"--render {path}: {exc.strerror or exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SideBySideError(f"--render {path}: not a JSON file of side_by_side.py ({type(exc).__name__}: {exc})") \
            from None


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(a: argparse.Namespace, argv: Sequence[str]) -> int:
    cfg = config_of(a)
    for p in (a.out, a.json):
        _check_writable(p)
    commit = resolve(a.ref)
    new_commit = resolve(a.new, "--new") if a.new is not None else None
    tmp = tempfile.mkdtemp(prefix="kvx-side-by-side-")
    try:
        work = os.path.join(tmp, "work")  # neutral cwd: `python -m` puts the cwd first on sys.path
        os.makedirs(work)
        old = _side_of("old", a.ref, commit, tmp)
        new = Side("new", this_tree_label(), ROOT) if new_commit is None else _side_of("new", a.new, new_commit, tmp)
        for side in (old, new):
            check_loads(side, work)
        meta: dict[str, Any] = {
            "start": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_start": _load(),
            "command": " ".join(["python", "benchmarks/side_by_side.py", *argv]),
            "old_commit": commit, "new_commit": new_commit, "failures": [],
        }
        raw: list[dict[str, Any]] = []
        for rnd in range(cfg.rounds):
            for bench in cfg.benchmarks:
                for side in ((old, new) if rnd % 2 == 0 else (new, old)):
                    jpath = os.path.join(tmp, f"{side.name}-{bench}-{rnd}.json")
                    t0 = time.perf_counter()
                    print(f"round {rnd + 1}/{cfg.rounds}: {bench} {side.name} ...", file=sys.stderr, flush=True)
                    try:
                        res = run_bench(side, bench, cfg, jpath, work)
                    except (SideBySideError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
                        msg = f"round {rnd + 1}, {bench}, {side.name}: {' '.join(str(exc).split())}"
                        print(msg, file=sys.stderr, flush=True)
                        meta["failures"].append(msg)
                        continue
                    raw.append({"round": rnd, "bench": bench, "side": side.name,
                                "seconds": time.perf_counter() - t0, **res})
                    for k in ("cpu", "cpus", "platform", "nixl"):
                        meta.setdefault(k, res["header"].get(k))
        meta["end"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        meta["load_end"] = _load()
        lines = summarize(results_of(raw))
        text = report(old, new, cfg, lines, meta)
        print(text, flush=True)
        with open(a.out, "w") as f:
            f.write(text)
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "config": asdict(cfg),
                       "sides": {s.name: {"label": s.label, "loaded": s.loaded} for s in (old, new)},
                       "lines": [{**asdict(ln.key), "old": ln.old, "new": ln.new, "verdict": ln.verdict}
                                 for ln in lines],
                       "runs": raw}, f, indent=1)
        print(f"wrote {a.out} and {a.json}", file=sys.stderr)
        return 1 if meta["failures"] else 0
    finally:
        if a.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    try:
        if a.render is not None:
            print(render(a.render), end="")
            return 0
        return run(a, argv)
    except SideBySideError as exc:
        print(f"side_by_side.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
