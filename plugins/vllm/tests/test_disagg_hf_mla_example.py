"""examples/disagg_hf_mla.py on CPU (the GPU machine runs it with ``--device cuda``): a transformers
DeepseekV3 (MLA) prefilled in one process, its latent cache moved through kvx in the connector's
plan (``kvx_vllm.plan.PeerTables``) between paged caches of different block sizes, greedy tokens
identical to one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
if not hasattr(pytest.importorskip("transformers"), "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3", allow_module_level=True)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "disagg_hf_mla.py")


def test_disagg_hf_mla_example_on_cpu() -> None:
    r = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--prompt-len", "70", "--new-tokens", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "token-identical to single-process generation" in r.stdout
    assert "via kvx backend 'host'" in r.stdout
    # 70 tokens in 16-token prefill blocks: 5 pieces per layer, 3 layers, into 32-token decode blocks
    assert "into 32-token blocks, 15 pieces" in r.stdout
    assert "MLA latent 512+64 per token x 3 layers" in r.stdout


def test_disagg_hf_mla_example_refuses_block_sizes_that_do_not_divide() -> None:
    r = subprocess.run([sys.executable, EXAMPLE, "--device", "cpu", "--prefill-block", "16", "--decode-block", "24"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "smaller must divide the larger" in r.stderr
