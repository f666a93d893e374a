"""Time ``DescList.blocks`` + ``prepare`` of 1,048,576 descriptors (local and against a peer).

Run: python benchmarks/bench_prepare.py [--n 1048576] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvx


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with kvx.Agent("prep-a") as x, kvx.Agent("prep-b") as y:
        buf = kvx.alloc_host(a.n * a.block)  # pages are never touched
        reg = x.register(buf)
        peer_buf = kvx.alloc_host(a.n * a.block)
        peer_reg = y.register(peer_buf)
        peer = x.add_peer(y.metadata())
        rows = []
        for name, fn in [
            ("blocks+prepare (local)", lambda: x.prepare(kvx.DescList.blocks(reg, a.block))),
            ("blocks+prepare (peer)", lambda: x.prepare(kvx.DescList.blocks(peer_reg.descs, a.block), peer=peer)),
        ]:
            fn()
            ts = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                pl = fn()
                ts.append(time.perf_counter() - t0)
            assert len(pl) == a.n
            rows.append((name, statistics.median(ts), min(ts)))
    print(f"| operation ({a.n:,} descriptors) | median s | min s |")
    print("|---|---|---|")
    for name, med, mn in rows:
        print(f"| {name} | {med:.3f} | {mn:.3f} |")


if __name__ == "__main__":
    main()
