"""Tests of the NIXL comparison runner (kvx.compare.nixl).

The end-to-end tests need NIXL (``pip install --no-deps nixl-cu12==1.5.1``) and are skipped
with that reason when it is not importable; the helper tests always run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvx.compare import nixl as cmp_nixl

REPO_ROOT = Path(__file__).resolve().parents[1]
NIXL_MISSING = cmp_nixl.nixl_available()
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None,
                                reason=f"NIXL not importable: {NIXL_MISSING}")

MiB = 1 << 20
BLOCK_SIZES = [4096, 64 * 1024]
TOTAL = 8 * MiB


def _children_of_us() -> list[tuple[int, str]]:
    """(pid, state) of every live or zombie process whose parent is this test process."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[1]) == me:
            found.append((int(entry.name), fields[0]))
    return found


def _check_result(result: dict, *, mem: str, op: str) -> None:
    assert result["impl"] == "nixl"
    assert result["version"] and result["version"] != "unknown"
    assert result["mem"] == mem and result["op"] == op
    assert [r["block_bytes"] for r in result["results"]] == BLOCK_SIZES
    for entry in result["results"]:
        bs = entry["block_bytes"]
        assert entry["nblocks"] == TOTAL // bs
        assert entry["total_bytes"] == TOTAL
        assert entry["iters"] == 2
        assert 0 < entry["seconds_min"] <= entry["seconds_median"] < 10
        assert entry["gbps"] == pytest.approx(TOTAL / entry["seconds_median"] / 1e9)
        assert 0.001 < entry["gbps"] < 1000
        assert entry["verified"] is True, f"bytes did not arrive as expected for {bs} B blocks"
    latency = result["latency_us"]
    assert latency["block_bytes"] == 4096
    assert 0 < latency["median"] <= latency["p99"] < 1e6
    assert result["verified"] is True


# ---------------------------------------------------------------------------------------------
# helpers (no NIXL needed)


def test_parse_size() -> None:
    assert cmp_nixl.parse_size("4K") == 4096
    assert cmp_nixl.parse_size("256M") == 256 * MiB
    assert cmp_nixl.parse_size("2MiB") == 2 * MiB
    assert cmp_nixl.parse_size("1g") == 1 << 30
    assert cmp_nixl.parse_size("123") == 123
    with pytest.raises(ValueError):
        cmp_nixl.parse_size("4 parsecs")


def test_layout_check_detects_wrong_placement() -> None:
    bs, n = 64, 32
    src = cmp_nixl._pattern(n * bs)
    perm = cmp_nixl._permutation(n, seed=0, permute=True)
    assert not np.array_equal(perm, np.arange(n))
    # write semantics: local block i lands in remote block perm[i]
    remote = np.empty_like(src)
    remote.reshape(n, bs)[perm] = src.reshape(n, bs)
    assert cmp_nixl._layout_ok(remote, src, bs, perm, source_is_local=True)
    assert not cmp_nixl._layout_ok(src, src, bs, perm, source_is_local=True)  # unpermuted copy
    corrupted = remote.copy()
    corrupted[5 * bs + 3] ^= 0xFF
    assert not cmp_nixl._layout_ok(corrupted, src, bs, perm, source_is_local=True)
    # read semantics: local block i receives remote block perm[i]
    local = src.reshape(n, bs)[perm].reshape(-1)
    assert cmp_nixl._layout_ok(local, src, bs, perm, source_is_local=False)


def test_block_descs() -> None:
    descs = cmp_nixl._block_descs(0x1000, 4096, 3, dev_id=7)
    assert descs.dtype == np.uint64 and descs.shape == (3, 3)
    assert descs[:, 0].tolist() == [0x1000, 0x2000, 0x3000]
    assert set(descs[:, 1].tolist()) == {4096} and set(descs[:, 2].tolist()) == {7}


def test_missing_nixl_reason_mentions_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ImportError("no module named nixl_cu12")

    monkeypatch.setattr(cmp_nixl, "_import_nixl_api", broken)
    reason = cmp_nixl.nixl_available()
    assert reason is not None and "pip install --no-deps nixl-cu12==1.5.1" in reason
    with pytest.raises(RuntimeError, match="nixl-cu12"):
        cmp_nixl.run_nixl(block_sizes=[4096], total=TOTAL)


def test_bad_arguments() -> None:
    with pytest.raises((ValueError, RuntimeError)):
        cmp_nixl.run_nixl(op="copy", block_sizes=[4096], total=TOTAL)
    with pytest.raises((ValueError, RuntimeError)):
        cmp_nixl.run_nixl(block_sizes=[2 * TOTAL], total=TOTAL)


# ---------------------------------------------------------------------------------------------
# end to end


@needs_nixl
@pytest.mark.timeout(180)
@pytest.mark.parametrize("op", ["write", "read"])
def test_dram_two_processes(op: str) -> None:
    result = cmp_nixl.run_nixl(mem="dram", op=op, block_sizes=BLOCK_SIZES, total=TOTAL, iters=2,
                               latency_samples=50, timeout=120)
    _check_result(result, mem="dram", op=op)
    assert result["backend"] == "UCX"
    assert _children_of_us() == []


@needs_nixl
@pytest.mark.timeout(180)
@pytest.mark.parametrize("op", ["write", "read"])
def test_file_posix(op: str, tmp_path: Path) -> None:
    result = cmp_nixl.run_nixl(mem="file", op=op, block_sizes=BLOCK_SIZES, total=TOTAL, iters=2,
                               latency_samples=50, timeout=120, file_dir=str(tmp_path))
    _check_result(result, mem="file", op=op)
    assert result["backend"] == "POSIX"
    assert list(tmp_path.iterdir()) == []  # the temporary file is gone


@needs_nixl
@pytest.mark.timeout(120)
def test_timeout_kills_children() -> None:
    with pytest.raises(RuntimeError, match="timed out|deadline|Timeout"):
        cmp_nixl.run_nixl(op="write", block_sizes=[4096], total=64 * MiB, iters=1000,
                          latency_samples=0, timeout=1.5)
    assert _children_of_us() == []


@needs_nixl
@pytest.mark.timeout(180)
def test_cli_prints_json() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kvx.compare.nixl", "--block-sizes", "4K,64K", "--total", "8M",
         "--op", "write", "--iters", "2", "--latency-samples", "50", "--timeout", "120"],
        capture_output=True, text=True, timeout=170, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    _check_result(result, mem="dram", op="write")
