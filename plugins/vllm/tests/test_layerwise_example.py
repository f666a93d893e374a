"""examples/disagg_layerwise.py's logic on CPU in the plugin's venv (which has transformers; the
main test venv does not, so tests/test_layerwise.py skips there): two processes, the KV pushed
whole and layer by layer through kvx_vllm.push, greedy tokens identical to one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "disagg_layerwise.py")


def test_disagg_layerwise_example_on_cpu(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "lw.json")
    r = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--prompt-lens", "80", "--reps", "1",
                        "--new-tokens", "4", "--modes", "whole,layer:1,layer:3", "--json", out],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens identical to single-process generation in every run" in r.stdout
    with open(out) as f:
        doc = json.load(f)
    writes = {(run["backend"], run["mode"]): run["writes"] for run in doc["runs"]}
    assert writes == {(b, m): n for b in ("host", "tcp") for m, n in (("whole", 1), ("layer:1", 4), ("layer:3", 2))}
    assert all(run["identical"] for run in doc["runs"])
    assert all(run["first_post_before_end_ms"] > 0 for run in doc["runs"] if run["mode"] == "layer:1")
