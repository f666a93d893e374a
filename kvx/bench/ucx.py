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

__all__ = ["run"]


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Run the ucx benchmark (kvx rows and 4 KiB latency rows)."""
    target = Target(opts, env={"KVX_BACKENDS": "ucx"})
    tls = os.environ.get("UCX_TLS", "default")
    try:
        with kvx.Agent("bench-initiator", kvx.AgentConfig(backends=("ucx",))) as agent:
            buf = alloc(opts.mem, opts.total)
            reg = agent.register(buf)
            peer = agent.add_peer(target.meta)
            rows = sweep(agent, peer, reg, buf, target, opts, prog, backend="ucx")
            prog.step("latency")
            rows += latency(agent, peer, reg, target, opts.latency_samples, backend="ucx")
            for r in rows:
                r["path"] = f"UCX_TLS={tls}"
    finally:
        target.close()
    return rows
