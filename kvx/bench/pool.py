"""``kvx bench --backend pool [--compare mooncake-store]``: the cluster-wide pool side by side
with Mooncake Store on one machine.

The workload of issue 30: ``members`` (4) member processes of ``member_bytes`` (1 GiB) each, one
client, batches of ``batch`` (128) blocks of each block size (64 KiB and 512 KiB by default) from
and into registered buffers (``pool.agent.register``; Mooncake: ``register_buffer``), source
blocks permuted. A put uses fresh block hashes every time (both stores keep what they hold, so a
second put of the same blocks would move nothing); a get reads back batches that were put and is
checked byte for byte. Each batch is timed from the call to its return; GB/s is bytes over the
sum of the batch times, p99 the 99th percentile of the batch times.

etcd is started for the run (the ``etcd`` binary: Debian ``etcd-server``). JSON (``--json``):
``{"header": ..., "rows": [{"op": "put"|"get", "block": bytes, "kvx_gbps", "kvx_p50_ms",
"kvx_p99_ms", "kvx_tcp_gbps", "kvx_tcp_p99_ms", "mooncake_gbps", "mooncake_p99_ms", ...}]}``:
``kvx_*`` is the client as configured by default (members on its node serve it the same-node
way, :mod:`kvx.pool.near`), ``kvx_tcp_*`` the same client with ``PoolConfig(near=False)``, what
a client on another host gets.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np

from ..errors import UsageError

__all__ = ["run_pool", "cmd"]

DEFAULT_SIZES = [64 << 10, 512 << 10]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Etcd:
    """A throw-away single-node etcd on loopback (bounded start)."""

    def __init__(self) -> None:
        exe = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
        if exe is None:
            raise UsageError("kvx bench --backend pool needs the etcd binary (apt-get install etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="kvx-bench-etcd-")
        cp, pp = _free_port(), _free_port()
        self.endpoint = f"http://127.0.0.1:{cp}"
        self.proc = subprocess.Popen(
            [exe, "--name", "b", "--data-dir", os.path.join(self.dir, "d"), "--listen-client-urls", self.endpoint,
             "--advertise-client-urls", self.endpoint, "--listen-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
             "--initial-cluster", f"b=http://127.0.0.1:{pp}", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise UsageError("etcd did not become healthy within 20 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


def _members(endpoint: str, pool: str, n: int, nbytes: int, bs: int) -> list[subprocess.Popen[str]]:
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kvx.pool.member", "--etcd", endpoint, "--pool", pool, "--name", f"m{i}",
             "--capacity", str(nbytes), "--block-bytes", str(bs), "--policy", "lru", "--stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if "ready" not in line:
            for q in procs:
                q.kill()
            raise RuntimeError(f"a pool member failed to start: {line.strip()[:300]}")
    return procs


def client_buffers(c: Any, members: int, batch: int, bs: int) -> tuple[Any, Any, Any, Any]:
    """Wait (10 s at most) until pool client ``c`` lists ``members`` members; then a source of
    ``batch`` random blocks of ``bs`` bytes and a destination as large, registered and prepared
    with ``c``'s agent: (src, dst, prepared src, prepared dst)."""
    import kvx

    deadline = time.monotonic() + 10
    while len(c.members()) < members and time.monotonic() < deadline:
        time.sleep(0.05)
    if len(c.members()) < members:
        raise RuntimeError(f"only {len(c.members())} of {members} members listed")
    src = kvx.alloc_host(batch * bs)
    src[:] = np.random.default_rng(7).integers(0, 256, src.size, dtype=np.uint8)
    dst = kvx.alloc_host(batch * bs)
    ps = c.agent.prepare(kvx.DescList.blocks(c.agent.register(src), bs))
    pd = c.agent.prepare(kvx.DescList.blocks(c.agent.register(dst), bs))
    return src, dst, ps, pd


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def run_pool(block_sizes: list[int], batch: int = 128, iters: int = 30, members: int = 4,
             member_bytes: int = 1 << 30, near: bool = True) -> list[dict[str, Any]]:
    """kvx rows: ``op``, ``block``, ``gbps``, ``p50_ms``, ``p99_ms`` per block size. ``near``:
    the members serve the client the same-node way (the default), else over loopback tcp (what
    a client on another host gets)."""
    from kvx.pool import Pool, PoolConfig

    rows: list[dict[str, Any]] = []
    etcd = _Etcd()
    try:
        for bs in block_sizes:
            need = batch * (iters + 2) * bs * 13 // 10
            if need > members * member_bytes:
                raise UsageError(f"{iters} puts of {batch} blocks of {bs} bytes do not fit the pool")
            name = f"bench-{bs}"
            procs = _members(etcd.endpoint, name, members, member_bytes, bs)
            try:
                with Pool("client", etcd=etcd.endpoint, pool=name, capacity=0, block_bytes=bs,
                          options=PoolConfig(refresh=0.2, timeout=30.0, near=near)) as c:
                    src, dst, ps, pd = client_buffers(c, members, batch, bs)
                    perm = np.random.default_rng(8).permutation(batch)
                    ident = np.arange(batch)
                    warm = 2
                    names: list[list[bytes]] = []
                    put_t: list[float] = []
                    for it in range(warm + iters):
                        keys = [f"b{bs}-{it}-{i}".encode() for i in range(batch)]
                        t = time.perf_counter()
                        n = c.put(keys, ps, perm)
                        dt = time.perf_counter() - t
                        if n != batch:
                            raise RuntimeError(f"pool put stored {n} of {batch} blocks: {c.stats()}")
                        names.append(keys)
                        if it >= warm:
                            put_t.append(dt)
                    get_t: list[float] = []
                    want = src.reshape(batch, bs)[perm]
                    for it in range(warm + iters):
                        keys = names[it % len(names)]
                        dst[:] = 0
                        t = time.perf_counter()
                        n = c.get(keys, pd, ident)
                        dt = time.perf_counter() - t
                        if n != batch or not np.array_equal(dst.reshape(batch, bs), want):
                            raise RuntimeError(f"pool get served {n} of {batch} blocks or wrong bytes")
                        if it >= warm:
                            get_t.append(dt)
                    st = c.stats()
                    if bool(st.get("near_blocks")) != near or bool(st.get("near_stores")) != near:
                        raise RuntimeError(f"the client was {'not ' if near else ''}served the same-node way: {st}")
                    for op, ts in (("put", put_t), ("get", get_t)):
                        a = np.asarray(ts)
                        rows.append({"op": op, "block": bs, "batch": batch,
                                     "gbps": float(batch * bs * len(a) / a.sum() / 1e9),
                                     "p50_ms": float(np.percentile(a, 50) * 1e3),
                                     "p99_ms": float(np.percentile(a, 99) * 1e3), "iters": len(a)})
            finally:
                _stop(procs)
    finally:
        etcd.close()
    return rows


