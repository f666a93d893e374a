"""``benchmarks/side_by_side.py`` (``make bench-side``): the old-vs-new table of issue 15.

The verdict and table logic on given figures, a bad ``--ref``, and one real run of the script with
a tiny configuration (``--ref HEAD``: the committed code extracted and built in a temporary
directory against this tree, host benchmark only, two rounds) whose markdown table is parsed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "side_by_side.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvx_side_by_side", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


sbs = _script()


def test_verdict_bandwidth_and_latency() -> None:
    v = sbs.verdict
    assert v([10.0, 12.0, 14.0], [11.0, 13.0, 20.0], True) == "within spread"  # new median 13 in [10, 14]
    assert v([10.0, 12.0, 14.0], [15.0, 16.0, 17.0], True) == "faster"
    assert v([10.0, 12.0, 14.0], [7.0, 8.0, 9.0], True) == "slower"
    assert v([10.0, 12.0, 14.0], [9.0, 9.5, 13.0], True) == "slower (ranges overlap)"
    assert v([10.0, 12.0, 14.0], [13.0, 15.0, 16.0], True) == "faster (ranges overlap)"
    # latency: lower is faster
    assert v([2.0, 2.5, 3.0], [1.0, 1.2, 1.4], False) == "faster"
    assert v([2.0, 2.5, 3.0], [3.5, 4.0, 4.5], False) == "slower"
    assert v([2.0, 2.5, 3.0], [2.9, 2.1, 9.0], False) == "within spread"
    # the bounds belong to the spread
    assert v([10.0, 14.0], [14.0], True) == "within spread"
    assert v([10.0, 14.0], [10.0], True) == "within spread"
    assert v([], [1.0], True) == "new only"
    assert v([1.0], [], True) == "old only"


def test_summarize_table_and_report() -> None:
    K = sbs.Key
    bw, lat, only_new = K("host", "kvx", "write", 4096, "GB/s"), K("host", "kvx", "write", 4096, "us"), \
        K("posix", "kvx-clean", "read", 2 << 20, "GB/s")
    # a ceiling measured once per run and repeated on every (op, block) row of its impl
    mc = [K("host", "memcpy", op, bs, "GB/s") for op in ("write", "read") for bs in (4096, 8192)]
    results = {"old": [{bw: 10.0, lat: 2.0, **dict.fromkeys(mc, 8.0)}, {bw: 12.0, lat: 3.0, **dict.fromkeys(mc, 9.0)},
                       {bw: 11.0, lat: 2.5, **dict.fromkeys(mc, 7.0)}],
               "new": [{bw: 13.0, lat: 1.0, only_new: 5.0, **dict.fromkeys(mc, 8.5)}, {bw: 14.0, lat: 1.5},
                       {bw: 13.5, lat: 1.2}]}
    results["new"][1].update({k: 6.0 + (k.op == "read") for k in mc})  # here write and read differ
    lines = sbs.summarize(results)
    by_key = {ln.key: ln for ln in lines}
    mc_lines = [ln for ln in lines if ln.key.impl == "memcpy"]
    assert [(ln.key.op, sbs.fmt_block(ln.key.block_bytes)) for ln in mc_lines] == [("write", "all"), ("read", "all")]
    assert mc_lines[0].old == [8.0, 9.0, 7.0] and mc_lines[1].new == [8.5, 7.0]
    assert set(by_key) - {ln.key for ln in mc_lines} == {bw, lat, only_new}
    assert by_key[bw].old_median == 11.0 and by_key[bw].new_median == 13.5
    assert by_key[bw].verdict == "faster" and by_key[lat].verdict == "faster"
    assert by_key[only_new].verdict == "new only" and by_key[only_new].ratio is None
    rows = _parse(sbs.table(lines))
    assert rows[0]["block"] == "4K" and rows[0]["old min-max"] == "10.00-12.00"
    assert rows[0]["new/old"] == f"{13.5 / 11.0:.2f}"
    assert rows[-1]["impl"] == "kvx-clean" and rows[-1]["block"] == "2M" and rows[-1]["old median"] == "-"
    assert rows[-1]["new median"] == "5.00"
    old = sbs.Side("old", "27cdcfb", "/x/old", {"kvx._native": "/x/old/kvx/_native.so"})
    new = sbs.Side("new", "this tree", "/x/new", {"kvx._native": "/x/new/kvx/_native.so"})
    meta = {"cpu": "cpu", "cpus": 2, "platform": "linux", "start": "s", "end": "e", "load_start": "1",
            "load_end": "2", "command": "cmd", "failures": ["round 1, tcp, old: boom"]}
    text = sbs.report(old, new, sbs.Config(), lines, meta)
    assert "### kvx bench --backend host" in text and "### kvx bench --backend posix" in text
    assert "- round 1, tcp, old: boom" in text
    assert "verdicts of the 3 kvx rows: faster: 2, new only: 1" in text
    assert "verdicts of the 2 control rows (code that is not kvx's: memcpy;" in text


def _parse(md: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``md`` as dicts keyed by its header cells."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert re.fullmatch(r"\|(---\|)+", lines[1]), lines[1]
    rows = []
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == len(head), ln
        rows.append(dict(zip(head, cells)))
    return rows


def test_bad_ref_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = tmp_path / "t.md"
    r = subprocess.run([sys.executable, str(SCRIPT), "--ref", "no-such-ref-kvx", "--out", str(out),
                        "--json", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("side_by_side.py: error: --ref 'no-such-ref-kvx'")
    assert not out.exists()
    r = subprocess.run([sys.executable, str(SCRIPT), "--ref", "HEAD", "--new", "no-such-ref-kvx", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == f"side_by_side.py: error: --new 'no-such-ref-kvx' names no commit in {ROOT}\n"
    r = subprocess.run([sys.executable, str(SCRIPT), "--benchmarks", "host,gpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--benchmarks" in r.stderr and r.stderr.count("\n") == 1


def _git_checkout() -> bool:
    """Whether ROOT is the top of a git checkout with a HEAD (not, e.g., a copy of the tree under
    build/, where git would answer for the enclosing checkout)."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel", "--verify", "HEAD"],
                       capture_output=True, text=True)
    return r.returncode == 0 and Path(r.stdout.splitlines()[0]).resolve() == ROOT


