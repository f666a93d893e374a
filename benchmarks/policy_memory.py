"""Bookkeeping memory of an eviction policy: RSS per tracked key, and for a tier of N blocks.

    .venv/bin/python benchmarks/policy_memory.py [--policy adaptive] [--capacity 65536]

Drives the policy with the store's calling protocol over chains of fresh keys (each request
16 new blocks, so every history, ghost and doorkeeper structure fills to its bound), measures
the process RSS before and after, and counts the keys the policy tracks (stored keys, history,
ghosts, doorkeeper, expert miniatures). Prints bytes per tracked key and the projection for a
1,048,576-block tier (tracked keys scale linearly with capacity).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvx.tiers.policies import make_policy


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tracked(p: object) -> int:
    """Keys held in the policy's dicts/sets/OrderedDicts and compact tables, miniatures included."""
    n = 0
    for v in vars(p).values() if hasattr(p, "__dict__") else ():
        if isinstance(v, (dict, set)):
            n += len(v)
        elif isinstance(v, list):
            for x in v:
                if isinstance(x, dict):
                    n += len(x)
                elif hasattr(x, "__dict__") or hasattr(x, "__slots__"):
                    n += tracked(x)
        elif hasattr(v, "a") and hasattr(v, "per"):  # a compact key table: its live entries
            n += sum(1 for e in v.a if e)
        elif hasattr(v, "t") and hasattr(v.t, "a"):
            n += sum(1 for e in v.t.a if e)
        elif hasattr(v, "__slots__") and not isinstance(v, (int, float, str)):
            n += sum(len(getattr(v, s)) for s in v.__slots__ if isinstance(getattr(v, s, None), (dict, set)))
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--mult", type=float, default=40.0, help="distinct keys offered, x capacity")
    a = ap.parse_args()
    gc.collect()
    r0 = rss()
    pol = make_policy(a.policy, a.capacity)
    stored: set[int] = set()
    key = 0
    total = int(a.mult * a.capacity)
    while key < total:
        parent = None
        for h in range(key, key + 16):
            pol.miss(h)
            if pol.admit(h, parent):
                while len(stored) >= a.capacity:
                    v = pol.victim()
                    stored.discard(v)
                    pol.removed(v)
                stored.add(h)
                pol.inserted(h, parent)
            parent = h
        # revisit a recent request so that hits and class changes happen too
        for h in range(max(0, key - 64), max(0, key - 48)):
            if h in stored:
                pol.hit(h)
        key += 16
    gc.collect()
    used = rss() - r0 - sys.getsizeof(stored)  # the tier's own index is not policy bookkeeping
    n = tracked(pol)
    per = used / max(1, n)
    proj = used * (1 << 20) / a.capacity
    print(f"policy {a.policy}, capacity {a.capacity}: {n:,} tracked keys, RSS +{used / 2**20:.0f} MiB, "
          f"{per:.0f} bytes per tracked key ({used / a.capacity:.0f} bytes per block of capacity); "
          f"projected for 1,048,576 blocks: {proj / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
