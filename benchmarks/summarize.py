"""Median table over several ``kvx bench --json`` runs of the same configuration.

Run: python benchmarks/summarize.py out/final-host-*.json [--ratio kvx-clean/nixl ...]
Each ratio is the median of the per-run ratios (both sides measured in the same run). The
ratios are of the first implementation to each other one; ``--ratio A/B`` adds a column A/B.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from kvx.bench import fmt_size


def main(argv: list[str]) -> None:
    paths: list[str] = []
    extra: list[tuple[str, str]] = []
    it = iter(argv)
    for a in it:
        if a == "--ratio":
            num, den = next(it).split("/")
            extra.append((num, den))
        else:
            paths.append(a)
    runs = [json.load(open(p))["rows"] for p in paths]
    impls: list[str] = []
    for rows in runs:
        for r in rows:
            if "gbps" in r and r["impl"] not in impls:
                impls.append(r["impl"])
    base = impls[0]
    keys: list[tuple[str, int]] = []
    bw: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    ratio: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    lat: dict[str, list[float]] = defaultdict(list)
    for rows in runs:
        per: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
        for r in rows:
            if "gbps" in r:
                k = (r["op"], r["block_bytes"])
                if k not in keys:
                    keys.append(k)
                per[k][r["impl"]] = r["gbps"]
                bw[(*k, r["impl"])].append(r["gbps"])
            elif "lat_us_median" in r:
                lat[r["impl"]].append(r["lat_us_median"])
        for k, v in per.items():
            for i in impls[1:]:
                if base in v and i in v and v[i] > 0:
                    ratio[(*k, i)].append(v[base] / v[i])
            for num, den in extra:
                if num in v and den in v and v[den] > 0:
                    ratio[(*k, f"{num}/{den}")].append(v[num] / v[den])
    cols = (["op", "block"] + [f"{i} GB/s" for i in impls] + [f"{base}/{i}" for i in impls[1:]]
            + [f"{n}/{d}" for n, d in extra])
    print(f"Medians of {len(runs)} run(s).\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for op, bs in keys:
        cells = [op, fmt_size(bs)]
        cells += [f"{statistics.median(bw[(op, bs, i)]):.2f}" if bw[(op, bs, i)] else "-" for i in impls]
        cells += [f"{statistics.median(ratio[(op, bs, i)]):.2f}x" if ratio[(op, bs, i)] else "-" for i in impls[1:]]
        cells += [f"{statistics.median(ratio[(op, bs, f'{n}/{d}')]):.2f}x" if ratio[(op, bs, f"{n}/{d}")] else "-"
                  for n, d in extra]
        print("| " + " | ".join(cells) + " |")
    if lat:
        print("\n| 4 KiB write latency | median us (median over runs) |")
        print("|---|---|")
        for i, v in lat.items():
            print(f"| {i} | {statistics.median(v):.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
