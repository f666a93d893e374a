"""The gds backend (kvikio/cuFile). GPU tests run on a GPU machine with GDS (make gpu-check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.backends.gds import GdsBackend


def test_unavailable_reason_is_clear_or_none() -> None:
    why = GdsBackend.unavailable_reason()
    if why is not None:
        assert ("pip install kvx[gds]" in why or "CUDA" in why or "GPUDirect" in why), why
    else:
        assert GdsBackend.mode() in ("gds", "compat")


def test_agent_without_gds_still_serves_files(tmp_path: Path) -> None:
    if GdsBackend.unavailable_reason() is None:
        pytest.skip("gds is available here")
    with kvx.Agent("g") as a:  # every available backend: gds is skipped, posix serves the file
        assert "gds" not in [b.name for b in a.backends]
        s = a.register(kvx.FileRegion(tmp_path / "kv.bin", 8192))
        m = a.register(np.arange(8192, dtype=np.uint8))
        x = a.write(a.prepare(kvx.DescList.blocks(m, 4096)), [0, 1], a.prepare(kvx.DescList.blocks(s, 4096)), [1, 0])
        assert x.wait(10).backend == "posix"
    with pytest.raises(kvx.BackendUnavailable, match="gds"):
        kvx.Agent("g2", kvx.AgentConfig(backends=("gds",)))


def _cuda_buffer(n: int) -> Any:
    cupy = pytest.importorskip("cupy")
    return cupy.zeros(n, dtype=cupy.uint8)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [4096, 65536, 4099, 1 << 20])
def test_gds_write_then_read_permuted(tmp_path: Path, bs: int) -> None:
    if (why := GdsBackend.unavailable_reason()) is not None:
        pytest.skip(why)
    import cupy

    n = 32
    host = np.random.default_rng(bs).integers(0, 256, n * bs, dtype=np.uint8)
    dev = _cuda_buffer(n * bs)
    dev.set(host)
    with kvx.Agent("gds", kvx.AgentConfig(backends=("gds",))) as a:
        s = a.register(kvx.FileRegion(tmp_path / "kv.bin", n * bs))
        m = a.register(dev)
        mem = a.prepare(kvx.DescList.blocks(m, bs))
        sto = a.prepare(kvx.DescList.blocks(s, bs))
        perm = np.random.default_rng(1).permutation(n)
        x = a.write(mem, np.arange(n), sto, perm)
        x.wait(60)
        assert x.backend == "gds"
        exp = np.empty_like(host)
        exp.reshape(n, bs)[perm] = host.reshape(n, bs)
        assert (tmp_path / "kv.bin").read_bytes() == exp.tobytes()
        dev[:] = 0
        cupy.cuda.runtime.deviceSynchronize()
        a.read(mem, np.arange(n), sto, perm).wait(60)
        assert np.array_equal(cupy.asnumpy(dev), host)


@pytest.mark.gpu
def test_gds_release_then_post_is_refused(tmp_path: Path) -> None:
    if (why := GdsBackend.unavailable_reason()) is not None:
        pytest.skip(why)
    dev = _cuda_buffer(1 << 20)
    with kvx.Agent("gds", kvx.AgentConfig(backends=("gds",))) as a:
        s = a.register(kvx.FileRegion(tmp_path / "kv.bin", 1 << 20))
        mem = a.prepare(kvx.DescList.blocks(a.register(dev), 4096))
        sto = a.prepare(kvx.DescList.blocks(s, 4096))
        a.write(mem, np.arange(256), sto, np.arange(256)).wait(30)
        s.release()
        with pytest.raises(kvx.UsageError):
            a.write(mem, [0], sto, [0])


@pytest.mark.gpu
def test_bench_gds_runs_and_verifies(tmp_path: Path) -> None:
    """``kvx bench --backend gds``: both paths, both directions, every point verified."""
    if (why := GdsBackend.unavailable_reason()) is not None:
        pytest.skip(why)
    from kvx import bench

    opts = bench.BenchOptions(backend="gds", total=4 << 20, block_sizes=[65536, 1 << 20], iters=1,
                              path=str(tmp_path))
    _hdr, rows = bench.run(opts, quiet=True)
    got = {(r["impl"], r["op"], r["block_bytes"]) for r in rows if r.get("verified")}
    assert got == {(i, o, b) for i in ("kvx-gds", "kvx-bounce") for o in ("write", "read") for b in (65536, 1 << 20)}
    assert list(tmp_path.iterdir()) == []  # the bench's files are gone


def test_bench_gds_refused_clearly_without_gds() -> None:
    """On a machine without the gds backend ``kvx bench --backend gds`` says why and exits 2."""
    if GdsBackend.unavailable_reason() is None:
        pytest.skip("gds is available here")
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvx.cli", "bench", "--backend", "gds", "--total", "4M"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "gds backend is not available here" in r.stderr and "Traceback" not in r.stderr
