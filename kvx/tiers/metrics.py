"""Latency histograms of the tiered store, in Prometheus text exposition format."""

from __future__ import annotations

import bisect
import threading

__all__ = ["Histogram", "BUCKETS"]

#: upper bounds in seconds (10 us .. 10 s, roughly x2.5 apart), then +Inf
BUCKETS: tuple[float, ...] = (1e-5, 2.5e-5, 1e-4, 2.5e-4, 1e-3, 2.5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0, 2.5, 10.0)


class Histogram:
    """A cumulative histogram of durations (thread-safe, O(log buckets) per observation)."""

    def __init__(self, name: str, help_: str, bounds: tuple[float, ...] = BUCKETS) -> None:
        self.name = name
        self.help = help_
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self.counts[i] += 1
            self.sum += seconds
            self.count += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (inf past the last bound; 0 if empty)."""
        with self._lock:
            total, counts = self.count, list(self.counts)
        if not total:
            return 0.0
        want = q * total
        acc = 0
        for b, c in zip((*self.bounds, float("inf")), counts):
            acc += c
            if acc >= want:
                return b
        return float("inf")

    def prometheus(self, prefix: str) -> list[str]:
        m = f"{prefix}_{self.name}_seconds"
        with self._lock:
            counts, s, n = list(self.counts), self.sum, self.count
        lines = [f"# HELP {m} {self.help}", f"# TYPE {m} histogram"]
        acc = 0
        for b, c in zip(self.bounds, counts):
            acc += c
            lines.append(f'{m}_bucket{{le="{b:g}"}} {acc}')
        lines.append(f'{m}_bucket{{le="+Inf"}} {n}')
        lines.append(f"{m}_sum {s:.9g}")
        lines.append(f"{m}_count {n}")
        return lines
