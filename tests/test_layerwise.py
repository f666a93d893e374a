"""examples/disagg_layerwise.py: layer-wise KV streaming (prefill pushes each layer's KV through kvx
while later layers compute) against the whole-request write.

On CPU (tiny Llama shape, fp32, kvx ``host`` and ``tcp``): two processes, greedy tokens identical
to one process after every run, one write per group of layers, the first layer-wise write posted
before the forward pass ended. On two GPUs (marked ``gpu``): the same through ``cuda`` and ``tcp``
on a short prompt. Needs torch and transformers (the vLLM plugin's venv has both); skipped without.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "disagg_layerwise.py")


def run_example(tmp_path: object, *args: str) -> dict:
    out = os.path.join(str(tmp_path), "lw.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, EXAMPLE, *args, "--json", out], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens identical to single-process generation in every run" in r.stdout
    with open(out) as f:
        return json.load(f)


def test_layerwise_on_cpu(tmp_path: object) -> None:
    doc = run_example(tmp_path, "--device", "cpu", "--prompt-lens", "96", "--reps", "1", "--new-tokens", "4",
                      "--modes", "whole,layer:1,layer:3")
    layers = doc["config"]["num_hidden_layers"]
    assert layers == 4
    runs = doc["runs"]
    assert {(r["backend"], r["mode"]) for r in runs} == {(b, m) for b in ("host", "tcp")
                                                         for m in ("whole", "layer:1", "layer:3")}
    for r in runs:
        assert r["identical"] is True
        assert r["kv_bytes"] == layers * 2 * 2 * 96 * 32 * 4  # layers, k|v, kv heads, tokens, head_dim, fp32
        assert r["via"] == r["backend"]
        assert r["transfer_ms"] > 0 and r["exposed_ms"] >= 0
        want = {"whole": 1, "layer:1": 4, "layer:3": 2}[r["mode"]]
        assert r["writes"] == want, r
        if r["mode"] == "layer:1":
            # streamed: layer 0's write went out while layers 1-3 were still to compute
            assert r["first_post_before_end_ms"] > 0, r
        if r["mode"] == "whole":
            assert r["first_post_before_end_ms"] <= 0, r
    rows = doc["summary"]
    assert len(rows) == 2 and all(row["identical"] for row in rows)
    assert all(row["best_mode"] in ("layer:1", "layer:3") for row in rows)


def test_bad_mode_is_refused(tmp_path: object) -> None:
    r = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--modes", "layer:0"],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode != 0 and "mode must be" in r.stderr


@pytest.mark.gpu
def test_layerwise_on_two_gpus(tmp_path: object) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    doc = run_example(tmp_path, "--prompt-lens", "4096", "--reps", "1", "--modes", "whole,layer:1,layer:4")
    assert doc["identical"] is True
    assert {r["via"] for r in doc["runs"]} == {"cuda", "tcp"}
