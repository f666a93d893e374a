"""The kvx PD transfer backend between a prefill and a decode process built from SGLang's classes.

Both processes load SGLang's plugins as SGLang does (``load_plugins()``), so
``--disaggregation-transfer-backend kvx`` resolves through our entry point; see pd_proc.py.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SUCCESS, FAILED = 4, 0
#: SGLang's heartbeat: every 2 s (its minimum), a prefill is dead after 2 missed beats.
HEARTBEAT_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
DEAD_PEER_BOUND = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, role: str, port: int, model: str, log: str, *extra: str, script: str = "pd_proc.py") -> None:
        env = dict(os.environ, **HEARTBEAT_ENV)
        self.err = open(log, "wb")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, script), role, str(port), model, *extra],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env, cwd=HERE)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.q.put(json.loads(line))
            except ValueError:
                pass
        self.q.put(None)

    def next(self, timeout: float) -> dict:
        ev = self.q.get(timeout=timeout)
        assert ev is not None, f"process exited (rc {self.p.poll()}); see {self.err.name}"
        return ev

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)
        self.err.close()


@pytest.fixture()
def model_dir(tmp_path):
    """A model directory with only a config: ServerArgs resolves it; no weights are loaded."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
           "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
           "head_dim": 16}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path / "model")


@pytest.mark.timeout(600)
def test_prefill_to_decode_success_aborts_and_dead_peers(tmp_path, model_dir):
    port = free_port()
    pre = Proc("prefill", port, model_dir, str(tmp_path / "prefill.log"))
    dec = Proc("decode", port, model_dir, str(tmp_path / "decode.log"))
    victim = Proc("decode", port, model_dir, str(tmp_path / "victim.log"), "victim")
    try:
        start = 300.0  # importing SGLang takes a while on a loaded 2-core machine
        assert pre.next(start)["event"] == "ready"
        assert dec.next(start)["event"] == "ready"
        # room 1: pages of every layer buffer and the aux row, byte for byte; nothing else touched
        p1, d1 = pre.next(60), dec.next(60)
        assert p1 == {**p1, "room": 1, "state": SUCCESS}
        assert d1 == {**d1, "room": 1, "state": SUCCESS, "kv_ok": True, "aux_ok": True, "untouched": True}
        # room 2: decode aborts after sending its page list -> both sides Failed
        p2, d2 = pre.next(60), dec.next(60)
        assert (p2["room"], p2["state"], d2["room"], d2["state"]) == (2, FAILED, 2, FAILED)
        # room 3: prefill aborts -> decode learns it at once, not at its waiting timeout
        p3, d3 = pre.next(60), dec.next(60)
        assert (p3["room"], p3["state"], d3["room"], d3["state"]) == (3, FAILED, 3, FAILED)
        assert d3["seconds"] < 10
        # room 5: its decode process dies after sending its page list -> the prefill's transfer fails
        assert pre.next(60) == {"event": "waiting", "room": 5}
        assert victim.next(300) == {"event": "waiting", "room": 5}
        victim.p.send_signal(signal.SIGKILL)
        victim.p.wait(timeout=30)
        assert pre.p.stdin is not None
        pre.p.stdin.write(b"send\n")
        pre.p.stdin.flush()
        p5 = pre.next(DEAD_PEER_BOUND + 30)
        assert (p5["room"], p5["state"]) == (5, FAILED) and p5["seconds"] < DEAD_PEER_BOUND
        # room 4: the prefill process dies mid-request -> decode reaches Failed within the bound
        assert pre.next(60) == {"event": "waiting", "room": 4}
        assert dec.next(60) == {"event": "waiting", "room": 4}
        pre.p.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        d4 = dec.next(DEAD_PEER_BOUND + 30)
        assert (d4["room"], d4["state"]) == (4, FAILED)
        assert d4["seconds"] < DEAD_PEER_BOUND and time.monotonic() - t0 < DEAD_PEER_BOUND
    finally:
        for p in (pre, dec, victim):
            p.stop()
