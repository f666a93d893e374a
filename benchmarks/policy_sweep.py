"""Single-tier eviction-policy sweep: the Mooncake traces and the seeded generator family.

    .venv/bin/python benchmarks/policy_sweep.py [--traces DIR] [--seed 0] [--only NAME,...]
                                                [--jobs 2] [--plot FILE.png]

For every trace (the two Mooncake traces in ``--traces`` and every member of
``benchmarks/trace_gen.py``'s ``FAMILY``) and capacity: the prefix block hit rate of lru, fifo,
s3fifo, arc and the default policy (``kvx.tiers.sim.simulate``) and Belady's bound
(``kvx.tiers.sim.belady``). Prints a markdown table of hit rates per trace, then the summary:
default / best classic (best of lru, fifo, s3fifo) per capacity and its worst case, and the
default's fraction of Belady's bound.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from trace_gen import family  # noqa: E402

from kvx.tiers.policies import DEFAULT_POLICY  # noqa: E402
from kvx.tiers.sim import belady, load_trace, simulate  # noqa: E402

CAPACITIES = [1000, 3000, 6000, 12000, 25000]
CLASSICS = ["lru", "fifo", "s3fifo"]
POLICIES = CLASSICS + ["arc", DEFAULT_POLICY]
MOONCAKE = {
    "conversation": "mooncake_conversation_trace.jsonl",
    "synthetic": "mooncake_synthetic_trace.jsonl",
}


def _requests(name: str, traces: str, seed: int) -> list[list[int]]:
    if name in MOONCAKE:
        return load_trace(os.path.join(traces, MOONCAKE[name]))
    return family(seed)[name]()


def _one(name: str, traces: str, seed: int, caps: list[int]) -> tuple[str, dict[str, list[float]], float]:
    reqs = _requests(name, traces, seed)
    res = {p: [simulate(reqs, c, p).hit_rate for c in caps] for p in POLICIES}
    res["belady"] = [belady(reqs, c) for c in caps]
    return name, res, float(sum(map(len, reqs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="/work/shared/traces")
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    ap.add_argument("--seed", type=int, default=0, help="seed of the generator family")
    ap.add_argument("--only", default="", help="comma list of trace names (default: all)")
    ap.add_argument("--jobs", type=int, default=2, help="processes")
    ap.add_argument("--plot", default=None, help="write a PNG of hit rate vs capacity (Mooncake traces)")
    args = ap.parse_args()
    caps = [int(c) for c in args.capacities.split(",")]
    names = [n for n in MOONCAKE if os.path.exists(os.path.join(args.traces, MOONCAKE[n]))] + list(family(args.seed))
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    with ProcessPoolExecutor(max(1, args.jobs)) as ex:
        done = list(ex.map(_one, names, [args.traces] * len(names), [args.seed] * len(names),
                           [caps] * len(names)))
    results = {name: res for name, res, _refs in done}

    print("| trace | policy | " + " | ".join(f"{c}" for c in caps) + " |")
    print("|" + "---|" * (len(caps) + 2))
    for name, res in results.items():
        for p in POLICIES + ["belady"]:
            label = f"**{p}** (default)" if p == DEFAULT_POLICY else ("belady (bound)" if p == "belady" else p)
            print(f"| {name} | {label} | " + " | ".join(f"{x:.3f}" for x in res[p]) + " |")
    print()
    print("| trace | " + " | ".join(f"{c}" for c in caps) + " | worst | default / Belady |")
    print("|" + "---|" * (len(caps) + 3))
    worst_all = (9.0, "", 0)
    for name, res in results.items():
        best = [max(res[p][i] for p in CLASSICS) for i in range(len(caps))]
        ratio = [res[DEFAULT_POLICY][i] / best[i] if best[i] else 1.0 for i in range(len(caps))]
        frac = [res[DEFAULT_POLICY][i] / res["belady"][i] if res["belady"][i] else 1.0 for i in range(len(caps))]
        w = min(range(len(caps)), key=lambda i: ratio[i])
        worst_all = min(worst_all, (ratio[w], name, caps[w]))
        print(f"| {name} | " + " | ".join(f"{x:.3f}x" for x in ratio) + f" | {ratio[w]:.3f}x at {caps[w]} | "
              + " / ".join(f"{x:.2f}" for x in frac) + " |")
    print(f"\nworst default / best classic over all traces and capacities: {worst_all[0]:.3f}x "
          f"({worst_all[1]}, {worst_all[2]} blocks)")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = [n for n in results if n in MOONCAKE]
        fig, axes = plt.subplots(1, len(shown), figsize=(6 * len(shown), 4.5), squeeze=False)
        for ax, name in zip(axes[0], shown):
            for p, ys in results[name].items():
                style = "k--" if p == "belady" else ("-o" if p == DEFAULT_POLICY else "-")
                ax.plot(caps, ys, style, label=p, linewidth=2.5 if p == DEFAULT_POLICY else 1.2)
            ax.set_xscale("log")
            ax.set_title(f"{name} trace")
            ax.set_xlabel("capacity (blocks)")
            ax.set_ylabel("prefix block hit rate")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
