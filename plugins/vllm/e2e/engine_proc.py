"""One real vLLM engine (``vllm.LLM``, in-process engine core) driven over stdin/stdout.

Started by the real-engine tests and the P/D benchmark, one process per engine::

    python engine_proc.py '{"model": DIR, "role": "kv_producer", "extra": {...}, ...}'

It answers one JSON line per command line (prompts are token ids, sampling is greedy):

- ``{"cmd": "generate", "prompts": [[ids], ...], "max_tokens": n, "params": [kv_transfer_params | null, ...]}``
  -> ``{"outputs": [{"tokens", "kv_transfer_params", "num_cached_tokens", "ttft_s"}], ...}``
- ``{"cmd": "drain", "timeout": s}``: step the engine until every KV block is free again (the
  prefill side frees a request's blocks once its decode instance has read them) or ``timeout``;
- ``{"cmd": "remote"}``: the offload stores' remote tier (the pool) counters, per KV cache group;
  ``{"cmd": "forget_local"}``: drop every block of the offload stores' local tiers;
- ``{"cmd": "spoil", "on": true}``: from now on, blocks this (decode) engine pulls are
  overwritten with noise after they arrive and before the model reads them (negative control);
- ``{"cmd": "lease", "seconds": s}``: the (prefill) connector's lease for requests finishing from now on;
- ``{"cmd": "push_wait", "seconds": s}``: the (prefill) connector's ``push_wait_s`` from now on;
- ``{"cmd": "push_group", "layers": n}``: layers per push write from now on (0: the whole request);
- ``{"cmd": "reset_prefix_cache"}``, ``{"cmd": "stats"}``, ``{"cmd": "quit"}``.

``tp`` > 1 runs ``tensor_parallel_size`` worker processes (``VLLM_CPU_OMP_THREADS_BIND`` lists a
core per rank, ``"0|1"``); ``stats`` then has no worker counters (they live in the workers) but
still ``external``: the prompt tokens the scheduler took from the connector.

Every answer carries ``free`` and ``initial``: free KV blocks now and when the engine started.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the answers
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    opts = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    kw: dict[str, Any] = dict(model=opts["model"], enforce_eager=True, skip_tokenizer_init=True,
                              block_size=int(opts.get("block_size", 32)),
                              max_model_len=int(opts.get("max_model_len", 256)),
                              num_gpu_blocks_override=int(opts.get("num_blocks", 64)),
                              dtype=opts.get("dtype", "float32"),
                              seed=0, max_num_seqs=int(opts.get("max_num_seqs", 32)),
                              max_num_batched_tokens=int(opts.get("max_num_batched_tokens", 8192)))
    tp = int(opts.get("tp", 1))
    if tp > 1:
        # worker processes of their own (vllm-cpu binds each to the cores VLLM_CPU_OMP_THREADS_BIND
        # lists for it, "0|1"); the worker-side connectors live there, not in this process
        kw.update(tensor_parallel_size=tp, distributed_executor_backend="mp")
    role = opts.get("role")
    if role:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=opts.get("connector", "KVXConnector"),
            kv_connector_module_path=opts.get("module", "kvx_vllm") or None, kv_role=role,
            engine_id=opts.get("engine_id"), kv_buffer_device=opts.get("kv_buffer_device", "cpu"),
            kv_connector_extra_config=opts.get("extra", {}),
            kv_load_failure_policy=opts.get("failure_policy", "fail"))
    if opts.get("events_endpoint"):
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=opts["events_endpoint"], topic="kv")
    t0 = time.monotonic()
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core  # in-process EngineCore (no multiprocessing)
    pool = core.scheduler.kv_cache_manager.block_pool
    initial = pool.get_num_free_blocks()
    spoil = {"on": False}
    pull_times: dict[str, list[float]] = {}  # request id -> [start, end] of its pull (decode side)
    worker_conn = None
    if role and tp == 1:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker_conn = get_kv_transfer_group()
        kvw = getattr(worker_conn, "worker", None)
        if kvw is not None:
            _patch_spoil(kvw, spoil)
        _time_pulls(worker_conn, pull_times)

    external = {"tokens": 0, "requests": 0}
    sched_conn = core.scheduler.connector if role else None
    if sched_conn is not None:
        # prompt tokens the scheduler took from the connector (a decode engine's pulled tokens)
        after_alloc = sched_conn.update_state_after_alloc

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens > 0:
                external["tokens"] += int(num_external_tokens)
                external["requests"] += 1
            after_alloc(request, blocks, num_external_tokens)

        sched_conn.update_state_after_alloc = update_state_after_alloc

    def state() -> dict[str, Any]:
        return {"free": pool.get_num_free_blocks(), "initial": initial}

    _reply({"ready": True, "startup_s": time.monotonic() - t0, **state()})
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "generate":
            prompts = cmd["prompts"]
            params = cmd.get("params") or [None] * len(prompts)
            sps = []
            for p in params:
                extra = {"kv_transfer_params": p} if p is not None else None
                sps.append(SamplingParams(temperature=0.0, max_tokens=int(cmd.get("max_tokens", 8)), ignore_eos=True,
                                          extra_args=extra))
            t = time.monotonic()
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sps, use_tqdm=False)
            wall = time.monotonic() - t
            res = []
            for o in outs:
                m = o.metrics
                ttft = None
                if m is not None and getattr(m, "first_token_latency", None):
                    ttft = float(m.first_token_latency)
                res.append({"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
                            "kv_transfer_params": o.kv_transfer_params, "num_cached_tokens": o.num_cached_tokens,
                            "ttft_s": ttft})
            _reply({"outputs": res, "wall_s": wall, **state()})
        elif c == "drain":
            end = time.monotonic() + float(cmd.get("timeout", 10))
            while pool.get_num_free_blocks() != initial and time.monotonic() < end:
                core.step()
                time.sleep(0.01)
            _reply(state())
        elif c == "remote":
            # the offload stores' remote tier (a kvx pool) as each store sees it, per KV cache group
            kvw = getattr(worker_conn, "worker", None)
            _reply({str(g): st.store.stats().remote for g, st in (kvw._stores.items() if kvw is not None else ())})
        elif c == "forget_local":
            # drop every block of the offload stores' local tiers (a remote tier keeps its own)
            kvw = getattr(worker_conn, "worker", None)
            n = sum(st.store.delete(list(st.store._where)) for st in (kvw._stores.values() if kvw is not None else ()))
            _reply({"dropped": n, **state()})
        elif c == "spoil":
            spoil["on"] = bool(cmd.get("on", True))
            _reply(state())
        elif c == "lease":
            # the scheduler-side connector's lease for requests finished from now on
            import dataclasses

            ks = getattr(core.scheduler.connector, "scheduler", None)
            ks.cfg = dataclasses.replace(ks.cfg, lease_s=float(cmd["seconds"]))
            _reply(state())
        elif c == "push_wait":
            import dataclasses

            ks = getattr(core.scheduler.connector, "scheduler", None)
            ks.cfg = dataclasses.replace(ks.cfg, push_wait_s=float(cmd["seconds"]))
            _reply(state())
        elif c == "push_group":
            # the (prefill, TP 1) connector's layers per push write from now on: 0 = whole request
            from kvx_vllm.push import LayerPusher

            pp = getattr(getattr(worker_conn, "worker", None), "push_prefill", None)
            n = int(cmd["layers"]) or len(pp.pusher.names)
            pp.pusher.close()
            pp.pusher = LayerPusher(pp.w.agent, pp.pusher.names, group=n, timeout=pp.pusher.timeout)
            _reply(state())
        elif c == "reset_prefix_cache":
            ok = llm.reset_prefix_cache()
            _reply({"ok": bool(ok), **state()})
        elif c == "stats":
            kvw = getattr(worker_conn, "worker", None)
            tiers = {str(g): st.store.stats().tiers for g, st in (kvw._stores.items() if kvw is not None else ())}
            ks = getattr(core.scheduler.connector, "scheduler", None)
            known = len(getattr(ks, "_stored", ()))  # blocks the scheduler knows kvx holds
            done = {r: t[1] - t[0] for r, t in pull_times.items() if len(t) == 2}
            pp = getattr(kvw, "push_prefill", None)
            _reply({"connector": dict(kvw.stats) if kvw is not None else {}, "tiers": tiers, "external": external,
                    "push": dict(pp.stats) if pp is not None else {},
                    "scheduler_known_blocks": known, "pull_s": done,
                    "layer_steps": list(getattr(kvw, "layer_steps", [])),
                    "whole_loads": list(getattr(kvw, "whole_loads", [])), **state()})
        elif c == "quit":
            del llm
            _reply({"bye": True})
            return
        else:
            _reply({"error": f"unknown command {c!r}"})


def _time_pulls(conn: Any, times: dict[str, list[float]]) -> None:
    """Record, per request, when the worker-side connector starts loading its KV and when it
    reports it received: the decode side's pull time, measured the same way for any connector
    (KVXConnector's metadata lists ``recv``, NixlConnector's ``reqs_to_recv``)."""
    start, results = conn.start_load_kv, conn.get_transfer_results

    def start_load_kv(forward_context: Any, **kw: Any) -> None:
        meta = conn._get_connector_metadata() if conn.has_connector_metadata() else None
        ids = [r.req_id for r in getattr(meta, "recv", ())] + list(getattr(meta, "reqs_to_recv", {}) or {})
        now = time.perf_counter()
        for rid in ids:
            times.setdefault(rid, [now])
        start(forward_context, **kw)

    def get_transfer_results(finished_req_ids: set[str]) -> Any:
        res = results(finished_req_ids)
        now = time.perf_counter()
        for rid in res.finished_recving or ():
            if rid in times and len(times[rid]) == 1:
                times[rid].append(now)
        return res

    conn.start_load_kv = start_load_kv
    conn.get_transfer_results = get_transfer_results


def _patch_spoil(kvw: Any, spoil: dict[str, bool]) -> None:
    """Negative control: while ``spoil["on"]``, overwrite the blocks of every request whose pull
    the worker reports received, before the model reads them."""
    import torch

    start, results = kvw.start_load_kv, kvw.get_transfer_results
    blocks: dict[str, list[int]] = {}

    def start_load_kv(meta: Any) -> None:
        for spec in meta.recv:
            blocks[spec.req_id] = [b for g in spec.local_block_ids for b in g]
        start(meta)

    def get_transfer_results(finished: set[str], *args: Any) -> Any:
        sending, recving, failed = results(finished, *args)
        for rid in recving:
            ids = blocks.pop(rid, [])
            if spoil["on"] and ids:
                for t in kvw._kv_refs:
                    t[ids] = torch.randn_like(t[ids]) * 4
        return sending, recving, failed

    kvw.start_load_kv = start_load_kv
    kvw.get_transfer_results = get_transfer_results


if __name__ == "__main__":
    main()
