"""Tier I/O benchmarks of issue 19, side by side in one run.

    .venv/bin/python benchmarks/bench_tiers.py [--base 27cdcfb,b4af9a6] [--limit 1000] [--skip-replay]

1. ``kvx replay`` through host + disk + SeaweedFS objects (one SeaweedFS for both runs), the
   code of ``--base`` (extracted with ``git archive`` into a temporary directory, sharing this
   tree's built native extension) against this tree: hit rate and block-ops/s of each.
2. ``get`` of a 64-block prefix from the disk tier against ``kvx bench --backend posix --op
   read`` at the same block size and transfer size, in the same run, measured alike: the bench
   row re-reads the same 16 MiB back-to-back (page cache warm, and on a CPU with a 32 MiB L3
   much of it stays in the CPU's caches between runs), so the get is timed the same way (the
   same blocks back-to-back, ``kvx.bench.timing.timed``, the same kind of destination, the page
   cache dropped before the first read where permitted) -- and, for reference, as an engine
   would see it (default store, alternating sets, caches cold), next to a plain read timed alike.

Prints a markdown table of each.
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import kvx  # noqa: E402
from kvx.bench.posix import drop_caches  # noqa: E402
from kvx.bench.timing import timed  # noqa: E402
from kvx.tiers import DiskTier, HostTier, TieredStore, checksum  # noqa: E402

TRACE = "/work/shared/traces/mooncake_conversation_trace.jsonl"


def extract_base(ref: str, into: str) -> str:
    """The ``kvx`` package of ``ref`` under ``into`` (python files from git, native from here)."""
    arch = subprocess.run(["git", "-C", ROOT, "archive", ref, "kvx"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=arch, check=True)
    for so in glob.glob(os.path.join(ROOT, "kvx", "*.so")):
        shutil.copy(so, os.path.join(into, "kvx"))
    return into


def replay(pythonpath: str, args: list[str], env: dict[str, str]) -> dict:
    e = dict(os.environ, **env, PYTHONPATH=pythonpath)
    r = subprocess.run([sys.executable, "-m", "kvx.cli", "replay", *args, "--json"], capture_output=True,
                       text=True, env=e, cwd=tempfile.gettempdir(), timeout=3600)
    if r.returncode:
        raise RuntimeError(f"replay failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def bench_replay(base_ref: str, limit: int, trace: str, policy: str) -> None:
    from kvx.testing.seaweed import SeaweedFS

    tmp = tempfile.mkdtemp(prefix="kvx-bench-tiers-")
    sw = SeaweedFS()
    sw.start()
    try:
        codes = [(f"main {ref}" if i == 0 else f"{ref}", extract_base(ref, _mk(tmp, f"base{i}")))
                 for i, ref in enumerate(base_ref.split(","))]
        args = [trace, "--capacity", "1000", "--disk", "4000", "--s3", "2000", "--limit", str(limit),
                "--policy", policy]
        rows = []
        for name, path in (*codes, ("this tree", ROOT)):
            t0 = time.perf_counter()
            res = replay(path, args, sw.env())
            rows.append((name, res, time.perf_counter() - t0))
        print(f"\nkvx replay {os.path.basename(trace)} --capacity 1000 --disk 4000 --s3 2000 --limit {limit}"
              f" --policy {policy} (SeaweedFS on loopback)\n")
        print("| code | hit rate | tier hits | block refs | seconds | block-ops/s | ratio |")
        print("|---|---|---|---|---|---|---|")
        b = rows[0][1]["ops_per_s"]
        for name, res, _wall in rows:
            print(f"| {name} | {res['hit_rate']:.4f} | {res['tier_hits']} | {res['block_refs']} | "
                  f"{res['seconds']:.1f} | {res['ops_per_s']:,.0f} | {res['ops_per_s'] / b:.1f}x |")
    finally:
        sw.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _mk(tmp: str, name: str) -> str:
    p = os.path.join(tmp, name)
    os.makedirs(p)
    return p


def _anon(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """A destination as ``kvx bench --backend posix`` has: anonymous private memory."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, np.frombuffer(m, dtype=np.uint8)


def _disk_hits(st: TieredStore) -> int:
    return int(st.stats().tiers[1]["hits"])


