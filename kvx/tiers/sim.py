"""Single-tier replay of request traces (Mooncake format) through an eviction policy.

Replay semantics, per request in trace order:

1. lookup: the prefix hit length ``k`` is the number of leading ``hash_ids`` all present in the
   tier; ``hits += k``, ``block_refs += len(hash_ids)``;
2. store: every id of the request is offered in order: a present id is touched
   (``policy.hit``); an absent one is reported (``policy.miss``) and, if ``policy.admit(key,
   parent)`` agrees, inserted after evicting ``policy.victim()`` while the tier is full
   (``policy.removed`` follows each eviction, ``policy.inserted`` the insertion).  ``parent`` is
   the previous id of the request (None for the first).

``hit_rate = hits / block_refs``; capacity is in blocks.  The lookup itself makes no policy
calls, so each offered block produces exactly one ``hit`` or one ``miss`` per request.
"""

from __future__ import annotations

import heapq
import json
import time
from dataclasses import dataclass
from os import PathLike

from ..errors import UsageError
from .policies import EvictionPolicy, make_policy

__all__ = ["SimResult", "load_trace", "simulate", "belady"]


@dataclass(frozen=True)
class SimResult:
    policy: str
    capacity: int
    requests: int
    block_refs: int
    hits: int
    hit_rate: float
    seconds: float
    ops_per_s: float  # block references (lookup + store of one block) per second


def load_trace(path: str | PathLike[str]) -> list[list[int]]:
    """The ``hash_ids`` of every request of a Mooncake-format JSONL trace, in file order."""
    out: list[list[int]] = []
    loads = json.loads
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                out.append(loads(line)["hash_ids"])
    return out


def simulate(requests: list[list[int]], capacity: int, policy: str | EvictionPolicy) -> SimResult:
    """Replay ``requests`` through one tier of ``capacity`` blocks managed by ``policy``."""
    pol = make_policy(policy, capacity) if isinstance(policy, str) else policy
    if pol.capacity != capacity:
        raise UsageError(f"policy capacity {pol.capacity} != simulated capacity {capacity}")
    stored: set = set()
    hit, miss, admit, victim = pol.hit, pol.miss, pol.admit, pol.victim
    removed, inserted = pol.removed, pol.inserted
    hits = refs = 0
    t0 = time.perf_counter()
    for ids in requests:
        k = 0
        for h in ids:
            if h not in stored:
                break
            k += 1
        hits += k
        refs += len(ids)
        parent = None
        for h in ids:
            if h in stored:
                hit(h)
            else:
                miss(h)
                if admit(h, parent):
                    while len(stored) >= capacity:
                        v = victim()
                        stored.remove(v)
                        removed(v)
                    stored.add(h)
                    inserted(h, parent)
            parent = h
    dt = time.perf_counter() - t0
    return SimResult(
        policy=getattr(pol, "name", type(pol).__name__),
        capacity=capacity,
        requests=len(requests),
        block_refs=refs,
        hits=hits,
        hit_rate=hits / refs if refs else 0.0,
        seconds=dt,
        ops_per_s=refs / dt if dt > 0 else float("inf"),
    )


def belady(requests: list[list[int]], capacity: int, bypass: bool = True) -> float:
    """Hit rate of Belady's MIN under the replay semantics above (offline upper reference).

    On a miss the block is inserted, evicting the stored block whose next reference (the index
    of the next request containing it) is farthest in the future; ties go to the deepest block,
    so a chain is cut from its tail.  With ``bypass`` (default) a block whose own next
    reference is farther than every stored block's is not inserted at all.  A block's next
    use always comes no earlier than its parent's (a request holding the child holds the
    parent), so this order also evicts leaves first.
    """
    n = len(requests)
    inf = n + 1
    # next_use[i][j]: index of the next request after i holding requests[i][j]
    nxt: list[list[int]] = [None] * n  # type: ignore[list-item]
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        ids = requests[i]
        nxt[i] = [last.get(h, inf) for h in ids]
        for h in ids:
            last[h] = i
    cur: dict[int, tuple[int, int]] = {}  # stored key -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next, -depth, key), lazy
    hits = refs = 0
    for i, ids in enumerate(requests):
        k = 0
        for h in ids:
            if h not in cur:
                break
            k += 1
        hits += k
        refs += len(ids)
        nu = nxt[i]
        for j, h in enumerate(ids):
            e = (nu[j], j)
            if h in cur:
                cur[h] = e
                heapq.heappush(heap, (-e[0], -j, h))
                continue
            if e[0] >= inf:
                continue  # never used again
            if len(cur) >= capacity:
                while True:
                    negn, negd, v = heap[0]
                    if cur.get(v) == (-negn, -negd):
                        break
                    heapq.heappop(heap)
                if bypass and (e[0], j) >= (-negn, -negd):
                    continue
                heapq.heappop(heap)
                del cur[v]
            cur[h] = e
            heapq.heappush(heap, (-e[0], -j, h))
    return hits / refs if refs else 0.0
