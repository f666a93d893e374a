"""Pull time across TP sizes and layouts through the connector's worker (``KVXWorker``), on GPUs.

Every TP rank is a process of its own holding a Llama-3-8B-shaped KV cache (32 layers, 8 KV heads,
head_dim 128, bf16, 16-token blocks; a TP 2 rank holds 4 heads) or a DeepSeek-V3-shaped MLA latent
(576 values per token, bf16), in vLLM's layouts: HND ``[blocks, heads, 16, 256]``, NHD
``[2, blocks, 16, heads, 128]``, MLA ``[blocks, 16, 576]``. The ranks run the real
``kvx_vllm.worker.KVXWorker`` (vLLM's configs replaced by the few fields the worker reads, so no
vLLM is needed): prefill ranks register and serve, decode ranks pull with ``start_load_kv`` and
poll ``get_transfer_results`` -- descriptor lists from ``kvx_vllm.plan``, one kvx read per
(decode rank, prefill rank) pair, then the blocks' generation words. A pull is timed inside the
decode rank from ``start_load_kv`` until the request is reported received, and every decode rank's
blocks are compared with the request's KV on the GPU.

Cases (GPU of each rank in brackets)::

    same   prefill TP1 [0]      -> decode TP1 [1]        (the reference: all heads, one pull)
    1to2   prefill TP1 [0]      -> decode TP2 [1, 0]     (each decode rank reads a head slice)
    2to1   prefill TP2 [0, 1]   -> decode TP1 [1]        (the decode rank reads from two ranks)
    2to2   prefill TP2 [0, 1]   -> decode TP2 [1, 0]

Run on a machine with 2 GPUs (after ``python setup.py build_ext --inplace``)::

    PYTHONPATH=.:plugins/vllm python plugins/vllm/e2e/bench_tp_gpu.py

``--compare nixl`` adds NIXL moving the same head slices of the HND cache the way vLLM's
NixlConnector plans them (``nixl_tp.py``: its descriptor lists, one READ per rank pair, the same
block ids, placement and timing), after kvx's ranks are gone; the table gains NIXL's columns and
``kvx / NIXL`` (NIXL's pull time over kvx's). NIXL comes from an installed ``nixl-cu13`` /
``nixl-cu12`` or from ``.carry/gpu-site.tar.xz`` (``bash scripts/gpu_carry.sh`` where pip works)::

    PYTHONPATH=.:plugins/vllm python plugins/vllm/e2e/bench_tp_gpu.py --layouts HND --compare nixl

``--device cpu`` runs the same on host memory with a small shape (a check of the script; NIXL then
moves ``DRAM`` over UCX). The exit status is 1 when any pull failed or moved wrong bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from types import SimpleNamespace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------
# one rank

class _Model:
    """The fields of vLLM's ModelConfig that ``compat_info`` reads."""

    def __init__(self, layers: int, kv_heads: int, head_size: int, mla: bool) -> None:
        self.served_model_name = "bench-llama3-8b-shape" if not mla else "bench-deepseek-v3-shape"
        self.model = self.served_model_name
        self.hf_config = SimpleNamespace(architectures=["Bench"])
        self.dtype = "bfloat16"
        self.use_mla = mla
        self._l, self._h, self._d = layers, kv_heads, head_size

    def get_num_layers(self, _pc: Any) -> int:
        return self._l

    def get_total_num_kv_heads(self) -> int:
        return self._h

    def get_head_size(self) -> int:
        return self._d


def cells(layout: str, t: Any, d: int) -> Any:
    """A cache as ``[blocks, planes, block_size, heads, d]`` (a view)."""
    if layout == "HND":
        b, h, n, _ = t.shape
        return t.view(b, h, n, 2, d).permute(0, 3, 2, 1, 4)
    if layout == "NHD":
        return t.permute(1, 0, 2, 3, 4)
    return t[:, None, :, None, :]


def request_kv(layer: int, tokens: int, seed: int, planes: int, heads: int, d: int, dev: Any) -> Any:
    """A request's KV of one layer, all heads, ``[tokens, planes, heads, d]`` bf16 (seeded)."""
    import torch

    g = torch.Generator(device=dev).manual_seed(seed * 1000 + layer)
    return torch.randn(tokens, planes, heads, d, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)


