"""``kvx bench --backend ucx``: two processes through the ucx backend (UCX's transports as
``UCX_TLS`` selects them: ``tcp``, shared memory, RDMA...), permuted blocks, and the
post-to-completion latency of one 4 KiB write. ``--compare nixl`` runs NIXL's UCX backend with
the same environment (the same ``UCX_TLS``), so only the software differs.

The target is :mod:`kvx.bench.target` with ``KVX_BACKENDS=ucx``.
"""

from __future__ import annotations

import os
from typing import Any

import kvx

from . import BenchOptions, Progress
from .host import Target, latency, sweep
from .target import alloc
from .tcp import TcpTarget, _alloc_seg, _gpus, _segs

__all__ = ["run"]


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Run the ucx benchmark (kvx rows and 4 KiB latency rows). ``--seg LOCAL,REMOTE`` takes
    ``dram``, ``pinned`` or ``vram`` (GPU 0 here, GPU 1 for the target where there are two)."""
    lseg, rseg = _segs(opts)
    target: Target
    if (lseg, rseg) == ("dram", "dram"):
        target = Target(opts, env={"KVX_BACKENDS": "ucx"})
    else:
        rdev = 1 if rseg == "vram" and _gpus() > 1 else 0
        target = TcpTarget(opts, env={"KVX_BACKENDS": "ucx"}, seg=rseg, dev=rdev, backend="ucx")
    tls = os.environ.get("UCX_TLS", "default")
    try:
        with kvx.Agent("bench-initiator", kvx.AgentConfig(backends=("ucx",))) as agent:
            if (lseg, rseg) == ("dram", "dram"):
                obj = buf = alloc(opts.mem, opts.total)
            else:
                obj, buf = _alloc_seg(lseg, opts.mem, opts.total, 0)
            reg = agent.register(obj)
            peer = agent.add_peer(target.meta)
            rows = sweep(agent, peer, reg, buf, target, opts, prog, backend="ucx")
            prog.step("latency")
            rows += latency(agent, peer, reg, target, opts.latency_samples, backend="ucx")
            for r in rows:
                r["path"] = f"UCX_TLS={tls}"
                r["seg"] = f"{lseg}->{rseg}"
    finally:
        target.close()
    return rows
