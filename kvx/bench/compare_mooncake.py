"""``--compare mooncake``: the Mooncake transfer engine over its TCP transport, two processes,
the same workload (one batch call per transfer, permuted block ids); see kvx.compare.mooncake."""

from __future__ import annotations

from typing import Any

from ..compare.mooncake import mooncake_available, run_mooncake
from . import BenchOptions, Progress


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    if opts.backend != "tcp":
        raise SystemExit("--compare mooncake is wired for --backend tcp (host memory over TCP)")
    reason = mooncake_available()
    if reason is not None:
        raise SystemExit(f"--compare mooncake: {reason}")
    prog.step("mooncake")
    return run_mooncake(ops=list(opts.ops), block_sizes=list(opts.block_sizes), total=opts.total, iters=opts.iters,
                        permute=opts.permute, seed=opts.seed)