def posix_bench(bs: int, n: int, iters: int, op: str, tmp: str) -> float:
    """GB/s of ``kvx bench --backend posix``'s ``kvx`` read row (``--op read`` or ``both``)."""
    jpath = os.path.join(tmp, f"posix-{op}.json")
    r = subprocess.run([sys.executable, "-m", "kvx.cli", "bench", "--backend", "posix", "--op", op,
                        "--block-sizes", f"{bs >> 10}K", "--total", f"{n * bs >> 10}K", "--iters", str(iters),
                        "--latency-samples", "0", "--quiet", "--json", jpath], capture_output=True, text=True,
                       timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    with open(jpath) as f:
        doc = json.load(f)
    rows = doc["rows"] if isinstance(doc, dict) else doc
    return float(next(x for x in rows if x["impl"] == "kvx" and x["op"] == "read")["gbps"])


def bench_get(bs: int, iters: int, rounds: int) -> None:
    """The get of a 64-block prefix from the disk tier next to ``kvx bench --backend posix``'s
    read row, measured alike: see the table's notes (printed with it)."""
    n = 64
    tmp = tempfile.mkdtemp(prefix="kvx-bench-tiers-get-", dir="/tmp")
    mm, out = _anon(n * bs)
    try:
        data = np.random.default_rng(0).integers(0, 256, n * bs, dtype=np.uint8)
        sets = [list(range(c * 1000, c * 1000 + n)) for c in range(3)]
        # 1. fill a disk tier (A, B, C: with a 64-block host tier, A and B end up on disk only) and close
        with TieredStore([HostTier(blocks=n), DiskTier(tmp, blocks=4 * n)], block_bytes=bs, policy="lru") as st:
            src = st.agent.prepare(kvx.DescList.blocks(st.agent.register(data), bs))
            for keys in sets:
                st.put(keys, src)
            st.flush()
        dropped = drop_caches()  # as kvx bench does before its read phase (root only): the first read is cold

        # 2. alike: a new store recovers the tier; the same 64 blocks read back-to-back, timed as kvx bench
        #    times (kvx.bench.timing.timed: warm-up, then `iters` runs, median), into the same kind of
        #    destination; promote=False keeps them on disk, so every timed get reads all 64 from the slab.
        #    `rounds` rounds, each: the kvx bench reference (a subprocess), the get, the plain read -- so
        #    the three see the same moments of a shared machine; medians over the rounds
        with TieredStore([HostTier(blocks=n), DiskTier(tmp, blocks=4 * n)], block_bytes=bs, policy="lru",
                         promote=False) as st:
            keys = sets[0]
            assert st.lookup(keys).tiers == (1,) * n, "set A must be on disk only"
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(out), bs))
            disk = st.tiers[1]
            assert disk.plist is not None
            slots = [disk.index[k][0] for k in keys]
            rows = list(range(n))

            def plain() -> None:
                st.agent.read(dst, rows, disk.plist, slots).wait(60)

            def get() -> None:
                if st.get(keys, dst) != n:
                    raise RuntimeError("get returned fewer blocks")

            ref_both, ref_read, get_meds, plain_meds = [], [], [], []
            gets = 0
            for _ in range(rounds):
                ref_both.append(posix_bench(bs, n, iters, "both", tmp))
                ref_read.append(posix_bench(bs, n, iters, "read", tmp))
                out[:] = 0
                h0 = _disk_hits(st)
                get_meds.append(timed(get, iters)[0])
                gets += (_disk_hits(st) - h0) // n
                if not np.array_equal(out, data) or st.lookup(keys).tiers != (1,) * n:
                    raise RuntimeError("get: wrong bytes, or the blocks left the disk tier")
                out[:] = 0
                plain_meds.append(timed(plain, iters)[0])
                if not np.array_equal(out, data):
                    raise RuntimeError("plain read: wrong bytes")
            get_med, plain_med = statistics.median(get_meds), statistics.median(plain_meds)

        # 3. the default store (promote=True), as an engine would see it: alternate A and B, so that
        #    every get reads its 64 blocks from disk while the other set sits in the host tier; the
        #    promotions land (flush) between gets, and the destination is zeroed and checked after
        #    each -- so nothing is warm in the CPU caches; the plain read is interleaved the same way
        with TieredStore([HostTier(blocks=n), DiskTier(tmp, blocks=4 * n)], block_bytes=bs, policy="lru") as st:
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(out), bs))
            disk = st.tiers[1]
            assert disk.plist is not None
            for keys in (sets[0], sets[1]):
                st.get(keys, dst)
            st.flush()
            ts, tf, tp = [], [], []
            for i in range(iters + 2):
                keys = sets[i % 2]
                if st.lookup(keys).tiers != (1,) * n:
                    raise RuntimeError("the set to read is not on disk only")
                slots = [disk.index[k][0] for k in keys]
                t0 = time.perf_counter()
                st.agent.read(dst, list(range(n)), disk.plist, slots).wait(60)
                t1 = time.perf_counter()
                out[:] = 0
                t2 = time.perf_counter()
                assert st.get(keys, dst) == n
                t3 = time.perf_counter()
                st.flush()  # its 64 promotions to the host tier are decided and land
                t4 = time.perf_counter()
                if not np.array_equal(out, data):
                    raise RuntimeError("get (default store): wrong bytes")
                if i >= 2:  # the first two: warm-up
                    tp.append(t1 - t0)
                    ts.append(t3 - t2)
                    tf.append(t4 - t2)
            cold_get, cold_getf, cold_plain = (statistics.median(x) for x in (ts, tf, tp))

        ref_zero = statistics.median(ref_read)
        ref = statistics.median(ref_both)

        def g(t: float) -> float:
            return n * bs / t / 1e9

        print(f"\nget of a {n}-block prefix from the disk tier vs kvx bench --backend posix read "
              f"({bs >> 10} KiB blocks, {n * bs >> 20} MiB per transfer, page cache warm, median of {iters}, "
              f"alike rows: median of {rounds} interleaved rounds, each round's value in parentheses; "
              f"checksums: {checksum.IMPL}; page cache dropped before the first read: {dropped})\n")
        print("| path | what is timed | GB/s | ratio to the bench row |")
        print("|---|---|---|---|")
        print(f"| kvx bench --backend posix --op both, read row kvx (the reference) | "
              f"the same 64 permuted blocks of a 16 MiB file of random bytes (its write phase wrote them; page "
              f"cache dropped, one warm-up) re-read back-to-back into one anonymous buffer | "
              f"{ref:.2f} ({', '.join(f'{x:.2f}' for x in ref_both)}) | 1.00 |")
        print(f"| kvx bench --backend posix --op read, row kvx | the same from a read-only run (the bench fills "
              f"the file with a pattern first) | {ref_zero:.2f} ({', '.join(f'{x:.2f}' for x in ref_read)}) | "
              f"{ref_zero / ref:.2f} |")
        print(f"| plain agent.read of the 64 disk-tier slots, alike | the same 64 slab slots re-read back-to-back "
              f"into one anonymous buffer (timed as the bench row) | {g(plain_med):.2f} "
              f"({', '.join(f'{g(x):.2f}' for x in plain_meds)}) | {g(plain_med) / ref:.2f} |")
        print(f"| **TieredStore.get, 64 blocks from disk, alike** | get(A) back-to-back ({gets} gets, each 64 disk "
              f"hits, checksummed in the copy), promote=False | **{g(get_med):.2f}** "
              f"({', '.join(f'{g(x):.2f}' for x in get_meds)}) | **{g(get_med) / ref:.2f}** |")
        print(f"| plain agent.read, CPU caches cold | alternating sets A/B, interleaved with the gets below | "
              f"{g(cold_plain):.2f} | {g(cold_plain) / ref:.2f} |")
        print(f"| TieredStore.get, default store, CPU caches cold | get(A), get(B), ... each 64 disk hits; "
              f"promotions decided after the get | {g(cold_get):.2f} | {g(cold_get) / ref:.2f} |")
        print(f"| the same get + flush() | until its 64 promotions to the host tier landed | {g(cold_getf):.2f} | "
              f"{g(cold_getf) / ref:.2f} |")
        print(f"\nget / plain read of the same slots: alike {plain_med / get_med:.2f}x, "
              f"caches cold {cold_plain / cold_get:.2f}x")
        print(f"get (alike) / kvx bench read rows: --op both {g(get_med) / ref:.2f}x, "
              f"--op read {g(get_med) / ref_zero:.2f}x")
    finally:
        del out
        try:
            mm.close()
        except BufferError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="27cdcfb,b4af9a6",
                    help="git refs of the codes to compare against, comma-separated (ratios to the first)")
    ap.add_argument("--limit", type=int, default=1000, help="requests of the trace to replay")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--block-bytes", type=int, default=256 << 10, help="block size of the get benchmark")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the get benchmark")
    ap.add_argument("--policy", default="lru",
                    help="replay policy (lru: the same decisions in both codes, so the hit rates must match)")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--skip-get", action="store_true")
    a = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, python "
          f"{sys.version.split()[0]}")
    if not a.skip_replay:
        bench_replay(a.base, a.limit, a.trace, a.policy)
    if not a.skip_get:
        bench_get(a.block_bytes, a.iters, a.rounds)


if __name__ == "__main__":
    main()
