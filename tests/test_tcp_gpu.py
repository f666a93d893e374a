"""The tcp backend on CUDA memory: two processes on two GPUs with only the tcp backend running
(so CUDA IPC is not used: the stand-in for two nodes). The shared conformance suite runs on
VRAM->VRAM, VRAM->pinned host, host->VRAM, and between a GPU process and a CPU-only process
(``CUDA_VISIBLE_DEVICES=""`` in the peer); plus blocks of unequal sizes cut across frames.

Everything here is marked ``gpu`` (``make gpu-check`` runs it on a GPU machine).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvx
from kvx.testing.conformance import TransferConformance, digest, pattern
from kvx.testing.memory import memory
from kvx.testing.procs import PeerProcess

pytestmark = pytest.mark.gpu

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


class TestTcpVramToVram(TransferConformance):
    backend = "tcp"
    mem, local_mem = "vram:1", "vram:0"


class TestTcpVramToPinned(TransferConformance):
    backend = "tcp"
    mem, local_mem = "pinned", "vram:0"


class TestTcpHostToVram(TransferConformance):
    backend = "tcp"
    mem, local_mem = "vram:1", "numpy"


class TestTcpPinnedToVram(TransferConformance):
    backend = "tcp"
    mem, local_mem = "vram:1", "pinned"


class TestTcpGpuToCpuOnlyProcess(TransferConformance):
    """A GPU process against a process that sees no GPU (a storage node's host memory)."""

    backend = "tcp"
    mem, local_mem = "numpy", "vram:0"
    env = CPU_ONLY


class TestTcpSmallStagingSlots(TransferConformance):
    """VRAM->VRAM through 64 KiB slots, two per connection: many frames per transfer."""

    backend = "tcp"
    mem, local_mem = "vram:1", "vram:0"
    env = {"KVX_TCP_STAGE_BYTES": "65536", "KVX_TCP_STAGE_SLOTS": "2"}

    def agent_config(self) -> kvx.AgentConfig:
        import dataclasses

        from kvx.backends.tcp import TcpOptions

        return dataclasses.replace(super().agent_config(),
                                   options={"tcp": TcpOptions(stage_bytes=65536, stage_slots=2)})


@pytest.mark.parametrize(("lspec", "rspec"), [("vram:0", "vram:1"), ("vram:0", "numpy"), ("numpy", "vram:1")])
@pytest.mark.parametrize("op", ["write", "read"])
def test_unequal_blocks_across_frames(lspec: str, rspec: str, op: str) -> None:
    """Blocks of unequal sizes (some larger than a slot, cut across frames), permuted, byte-exact."""
    lm, rm = memory(lspec), memory(rspec)
    for m in (lm, rm):
        why = m.unavailable()
        if why is not None:
            pytest.skip(why)
    a = kvx.Agent("initiator", kvx.AgentConfig(backends=("tcp",), peer_timeout=5.0))
    p = PeerProcess("target", {"backends": ["tcp"], "peer_timeout": 5.0})
    try:
        rng = np.random.default_rng(17)
        sizes = rng.integers(1, 9 << 20, size=24).astype(np.uint64)
        total = int(sizes.sum())
        rid, rdescs = p.register(rspec, total)
        name = a.add_peer(p.meta)
        obj, buf = lm.alloc(total)
        reg = a.register(obj)
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        perm = rng.permutation(len(sizes))
        roffs = np.zeros(len(sizes), np.uint64)
        roffs[perm] = np.concatenate([[0], np.cumsum(sizes[perm])[:-1]]).astype(np.uint64)
        ldev = np.full(len(sizes), reg.descs.dev[0], np.uint64)
        rdev = np.full(len(sizes), rdescs.dev[0], np.uint64)
        local = a.prepare(kvx.DescList.from_arrays(kind=reg.descs.kind, addr=reg.descs.addr[0] + offs,
                                                   nbytes=sizes, dev=ldev))
        remote = a.prepare(kvx.DescList.from_arrays(kind=rdescs.kind, addr=rdescs.addr[0] + roffs,
                                                    nbytes=sizes, dev=rdev), peer=name)
        src = pattern(total, 23)
        exp = np.empty(total, np.uint8)
        for i in range(len(sizes)):
            exp[int(roffs[i]): int(roffs[i] + sizes[i])] = src[int(offs[i]): int(offs[i] + sizes[i])]
        idx = np.arange(len(sizes))
        lm.fill(buf, src)
        a.write(local, idx, remote, idx).wait(60)
        assert p.digest(rid) == digest(exp)
        if op == "read":
            lm.fill(buf, np.zeros(total, np.uint8))
            a.read(local, idx, remote, idx).wait(60)
            assert np.array_equal(lm.read(buf), src)
    finally:
        a.close()
        p.close()
