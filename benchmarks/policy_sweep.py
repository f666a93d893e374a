"""Single-tier eviction-policy sweep over the Mooncake request traces.

    .venv/bin/python benchmarks/policy_sweep.py [--traces DIR] [--plot FILE.png]

Prints a markdown table: rows = trace x policy (lru, fifo, s3fifo, arc, the default, Belady),
columns = capacities in blocks, then the ratio default / best of (lru, fifo, s3fifo), and the
simulator throughput (block references per second) of each policy.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvx.tiers.policies import DEFAULT_POLICY
from kvx.tiers.sim import belady, load_trace, simulate

CAPACITIES = [1000, 3000, 6000, 12000, 25000]
CLASSICS = ["lru", "fifo", "s3fifo"]
TRACES = {
    "conversation": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="/work/shared/traces")
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    ap.add_argument("--plot", default=None, help="write a PNG of hit rate vs capacity")
    args = ap.parse_args()
    caps = [int(c) for c in args.capacities.split(",")]
    policies = CLASSICS + ["arc", DEFAULT_POLICY]
    results: dict[str, dict[str, list[float]]] = {}
    speed: dict[str, list[float]] = {}

    head = "| trace | policy | " + " | ".join(f"{c}" for c in caps) + " |"
    print(head)
    print("|" + "---|" * (len(caps) + 2))
    for trace, fname in TRACES.items():
        reqs = load_trace(os.path.join(args.traces, fname))
        res = results[trace] = {}
        for p in policies:
            rs = [simulate(reqs, c, p) for c in caps]
            res[p] = [r.hit_rate for r in rs]
            speed.setdefault(p, []).append(sum(r.block_refs for r in rs) / sum(r.seconds for r in rs))
            label = f"**{p}** (default)" if p == DEFAULT_POLICY else p
            print(f"| {trace} | {label} | " + " | ".join(f"{x:.3f}" for x in res[p]) + " |")
        res["belady"] = [belady(reqs, c) for c in caps]
        print(f"| {trace} | belady (bound) | " + " | ".join(f"{x:.3f}" for x in res["belady"]) + " |")
        best = [max(res[p][i] for p in CLASSICS) for i in range(len(caps))]
        ratio = [res[DEFAULT_POLICY][i] / best[i] if best[i] else float("nan") for i in range(len(caps))]
        print(f"| {trace} | default / best classic | " + " | ".join(f"{x:.2f}x" for x in ratio) + " |")
    print()
    print("| policy | sim throughput (block refs/s, both traces, all capacities) |")
    print("|---|---|")
    for p, v in speed.items():
        print(f"| {p} | {sum(v) / len(v) / 1e3:.0f}k |")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
        for ax, (trace, res) in zip(axes, results.items()):
            for p, ys in res.items():
                style = "k--" if p == "belady" else ("-o" if p == DEFAULT_POLICY else "-")
                ax.plot(caps, ys, style, label=p, linewidth=2.5 if p == DEFAULT_POLICY else 1.2)
            ax.set_xscale("log")
            ax.set_title(f"{trace} trace")
            ax.set_xlabel("capacity (blocks)")
            ax.set_ylabel("prefix block hit rate")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
