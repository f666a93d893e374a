"""The kvx console script and the example, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kvx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvx.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_info() -> None:
    r = kvx("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backends"]["host"] == "available"
    assert info["host_paths"]["shm"].startswith("yes")


def test_bench_small_json(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    png = tmp_path / "b.png"
    r = kvx("bench", "--backend", "host", "--total", "8M", "--block-sizes", "4K,1M", "--iters", "2",
            "--latency-samples", "50", "--json", str(out), "--plot", str(png), "--quiet")
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = [x for x in data["rows"] if x["impl"] == "kvx" and "gbps" in x]
    assert {(x["op"], x["block_bytes"]) for x in rows} == {("write", 4096), ("write", 1 << 20), ("read", 4096),
                                                            ("read", 1 << 20)}
    assert all(x["verified"] and x["gbps"] > 0 for x in rows)
    assert any(x["impl"] == "kvx-plan" for x in data["rows"])
    assert png.stat().st_size > 1000
    assert "| op | block |" in r.stdout


def test_bench_rejects_bad_sizes() -> None:
    r = kvx("bench", "--block-sizes", "4Q")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = kvx("bench", "--total", "4K", "--block-sizes", "8K")
    assert r.returncode == 2


def test_bench_without_latency_test(tmp_path: Path) -> None:
    """``--latency-samples 0`` skips the latency test (small totals time whole small transfers)."""
    out = tmp_path / "b.json"
    r = kvx("bench", "--backend", "host", "--total", "64K", "--block-sizes", "16K", "--iters", "3",
            "--latency-samples", "0", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert not [x for x in rows if "lat_us_median" in x]
    assert {(x["op"], x["block_bytes"]) for x in rows if x["impl"] == "kvx"} == {("write", 16384), ("read", 16384)}
    assert "| latency |" not in r.stdout
    for bad in (("--latency-samples", "-1"), ("--iters", "0"), ("--total", "0")):
        r = kvx("bench", "--backend", "host", "--total", "64K", "--block-sizes", "16K", *bad)
        assert r.returncode == 2 and "must be" in r.stderr and "Traceback" not in r.stderr


def test_bench_path_must_be_a_directory(tmp_path: Path) -> None:
    """A mistyped ``--path`` is an error, not a directory created on the way."""
    missing = tmp_path / "no" / "such"
    r = kvx("bench", "--backend", "posix", "--path", str(missing), "--total", "1M", "--block-sizes", "64K")
    assert r.returncode == 2 and "not an existing directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "no").exists()


def test_bench_unknown_or_unavailable_backend_is_a_clear_error() -> None:
    r = kvx("bench", "--backend", "bogus", "--total", "4M")
    assert r.returncode == 2 and "unknown backend 'bogus'" in r.stderr and "Traceback" not in r.stderr
    from kvx.backends.cuda import CudaBackend

    if CudaBackend.unavailable_reason() is not None:  # a CPU machine: cupy or the GPU missing
        r = kvx("bench", "--backend", "cuda", "--total", "4M")
        assert r.returncode == 2 and "cuda backend is not available here" in r.stderr
        assert "Traceback" not in r.stderr


def test_replay_json(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    reqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9], [1, 2, 3]]
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": r}) + "\n" for i, r in enumerate(reqs)))
    r = kvx("replay", str(trace), "--capacity", "100", "--json", "--policy", "lru")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # hits: req2 [1,2], req3 [1,2,3], req5 [1,2,3] -> 2+3+3 = 8 of 14 refs
    assert res["requests"] == 5 and res["block_refs"] == 14 and res["hits"] == 8
    assert abs(res["hit_rate"] - 8 / 14) < 1e-9 and res["ops_per_s"] > 0 and "tier_hits" in res
    r = kvx("replay", str(tmp_path / "missing.jsonl"), "--capacity", "10")
    assert r.returncode == 2


def test_quickstart_example() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DONE: 2097152 bytes via host")
