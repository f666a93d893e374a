"""examples/disagg_hf.py's logic on CPU (the GPU machine runs it with ``--device cuda``): two
processes, KV pulled through kvx, greedy tokens identical to one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from engines import why_no_cpu_engine

if why_no_cpu_engine():
    pytest.skip(why_no_cpu_engine(), allow_module_level=True)

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples", "disagg_hf.py")


def test_disagg_hf_example_on_cpu() -> None:
    r = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--prompt-len", "70", "--new-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "token-identical to single-process generation" in r.stdout
    assert "via kvx backend 'host'" in r.stdout
    assert "KV cache   : " in r.stdout and "GB/s" in r.stdout
