"""A stress loop for :class:`kvx.tiers.TieredStore` (issue 26): puts, gets and deletes of random
keys through a tiny host tier over a small disk tier (optionally an object tier below), every
block's bytes derived from its key, so a get that returns other bytes is caught at once.

The store's promise is checked on every operation: a block is served exactly as it was put or
reported missing, and nothing is dropped without a fault (no checksum failure, no failed
write-back: nothing corrupts the disk here). Run it beside a CPU hog to shake out races::

    python -m kvx.testing.tier_stress --seconds 60 --seeds 15,1,2 --threads 1 --hog
    python -m kvx.testing.tier_stress --seconds 600 --seeds 15 --threads 2 --hog --json out/stress.json

``--threads 1`` is one thread doing everything (the issue's loop); ``--threads 2`` is one thread
putting and deleting while another gets. Each seed runs in its own process, all at once; the
report (one JSON object per seed, and the totals) counts operations, wrong bytes and drops. The
exit status is 1 when any seed saw wrong bytes or a drop.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import logging
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

import kvx
from kvx.tiers import DiskTier, HostTier, ObjectTier, TieredStore

__all__ = ["content", "run_seed", "main"]

BB = 64 << 10
KEYS = 400


def content(key: int, bb: int = BB) -> np.ndarray:
    """The bytes of block ``key``: a SHA-256 of the key, repeated."""
    return np.frombuffer(hashlib.sha256(str(key).encode()).digest() * (bb // 32), dtype=np.uint8)


class _Drops(logging.Handler):
    """Counts the store's checksum-drop warnings (the stats count them too; this names them)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "checksum" in msg or "write-back" in msg:
            self.seen.append(msg)


def _store(path: str, host_blocks: int, disk_blocks: int, s3: dict[str, Any] | None) -> TieredStore:
    tiers: list[Any] = [HostTier(blocks=host_blocks), DiskTier(os.path.join(path, "disk"), blocks=disk_blocks)]
    if s3 is not None:
        tiers.append(ObjectTier(s3["bucket"], blocks=s3.get("blocks", 96), prefix=s3.get("prefix", "stress"),
                                pack_blocks=4, journal=os.path.join(path, "objects")))
    return TieredStore(tiers, block_bytes=BB)


def run_seed(path: str, seed: int, seconds: float, threads: int = 1, host_blocks: int = 4,
             disk_blocks: int = 48, s3: dict[str, Any] | None = None, max_ops: int | None = None) -> dict[str, Any]:
    """Run the loop for ``seconds`` (or ``max_ops`` operations) on a store under ``path``; return
    the counts. Stops early at the first wrong bytes or drop."""
    handler = _Drops()
    logging.getLogger("kvx.tiers").addHandler(handler)
    store = _store(path, host_blocks, disk_blocks, s3)
    counts: dict[str, Any] = {"seed": seed, "threads": threads, "ops": 0, "puts": 0, "gets": 0, "hits": 0, "deletes": 0,
              "wrong": 0, "drops": 0, "errors": 0, "max_op_s": 0.0}
    first: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    t_end = time.monotonic() + seconds

    def bump(**kw: int) -> None:
        with lock:
            for k, v in kw.items():
                counts[k] += v
            if max_ops is not None and counts["ops"] >= max_ops:
                stop.set()

    def loop(rng: random.Random, do_put: bool, do_get: bool) -> None:
        src = np.zeros(BB * 8, np.uint8)
        spl = store.agent.prepare(kvx.DescList.blocks(store.agent.register(src), BB))
        dst = np.zeros(BB, np.uint8)
        dpl = store.agent.prepare(kvx.DescList.blocks(store.agent.register(dst), BB))
        pput = 0.6 if do_get else 0.85  # a putting-only thread also deletes
        pget = 0.9 if do_put else 1.0
        last = [time.monotonic()]
        try:
            while not stop.is_set() and time.monotonic() < t_end:
                t_op = time.monotonic()
                if t_op - last[0] > counts["max_op_s"]:  # the longest operation (a stall shows here)
                    with lock:
                        counts["max_op_s"] = max(counts["max_op_s"], round(t_op - last[0], 3))
                last[0] = t_op
                r = rng.random()
                if do_put and r < pput:
                    keys = list(dict.fromkeys(rng.randrange(KEYS) for _ in range(rng.randint(1, 8))))
                    for j, k in enumerate(keys):  # the source buffer is reused at once
                        src[j * BB:(j + 1) * BB] = content(k)
                    store.put(keys, spl, list(range(len(keys))))
                    bump(ops=1, puts=1)
                elif do_get and r < pget:
                    k = rng.randrange(KEYS)
                    try:
                        store.get([k], dpl)
                    except kvx.BlockNotFound:
                        bump(ops=1, gets=1)
                        continue
                    if not np.array_equal(dst, content(k)):
                        first.append(f"get({k}) returned other bytes")
                        bump(ops=1, gets=1, hits=1, wrong=1)
                        stop.set()
                    else:
                        bump(ops=1, gets=1, hits=1)
                elif do_put:
                    store.delete([rng.randrange(KEYS)])
                    bump(ops=1, deletes=1)
                if handler.seen:
                    stop.set()
        except Exception as exc:
            first.append(f"{type(exc).__name__}: {exc}")
            bump(errors=1)
            stop.set()

    try:
        if threads == 1:
            loop(random.Random(seed), True, True)
        else:
            ths = [threading.Thread(target=loop, args=(random.Random(seed), True, False), name="stress-put"),
                   threading.Thread(target=loop, args=(random.Random(seed + 1_000_003), False, True),
                                    name="stress-get")]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        store.flush()
        st = store.stats()
        counts["drops"] = sum(t["corrupt"] + t["writeback_errors"] for t in st.tiers)
        counts["drops"] = max(counts["drops"], len(handler.seen))
    finally:
        store.close()
        logging.getLogger("kvx.tiers").removeHandler(handler)
    counts["first"] = (first + handler.seen)[:3]
    return counts