def token_places(ids: list[int], tokens: int, bs: int, dev: Any) -> tuple[Any, Any]:
    """(block, offset in block) of every token of a request in blocks ``ids``."""
    import torch

    t = torch.arange(tokens, device=dev)
    return torch.as_tensor(ids, device=dev)[t // bs], t % bs


def worker_configs(o: dict[str, Any], layers: int, heads: int, head_size: int, rank_heads: int, mla: bool,
                   tp: int) -> tuple[list[str], Any, Any]:
    """``(layer names, vllm_config, kv_cache_config)``: the fields of vLLM's configs that
    ``KVXWorker`` reads, for a rank holding ``rank_heads`` of ``heads`` KV heads (``o``: the rank's
    options, ``role``, ``engine`` and ``block``)."""
    bs = o["block"]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = SimpleNamespace(block_size=bs, num_kv_heads=rank_heads, head_size=head_size)
    vc = SimpleNamespace(model_config=_Model(layers, heads, head_size, mla),
                         cache_config=SimpleNamespace(block_size=bs, cache_dtype="auto"),
                         parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                         kv_transfer_config=SimpleNamespace(kv_role=o["role"], engine_id=o["engine"]))
    kcc = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=names, kv_cache_spec=spec)],
                          prefix_cacheable_group_ids=(0,))
    return names, vc, kcc


def _rank(conn: Any, o: dict[str, Any]) -> None:
    import torch

    sys.path.insert(0, os.path.dirname(HERE))
    from kvx_vllm.config import KVXConnectorConfig
    from kvx_vllm.metadata import KVXConnectorMetadata, RecvSpec, SendSpec
    from kvx_vllm.plan import heads_of
    from kvx_vllm.util import compat_info, remote_params
    from kvx_vllm.worker import KVXWorker

    dev = torch.device("cuda", o["gpu"]) if o["device"] == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    layout, mla = o["layout"], o["layout"] == "MLA"
    L, H, D, bs, nb, tp, rank = o["layers"], o["heads"], o["head_dim"], o["block"], o["blocks"], o["tp"], o["rank"]
    if mla:
        H, D = 1, o["latent"]
    h0, nh = (0, 1) if mla else heads_of(H, tp, rank)
    planes = 1 if mla else 2
    names, vc, kcc = worker_configs(o, L, H, D, nh, mla, tp)
    cfg = KVXConnectorConfig.from_extra({"load_timeout_s": 300, "lease_s": 3600})
    w = KVXWorker(vc, kcc, cfg, tp_rank=rank)  # type: ignore[arg-type]
    dt = torch.bfloat16
    caches = {}
    for n in names:
        if mla:
            caches[n] = torch.zeros(nb, bs, D, dtype=dt, device=dev)
        elif layout == "HND":
            caches[n] = torch.zeros(nb, nh, bs, 2 * D, dtype=dt, device=dev)
        else:
            caches[n] = torch.zeros(2, nb, bs, nh, D, dtype=dt, device=dev)
    w.register_kv_caches(caches)

    def kv(layer: int, tokens: int, seed: int) -> Any:
        return request_kv(layer, tokens, seed, planes, H, D, dev)

    def place(ids: list[int], tokens: int) -> tuple[Any, Any]:
        return token_places(ids, tokens, bs, dev)

    hs = w.handshake_metadata()
    conn.send_bytes(json.dumps({"ready": True, "hs": hs.__dict__ if hs is not None else None}).encode())
    while True:
        cmd = json.loads(conn.recv_bytes())
        c = cmd["cmd"]
        if c == "fill":  # prefill: write the request's KV into blocks, start the lease, make params
            blk, pos = place(cmd["blocks"], cmd["tokens"])
            for i, n in enumerate(names):
                cells(layout, caches[n], D)[blk, :, pos] = kv(i, cmd["tokens"], cmd["seed"])[:, :, h0:h0 + nh]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            w.wait_for_save(KVXConnectorMetadata(send=[SendSpec(cmd["rid"], 3600.0, cmd["lease"], cmd["blocks"])]))
            conn.send_bytes(json.dumps({"ok": True}).encode())
        elif c == "params":  # prefill rank 0: the scheduler half's kv_transfer_params
            from kvx_vllm.metadata import KVXHandshakeMetadata

            workers = {int(r): KVXHandshakeMetadata(**m) for r, m in cmd["workers"].items()}
            p = remote_params(engine_id=o["engine"], request_id=cmd["rid"], block_ids=[cmd["blocks"]],
                              workers=workers, num_tokens=cmd["tokens"], tp_size=tp, lease=cmd["lease"],
                              compat=compat_info(vc), host="127.0.0.1", port=0)  # type: ignore[arg-type]
            conn.send_bytes(json.dumps({"params": p}).encode())
        elif c == "poll":  # prefill: handle notifications (frees what decode has read)
            sending, _r, _f = w.get_transfer_results(set(cmd["rids"]))
            conn.send_bytes(json.dumps({"freed": sorted(sending)}).encode())
        elif c == "pull":  # decode: the connector's pull, timed
            lids = cmd["blocks"]
            recv = RecvSpec(cmd["rid"], [lids], [cmd["remote"]], cmd["params"], [list(range(len(lids)))])
            p0 = w.stats["post_s"]
            t0 = time.perf_counter()
            w.start_load_kv(KVXConnectorMetadata(recv=[recv]))
            while True:
                _s, recving, failed = w.get_transfer_results(set())
                if cmd["rid"] in recving:
                    break
            el = time.perf_counter() - t0
            bad = w.get_block_ids_with_load_errors()
            ok = None
            if cmd.get("verify"):
                blk, pos = place(lids, cmd["tokens"])
                ok = all(torch.equal(cells(layout, caches[n], D)[blk, :, pos],
                                     kv(i, cmd["tokens"], cmd["seed"])[:, :, h0:h0 + nh]) for i, n in enumerate(names))
            nbytes = cmd["tokens"] * planes * nh * D * 2 * L
            conn.send_bytes(json.dumps({"s": el, "post_s": w.stats["post_s"] - p0, "failed": sorted(bad), "ok": ok,
                                        "bytes": nbytes,
                                        "stats": w.stats}).encode())
        elif c == "quit":
            w.shutdown()
            conn.send_bytes(b"{}")
            return


