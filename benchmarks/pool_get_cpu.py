"""CPU and wall time per ``Pool.get``: checksums taken in the tcp receive vs a second pass.

The workload of ``kvx bench --backend pool`` (four member processes of 1 GiB, one client, batches
of 128 registered blocks, loopback tcp), one pool per block size. After the puts, the same client
alternates ``--rounds`` times between the two ways of checking a get (``Pool._sums_in_copy``):

- ``reread``: the code before (the tcp read lands the blocks, then kvx-nh64 over each landed
  block in the client);
- ``in-recv``: the tcp receive hashes each block right after the kernel copied it
  (``TcpBackend.keep_digests``) and the pool compares those digests.

Per mode and round: ``--gets`` gets (after 3 warm-up ones), each checked byte for byte after the
timing; wall GB/s = bytes / sum of get times, p50/p99 of the get times, and CPU per get = the
client process's CPU time (every thread) plus every member's (``/proc/PID/stat`` utime + stime)
over the timed gets, divided by their number (and the client's part alone). JSON with ``--json``.

    PYTHONPATH=. python benchmarks/pool_get_cpu.py --block-sizes 65536,524288 --rounds 3 --gets 60
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

from kvx.bench.pool import _Etcd, _members, _stop, client_buffers
from kvx.pool import Pool, PoolConfig

TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / TICK  # utime, stime (fields 14, 15)


def _run_size(etcd: str, bs: int, batch: int, gets: int, rounds: int, members: int, mbytes: int
              ) -> list[dict[str, Any]]:
    name = f"cpu-{bs}"
    procs = _members(etcd, name, members, mbytes, bs)
    rows: list[dict[str, Any]] = []
    try:
        with Pool("client", etcd=etcd, pool=name, capacity=0, block_bytes=bs,
                  options=PoolConfig(refresh=0.2, timeout=30.0, near=False)) as c:
            src, dst, ps, pd = client_buffers(c, members, batch, bs)
            perm = np.random.default_rng(8).permutation(batch)
            ident = np.arange(batch)
            nb = 4
            names = []
            for it in range(nb):
                keys = [f"c{bs}-{it}-{i}".encode() for i in range(batch)]
                if c.put(keys, ps, perm) != batch:
                    raise RuntimeError(f"put stored fewer than {batch} blocks: {c.stats()}")
                names.append(keys)
            want = src.reshape(batch, bs)[perm]
            for rnd in range(rounds):
                for mode in ("reread", "in-recv"):
                    c._sums_in_copy = mode == "in-recv"
                    before = dict(c.stats())
                    for it in range(3):  # warm-up
                        c.get(names[it % nb], pd, ident)
                    ts = []
                    c0, m0 = time.process_time(), sum(_proc_cpu(p.pid) for p in procs)
                    for it in range(gets):
                        t = time.perf_counter()
                        n = c.get(names[it % nb], pd, ident)
                        ts.append(time.perf_counter() - t)
                        if n != batch:
                            raise RuntimeError(f"get served {n} of {batch} blocks")
                    ccpu, mcpu = time.process_time() - c0, sum(_proc_cpu(p.pid) for p in procs) - m0
                    cpu = ccpu + mcpu
                    if not np.array_equal(dst.reshape(batch, bs), want):
                        raise RuntimeError("wrong bytes after the gets")
                    after = c.stats()
                    a = np.asarray(ts)
                    rows.append({"block": bs, "mode": mode, "round": rnd, "gets": gets,
                                 "gbps": batch * bs * gets / a.sum() / 1e9,
                                 "p50_ms": float(np.percentile(a, 50) * 1e3),
                                 "p99_ms": float(np.percentile(a, 99) * 1e3),
                                 "cpu_ms_per_get": cpu / gets * 1e3,
                                 "client_cpu_ms_per_get": ccpu / gets * 1e3,
                                 "members_cpu_ms_per_get": mcpu / gets * 1e3,
                                 "sums_in_copy": after.get("sums_in_copy", 0) - before.get("sums_in_copy", 0),
                                 "sums_reread": after.get("sums_reread", 0) - before.get("sums_reread", 0)})
                    r = rows[-1]
                    print(f"{bs >> 10:4d} KiB {mode:8s} round {rnd}: {r['gbps']:.2f} GB/s p50 {r['p50_ms']:.1f} "
                          f"p99 {r['p99_ms']:.1f} ms, {r['cpu_ms_per_get']:.2f} ms CPU/get "
                          f"(client {r['client_cpu_ms_per_get']:.2f}, members {r['members_cpu_ms_per_get']:.2f}) "
                          f"(in-recv sums {r['sums_in_copy']}, re-read {r['sums_reread']})", flush=True)
    finally:
        _stop(procs)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default="65536,524288")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--gets", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--member-bytes", type=int, default=1 << 30)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    etcd = _Etcd()
    rows: list[dict[str, Any]] = []
    try:
        for bs in [int(x) for x in a.block_sizes.split(",")]:
            rows += _run_size(etcd.endpoint, bs, a.batch, a.gets, a.rounds, a.members, a.member_bytes)
    finally:
        etcd.close()
    print("| block | mode | GB/s (rounds) | p99 ms (rounds) | ms CPU/get (rounds) | client ms CPU/get |")
    print("|---|---|---|---|---|---|")
    for bs in sorted({r["block"] for r in rows}):
        for mode in ("reread", "in-recv"):
            rs = [r for r in rows if r["block"] == bs and r["mode"] == mode]
            cols = [", ".join(f"{r[k]:{fmt}}" for r in rs)
                    for k, fmt in (("gbps", ".2f"), ("p99_ms", ".1f"), ("cpu_ms_per_get", ".2f"),
                                   ("client_cpu_ms_per_get", ".2f"))]
            print(f"| {bs >> 10} KiB | {mode} | {' | '.join(cols)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": platform.node(), "cpus": os.cpu_count(), "load": os.getloadavg(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
