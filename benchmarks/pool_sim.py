"""A 256-member simulation of kvx.pool: placement, membership changes and the owners' eviction
policy, with no data moved.

Measures, with the real placement (:class:`kvx.pool.Placement`) and the real policies
(:mod:`kvx.tiers.policies`, driven as :class:`kvx.pool.owner.Owner` drives them):

1. load balance: max/mean of the blocks each of 256 members stores, equal and mixed capacities;
2. remap on a join (257th member) and a leave (one of 256): the fraction of keys whose owner
   changes, and whether every moved key moved to the newcomer / from the leaver only;
3. the block prefix hit rate of the shared Mooncake traces replayed by 8 instances (requests
   dealt round-robin, as a router without KV awareness does) sharing one pool of 256 members,
   vs 8 private host tiers of the same total capacity; and the pool's hit rate when a member
   leaves and another joins halfway through.

Usage::

    python benchmarks/pool_sim.py [--members 256] [--keys 1000000] [--json out/pool-sim.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from kvx.pool.placement import Placement, key64, key_bytes
from kvx.tiers.policies import TierFull, make_policy
from kvx.tiers.sim import load_trace

TRACES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces")


def owners_of(pl: Placement, k64: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    out = np.empty(len(k64), dtype=np.int64)
    for i in range(0, len(k64), chunk):
        out[i:i + chunk] = pl.owners(k64[i:i + chunk])[:, 0]
    return out


def balance(members: int, keys: int, mixed: bool) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    names = [f"m{i:03d}" for i in range(members)]
    w = rng.choice([1.0, 2.0, 4.0], size=members) if mixed else np.ones(members)
    pl = Placement(names, list(w))
    k = rng.integers(0, 1 << 63, size=keys, dtype=np.uint64)
    load = np.bincount(owners_of(pl, k), minlength=members).astype(float)
    fill = load / (w[np.argsort(names)] / w.sum() * keys)  # per member: stored / its fair share
    return {"members": members, "keys": keys, "capacities": "1/2/4 mixed" if mixed else "equal",
            "max_over_mean": round(float(fill.max()), 4), "min_over_mean": round(float(fill.min()), 4)}


def remap(members: int, keys: int) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    names = [f"m{i:03d}" for i in range(members)]
    k = rng.integers(0, 1 << 63, size=keys, dtype=np.uint64)
    base = Placement(names, [1.0] * members)
    before = np.asarray(base.names)[owners_of(base, k)]
    join = Placement([*names, "new"], [1.0] * (members + 1))
    aj = np.asarray(join.names)[owners_of(join, k)]
    leave = Placement(names[1:], [1.0] * (members - 1))
    al = np.asarray(leave.names)[owners_of(leave, k)]
    mj, ml = before != aj, before != al
    return {"members": members, "keys": keys,
            "join_moved": round(float(mj.mean()), 5), "join_expected": round(1 / (members + 1), 5),
            "join_only_to_newcomer": bool(set(aj[mj]) <= {"new"}),
            "leave_moved": round(float(ml.mean()), 5), "leave_expected": round(1 / members, 5),
            "leave_only_from_leaver": bool(np.array_equal(ml, before == names[0]))}


class _Member:
    """One owner's index under its policy, as kvx.pool.owner.Owner keeps it (no slots, no data)."""

    def __init__(self, capacity: int, policy: str) -> None:
        self.pol = make_policy(policy, capacity)
        self.cap = capacity
        self.held: set[int] = set()

    def offer(self, k: int, parent: int | None) -> None:
        pol = self.pol
        if k in self.held:
            pol.hit(k)
            return
        pol.miss(k)
        p = parent if parent in self.held else None
        if not pol.admit(k, p):
            return
        while len(self.held) >= self.cap:
            try:
                v = pol.victim()
            except TierFull:
                return
            pol.removed(v)
            self.held.discard(v)
        pol.inserted(k, p)
        self.held.add(k)


