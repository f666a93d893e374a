"""The tcp backend's staging pipeline (the path CUDA memory takes) on host memory, without a GPU.

``TcpOptions(stage_host=True)`` sends host memory through the same code as GPU memory: blocks
gathered into a connection's slots (a write's next frame staged while one is on the wire), frames
landing in the target's slots and scattered while the connection goes on, acknowledgements after
the scatter, a read's slot held from its request to its scatter. Only the copier differs (native
memcpy instead of the CUDA kernel). Small slots force many frames per transfer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.backends.tcp import TcpOptions
from kvx.backends.tcp.staging import HostCopier, SlotRing
from kvx.testing.conformance import TransferConformance, digest, pattern
from kvx.testing.procs import PeerProcess

STAGE = 64 << 10
ENV = {"KVX_TCP_STAGE_HOST": "1", "KVX_TCP_STAGE_BYTES": str(STAGE), "KVX_TCP_STAGE_SLOTS": "2"}


def _opts(**kw: Any) -> TcpOptions:
    return TcpOptions(**{"stage_host": True, "stage_bytes": STAGE, "stage_slots": 2, **kw})


class TestTcpStagedBothSides(TransferConformance):
    """Both agents stage: initiator gathers/scatters, target lands and scatters."""

    backend = "tcp"
    mem = "numpy"
    env = ENV

    def agent_config(self) -> kvx.AgentConfig:
        return dataclasses.replace(super().agent_config(), options={"tcp": _opts()})


class TestTcpStagedInitiatorOnly(TransferConformance):
    """Only the initiator stages (a GPU process against a CPU-only target, as far as the pipeline goes)."""

    backend = "tcp"
    mem = "numpy"

    def agent_config(self) -> kvx.AgentConfig:
        return dataclasses.replace(super().agent_config(), options={"tcp": _opts()})


class TestTcpStagedTargetOnly(TransferConformance):
    """Only the target stages (a CPU-only process against a GPU target)."""

    backend = "tcp"
    mem = "numpy"
    env = ENV


def _pair(peer_env: dict[str, str] | None = None, **kw: Any) -> tuple[kvx.Agent, PeerProcess]:
    a = kvx.Agent("initiator", kvx.AgentConfig(backends=("tcp",), peer_timeout=3.0, options={"tcp": _opts(**kw)}))
    p = PeerProcess("target", {"backends": ["tcp"], "peer_timeout": 3.0}, peer_env or ENV)
    return a, p


@pytest.mark.parametrize("op", ["write", "read"])
def test_many_frames_mixed_sizes_byte_exact(op: str) -> None:
    """Unequal blocks (some larger than a slot, cut across frames), permuted, both directions."""
    a, p = _pair()
    try:
        rng = np.random.default_rng(5)
        sizes = rng.integers(1, 3 * STAGE, size=40).astype(np.uint64)
        total = int(sizes.sum())
        rid, rdescs = p.register("numpy", total)
        name = a.add_peer(p.meta)
        buf = np.zeros(total, np.uint8)
        reg = a.register(buf)
        offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        perm = rng.permutation(len(sizes))
        # the remote list holds the same sizes in permuted order
        roffs = np.zeros(len(sizes), np.uint64)
        roffs[perm] = np.concatenate([[0], np.cumsum(sizes[perm])[:-1]]).astype(np.uint64)
        local = a.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=reg.descs.addr[0] + offs,
                                                   nbytes=sizes, dev=np.zeros(len(sizes), np.uint64)))
        remote = a.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=rdescs.addr[0] + roffs,
                                                    nbytes=sizes, dev=np.zeros(len(sizes), np.uint64)), peer=name)
        src = pattern(total, 11)
        idx = np.arange(len(sizes))
        exp = np.empty(total, np.uint8)
        for i in range(len(sizes)):
            exp[int(roffs[i]): int(roffs[i] + sizes[i])] = src[int(offs[i]): int(offs[i] + sizes[i])]
        if op == "write":
            buf[:] = src
            a.write(local, idx, remote, idx).wait(30)
            assert p.digest(rid) == digest(exp)
        else:
            buf[:] = src
            a.write(local, idx, remote, idx).wait(30)  # the target now holds exp
            assert p.digest(rid) == digest(exp)
            buf[:] = 0
            a.read(local, idx, remote, idx).wait(30)
            assert np.array_equal(buf, src)
    finally:
        a.close()
        p.close()


def test_concurrent_transfers_share_the_rings_without_deadlock() -> None:
    """Writes and reads from several threads at once through two slots per connection."""
    a, p = _pair()
    try:
        bs, n = 16 << 10, 64
        rid, rdescs = p.register("numpy", n * bs)
        name = a.add_peer(p.meta)
        buf = np.zeros(n * bs, np.uint8)
        reg = a.register(buf)
        local = a.prepare(kvx.DescList.blocks(reg, bs))
        remote = a.prepare(kvx.DescList.blocks(rdescs, bs), peer=name)
        buf[:] = pattern(n * bs, 3)
        a.write(local, np.arange(n), remote, np.arange(n)).wait(30)
        errs: list[BaseException] = []

        def work(k: int) -> None:
            try:
                half = np.arange(k * (n // 4), (k + 1) * (n // 4))
                for _ in range(5):
                    if k % 2:
                        a.read(local, half, remote, half).wait(30)
                    else:
                        a.write(local, half, remote, half).wait(30)
            except BaseException as exc:
                errs.append(exc)

        ts = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errs and not any(t.is_alive() for t in ts)
        assert p.digest(rid) == digest(pattern(n * bs, 3))
        assert np.array_equal(buf, pattern(n * bs, 3))
    finally:
        a.close()
        p.close()


def test_killed_target_mid_staged_transfer_fails_within_bound_and_frees_slots() -> None:
    a, p = _pair()
    try:
        bs, n = 1 << 20, 64
        rid, rdescs = p.register("numpy", n * bs)
        name = a.add_peer(p.meta)
        reg = a.register(np.zeros(n * bs, np.uint8))
        local = a.prepare(kvx.DescList.blocks(reg, bs))
        remote = a.prepare(kvx.DescList.blocks(rdescs, bs), peer=name)
        be: Any = a.backend("tcp")
        x = a.write(local, np.arange(n), remote, np.arange(n))
        p.proc.kill()
        t0 = time.monotonic()
        with pytest.raises(kvx.TransferError):
            x.wait(15)
        assert time.monotonic() - t0 < 10
        conn = be._peers.get(name)
        deadline = time.monotonic() + 10
        while conn is not None and any(t.is_alive() for s in conn.streams for t in s.threads):
            assert time.monotonic() < deadline, "stream threads still alive"
            time.sleep(0.05)
        if conn is not None:
            assert all(r.allocated == 0 for s in conn.streams for r in s.rings.values())
    finally:
        a.close()
        p.close()


def test_forged_staged_frame_larger_than_a_slot_is_refused() -> None:
    """A target takes staged frames up to its slot size only: a bigger one is refused, memory untouched."""
    a = kvx.Agent("initiator", kvx.AgentConfig(backends=("tcp",), peer_timeout=3.0,
                                               options={"tcp": TcpOptions(stage_bytes=4 * STAGE)}))
    p = PeerProcess("target", {"backends": ["tcp"], "peer_timeout": 3.0}, ENV)
    try:
        rid, rdescs = p.register("numpy", 8 * STAGE)
        name = a.add_peer(p.meta)
        be: Any = a.backend("tcp")
        be._peers[name].stage = 4 * STAGE  # forged: pretend the target takes bigger frames
        buf = np.full(8 * STAGE, 7, np.uint8)
        reg = a.register(buf)
        local = a.prepare(kvx.DescList.blocks(reg, 2 * STAGE))
        remote = a.prepare(kvx.DescList.blocks(rdescs, 2 * STAGE), peer=name)
        before = p.digest(rid)
        with pytest.raises(kvx.RemoteError, match="exceeds"):
            a.write(local, [0], remote, [1]).wait(10)
        assert p.digest(rid) == before
        # the connection is still in sync afterwards
        be._peers[name].stage = STAGE
        a.write(local, [0], remote, [1]).wait(10)
        exp = np.zeros(8 * STAGE, np.uint8)
        exp[2 * STAGE: 4 * STAGE] = 7
        assert p.digest(rid) == digest(exp)
    finally:
        a.close()
        p.close()


def test_slot_ring_bounds_and_close() -> None:
    ring = SlotRing(HostCopier(), 4096, 2)
    s1, s2 = ring.take(1.0), ring.take(1.0)
    assert s1 is not s2 and ring.allocated == 2
    t0 = time.monotonic()
    with pytest.raises(kvx.TransferTimeout):
        ring.take(0.2)
    assert time.monotonic() - t0 < 2
    ring.give(s1)
    assert ring.take(1.0) is s1
    ring.close()
    assert ring.allocated == 0
    with pytest.raises(kvx.TransferError):
        ring.take(0.1)
    ring.copier.close()  # type: ignore[attr-defined]


def test_host_copier_gather_scatter_roundtrip() -> None:
    c = HostCopier()
    slot = c.alloc(1 << 16)
    src = pattern(1 << 16, 9)
    nb = np.array([100, 1, 4096, 3000], np.uint64)
    offs = np.array([5000, 0, 20000, 9000], np.uint64)
    addr = np.uint64(src.ctypes.data) + offs
    c.gather(slot, addr, nb, None).wait(1.0)
    got = np.frombuffer(bytes((__import__("ctypes").c_char * int(nb.sum())).from_address(slot.addr)), np.uint8)
    exp = np.concatenate([src[int(o): int(o + n)] for o, n in zip(offs, nb)])
    assert np.array_equal(got, exp)
    dst = np.zeros_like(src)
    c.scatter(slot, np.uint64(dst.ctypes.data) + offs, nb, None).wait(1.0)
    for o, n in zip(offs, nb):
        assert np.array_equal(dst[int(o): int(o + n)], src[int(o): int(o + n)])
    c.free(slot)
    c.close()


def test_staged_connections_leave_no_threads_fds_or_slots() -> None:
    """Both agents in this process, both staging: after the initiator closes, the target's serving
    threads end with their slots freed, and no thread or fd of either side stays."""
    import gc
    import os

    def census() -> tuple[int, int]:
        gc.collect()
        return threading.active_count(), len(os.listdir("/proc/self/fd"))

    cfg = kvx.AgentConfig(backends=("tcp",), peer_timeout=3.0, options={"tcp": _opts()})
    with kvx.Agent("target", cfg) as tgt:
        treg = tgt.register(np.zeros(1 << 20, np.uint8))
        be: Any = tgt.backend("tcp")
        made: list[int] = []
        freed: list[int] = []
        copier = be._host_copier  # shared by the target's rings: count what they take and give back
        orig_alloc, orig_free = copier.alloc, copier.free
        copier.alloc = lambda size: (made.append(size), orig_alloc(size))[1]
        copier.free = lambda slot: (freed.append(slot.size), orig_free(slot))
        time.sleep(0.5)
        t0, f0 = census()
        for _ in range(2):
            with kvx.Agent("initiator", cfg) as a:
                name = a.add_peer(tgt.metadata())
                reg = a.register(np.full(1 << 20, 3, np.uint8))
                loc = a.prepare(kvx.DescList.blocks(reg, 4096))
                rem = a.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
                a.write(loc, np.arange(256), rem, np.arange(256)[::-1], notify=b"n").wait(10)
                a.read(loc, np.arange(256), rem, np.arange(256)).wait(10)
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and (census() != (t0, f0) or be._served):
            time.sleep(0.1)
        threads, fds = census()
        assert threads <= t0 and fds <= f0, f"threads {t0} -> {threads}, fds {f0} -> {fds}"
        assert not be._served
        assert made and len(freed) == len(made), f"target slots: {len(made)} allocated, {len(freed)} freed"
        treg.release()
