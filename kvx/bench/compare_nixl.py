"""``--compare nixl``: NIXL run the same way (two processes, prepared lists, permuted ids)."""

from __future__ import annotations

import sys
from typing import Any

from ..compare.nixl import nixl_available, run_nixl
from ..errors import UsageError
from . import BenchOptions, Progress

#: kvx backend -> (NIXL mem mode, NIXL backend, extra environment)
_MODES: dict[str, tuple[str, str, dict[str, str]]] = {
    "host": ("dram", "UCX", {}),
    "tcp": ("dram", "UCX", {"UCX_TLS": "tcp,self"}),
    "ucx": ("dram", "UCX", {}),  # the environment's UCX_TLS, as kvx's ucx backend runs with
    "posix": ("file", "POSIX", {}),
    "cuda": ("vram", "UCX", {}),  # --seg vram,vram; vram,pinned -> "pinned" (see _mode)
}


def _mode(opts: BenchOptions) -> tuple[str, str, dict[str, str]]:
    mem, backend, env = _MODES[opts.backend]
    if opts.backend == "ucx" and tuple(opts.seg) != ("dram", "dram"):
        if tuple(opts.seg) != ("vram", "vram"):
            raise UsageError(f"--compare nixl with --backend ucx takes --seg dram,dram or vram,vram, not {opts.seg}")
        mem = "vram"
    if opts.backend == "cuda":
        seg = tuple("vram" if s in ("dram", "") else s for s in opts.seg)
        if seg == ("vram", "pinned"):
            mem = "pinned"
        elif seg != ("vram", "vram"):
            raise UsageError(f"--compare nixl with --backend cuda takes --seg vram,vram or vram,pinned, not {seg}")
    return mem, backend, dict(env)


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    if opts.backend == "s3":
        return []  # kvx.bench.s3 runs NIXL OBJ itself, against the same short-lived SeaweedFS
    reason = nixl_available()
    if reason is not None:
        raise UsageError(f"--compare nixl: {reason}")
    if opts.backend not in _MODES:
        raise UsageError(f"--compare nixl is not wired for --backend {opts.backend}")
    mem, backend, env = _mode(opts)
    # Two NIXL configurations: "nixl" is NIXL at its best here (the target's progress thread
    # sleeps 1 ms between polls instead of spinning a core away from the initiator on a small
    # machine); "nixl-stock" is nixl_agent's shipped setting (busy polling). File mode has no
    # target process, so it runs once.
    # GPU modes also run once: UCX's cuda_ipc puts/gets are one-sided, the target's progress
    # thread only carries the verification notification.
    variants = [("nixl", 1000)] if mem in ("file", "vram", "pinned") else [("nixl", 1000), ("nixl-stock", 0)]
    if opts.extra.get("nixl_variants") == "best":
        variants = variants[:1]
    rows: list[dict[str, Any]] = []
    for impl, delay in variants:
        for op in opts.ops:
            prog.step(f"{impl} {op}")
            kw: dict[str, Any] = {}
            if mem == "file":
                kw["file_dir"] = opts.path
            else:
                kw["target_progress_delay_us"] = delay
            try:
                res = run_nixl(mem=mem, op=op, block_sizes=list(opts.block_sizes), total=opts.total,
                               iters=opts.iters, permute=opts.permute, seed=opts.seed,
                               latency_samples=opts.latency_samples, backend=backend, env=env, **kw)
            except RuntimeError as exc:
                if mem != "pinned":
                    raise
                # optional mode (GPU -> another process's cudaHostRegister'd DRAM): keep kvx's rows
                print(f"--compare nixl ({mem} {op}) failed: {str(exc)[:2000]}", file=sys.stderr)
                rows.append({"impl": impl, "op": op, "error": str(exc)[:500]})
                continue
            if not res.get("verified", False):
                raise RuntimeError("NIXL's transfers did not verify; its figures are not comparable")
            for r in res["results"]:
                rows.append(dict(impl=impl, op=op, block_bytes=r["block_bytes"], nblocks=r["nblocks"],
                                 total_bytes=r["total_bytes"], iters=r["iters"], seconds_median=r["seconds_median"],
                                 seconds_min=r["seconds_min"], gbps=r["gbps"], nixl=res.get("version")))
            lat = res.get("latency_us")
            if op == "write" and lat:
                rows.append({"impl": impl, "op": "write", "block_bytes": lat["block_bytes"],
                             "lat_us_median": lat["median"], "lat_us_p99": lat["p99"]})
    return rows
