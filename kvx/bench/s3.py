"""``kvx bench --backend s3``: host memory <-> one object per block on an S3 endpoint.

Uses the endpoint configured in the environment (``KVX_S3_ENDPOINT`` / ``AWS_ENDPOINT_URL`` and
the AWS credential variables); when none is configured it starts its own SeaweedFS
(:class:`kvx.testing.seaweed.SeaweedFS`) for the run. Per block size: ``total // bs`` objects
``<prefix>/<bs>/<i>`` in bucket ``opts.extra.get("bucket", "kvx-bench")``; a timed write of
every block (memory block ``i`` -> object ``perm[i]``), then a timed read back into zeroed
memory, each verified byte for byte. ``--compare nixl`` (or ``opts.extra["compare_nixl_obj"]``)
adds NIXL's OBJ plugin on the same server and object layout (:mod:`kvx.compare.nixl_obj`); it
runs here, not in ``kvx.bench.compare_nixl``, because the server lives only as long as this run.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import numpy as np

import kvx

from . import BenchOptions, Progress, iter_sizes, permutation, row, timed
from .target import pattern

__all__ = ["run"]

log = logging.getLogger(__name__)


def _endpoint_configured() -> bool:
    return bool(kvx.config.get("KVX_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
                or os.environ.get("AWS_ENDPOINT_URL_S3"))


def sweep(agent: kvx.Agent, buf: np.ndarray, reg: kvx.Registration, opts: BenchOptions, prog: Progress,
          bucket: str, prefix: str, impl: str = "kvx") -> list[dict[str, Any]]:
    """Time write then read of one object per block for every block size; verify; return rows."""
    rows = []
    for bs, n in iter_sizes(opts):
        objs = agent.register([kvx.ObjectRegion(bucket, f"{prefix}/{bs}/{i}", bs) for i in range(n)])
        try:
            mem = agent.prepare(kvx.DescList.blocks(reg, bs)[:n])
            sto = agent.prepare(objs)
            lidx = np.arange(n, dtype=np.int64)
            ridx = permutation(n, opts)
            src = pattern(n * bs, opts.seed + bs)
            for op in opts.ops:
                prog.step(f"{impl} s3 {op} {bs >> 10}K")
                if op == "write":
                    buf[: n * bs] = src
                    fn = agent.write
                else:
                    if "write" not in opts.ops:  # objects must exist: write them once, untimed
                        buf[: n * bs] = src
                        agent.write(mem, lidx, sto, ridx).wait()
                    fn = agent.read

                def once() -> None:
                    if op == "read":
                        buf[: n * bs] = 0
                    fn(mem, lidx, sto, ridx).wait()

                med, mn = timed(once, opts.iters)
                if op == "read":
                    ok = np.array_equal(buf[: n * bs], src)
                else:  # read back through kvx into a scratch copy and compare
                    buf[: n * bs] = 0
                    agent.read(mem, lidx, sto, ridx).wait()
                    ok = np.array_equal(buf[: n * bs], src)
                if not ok:
                    raise RuntimeError(f"{impl} s3 {op} at {bs} bytes: bytes do not match")
                be = agent.backend("s3")
                rows.append(row(impl, op, bs, n, opts.iters, med, mn, verified=True,
                                threads=int(kvx.config.get("KVX_S3_THREADS")),
                                client="lean" if getattr(be, "_lean", None) is not None else "boto3"))
        finally:
            objs.release()
    return rows


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Run the s3 benchmark (starting a SeaweedFS if no endpoint is configured); return rows."""
    server = None
    saved: dict[str, str | None] = {}
    if not _endpoint_configured():
        from ..testing.seaweed import SeaweedFS

        server = SeaweedFS().start()
        for k, v in server.env().items():
            saved[k] = os.environ.get(k)
            os.environ[k] = v
    bucket = str(opts.extra.get("bucket", "kvx-bench"))
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        with kvx.Agent("bench-s3", kvx.AgentConfig(backends=("host", "s3"))) as agent:
            buf = kvx.alloc_host(opts.total)
            reg = agent.register(buf)
            rows = sweep(agent, buf, reg, opts, prog, bucket, prefix)
        endpoint = kvx.config.get("KVX_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
        for r in rows:
            r["endpoint"] = "seaweedfs (started by the bench)" if server else endpoint
        if "nixl" in opts.compare or opts.extra.get("compare_nixl_obj"):
            from ..compare.nixl_obj import run_nixl_obj

            for op in opts.ops:
                prog.step(f"nixl OBJ {op}")
                res = run_nixl_obj(op=op, block_sizes=[bs for bs, _ in iter_sizes(opts)], total=opts.total,
                                   iters=opts.iters, endpoint=str(endpoint),
                                   access_key=os.environ["AWS_ACCESS_KEY_ID"],
                                   secret_key=os.environ["AWS_SECRET_ACCESS_KEY"], bucket=bucket,
                                   permute=opts.permute, seed=opts.seed)
                for r in res["results"]:
                    rows.append(row("nixl-obj", op, r["block_bytes"], r["nblocks"], r["iters"], r["seconds_median"],
                                    r["seconds_min"], verified=res["verified"]))
        return rows
    finally:
        if server is not None:
            server.stop()
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
