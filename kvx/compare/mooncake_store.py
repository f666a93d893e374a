"""Mooncake Store comparison for ``kvx bench --backend pool --compare mooncake-store``.

Drives Mooncake Store (PyPI ``mooncake-transfer-engine-non-cuda``, module ``mooncake.store``)
at its best on the pool workload: one ``mooncake_master`` (``--rpc_port P``), ``members``
processes that each contribute a segment of ``member_bytes`` (``MooncakeDistributedStore().setup(
"127.0.0.1", "P2PHANDSHAKE", member_bytes, 16 MiB, "tcp", "", master)``) and one client process
that contributes none, registers its source and destination buffers once (``register_buffer``:
zero copy) and moves batches of ``batch`` blocks with ``batch_put_from`` / ``batch_get_into``.
Every put uses fresh keys (a put of a key the store holds is refused, so re-putting would time
nothing); gets read back batches that were put, and are checked byte for byte. The transfer
engine's TCP settings are :data:`kvx.compare.mooncake.BEST_ENV`.

The engine links libibverbs and libnl even for TCP (Debian ``libibverbs1``, ``libnl-3-200``,
``libnl-route-3-200`` on the library path). Processes speak JSON lines on stdin/stdout; every
wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from .mooncake import BEST_ENV

__all__ = ["mooncake_store_available", "run_mooncake_store", "INSTALL_HINT"]

INSTALL_HINT = ("pip install --no-deps mooncake-transfer-engine-non-cuda (and Debian libibverbs1 libnl-3-200 "
                "libnl-route-3-200 on LD_LIBRARY_PATH)")


def mooncake_store_available() -> str | None:
    """None if ``mooncake.store`` imports here, else the reason and the fix."""
    from .mooncake import importable

    return importable("mooncake.store", "Mooncake Store", "Mooncake Store", INSTALL_HINT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _master_binary() -> str:
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u, os;"
                          "print(os.path.join(u.find_spec('mooncake').submodule_search_locations[0],"
                          " 'mooncake_master'))"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def _line(p: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert p.stdout is not None
    r, _, _ = select.select([p.stdout], [], [], timeout)
    if not r:
        raise TimeoutError(f"no answer from a Mooncake process within {timeout} s")
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"a Mooncake process exited ({p.poll()})")
    return json.loads(line)  # type: ignore[no-any-return]


def _stop(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        try:
            if p.stdin is not None:
                p.stdin.close()
            p.terminate()
            p.wait(10)
        except (subprocess.TimeoutExpired, OSError):
            p.kill()
            p.wait(10)


def run_mooncake_store(block_sizes: list[int], batch: int = 128, iters: int = 20, members: int = 4,
                       member_bytes: int = 1 << 30, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Per block size: put and get rows (``op``, ``block``, ``gbps``, ``p50_ms``, ``p99_ms``)."""
    env = {**os.environ, **BEST_ENV}
    rows: list[dict[str, Any]] = []
    for bs in block_sizes:
        port = _free_port()
        master = subprocess.Popen([_master_binary(), f"--rpc_port={port}", "--default_kv_lease_ttl=5000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        procs: list[subprocess.Popen[str]] = []
        try:
            time.sleep(1.0)
            if master.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {master.returncode}")
            me = [sys.executable, "-m", "kvx.compare.mooncake_store"]
            for _ in range(members):
                procs.append(subprocess.Popen([*me, "--role", "member", "--master", f"127.0.0.1:{port}",
                                               "--bytes", str(member_bytes)], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, text=True, env=env))
            for p in procs:
                rep = _line(p, timeout)
                if not rep.get("ready"):
                    raise RuntimeError(f"a Mooncake Store member failed: {rep}")
            cl = subprocess.Popen([*me, "--role", "client", "--master", f"127.0.0.1:{port}", "--block", str(bs),
                                   "--batch", str(batch), "--iters", str(iters)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
            procs.append(cl)
            rep = _line(cl, timeout)
            if "rows" not in rep:
                raise RuntimeError(f"the Mooncake Store client failed: {rep}")
            rows += rep["rows"]
        finally:
            for p in procs:
                _stop(p)
            _stop(master)
    return rows


# ---- the processes ------------------------------------------------------------------------
def _setup(store: Any, master: str, seg: int) -> None:
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", seg, 16 << 20, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")


def _member(master: str, nbytes: int) -> int:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    _setup(s, master, nbytes)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    s.close()
    return 0


def _client(master: str, bs: int, batch: int, iters: int) -> int:
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    _setup(s, master, 0)
    src = np.random.default_rng(7).integers(0, 256, batch * bs, dtype=np.uint8)
    dst = np.zeros(batch * bs, dtype=np.uint8)
    sa, da = int(src.ctypes.data), int(dst.ctypes.data)
    for a in (sa, da):
        if s.register_buffer(a, batch * bs) != 0:
            raise RuntimeError("register_buffer failed")
    perm = np.random.default_rng(8).permutation(batch)  # paged KV blocks are not contiguous
    sptr = [sa + int(i) * bs for i in perm]
    dptr = [da + int(i) * bs for i in range(batch)]
    sizes = [bs] * batch
    rows = []
    warm = 2
    put_t: list[float] = []
    names: list[list[str]] = []
    for it in range(warm + iters):
        keys = [f"b{bs}-{it}-{i}" for i in range(batch)]
        t = time.perf_counter()
        rc = s.batch_put_from(keys, sptr, sizes)
        dt = time.perf_counter() - t
        if any(r != 0 for r in rc):
            raise RuntimeError(f"batch_put_from failed: {sorted(set(rc))}")
        names.append(keys)
        if it >= warm:
            put_t.append(dt)
    get_t: list[float] = []
    for it in range(warm + iters):
        keys = names[it % len(names)]
        dst[:] = 0
        t = time.perf_counter()
        rc = s.batch_get_into(keys, dptr, sizes)
        dt = time.perf_counter() - t
        if any(r != bs for r in rc):
            raise RuntimeError(f"batch_get_into failed: {sorted(set(rc))[:4]}")
        want = src.reshape(batch, bs)[perm]
        if not np.array_equal(dst.reshape(batch, bs), want):
            raise RuntimeError("batch_get_into returned wrong bytes")
        if it >= warm:
            get_t.append(dt)
    for op, ts in (("put", put_t), ("get", get_t)):
        ta = np.asarray(ts)
        rows.append({"op": op, "block": bs, "batch": batch, "gbps": float(batch * bs * len(ta) / ta.sum() / 1e9),
                     "p50_ms": float(np.percentile(ta, 50) * 1e3), "p99_ms": float(np.percentile(ta, 99) * 1e3),
                     "iters": len(ta)})
    print(json.dumps({"rows": rows}), flush=True)
    s.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.compare.mooncake_store")
    ap.add_argument("--role", choices=["member", "client"], required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--bytes", type=int, default=1 << 30)
    ap.add_argument("--block", type=int, default=64 << 10)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        if a.role == "member":
            return _member(a.master, a.bytes)
        return _client(a.master, a.block, a.batch, a.iters)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
