"""Mooncake transfer engine comparison for ``kvx bench --backend tcp --compare mooncake``.

Drives the Mooncake transfer engine (PyPI ``mooncake-transfer-engine-non-cuda`` 0.3.13.post1,
Python module ``mooncake.engine``) over its TCP transport on the workload kvx benchmarks: two
separate processes, a *target* and an *initiator*, each with one engine initialised as
``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")`` (peer-to-peer handshake, no metadata
server) and one host buffer of ``total`` bytes registered once (``register_memory``). Per block
size the initiator carves ``n = total // bs`` blocks and moves all of them with one
``batch_transfer_sync_write`` / ``batch_transfer_sync_read`` call (local block ``i`` <-> remote
block ``perm[i]``, a permutation: paged KV blocks are not contiguous), ``iters`` timed calls
after a warm-up (:func:`kvx.bench.warm`, as for kvx). The receiving buffer is zeroed first and
checked afterwards (by the target's digest for writes, by the initiator for reads).

"At its best" here means the settings that the engine needs to run this workload well over
TCP (found on this kind of machine): ``MC_FORCE_TCP=1``; ``MC_TCP_ENABLE_CONNECTION_POOL=1``
(without it the engine opens a connection per request: 0.004 GB/s at 4 KiB); and
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` / ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` raised
above the batch size. Callers may override any of them through ``env``. The engine's
``engine.so`` links libibverbs and libnl even for TCP (Debian ``libibverbs1``, ``libnl-3-200``,
``libnl-route-3-200``). Installing those has a side effect: NIXL's bundled UCX then loads its
InfiniBand modules and, on a host without an RDMA device, its processes were seen dying with
SIGSEGV at exit; run NIXL comparisons there with ``UCX_MODULES='^ib,rdmacm'``.

The calling process only orchestrates: both roles run as ``python -m kvx.compare.mooncake
--role ...`` speaking JSON lines on stdin/stdout, every wait bounded by ``timeout``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

import numpy as np

__all__ = ["INSTALL_HINT", "mooncake_available", "mooncake_version", "run_mooncake", "BEST_ENV"]

INSTALL_HINT = ("pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1 (and Debian libibverbs1 "
                "libnl-3-200 libnl-route-3-200)")

#: The engine's environment for this workload (see the module docstring).
BEST_ENV = {
    "MC_FORCE_TCP": "1",
    "MC_TCP_ENABLE_CONNECTION_POOL": "1",
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "65535",  # larger values were refused or failed here
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "65535",
    "MC_LOG_LEVEL": "WARNING",
    "GLOG_minloglevel": "2",
}


def importable(module: str, checking: str, missing: str, hint: str) -> str | None:
    """None if ``module`` imports in a fresh interpreter here, else the reason and ``hint``
    (``checking``/``missing`` name the part in the messages)."""
    try:
        out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot check for {checking} ({exc}); {hint}"
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{missing} is not importable ({tail}); {hint}"
    return None


def mooncake_available() -> str | None:
    """None if the Mooncake transfer engine imports here, else the reason and the fix."""
    return importable("mooncake.engine", "Mooncake", "the Mooncake transfer engine", INSTALL_HINT)


def mooncake_version() -> str:
    from importlib import metadata

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(buf.data, digest_size=16).hexdigest()


# ---- the roles (child processes) --------------------------------------------------------------
def _engine(total: int) -> tuple[Any, np.ndarray]:
    from mooncake.engine import TransferEngine  # type: ignore[import-not-found]

    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {rc}")
    buf = np.zeros(total, dtype=np.uint8)
    rc = te.register_memory(buf.ctypes.data, total)
    if rc != 0:
        raise RuntimeError(f"TransferEngine.register_memory returned {rc}")
    return te, buf


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _target_main(total: int) -> int:
    te, buf = _engine(total)
    _say({"port": te.get_rpc_port(), "addr": buf.ctypes.data})
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "zero":
            buf[:] = 0
            _say({"ok": True})
        elif c == "fill":
            buf[:] = _pattern(total, int(cmd["seed"]))
            _say({"ok": True})
        elif c == "digest":
            _say({"digest": _digest(buf)})
        elif c == "quit":
            break
        else:
            _say({"error": f"unknown command {c!r}"})
    te.unregister_memory(buf.ctypes.data)
    return 0


def _initiator_main(total: int) -> int:
    from kvx.bench import warm

    te, buf = _engine(total)
    _say({"ok": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "quit":
            break
        if c != "run":
            _say({"error": f"unknown command {c!r}"})
            continue
        op, bs, iters, seed = cmd["op"], int(cmd["bs"]), int(cmd["iters"]), int(cmd["seed"])
        target, raddr = str(cmd["target"]), int(cmd["raddr"])
        perm = np.asarray(cmd["perm"], dtype=np.int64)
        n = perm.shape[0]
        base = buf.ctypes.data
        local = (base + np.arange(n, dtype=np.int64) * bs).tolist()
        remote = (raddr + perm * bs).tolist()
        lens = [bs] * n
        fn = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
        if op == "write":
            buf[: n * bs] = _pattern(n * bs, seed)
        else:
            buf[:] = 0
        failures: list[int] = []

        def once() -> None:
            rc = fn(target, local, remote, lens)
            if rc != 0:
                failures.append(rc)
                raise RuntimeError(f"Mooncake batch_transfer_sync_{op} returned {rc}")

        warm(once)
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            once()
            ts.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"times": ts}
        if op == "write":
            exp = np.zeros(total, dtype=np.uint8)
            exp[: n * bs].reshape(n, bs)[perm] = buf[: n * bs].reshape(n, bs)
            out["expect"] = _digest(exp)
        else:
            src = _pattern(total, seed)[: n * bs].reshape(n, bs)
            out["verified"] = bool(np.array_equal(buf[: n * bs].reshape(n, bs), src[perm]))
        _say(out)
    te.unregister_memory(buf.ctypes.data)
    return 0


# ---- orchestration ----------------------------------------------------------------------------
class _Child:
    def __init__(self, role: str, total: int, env: dict[str, str], deadline: float) -> None:
        self.deadline = deadline
        self.role = role
        self.proc = subprocess.Popen([sys.executable, "-m", "kvx.compare.mooncake", "--role", role,
                                      "--total", str(total)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        left = self.deadline - time.monotonic()
        r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
        if not r:
            raise RuntimeError(f"Mooncake {self.role} did not answer within the time limit")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-3000:] if self.proc.stderr else ""
            raise RuntimeError(f"Mooncake {self.role} exited ({self.proc.wait(5)}): {err}")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"Mooncake {self.role}: {msg['error']}")
        return msg  # type: ignore[no-any-return]

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        from kvx.bench import quit_child

        quit_child(self.proc, 10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


def run_mooncake(*, ops: list[str], block_sizes: list[int], total: int, iters: int = 5, permute: bool = True,
                 seed: int = 0, env: dict[str, str] | None = None, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run the Mooncake workload; return kvx bench rows (impl ``mooncake``), every row verified.

    Raises
    ------
    RuntimeError
        If the engine fails, a child does not answer within ``timeout`` or the bytes do not match.
    """
    from kvx.bench import row

    cenv = dict(os.environ)
    cenv.update(BEST_ENV)
    cenv.update(env or {})
    deadline = time.monotonic() + timeout
    target = _Child("target", total, cenv, deadline)
    init: _Child | None = None
    rows: list[dict[str, Any]] = []
    try:
        hello = target.read()
        where = f"127.0.0.1:{hello['port']}"
        init = _Child("initiator", total, cenv, deadline)
        init.read()
        for op in ops:
            for bs in block_sizes:
                n = total // bs
                if n < 1:
                    continue
                perm = (np.random.default_rng(seed).permutation(n) if permute else np.arange(n)).astype(np.int64)
                s = seed + bs
                if op == "write":
                    target.call(cmd="zero")
                else:
                    target.call(cmd="fill", seed=s)
                res = init.call(cmd="run", op=op, bs=bs, iters=iters, seed=s, target=where, raddr=hello["addr"],
                                perm=perm.tolist())
                if op == "write":
                    ok = target.call(cmd="digest")["digest"] == res["expect"]
                else:
                    ok = bool(res["verified"])
                if not ok:
                    raise RuntimeError(f"Mooncake {op} at {bs} bytes: destination bytes do not match")
                ts = sorted(res["times"])
                rows.append(row("mooncake", op, bs, n, iters, ts[len(ts) // 2], ts[0], verified=True,
                                mooncake=mooncake_version(), path="mooncake-tcp-loopback"))
    finally:
        if init is not None:
            init.close()
        target.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.compare.mooncake")
    ap.add_argument("--role", choices=["target", "initiator"], required=True)
    ap.add_argument("--total", type=int, required=True)
    a = ap.parse_args(argv)
    return _target_main(a.total) if a.role == "target" else _initiator_main(a.total)


if __name__ == "__main__":
    sys.exit(main())
