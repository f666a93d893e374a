"""Tests of kvx_vllm against vLLM's own classes (run inside the plugin's venv: run_tests.sh)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import sys

import pytest

E2E = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "e2e")
if E2E not in sys.path:
    sys.path.insert(0, E2E)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama of issue 17 (random weights, seed 0), built locally once per session."""
    from tinymodel import build_model

    return build_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"))
