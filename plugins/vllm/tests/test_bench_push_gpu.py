"""``e2e/bench_push_gpu.py`` (push through the connector's worker, timed) on CPU: the script's
logic with a small shape, over the host and tcp backends, every mode landing the right bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e")
sys.path.insert(0, E2E)


def test_checksum_sees_every_bit_and_its_place() -> None:
    torch = pytest.importorskip("torch")
    from bench_push_gpu import checksum

    t = torch.randn(64, 2, 3, 8, dtype=torch.bfloat16)
    assert checksum(t) == checksum(t.clone())
    swapped = t.clone()
    swapped[[0, 1]] = t[[1, 0]]
    assert checksum(swapped) != checksum(t)  # same values, other places
    flipped = t.clone().view(torch.int16)
    flipped.view(-1)[100] ^= 1
    assert checksum(flipped.view(torch.bfloat16)) != checksum(t)  # one bit
    assert checksum(torch.ones(4, dtype=torch.float32)) != checksum(torch.ones(4, dtype=torch.float32) * 2)


def test_bench_push_gpu_on_cpu(tmp_path: object) -> None:
    pytest.importorskip("torch")
    out = os.path.join(str(tmp_path), "push.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(E2E, "..", "..", ".."), os.path.join(E2E, ".."),
                                                         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, os.path.join(E2E, "bench_push_gpu.py"), "--device", "cpu", "--tokens", "160",
                        "--iters", "1", "--json", out], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    with open(out) as f:
        rows = json.load(f)["rows"]
    got = {(x["backend"], x["mode"], x["tokens"]) for x in rows}
    assert got == {(b, m, n) for b in ("host", "tcp") for m in ("whole", "layer-wise", "layer-wise caller")
                   for n in (160,)}
    assert all(x["verified"] and x["prefill_ms"] > 0 and x["exposed_ms"] is not None for x in rows)
    assert "| tcp | 160 |" in r.stdout
