"""NIXL's OBJ plugin (aws-sdk-cpp S3 client) on kvx's object workload, for side-by-side figures.

One NIXL agent in a child process (``python -m kvx.compare.nixl_obj``, bounded by ``timeout``)
creates the ``OBJ`` backend with explicit parameters (``bucket``, ``endpoint_override``,
``scheme``, ``access_key``, ``secret_key``, ``region``, path-style addressing, and
``create_bucket``), registers one host buffer of ``total`` bytes (DRAM) and, per block size,
``total // bs`` objects of ``bs`` bytes (OBJ descriptors ``(0, bs, dev_id, key)``, one object per
block, keys ``nixl-<run>/<bs>/<i>``). One prepared transfer moves all blocks: local block ``i``
<-> object ``perm[i]``; ``iters`` timed posts after one warm-up, each from ``transfer`` to
``check_xfer_state`` = DONE. Polling sleeps 0.2 ms between checks: on a small machine a
busy-wait would take a core from NIXL's own I/O threads and the server.

Writes are verified by reading the objects back through NIXL into a zeroed buffer; reads
(objects written once, untimed, first) by comparing the buffer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import numpy as np

__all__ = ["run_nixl_obj", "obj_plugin_available"]

logger = logging.getLogger(__name__)

_OPS = {"write": "WRITE", "read": "READ"}


def obj_plugin_available() -> str | None:
    """None if NIXL with its OBJ plugin is importable here, else the reason."""
    from .nixl import nixl_available

    reason = nixl_available()
    if reason is not None:
        return reason
    try:
        from .nixl import _import_nixl_api

        api = _import_nixl_api()
        agent = api.nixl_agent(f"probe-{os.getpid()}", api.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]))
        if "OBJ" not in agent.get_plugin_list():
            return f"NIXL has no OBJ plugin (plugins: {agent.get_plugin_list()})"
    except Exception as exc:
        return f"NIXL OBJ probe failed: {exc}"
    return None


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _wait(agent: Any, handle: Any, deadline: float) -> float:
    t0 = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        time.sleep(0.0002)
        state = agent.check_xfer_state(handle)
        if time.time() > deadline:
            raise TimeoutError("deadline passed while waiting for a NIXL OBJ transfer")
    t1 = time.perf_counter()
    if state != "DONE":
        raise RuntimeError(f"NIXL OBJ transfer failed (state {state})")
    return t1 - t0


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    from .nixl import _import_nixl_api

    api = _import_nixl_api()
    deadline = float(cfg["deadline"])
    agent = api.nixl_agent("kvx-nixl-obj", api.nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    ep = str(cfg["endpoint"])
    params = {
        "bucket": cfg["bucket"],
        "endpoint_override": ep,
        "scheme": "https" if ep.startswith("https") else "http",
        "access_key": cfg["access_key"],
        "secret_key": cfg["secret_key"],
        "region": cfg.get("region", "us-east-1"),
        "use_virtual_addressing": "false",
        "create_bucket": "true",
    }
    agent.create_backend("OBJ", params)
    be = ["OBJ"]
    total = int(cfg["total"])
    buf = np.zeros(total, np.uint8)
    dram = agent.register_memory([(buf.ctypes.data, total, 0, "")], "DRAM", backends=be)
    run = uuid.uuid4().hex[:8]
    op = cfg["op"]
    results = []
    dev = 1
    all_ok = True
    for bs in cfg["block_sizes"]:
        n = total // bs
        src = _pattern(n * bs, int(cfg["seed"]) + bs)
        perm = (np.random.default_rng(int(cfg["seed"])).permutation(n) if cfg["permute"]
                else np.arange(n)).astype(np.int32)
        objs = [(0, bs, dev + i, f"nixl-{run}/{bs}/{i}") for i in range(n)]
        oreg = agent.register_memory(objs, "OBJ", backends=be)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data + i * bs, bs, 0) for i in range(n)],
                                      "DRAM", backends=be)
        remote = agent.prep_xfer_dlist(agent.name, [(0, bs, dev + i) for i in range(n)], "OBJ", backends=be)
        dev += n
        wr = agent.make_prepped_xfer("WRITE", local, np.arange(n, dtype=np.int32), remote, perm, backends=be)
        rd = agent.make_prepped_xfer("READ", local, np.arange(n, dtype=np.int32), remote, perm, backends=be)
        buf[: n * bs] = src
        if op == "write":
            _wait(agent, wr, deadline)  # warm-up
            times = [_wait(agent, wr, deadline) for _ in range(int(cfg["iters"]))]
            buf[: n * bs] = 0
            _wait(agent, rd, deadline)
        else:
            _wait(agent, wr, deadline)  # create the objects (untimed)
            buf[: n * bs] = 0
            _wait(agent, rd, deadline)  # warm-up
            times = []
            for _ in range(int(cfg["iters"])):
                buf[: n * bs] = 0
                times.append(_wait(agent, rd, deadline))
        ok = bool(np.array_equal(buf[: n * bs], src))
        all_ok &= ok
        wr.release()
        rd.release()
        local.release()
        remote.release()
        agent.deregister_memory(oreg, backends=be)
        med = float(np.median(times))
        results.append({"block_bytes": bs, "nblocks": n, "total_bytes": n * bs, "iters": len(times),
                        "seconds_median": med, "seconds_min": float(np.min(times)), "gbps": n * bs / med / 1e9,
                        "verified": ok})
    agent.deregister_memory(dram, backends=be)
    return {"impl": "nixl", "backend": "OBJ", "mem": "object", "op": op, "results": results,
            "latency_us": None, "verified": all_ok}


def run_nixl_obj(op: str, block_sizes: list[int], total: int, iters: int, endpoint: str, access_key: str,
                 secret_key: str, bucket: str, *, permute: bool = True, seed: int = 0, region: str = "us-east-1",
                 timeout: float = 600.0) -> dict[str, Any]:
    """Benchmark NIXL's OBJ plugin: one object per block, write or read, against ``endpoint``.

    Parameters
    ----------
    op
        ``"write"`` (memory -> objects) or ``"read"``.
    block_sizes
        Block (object) sizes in bytes; each is swept over ``total // bs`` objects.
    total
        Bytes of the host buffer.
    iters
        Timed transfers per block size (after one warm-up).
    endpoint, access_key, secret_key, bucket, region
        The S3 endpoint (``http://host:port``) and identity; the bucket is created if missing.
    permute, seed
        Object ids permuted with ``default_rng(seed).permutation(n)``.
    timeout
        Bound on the whole run in seconds.

    Returns
    -------
    dict
        ``{"impl": "nixl", "version", "backend": "OBJ", "mem": "object", "op", "results": [...],
        "latency_us": None, "verified"}`` with ``results`` entries as in
        :func:`kvx.compare.nixl.run_nixl`.

    Raises
    ------
    RuntimeError
        NIXL or its OBJ plugin is missing, the child failed, or the run exceeded ``timeout``.
    """
    from .nixl import nixl_available, nixl_version

    reason = nixl_available()
    if reason is not None:
        raise RuntimeError(reason)
    if op not in _OPS:
        raise ValueError(f"op must be 'write' or 'read', not {op!r}")
    if not block_sizes or any(bs <= 0 or bs > total for bs in block_sizes):
        raise ValueError(f"block sizes {block_sizes} must be in 1..total ({total})")
    cfg = {"op": op, "block_sizes": [int(b) for b in block_sizes], "total": int(total), "iters": int(iters),
           "endpoint": endpoint, "access_key": access_key, "secret_key": secret_key, "bucket": bucket,
           "region": region, "permute": bool(permute), "seed": int(seed),
           "deadline": time.time() + timeout - min(5.0, 0.1 * timeout)}
    with tempfile.TemporaryDirectory(prefix="kvx-nixl-obj-") as tmp:
        cpath, rpath, lpath = (os.path.join(tmp, x) for x in ("cfg.json", "result.json", "child.log"))
        with open(cpath, "w") as f:
            json.dump(cfg, f)
        with open(lpath, "wb") as logf:
            p = subprocess.Popen([sys.executable, "-m", "kvx.compare.nixl_obj", "--config", cpath, "--out", rpath],
                                 stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                rc = None
        if rc != 0 or not os.path.exists(rpath):
            with open(lpath, "rb") as f:
                tail = f.read()[-4000:].decode(errors="replace")
            raise RuntimeError(f"NIXL OBJ run {'timed out' if rc is None else f'failed (exit {rc})'}:\n{tail}")
        with open(rpath) as f:
            res: dict[str, Any] = json.load(f)
    res["version"] = nixl_version()
    return res


def main(argv: list[str] | None = None) -> int:
    """Child entry point: ``python -m kvx.compare.nixl_obj --config CFG --out RESULT``."""
    ap = argparse.ArgumentParser(prog="python -m kvx.compare.nixl_obj")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    with open(a.config) as f:
        cfg = json.load(f)
    res = _child(cfg)
    with open(a.out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
