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

from ..errors import KVXError
from .policies import DEFAULT_POLICY
from .store import DiskTier, HostTier, ObjectTier, Tier, TieredStore

__all__ = ["replay", "load_requests", "main"]


def load_requests(path: str, limit: int = 0) -> list[list[int]]:
    """hash_ids per request, in trace order (``limit`` > 0: only the first ``limit``).

    Raises
    ------
    ValueError
        A line that is not a JSON object with a ``hash_ids`` list of integers (named by number).
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    out: list[list[int]] = []
    with open(path, "rb") as f:
        for no, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{path}:{no}: not JSON ({exc})") from None
            ids = rec.get("hash_ids") if isinstance(rec, dict) else None
            if not isinstance(ids, list):
                raise ValueError(f"{path}:{no}: not a JSON object with a hash_ids list")
            for h in ids:
                if type(h) is not int:
                    raise ValueError(f"{path}:{no}: hash_ids must be integers, found {type(h).__name__}")
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
            if progress is not None and i % 64 == 0:
                progress(i, hits, refs)
        dt = time.perf_counter() - t0
        if progress is not None:
            progress(len(requests), hits, refs)
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


class Progress:
    """A one-line live bar on ``stream``: requests done, hit rate so far, block-ops/s."""

    def __init__(self, total: int, stream: Any = None, every: float = 0.2) -> None:
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, hits: int, refs: int) -> None:
        now = time.perf_counter()
        if now - self._last < self.every and done < self.total:
            return
        self._last = now
        frac = min(1.0, done / self.total)
        width = 30
        fill = int(frac * width)
        rate = hits / refs if refs else 0.0
        ops = refs / (now - self.t0) if now > self.t0 else 0.0
        self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} req  "
                          f"hit rate {rate:.4f}  {ops:,.0f} block-ops/s ")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _check_args(a: argparse.Namespace) -> str | None:
    """The first problem with the arguments of ``kvx replay``, or None."""
    from .policies import POLICIES

    if a.capacity < 1:
        return "--capacity must be >= 1"
    if a.block_bytes < 1:
        return "--block-bytes must be >= 1"
    for name in ("disk", "s3", "limit"):
        if getattr(a, name) < 0:
            return f"--{name} must be >= 0"
    if a.policy is not None and a.policy.lower() not in POLICIES:
        return f"unknown --policy {a.policy!r}; known: {', '.join(sorted(POLICIES))}"
    need = a.capacity * a.block_bytes
    try:
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        mem = 0
    if mem and need > mem:
        return (f"--capacity {a.capacity} x --block-bytes {a.block_bytes} = {need} bytes exceeds this "
                f"machine's memory ({mem})")
    if a.disk:
        base = os.environ.get("TMPDIR") or tempfile.gettempdir()
        try:
            st = os.statvfs(base)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = 0
        if free and a.disk * a.block_bytes > free:
            return (f"--disk {a.disk} x --block-bytes {a.block_bytes} bytes exceeds the free space of {base} "
                    f"({free})")
    return None


def main(a: argparse.Namespace) -> int:
    """``kvx replay``: bad arguments, an unreadable trace or a failing tier give one line on
    stderr and exit status 2."""
    bad = _check_args(a)
    if bad:
        print(f"kvx replay: {bad}", file=sys.stderr)
        return 2
    try:
        reqs = load_requests(a.trace, a.limit)
    except (OSError, ValueError) as exc:
        print(f"kvx replay: {exc}", file=sys.stderr)
        return 2
    show = getattr(a, "progress", False) or (not a.json and sys.stderr.isatty())
    bar = Progress(len(reqs)) if show else None
    try:
        res = replay(reqs, a.capacity, disk=a.disk, s3=a.s3, policy=a.policy or DEFAULT_POLICY,
                     block_bytes=a.block_bytes, progress=bar)
    except (KVXError, OSError, MemoryError) as exc:
        if bar is not None:
            bar.close()
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"kvx replay: {type(exc).__name__}: {msg}", file=sys.stderr)
        return 2
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