def _serve(conn: Any, o: dict[str, Any], impl: str) -> None:
    """A rank process: kvx's rank, NIXL's, or a push rank (``bench_push_gpu.py``); whatever it raises
    goes to the parent before it exits."""
    try:
        if impl == "nixl":
            from nixl_tp import nixl_rank

            nixl_rank(conn, o)
        elif impl == "push":
            from bench_push_gpu import push_rank

            push_rank(conn, o)
        else:
            _rank(conn, o)
    except BaseException as exc:
        try:
            conn.send_bytes(json.dumps({"error": f"{type(exc).__name__}: {exc}",
                                        "trace": traceback.format_exc()[-3000:]}).encode())
        except Exception:
            pass
        raise


class Rank:
    """One rank process (``impl``: kvx's worker, NIXL, or ``push``), driven by JSON commands."""

    def __init__(self, ctx: Any, impl: str = "kvx", **o: Any) -> None:
        self.o = o
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, o, impl), daemon=True)
        self.proc.start()
        self.hello: dict[str, Any] = {}

    def ready(self) -> dict[str, Any]:
        if not self.hello:
            self.hello = self.recv(600)
        return self.hello

    def send(self, **cmd: Any) -> None:
        self.conn.send_bytes(json.dumps(cmd).encode())

    def recv(self, timeout: float = 600) -> dict[str, Any]:
        """The rank's answer; a rank that failed or died raises at once (not after ``timeout``)."""
        who = f"{self.o['role']} rank {self.o['rank']} of TP {self.o['tp']} ({self.o['layout']})"
        end = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise RuntimeError(f"{who} exited with status {self.proc.exitcode}")
            if time.monotonic() > end:
                raise TimeoutError(f"{who} did not answer within {timeout} s")
        msg: dict[str, Any] = json.loads(self.conn.recv_bytes())
        if "error" in msg:
            raise RuntimeError(f"{who} failed: {msg['error']}\n{msg.get('trace', '')}")
        return msg

    def call(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.send(cmd="quit")
                self.recv(30)
        except Exception:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


CASES = {"same": (1, 1), "1to2": (1, 2), "2to1": (2, 1), "2to2": (2, 2)}


def start_ranks(ctx: Any, impl: str, gpus: list[int], common: dict[str, Any]) -> tuple[dict[int, list[Rank]], ...]:
    """Prefill ranks at TP 1 and 2 and decode ranks at TP 1 and 2, started and ready."""
    pre = {1: [Rank(ctx, impl, role="kv_producer", engine="p1", tp=1, rank=0, gpu=gpus[0], **common)],
           2: [Rank(ctx, impl, role="kv_producer", engine="p2", tp=2, rank=r, gpu=gpus[r], **common)
               for r in (0, 1)]}
    dec = {1: [Rank(ctx, impl, role="kv_consumer", engine="d1", tp=1, rank=0, gpu=gpus[1], **common)],
           2: [Rank(ctx, impl, role="kv_consumer", engine="d2", tp=2, rank=r, gpu=gpus[1 - r], **common)
               for r in (0, 1)]}
    try:
        for r in [*pre[1], *pre[2], *dec[1], *dec[2]]:
            r.ready()
    except BaseException:
        for r in [*pre[1], *pre[2], *dec[1], *dec[2]]:
            r.close()
        raise
    return pre, dec


def run_case(impl: str, pre: list[Rank], dec: list[Rank], layout: str, case: str, n: int, a: argparse.Namespace,
             blocks: int, rng: Any, lease: int) -> dict[str, Any]:
    """``a.iters`` timed pulls (after one warm-up) of an ``n``-token request from ``pre`` into
    ``dec``, permuted block ids on both sides; the median row. ``lease``: a fresh lease base."""
    import numpy as np

    workers = {str(r.o["rank"]): r.hello["hs"] for r in pre}
    if impl == "nixl":
        for r in dec:
            r.call(cmd="connect", engine=pre[0].o["engine"], tp=len(pre), workers=workers)
    times, posts, ok, nbytes = [], [], True, 0
    errors: list[str] = []
    for it in range(a.iters + 1):
        nblk = -(-n // a.block)
        rb = [int(b) for b in rng.permutation(blocks)[:nblk]]
        lb = [int(b) for b in rng.permutation(blocks)[:nblk]]
        rid = f"{impl}-{layout}-{case}-{n}-{it}"
        lease += 2
        seed = it + 7
        for r in pre:
            r.call(cmd="fill", rid=rid, blocks=rb, tokens=n, seed=seed, lease=lease)
        verify = it in (1, a.iters)
        if impl == "nixl":
            pull = dict(engine=pre[0].o["engine"])
        else:
            pull = dict(params=pre[0].call(cmd="params", rid=rid, blocks=rb, tokens=n, lease=lease,
                                           workers=workers)["params"])
        for r in dec:
            r.send(cmd="pull", rid=rid, blocks=lb, remote=rb, tokens=n, seed=seed, verify=verify, **pull)
        res = [r.recv() for r in dec]
        for r in pre:
            r.call(cmd="poll", rids=[rid])
        errors += [str(e) for x in res for e in x["failed"]]
        if any(x["failed"] for x in res) or (verify and not all(x["ok"] for x in res)):
            ok = False
        if it:  # the first is a warm-up (connects the peers, builds the lists)
            times.append(max(x["s"] for x in res))
            posts.append(max(x["post_s"] for x in res))
            nbytes = sum(x["bytes"] for x in res)
    med = float(np.median(times))
    row = {"impl": impl, "layout": layout, "case": case, "tokens": n, "ms": med * 1e3,
           "post_ms": float(np.median(posts)) * 1e3, "GBps": nbytes / med / 1e9, "bytes": nbytes, "verified": ok}
    if errors:
        row["errors"] = sorted(set(errors))[:3]
    return row


def main() -> None:
    a = arguments()
    tokens = [int(t) for t in a.tokens.split(",")]
    layouts = a.layouts.split(",")
    cases = a.cases.split(",")
    blocks = -(-max(tokens) // a.block) + 16
    gpus = [0, 1] if a.device == "cuda" else [0, 0]
    import torch

    if a.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"needs two GPUs, found {torch.cuda.device_count()} (--device cpu checks the script on CPU)")
    where = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if a.device == "cuda"
             else "CPU (host memory)")
    print(f"== {where}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    impls = ["kvx"]
    if a.compare == "nixl":
        from nixl_tp import import_nixl, nixl_version

        try:
            api = import_nixl()
        except RuntimeError as exc:
            sys.exit(str(exc))
        print(f"== NIXL: {nixl_version()} ({api.__name__} from {os.path.dirname(str(api.__file__))}), UCX_TLS="
              f"{os.environ.get('UCX_TLS', '(UCX default)')}", flush=True)
        impls.append("nixl")
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    import numpy as np

    lease = int(time.time_ns() // 1000) * 2
    for layout in layouts:
        common = dict(device=a.device, layout=layout, layers=a.layers, heads=a.heads, head_dim=a.head_dim,
                      latent=a.latent, block=a.block, blocks=blocks)
        for impl in impls:
            if impl == "nixl" and layout != "HND":
                continue  # NixlConnector refuses NHD across TP sizes; MLA is not a head-slice case
            rng = np.random.default_rng(0)  # the same block ids for kvx and NIXL
            try:
                pre, dec = start_ranks(ctx, impl, gpus, common)
            except Exception as exc:
                if impl == "kvx":
                    raise
                failures.append(f"NIXL ({layout}) did not start: {exc}")  # kvx's rows still count
                continue
            try:
                for case in cases:
                    tp_p, tp_d = CASES[case]
                    for n in tokens:
                        lease += 4 * (a.iters + 1)
                        row = run_case(impl, pre[tp_p], dec[tp_d], layout, case, n, a, blocks, rng, lease)
                        results.append(row)
                        print(json.dumps(row), flush=True)
            except Exception as exc:
                if impl == "kvx":
                    raise
                failures.append(f"NIXL ({layout}) failed: {exc}")
            finally:
                for r in [*pre[1], *pre[2], *dec[1], *dec[2]]:
                    r.close()
    print()
    print(table(results, a.iters))
    for f in failures:
        print(f"\n{f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"rows": results, "failures": failures}, fh, indent=1)
    if failures or not all(r["verified"] for r in results):
        sys.exit("some pulls failed or moved wrong bytes (verified: NO), or NIXL failed (above)")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and fill the per-device defaults (a small shape on CPU); refuse what cannot run."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tokens", default=None, help="default: 4096,16384 (cuda), 512,2048 (cpu)")
    ap.add_argument("--layouts", default="HND,NHD,MLA")
    ap.add_argument("--cases", default="same,1to2,2to1,2to2")
    ap.add_argument("--layers", type=int, default=None, help="default: 32 (cuda), 4 (cpu)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=None, help="default: 128 (cuda), 32 (cpu)")
    ap.add_argument("--latent", type=int, default=None, help="default: 576 (cuda), 96 (cpu)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compare", choices=("nixl",), default=None,
                    help="also run NIXL moving the same head slices as NixlConnector plans them (HND layouts)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    cpu = a.device == "cpu"
    a.tokens = a.tokens or ("512,2048" if cpu else "4096,16384")
    a.layers = a.layers or (4 if cpu else 32)
    a.head_dim = a.head_dim or (32 if cpu else 128)
    a.latent = a.latent or (96 if cpu else 576)
    bad = [c for c in a.cases.split(",") if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {bad}; known: {sorted(CASES)}")
    bad = [x for x in a.layouts.split(",") if x not in ("HND", "NHD", "MLA")]
    if bad:
        ap.error(f"unknown layout(s) {bad}; known: HND, NHD, MLA")
    if a.compare == "nixl" and "HND" not in a.layouts.split(","):
        ap.error("--compare nixl needs the HND layout (NixlConnector moves head slices only in HND)")
    try:
        if min(int(t) for t in a.tokens.split(",")) <= 0 or a.iters < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--tokens must be positive integers and --iters >= 1 (got {a.tokens!r}, {a.iters})")
    if a.heads % 2:
        ap.error(f"--heads {a.heads} does not split over TP 2")
    return a


def _rate(gbps: float) -> str:
    return f"{gbps:.1f}" if gbps >= 10 else f"{gbps:.3g}"


def table(results: list[dict[str, Any]], iters: int) -> str:
    """The markdown table: kvx's rows, each with the same-TP reference and NIXL's same case."""
    nixl = any(r["impl"] == "nixl" for r in results)
    head = (f"| layout | case | tokens | pull ms (median of {iters}) | of which posting ms | GB/s into decode "
            "| vs same-TP | bytes verified |")
    rule = "|---|---|---:|---:|---:|---:|---:|---|"
    if nixl:
        head += " NIXL pull ms | NIXL GB/s | NIXL verified | kvx / NIXL |"
        rule += "---:|---:|---|---:|"
    lines = [head, rule]
    yes = {True: "yes", False: "NO"}
    for row in results:
        if row["impl"] != "kvx":
            continue
        ref = next((x for x in results if x["impl"] == "kvx" and x["layout"] == row["layout"]
                    and x["case"] == "same" and x["tokens"] == row["tokens"]), None)
        rel = f"{row['GBps'] / ref['GBps']:.2f}x" if ref else "-"
        line = (f"| {row['layout']} | {row['case']} | {row['tokens']} | {row['ms']:.2f} | {row['post_ms']:.2f} | "
                f"{_rate(row['GBps'])} | {rel} | {yes[row['verified']]} |")
        if nixl:
            x = next((x for x in results if x["impl"] == "nixl" and x["layout"] == row["layout"]
                      and x["case"] == row["case"] and x["tokens"] == row["tokens"]), None)
            line += (f" {x['ms']:.2f} | {_rate(x['GBps'])} | {yes[x['verified']]} | {x['ms'] / row['ms']:.2f}x |"
                     if x else " - | - | - | - |")
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
