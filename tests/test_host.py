"""The host backend through the conformance suite, once per same-node path."""

from __future__ import annotations

import pytest

import kvx
from kvx.testing.conformance import TransferConformance
from kvx.testing.procs import PeerProcess


class TestHostShm(TransferConformance):
    backend = "host"
    config = {"host_path": "auto"}
    mem = "alloc"


class TestHostCma(TransferConformance):
    backend = "host"
    config = {"host_path": "cma"}
    mem = "numpy"


class TestHostUds(TransferConformance):
    backend = "host"
    config = {"host_path": "uds"}
    mem = "numpy"

    def test_index_and_size_errors_are_the_shared_check(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        """The AF_UNIX path checks indices and paired sizes with ``base.paired_nbytes``, as ucx
        does: the same UsageError messages, and nothing moves."""
        local, remote, _buf, rid, reg = self.connect(agent, peer, 8 * 64, 64)
        before = peer.digest(rid)
        for li, ri in (([0], [8]), ([9], [0]), ([-1], [0])):
            with pytest.raises(kvx.UsageError, match=r"^bad transfer request: index out of range$"):
                agent.write(local, li, remote, ri)
        with pytest.raises(kvx.UsageError, match=r"^index lists differ in length \(2 local, 1 remote\)$"):
            agent.write(local, [0, 1], remote, [0])
        big = agent.prepare(kvx.DescList.blocks(reg, 128))
        with pytest.raises(kvx.UsageError, match=r"^bad transfer request: local and remote blocks differ in size$"):
            agent.read(big, [0], remote, [1])
        assert peer.digest(rid) == before


def test_native_pool_copies_after_fork() -> None:
    """The native copy pool (large host copies run on its threads) works in a forked child, whose
    workers are gone and whose condition variable still counted them: a child's pooled copy used to
    hang. Parent, child (twice) and parent again each copy 256 MiB and check every byte."""
    import numpy as np

    from kvx import _native
    from kvx.testing.procs import forked_ok

    n, bs = 256, 1 << 20
    src = np.random.default_rng(0).integers(0, 255, n * bs, dtype=np.uint8)
    dst = np.zeros_like(src)
    offs = np.arange(n, dtype=np.uint64) * np.uint64(bs)
    sa, da = offs + np.uint64(src.ctypes.data), offs + np.uint64(dst.ctypes.data)
    ln = np.full(n, bs, dtype=np.uint64)
    idx = np.arange(n, dtype=np.int64)[::-1].copy()

    def copied() -> bool:
        dst[:] = 0
        job = _native.submit(_native.OP_MEMCPY, 0, da, ln, idx, sa, ln, idx, None, None, 4, 0, 0)
        if not isinstance(job, int) and not job.wait(20.0):
            return False
        return bool(np.array_equal(dst, src))

    assert copied()
    assert forked_ok(lambda: copied() and copied(), 60.0)
    assert copied()
