"""Start and drive real vLLM engines in processes of their own (see ``engine_proc.py``)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
PROC = os.path.join(HERE, "engine_proc.py")


class EngineProcess:
    """One engine process; ``call`` sends a command and waits (bounded) for its answer.

    Parameters
    ----------
    opts
        ``engine_proc.py``'s options (model, role, extra, block_size, num_blocks, ...).
    core
        The CPU core its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``).
    log
        File its stderr (vLLM's log) goes to.
    """

    def __init__(self, opts: dict[str, Any], core: int | str = 0, log: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.opts = opts
        self.log_path = log
        self._log = open(log, "w") if log else subprocess.DEVNULL  # closed in close()
        # vLLM seeds its block hashes from PYTHONHASHSEED (random when unset): a restarted engine
        # finds its blocks in a kvx tier only under the same seed
        e = {**os.environ, "PYTHONHASHSEED": "0", "VLLM_CPU_OMP_THREADS_BIND": str(core), **(env or {})}
        self.proc = subprocess.Popen([sys.executable, PROC, json.dumps(opts)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=e)
        self.hello: dict[str, Any] | None = None

    def ready(self, timeout: float = 600) -> dict[str, Any]:
        """Wait for the engine to be up; returns its first answer."""
        if self.hello is None:
            self.hello = self._read(timeout)
        return self.hello

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout
        while True:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not r:
                raise TimeoutError(f"engine {self.opts.get('role') or 'plain'} did not answer within {timeout} s"
                                   f"{self._tail()}")
            line = self.proc.stdout.readline()
            if not line:
                raise EOFError(f"engine exited ({self.proc.poll()}){self._tail()}")
            if line.startswith("{"):
                res = json.loads(line)
                if "error" in res:
                    raise RuntimeError(res["error"])
                return res

    def _tail(self) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return "; its log ends:\n" + "".join(f.readlines()[-15:])
        except OSError:
            return ""

    def send(self, **cmd: Any) -> None:
        """Send one command without waiting for its answer (read it later with ``_read``): two
        engines can then be given their requests at once."""
        self.ready()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 300, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self._read(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, params: list[Any] | None = None,
                 timeout: float = 300) -> dict[str, Any]:
        return self.call(timeout, cmd="generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call(30, cmd="quit")
                self.proc.wait(30)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        finally:
            if self._log is not subprocess.DEVNULL:
                self._log.close()


def push_endpoint(prefill: EngineProcess, decode: EngineProcess, tokens: list[int]) -> dict[str, Any]:
    """The prefill engine's kvx endpoint, from a pull-mode answer for prompt ``tokens`` (as the
    proxy learns it: a prefill server's first request goes by pull, which a push-mode decode
    engine still serves); the decode engine pulls it once, then its prefix cache is reset."""
    from kvx_vllm.proxy import ENDPOINT_KEYS

    out = prefill.generate([tokens], max_tokens=1, params=[{"do_remote_decode": True}])
    params = out["outputs"][0]["kv_transfer_params"]
    assert params and all(k in params for k in ENDPOINT_KEYS), params
    assert decode.generate([tokens], max_tokens=2, params=[params])["outputs"][0]["finish"] == "length"
    assert decode.call(cmd="reset_prefix_cache")["ok"]
    return params  # type: ignore[no-any-return]


def pushed_equals_plain(prefill: EngineProcess, decode: EngineProcess, ep: dict[str, Any], prompts: list[list[int]],
                        max_tokens: int, label: str) -> None:
    """The decode engine's own greedy tokens for ``prompts`` (its prefix cache reset after), then
    the same prompts pushed from ``prefill`` (endpoint ``ep``, from :func:`push_endpoint`): both
    engines get them at once, decode first, as the proxy's ``--mode push`` sends them. Checks
    that every request ran to its length with the plain tokens, that every prompt token came from
    the connector, and that both engines free every block again (the prefill stepped until its
    writes are done: an offline engine steps only while asked to)."""
    from kvx_vllm.proxy import push_params

    want = [o["tokens"] for o in decode.generate(prompts, max_tokens=max_tokens)["outputs"]]
    assert len({tuple(t) for t in want}) == len(want)
    assert decode.call(cmd="reset_prefix_cache")["ok"]
    pairs = [push_params(ep, uuid.uuid4().hex) for _ in prompts]
    ext0 = decode.call(cmd="stats")["external"]
    decode.send(cmd="generate", prompts=prompts, max_tokens=max_tokens, params=[d for _p, d in pairs])
    prefill.send(cmd="generate", prompts=prompts, max_tokens=1, params=[p for p, _d in pairs])
    pre = prefill._read(300)
    r = prefill.call(cmd="drain", timeout=60)
    assert r["free"] == r["initial"]
    got = decode._read(300)
    assert [o["finish"] for o in pre["outputs"]] == ["length"] * len(prompts)
    assert [o["finish"] for o in got["outputs"]] == ["length"] * len(prompts), [o["finish"] for o in got["outputs"]]
    for p, w, o in zip(prompts, want, got["outputs"]):
        assert o["tokens"] == w, f"{label} push, prompt of {len(p)} tokens: {o['tokens']} != plain {w}"
    ext = decode.call(cmd="stats")["external"]
    # every prompt token came from the connector (vLLM recomputes the last one's logits itself)
    assert ext["tokens"] - ext0["tokens"] == sum(len(p) for p in prompts)
    assert ext["requests"] - ext0["requests"] == len(prompts)
    r = decode.call(cmd="drain", timeout=30)
    assert r["free"] == r["initial"]


def why_no_cpu_engine() -> str | None:
    """Why real vLLM engines cannot run on this CPU-only machine (None: they can)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "real engines run on the CPU build of vLLM (vllm-cpu); this venv has another build"
    return None
