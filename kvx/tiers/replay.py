"""``kvx replay TRACE.jsonl``: replay a Mooncake-format trace through a real TieredStore.

Each request looks up its ``hash_ids`` (a prefix hit counts the blocks of the longest stored
prefix), then stores all its blocks (present ones are touched, new ones admitted by the policy).
Block contents are real bytes moved by the store's agent from an "engine cache" buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

import kvx

from .policies import DEFAULT_POLICY
from .store import DiskTier, HostTier, ObjectTier, Tier, TieredStore

__all__ = ["replay", "load_requests", "main"]


def load_requests(path: str, limit: int = 0) -> list[list[int]]:
    """hash_ids per request, in trace order."""
    out: list[list[int]] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            ids = json.loads(line).get("hash_ids")
            if not isinstance(ids, list):
                raise ValueError(f"{path}: a line without a hash_ids list")
            out.append(ids)
            if limit and len(out) >= limit:
                break
    return out


def replay(requests: list[list[int]], capacity: int, *, disk: int = 0, s3: int = 0, policy: str = DEFAULT_POLICY,
           block_bytes: int = 64, progress: Any = None, workdir: str | None = None) -> dict[str, Any]:
    """Replay ``requests`` and return the summary dict (see ``kvx replay --json``)."""
    tiers: list[Tier] = [HostTier(blocks=capacity)]
    tmp = None
    seaweed = None
    if disk:
        tmp = workdir or tempfile.mkdtemp(prefix="kvx-replay-")
        tiers.append(DiskTier(os.path.join(tmp, "disk"), blocks=disk))
    if s3:
        from .. import config

        if not config.get("KVX_S3_ENDPOINT") and not os.environ.get("AWS_ENDPOINT_URL"):
            from ..testing.seaweed import SeaweedFS

            seaweed = SeaweedFS()
            seaweed.start()
            os.environ.update(seaweed.env())
        tiers.append(ObjectTier("kvx-replay", blocks=s3, prefix=f"replay-{os.getpid()}"))
    store = TieredStore(tiers, block_bytes=block_bytes, policy=policy)
    try:
        longest = max((len(r) for r in requests), default=1) or 1
        cache = np.random.default_rng(0).integers(0, 256, longest * block_bytes, dtype=np.uint8)
        src = store.agent.prepare(kvx.DescList.blocks(store.agent.register(cache), block_bytes))
        idx = np.arange(longest, dtype=np.int64)
        hits = refs = 0
        t0 = time.perf_counter()
        lookup, put = store.lookup, store.put
        for i, ids in enumerate(requests):
            if not ids:
                continue
            hits += lookup(ids).hits
            refs += len(ids)
            put(ids, src, idx[: len(ids)])
            if progress is not None and i % 256 == 0:
                progress(i)
        dt = time.perf_counter() - t0
        st = store.stats()
    finally:
        store.close()
        if seaweed is not None:
            seaweed.stop()
        if tmp is not None and workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {
        "requests": len(requests),
        "block_refs": refs,
        "hits": hits,
        "hit_rate": hits / refs if refs else 0.0,
        "tier_hits": {f"{i}:{t['medium']}": t["hits"] for i, t in enumerate(st.tiers)},
        "tiers": st.tiers,
        "policy": policy,
        "capacity": capacity,
        "disk": disk,
        "s3": s3,
        "block_bytes": block_bytes,
        "seconds": dt,
        "ops_per_s": refs / dt if dt > 0 else float("inf"),
    }


def main(a: argparse.Namespace) -> int:
    if a.capacity < 1:
        print("kvx replay: --capacity must be >= 1", file=sys.stderr)
        return 2
    try:
        reqs = load_requests(a.trace, a.limit)
    except (OSError, ValueError) as exc:
        print(f"kvx replay: {exc}", file=sys.stderr)
        return 2
    bar = None
    prog = None
    if not a.json:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), unit="req", file=sys.stderr, leave=False)
            last = [0]

            def prog(i: int) -> None:
                bar.update(i - last[0])
                last[0] = i
        except ImportError:
            pass
    res = replay(reqs, a.capacity, disk=a.disk, s3=a.s3, policy=a.policy or DEFAULT_POLICY,
                 block_bytes=a.block_bytes, progress=prog)
    if bar is not None:
        bar.close()
    if a.json:
        print(json.dumps({k: v for k, v in res.items() if k != "tiers"}))
    else:
        print(f"{os.path.basename(a.trace)}: {res['requests']} requests, {res['block_refs']} block refs, "
              f"policy {res['policy']}, capacity {a.capacity} blocks"
              + (f" + disk {a.disk}" if a.disk else "") + (f" + s3 {a.s3}" if a.s3 else ""))
        print(f"hit rate {res['hit_rate']:.4f}   {res['ops_per_s']:,.0f} block lookups+inserts/s "
              f"({res['seconds']:.2f} s)")
        for i, t in enumerate(res["tiers"]):
            print(f"  tier {i} {t['medium']:6s} used {t['used']}/{t['capacity']}  hits {t['hits']}  "
                  f"stored {t['stored']}  evicted {t['evicted']}  demoted {t['demoted']}  promoted {t['promoted']}")
    return 0