def replay(reqs: list[list[int]], instances: int, members: int, total_blocks: int, policy: str,
           churn: bool = False) -> dict[str, float]:
    """Prefix hit rates: ``private`` (one tier per instance) and ``pool`` (shared)."""
    ids = sorted({h for r in reqs for h in r})
    k64 = key64([key_bytes(h) for h in ids])
    names = [f"m{i:03d}" for i in range(members)]
    pl = Placement(names, [1.0] * members)
    own = dict(zip(ids, owners_of(pl, k64).tolist()))
    pool = [_Member(max(1, total_blocks // members), policy) for _ in range(members)]
    priv = [_Member(max(1, total_blocks // instances), policy) for _ in range(instances)]
    hits_pool = hits_priv = refs = 0
    half = len(reqs) // 2
    for i, r in enumerate(reqs):
        if churn and i == half:  # m000 leaves (its blocks are gone), "new" joins: keys remap
            pl = Placement([*names[1:], "new"], [1.0] * members)
            order = {n: j for j, n in enumerate(pl.names)}
            old = {n: pool[j] for j, n in enumerate(names)}
            old["new"] = _Member(max(1, total_blocks // members), policy)
            pool = [old[n] for n in pl.names]
            names = list(pl.names)
            own = dict(zip(ids, owners_of(pl, k64).tolist()))
            del order
        inst = priv[i % instances]
        refs += len(r)
        k = 0
        for h in r:
            if h not in inst.held:
                break
            k += 1
        hits_priv += k
        k = 0
        for h in r:
            if h not in pool[own[h]].held:
                break
            k += 1
        hits_pool += k
        prev = None
        for h in r:
            inst.offer(h, prev)
            pool[own[h]].offer(h, prev)
            prev = h
    return {"private": round(hits_priv / refs, 4), "pool": round(hits_pool / refs, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", type=int, default=256)
    ap.add_argument("--keys", type=int, default=1 << 20)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--traces", default=TRACES)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    out: dict[str, Any] = {"machine": platform.node(), "python": sys.version.split()[0],
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out["balance"] = [balance(a.members, a.keys, False), balance(a.members, a.keys, True)]
    for b in out["balance"]:
        print(f"balance  {b['capacities']:>11}: max/mean {b['max_over_mean']:.3f}  min/mean {b['min_over_mean']:.3f}"
              f"  ({b['keys']} keys over {b['members']} members)")
    out["remap"] = remap(a.members, a.keys)
    r = out["remap"]
    print(f"remap    join: {r['join_moved']:.5f} of keys moved (1/N+1 = {r['join_expected']:.5f}), "
          f"all to the newcomer: {r['join_only_to_newcomer']}")
    print(f"remap   leave: {r['leave_moved']:.5f} of keys moved (1/N = {r['leave_expected']:.5f}), "
          f"only the leaver's: {r['leave_only_from_leaver']}")
    out["traces"] = []
    for name in ("mooncake_conversation_trace.jsonl", "mooncake_synthetic_trace.jsonl"):
        path = os.path.join(a.traces, name)
        if not os.path.exists(path):
            print(f"(no trace {path})")
            continue
        reqs = load_trace(path)
        uniq = len({h for q in reqs for h in q})
        for frac in (0.05, 0.1, 0.25):
            total = max(a.members, int(uniq * frac))
            res = replay(reqs, a.instances, a.members, total, a.policy)
            ch = replay(reqs, a.instances, a.members, total, a.policy, churn=True)
            row = {"trace": name, "unique_blocks": uniq, "total_capacity_blocks": total,
                   "capacity_fraction": frac, "instances": a.instances, "members": a.members,
                   "policy": a.policy, "private_hit_rate": res["private"], "pool_hit_rate": res["pool"],
                   "pool_hit_rate_with_churn": ch["pool"]}
            out["traces"].append(row)
            print(f"trace {name.split('_')[1]:>12} cap {frac:>4.0%} of {uniq} blocks: private x{a.instances} "
                  f"{res['private']:.3f}  shared pool {res['pool']:.3f}  (pool, one leave + one join "
                  f"halfway: {ch['pool']:.3f})")
    out["seconds"] = round(time.monotonic() - t0, 1)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
