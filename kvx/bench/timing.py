"""How every measured point is timed: kvx and the peers it is compared with alike."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["WARMUP_S", "timed", "warm"]

#: Every measured point is warmed up for at least this long (and at least ``warmup`` runs) before it
#: is timed, kvx and the comparisons alike: a point of 1 warm-up run (~1 ms on a GPU) could be timed
#: while clocks, TLBs and caches were still settling (the first point of a GPU run was seen 5-15% low,
#: its fastest run at the level of the next points).
WARMUP_S = 0.02


def warm(fn: Callable[[], Any], runs: int = 1, seconds: float = WARMUP_S) -> None:
    """Run ``fn`` at least ``runs`` times and until ``seconds`` have passed."""
    t0 = time.perf_counter()
    k = 0
    while k < runs or time.perf_counter() - t0 < seconds:
        fn()
        k += 1


def timed(fn: Callable[[], Any], iters: int, warmup: int = 1) -> tuple[float, float]:
    """Run ``fn`` (warmed up: :func:`warm`, ``warmup`` runs at least) then ``iters`` times; return
    (median, min) seconds of the timed runs."""
    warm(fn, warmup)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), min(ts)