def _child(args: tuple[str, int, float, int, dict[str, Any] | None], q: Any) -> None:
    path, seed, seconds, threads, s3 = args
    # a crash prints its stack, and a seed that has not answered well after its time dumps every
    # thread's stack to stderr (the parent reports it as hung 240 s after the time): a failure in
    # CI then names where it happened
    faulthandler.enable()
    faulthandler.dump_traceback_later(seconds + 180, exit=False)
    try:
        q.put(run_seed(path, seed, seconds, threads, s3=s3))
    except BaseException as exc:
        q.put({"seed": seed, "threads": threads, "errors": 1, "first": [f"{type(exc).__name__}: {exc}"]})


def _hog(seconds: float) -> None:
    t_end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < t_end:
        for _ in range(100_000):
            x += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.testing.tier_stress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="per seed (all seeds run at once)")
    ap.add_argument("--seeds", default="15,1", help="comma-separated seeds, one process each")
    ap.add_argument("--threads", type=int, choices=(1, 2), default=1)
    ap.add_argument("--hog", action="store_true", help="keep a core busy in another process meanwhile")
    ap.add_argument("--dir", default=None, help="where the disk tiers go (default: a temporary directory)")
    ap.add_argument("--json", default=None, help="write the report here too")
    a = ap.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"kvx stress: --seeds takes integers separated by commas, not {a.seeds!r}", file=sys.stderr)
        return 2
    if not seeds or a.seconds <= 0:
        print("kvx stress: give at least one seed and a positive --seconds", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvx-stress-") as tmp:
        hog = ctx.Process(target=_hog, args=(a.seconds + 5,), daemon=True) if a.hog else None
        if hog is not None:
            hog.start()
        procs = [ctx.Process(target=_child, args=((os.path.join(tmp, f"s{s}"), s, a.seconds, a.threads, None), q))
                 for s in seeds]
        for p in procs:
            p.start()
        results: list[dict[str, Any]] = []
        deadline = time.monotonic() + a.seconds + 240  # a store's waits are bounded (60 s each)
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(q.get(timeout=1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs):  # a child died without answering
                    try:
                        results.append(q.get(timeout=1.0))
                    except queue.Empty:
                        break
        codes = {s: p.exitcode for s, p in zip(seeds, procs)}
        for s in set(seeds) - {r["seed"] for r in results}:
            why = "no answer: hung" if codes[s] is None else f"no answer: exited with {codes[s]}"
            results.append({"seed": s, "threads": a.threads, "errors": 1, "first": [why]})
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if hog is not None:
            hog.terminate()
            hog.join(timeout=5)
    results.sort(key=lambda r: r["seed"])
    total = {k: sum(int(r.get(k, 0)) for r in results) for k in ("ops", "puts", "gets", "hits", "deletes",
                                                                    "wrong", "drops", "errors")}
    report = {"seconds": a.seconds, "threads": a.threads, "hog": a.hog, "seeds": results, "total": total}
    for r in results:
        print(f"seed {r['seed']:>4}: {r.get('ops', 0):>9} ops  wrong {r.get('wrong', 0)}  drops {r.get('drops', 0)}"
              f"  errors {r.get('errors', 0)}  longest op {r.get('max_op_s', 0):.2f} s"
              + (f"  first: {r['first'][0]}" if r.get("first") else ""))
    print(f"total: {total['ops']} ops, {total['wrong']} wrong, {total['drops']} drops, {total['errors']} errors")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if total["wrong"] or total["drops"] or total["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