@pytest.mark.skipif(not _git_checkout(), reason="needs this tree to be a git checkout with its history")
def test_tiny_run_parses(tmp_path: Path) -> None:
    out, js = tmp_path / "side.md", tmp_path / "side.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--ref", "HEAD", "--rounds", "2", "--benchmarks", "host",
                        "--total", "256K", "--block-sizes", "4K,64K", "--iters", "1", "--latency-samples", "20",
                        "--compare", "none", "--out", str(out), "--json", str(js)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    md = out.read_text()
    assert md in r.stdout  # printed and written
    assert md.startswith("## Side by side: HEAD (") and "(old) vs this tree (" in md
    section = md.split("### kvx bench --backend host", 1)[1]
    rows = _parse(section)
    assert list(rows[0]) == list(sbs.COLUMNS)
    got = {(x["impl"], x["op"], x["block"], x["unit"]) for x in rows}
    for op in ("write", "read"):
        for block in ("4K", "64K"):
            assert ("kvx", op, block, "GB/s") in got
    assert ("memcpy", "write+read", "all", "GB/s") in got  # one ceiling per run: one line
    assert ("kvx", "write", "4K", "us") in got and ("kvx-plan", "write", "4K", "us") in got
    data = json.loads(js.read_text())
    figs = {(ln["impl"], ln["op"], sbs.fmt_block(ln["block_bytes"]), ln["unit"]): ln for ln in data["lines"]}
    for x in rows:
        old, new = float(x["old median"]), float(x["new median"])  # both columns filled, numbers
        lo, hi = (float(v) for v in x["old min-max"].split("-"))
        assert lo <= old <= hi and float(x["new min-max"].split("-")[0]) <= new
        ln = figs[(x["impl"], x["op"], x["block"], x["unit"])]
        assert len(ln["old"]) == 2 and len(ln["new"]) == 2  # one figure per round and side
        assert x["new/old"] == f"{statistics.median(ln['new']) / statistics.median(ln['old']):.2f}"
        assert x["verdict"] == ln["verdict"]
        assert x["verdict"] in ("within spread", "faster", "slower", "faster (ranges overlap)",
                                "slower (ranges overlap)")
    # each side ran its own code: the old side's kvx and native build from the extracted tree
    old_native = data["sides"]["old"]["loaded"]["kvx._native"]
    assert "kvx-side-by-side-" in old_native and not old_native.startswith(str(ROOT))
    assert data["sides"]["new"]["loaded"]["kvx._native"].startswith(str(ROOT))
    # old and new alternate, the order flipped every round; every line has one figure per round
    assert [(x["round"], x["side"]) for x in data["runs"]] == [(0, "old"), (0, "new"), (1, "new"), (1, "old")]
    tmp = old_native.split("kvx-side-by-side-", 1)[0] + "kvx-side-by-side-" + \
        old_native.split("kvx-side-by-side-", 1)[1].split(os.sep, 1)[0]
    assert not os.path.exists(tmp)  # the extracted tree is removed
    # the JSON file renders the same report again
    r = subprocess.run([sys.executable, str(SCRIPT), "--render", str(js)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == md
    js.write_text(json.dumps({"runs": []}))
    r = subprocess.run([sys.executable, str(SCRIPT), "--render", str(js)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"side_by_side.py: error: --render {js}: not a JSON file")