def _median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (op, block): the median GB/s and p50/p99 over rounds, with the per-round GB/s."""
    out = []
    for r0 in rounds[0]:
        same = [r for rs in rounds for r in rs if r["op"] == r0["op"] and r["block"] == r0["block"]]
        out.append({**r0, "gbps": float(np.median([r["gbps"] for r in same])),
                    "p50_ms": float(np.median([r["p50_ms"] for r in same])),
                    "p99_ms": float(np.median([r["p99_ms"] for r in same])),
                    "gbps_rounds": [round(r["gbps"], 3) for r in same]})
    return out


def cmd(block_sizes: list[int] | None, iters: int, compare: list[str], json_path: str | None,
        quiet: bool = False, rounds: int = 1) -> int:
    """The ``kvx bench --backend pool`` command: kvx and Mooncake Store alternately ``rounds``
    times (medians reported: the machine may be shared)."""
    sizes = block_sizes or DEFAULT_SIZES
    for c in compare:
        if c != "mooncake-store":
            raise UsageError(f"--backend pool compares with mooncake-store only, not {c!r}")
    mc_rows: list[dict[str, Any]] = []
    if compare:
        from ..compare.mooncake_store import mooncake_store_available

        why = mooncake_store_available()
        if why is not None:
            raise UsageError(f"--compare mooncake-store: {why}")
    kvr, tcpr, mcr = [], [], []
    for _ in range(max(1, rounds)):
        kvr.append(run_pool(sizes, iters=iters))
        tcpr.append(run_pool(sizes, iters=iters, near=False))
        if compare:
            from ..compare.mooncake_store import run_mooncake_store

            mcr.append(run_mooncake_store(sizes, iters=iters))
    kv = _median_rows(kvr)
    tcp_rows = _median_rows(tcpr)
    mc_rows = _median_rows(mcr) if mcr else []
    rows = []
    for r, t in zip(kv, tcp_rows):
        row = {"op": r["op"], "block": r["block"], "batch": r["batch"], "iters": r["iters"], "kvx_gbps": r["gbps"],
               "kvx_p50_ms": r["p50_ms"], "kvx_p99_ms": r["p99_ms"], "kvx_gbps_rounds": r["gbps_rounds"],
               "kvx_tcp_gbps": t["gbps"], "kvx_tcp_p99_ms": t["p99_ms"], "kvx_tcp_gbps_rounds": t["gbps_rounds"]}
        m = next((x for x in mc_rows if x["op"] == r["op"] and x["block"] == r["block"]), None)
        if m is not None:
            row.update({"mooncake_gbps": m["gbps"], "mooncake_p50_ms": m["p50_ms"], "mooncake_p99_ms": m["p99_ms"],
                        "mooncake_gbps_rounds": m["gbps_rounds"],
                        "ratio": r["gbps"] / m["gbps"] if m["gbps"] else None})
        rows.append(row)
    hdr = {"machine": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "workload": "4 members x 1 GiB, 1 client, 128-block batches, registered buffers; kvx: the "
                       "same-node path (owners copy, PoolConfig.near) and loopback tcp (kvx_tcp_*, what a "
                       "client on another host gets); Mooncake Store: its tcp transport",
           "rounds": max(1, rounds), "iters": iters}
    print("| op | block | kvx GB/s | kvx p99 ms | kvx tcp GB/s | kvx tcp p99 ms | mooncake GB/s | mooncake p99 ms "
          "| kvx/mooncake | kvx tcp/mooncake |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mc = (f"{r['mooncake_gbps']:.2f} | {r['mooncake_p99_ms']:.1f} | {r['ratio']:.2f}x | "
              f"{r['kvx_tcp_gbps'] / r['mooncake_gbps']:.2f}x" if r.get("mooncake_gbps") else "- | - | - | -")
        print(f"| {r['op']} | {r['block'] >> 10} KiB | {r['kvx_gbps']:.2f} | {r['kvx_p99_ms']:.1f} | "
              f"{r['kvx_tcp_gbps']:.2f} | {r['kvx_tcp_p99_ms']:.1f} | {mc} |")
    if json_path:
        d = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(d, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"header": hdr, "rows": rows}, f, indent=1)
    return 0
