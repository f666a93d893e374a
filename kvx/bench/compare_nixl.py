"""``--compare nixl``: NIXL run the same way (two processes, prepared lists, permuted ids)."""

from __future__ import annotations

from typing import Any

from ..compare.nixl import nixl_available, run_nixl
from . import BenchOptions, Progress

#: kvx backend -> (NIXL mem mode, NIXL backend, extra environment)
_MODES: dict[str, tuple[str, str, dict[str, str]]] = {
    "host": ("dram", "UCX", {}),
    "tcp": ("dram", "UCX", {"UCX_TLS": "tcp,self"}),
    "posix": ("file", "POSIX", {}),
}


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    reason = nixl_available()
    if reason is not None:
        raise SystemExit(f"--compare nixl: {reason}")
    if opts.backend not in _MODES:
        raise SystemExit(f"--compare nixl is not wired for --backend {opts.backend}")
    mem, backend, env = _MODES[opts.backend]
    # Two NIXL configurations: "nixl" is NIXL at its best here (the target's progress thread
    # sleeps 1 ms between polls instead of spinning a core away from the initiator on a small
    # machine); "nixl-stock" is nixl_agent's shipped setting (busy polling). File mode has no
    # target process, so it runs once.
    variants = [("nixl", 1000)] if mem == "file" else [("nixl", 1000), ("nixl-stock", 0)]
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
            res = run_nixl(mem=mem, op=op, block_sizes=list(opts.block_sizes), total=opts.total, iters=opts.iters,
                           permute=opts.permute, seed=opts.seed, latency_samples=opts.latency_samples,
                           backend=backend, env=env, **kw)
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
