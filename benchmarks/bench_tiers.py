"""Tier I/O benchmarks of issue 19, side by side in one run.

    .venv/bin/python benchmarks/bench_tiers.py [--base 27cdcfb,b4af9a6] [--limit 1000] [--skip-replay]

1. ``kvx replay`` through host + disk + SeaweedFS objects (one SeaweedFS for both runs), the
   code of ``--base`` (extracted with ``git archive`` into a temporary directory, sharing this
   tree's built native extension) against this tree: hit rate and block-ops/s of each.
2. ``get`` of a 64-block prefix from the disk tier (page cache warm, as ``kvx bench``'s ``kvx``
   row) against ``kvx bench --backend posix --op read`` at the same block size and transfer
   size, in the same run.

Prints a markdown table of each.
"""

from __future__ import annotations

import argparse
import glob
import json
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


def bench_get(bs: int, iters: int) -> None:
    n = 64
    tmp = tempfile.mkdtemp(prefix="kvx-bench-tiers-get-", dir="/tmp")
    try:
        with TieredStore([HostTier(blocks=n), DiskTier(tmp, blocks=4 * n)], block_bytes=bs, policy="lru") as st:
            data = np.random.default_rng(0).integers(0, 256, n * bs, dtype=np.uint8)
            src = st.agent.prepare(kvx.DescList.blocks(st.agent.register(data), bs))
            sets = [list(range(c * 1000, c * 1000 + n)) for c in range(3)]
            for keys in sets:  # A, B, C: A and B end up on disk (and stay there: persistent)
                st.put(keys, src)
            st.flush()
            pool = kvx.alloc_host(n * bs)  # the destination: host memory as kvx bench's (alloc_host)
            out = np.frombuffer(pool.data, np.uint8)
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(pool), bs))
            for keys in (sets[0], sets[1], sets[0], sets[1]):  # warm up; C lands on disk too
                st.get(keys, dst)
            st.flush()
            ts = []
            tf = []
            tp = []
            disk = st.tiers[1]
            assert disk.plist is not None
            for i in range(iters):  # alternate: every get reads its 64 blocks from disk
                keys = sets[i % 2]
                assert st.lookup(keys).tiers == (1,) * n
                # the ceiling, interleaved: one plain posix read of the same 64 slots into dst
                slots = [disk.index[k][0] for k in keys]
                t0 = time.perf_counter()
                st.agent.read(dst, list(range(n)), disk.plist, slots).wait(60)
                tp.append(time.perf_counter() - t0)
                out[:] = 0
                t0 = time.perf_counter()
                assert st.get(keys, dst) == n
                ts.append(time.perf_counter() - t0)
                st.flush()  # the promotions to the host tier (background jobs) land
                tf.append(time.perf_counter() - t0)
                assert np.array_equal(out, data)
            get_gbps = n * bs / statistics.median(ts) / 1e9
            getf_gbps = n * bs / statistics.median(tf) / 1e9
            plain_gbps = n * bs / statistics.median(tp) / 1e9
        jpath = os.path.join(tmp, "posix.json")
        r = subprocess.run([sys.executable, "-m", "kvx.cli", "bench", "--backend", "posix", "--op", "read",
                            "--block-sizes", f"{bs >> 10}K", "--total", f"{n * bs >> 10}K", "--iters", str(iters),
                            "--latency-samples", "0", "--quiet", "--json", jpath], capture_output=True, text=True,
                           timeout=900)
        if r.returncode:
            raise RuntimeError(r.stderr[-2000:])
        with open(jpath) as f:
            doc = json.load(f)
        rows = doc["rows"] if isinstance(doc, dict) else doc
        posix = next(x for x in rows if x["impl"] == "kvx" and x["op"] == "read")
        print(f"\nget of a {n}-block prefix from the disk tier vs kvx bench --backend posix read "
              f"({bs >> 10} KiB blocks, {n * bs >> 20} MiB per transfer, page cache warm, median of {iters})\n")
        print("| path | GB/s | ratio |")
        print("|---|---|---|")
        print(f"| kvx bench --backend posix read (row kvx) | {posix['gbps']:.2f} | 1.00 |")
        print(f"| plain posix read of the same 64 disk slots into the destination (agent.read, interleaved) | "
              f"{plain_gbps:.2f} | {plain_gbps / posix['gbps']:.2f} |")
        print(f"| TieredStore.get, 64 blocks from disk (checksummed in the destination) | {get_gbps:.2f} | "
              f"{get_gbps / posix['gbps']:.2f} |")
        print(f"| the same get + flush() (its 64 promotions to the host tier landed) | {getf_gbps:.2f} | "
              f"{getf_gbps / posix['gbps']:.2f} |")
        print(f"\nget / plain read of the same slots: {get_gbps / plain_gbps:.2f}x; checksums: "
              f"{checksum.IMPL}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="27cdcfb,b4af9a6",
                    help="git refs of the codes to compare against, comma-separated (ratios to the first)")
    ap.add_argument("--limit", type=int, default=1000, help="requests of the trace to replay")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--block-bytes", type=int, default=256 << 10, help="block size of the get benchmark")
    ap.add_argument("--iters", type=int, default=9)
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
        bench_get(a.block_bytes, a.iters)


if __name__ == "__main__":
    main()
