"""Conformance suites every backend's tests subclass (the same cases for every backend).

Usage in a test module::

    from kvx.testing.conformance import TransferConformance

    class TestHost(TransferConformance):
        backend = "host"
        config = {"host_path": "shm"}

    class TestCudaAcrossGpus(TransferConformance):      # the same cases on GPU memory
        backend = "cuda"
        mem, local_mem = "vram:1", "vram:0"             # kvx.testing.memory specs

and for storage::

    class TestPosix(StorageConformance):
        backend = "posix"
        def storage_regions(self, tmp_path, nblocks, block_bytes): ...

Every invariant of DESIGN section 4 that applies to a backend has a case here: forged and
out-of-bounds descriptors, garbage and truncated metadata, a release racing a transfer, a
killed peer, misuse after close.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest

import kvx
from kvx.testing.memory import Memory, memory, pattern
from kvx.testing.procs import PeerProcess

__all__ = ["race_release", "TransferConformance", "StorageConformance", "digest", "pattern"]

def digest(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def race_release(agent: kvx.Agent, local: Any, remote: Any, n: int, release: Any, lead: float = 0.2,
                 trail: float = 0.3) -> tuple[list[str], int]:
    """Post writes of blocks ``0..n-1`` of ``local`` to ``remote`` back to back on a thread, call
    ``release()`` after ``lead`` seconds, let it post ``trail`` seconds more, stop it (bounded):
    (each post's outcome, "done" or "failed"; how many had ended when ``release()`` returned)."""
    outcomes: list[str] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            try:
                agent.write(local, np.arange(n), remote, np.arange(n)).wait(10)
                outcomes.append("done")
            except (kvx.TransferError, kvx.UsageError):
                outcomes.append("failed")

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(lead)
    release()
    at = len(outcomes)
    time.sleep(trail)
    stop.set()
    t.join(15)
    assert not t.is_alive(), "a transfer posted around the release did not end within its bound"
    return outcomes, at


class TransferConformance:
    """Agent-to-agent transfers between two processes through one backend, on any memory.

    ``mem`` and ``local_mem`` are :mod:`kvx.testing.memory` specs; every case fills and checks
    memory through them, so a backend of GPU memory inherits the same cases as one of host memory.
    """

    backend: ClassVar[str] = "host"
    #: AgentConfig fields for both agents (JSON-able)
    config: ClassVar[dict[str, Any]] = {}
    #: memory of the target (a kvx.testing.memory spec: "alloc", "numpy", "pinned", "vram:1", ...)
    mem: ClassVar[str] = "alloc"
    #: memory of the initiator (default: the same as ``mem``)
    local_mem: ClassVar[str | None] = None
    #: extra environment of the peer process
    env: ClassVar[dict[str, str]] = {}
    #: bound (s) within which a killed peer must fail transfers
    peer_timeout: ClassVar[float] = 3.0

    def agent_config(self) -> kvx.AgentConfig:
        cfg = dict(self.config)
        cfg.setdefault("peer_timeout", self.peer_timeout)
        cfg.setdefault("backends", (self.backend,))
        return kvx.AgentConfig(**cfg)

    def peer_config(self) -> dict[str, Any]:
        cfg = dict(self.config)
        cfg.setdefault("peer_timeout", self.peer_timeout)
        cfg.setdefault("backends", [self.backend])
        return cfg

    @property
    def lm(self) -> Memory:
        """The initiator's memory."""
        return memory(self.local_mem or self.mem)

    @property
    def tkind(self) -> kvx.MemoryKind:
        """The kind of the target's memory."""
        return memory(self.mem).kind

    def local_buffer(self, n: int) -> tuple[Any, Any]:
        """(object to register, flat uint8 view) of ``n`` zeroed bytes of the initiator's memory."""
        return self.lm.alloc(n)

    @pytest.fixture
    def agent(self) -> Any:
        for spec in (self.mem, self.local_mem or self.mem):
            why = memory(spec).unavailable()
            if why is not None:
                pytest.skip(f"{spec} memory: {why}")
        a = kvx.Agent("initiator", self.agent_config())
        yield a
        a.close()

    @pytest.fixture
    def peer(self) -> Any:
        p = PeerProcess("target", self.peer_config(), self.env)
        yield p
        p.close()

    def connect(self, agent: kvx.Agent, peer: PeerProcess, nbytes: int, bs: int, seed: int = 7
                ) -> tuple[kvx.PreparedList, kvx.PreparedList, Any, int, kvx.Registration]:
        """Target memory in the peer, ``pattern(nbytes, seed)`` in local memory, both prepared as
        blocks of ``bs``: (local list, remote list, local view, remote id, local registration)."""
        rid, rdescs = peer.register(self.mem, nbytes)
        name = agent.add_peer(peer.meta)
        obj, buf = self.local_buffer(nbytes)
        self.lm.fill(buf, pattern(nbytes, seed))
        reg = agent.register(obj)
        local = agent.prepare(kvx.DescList.blocks(reg, bs))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=name)
        return local, remote, buf, rid, reg

    # ---- data movement --------------------------------------------------------------------
    @pytest.mark.parametrize("bs", [1, 4096, 4097, 65536])
    def test_write_then_read_permuted(self, agent: kvx.Agent, peer: PeerProcess, bs: int) -> None:
        n = 64
        local, remote, buf, rid, _ = self.connect(agent, peer, n * bs, bs)
        orig = self.lm.read(buf)
        perm = np.random.default_rng(bs).permutation(n)
        x = agent.write(local, np.arange(n), remote, perm)
        assert x.wait(10) is x and x.status is kvx.Status.DONE and x.error is None
        assert x.nbytes == n * bs
        exp = np.empty(n * bs, np.uint8)
        exp.reshape(n, bs)[perm] = orig.reshape(n, bs)
        assert peer.digest(rid) == digest(exp)
        self.lm.fill(buf, 0)
        agent.read(local, perm, remote, np.arange(n)).wait(10)
        back = np.empty_like(orig)
        back.reshape(n, bs)[perm] = exp.reshape(n, bs)
        assert np.array_equal(self.lm.read(buf), back)
        self.lm.fill(buf, 0)
        agent.read(local, np.arange(n), remote, perm).wait(10)
        assert np.array_equal(self.lm.read(buf), orig)

    def test_large_transfer_is_nonblocking_and_correct(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        bs, n = 1 << 20, 48
        local, remote, buf, rid, _ = self.connect(agent, peer, n * bs, bs)
        perm = np.random.default_rng(3).permutation(n)
        x = agent.write(local, np.arange(n), remote, perm)
        x.wait(30)
        exp = np.empty(n * bs, np.uint8)
        exp.reshape(n, bs)[perm] = self.lm.read(buf).reshape(n, bs)
        assert peer.digest(rid) == digest(exp)

    def test_index_forms(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, buf, rid, _ = self.connect(agent, peer, 8 * 64, 64)
        for li, ri in [([0, 1], [1, 0]), ((2,), (3,)), (np.array([4], np.int32), np.array([5], np.uint64)), (6, 7),
                       (np.int64(7), np.int64(6))]:
            agent.write(local, li, remote, ri).wait(10)
        exp = np.zeros(8 * 64, np.uint8).reshape(8, 64)
        b = self.lm.read(buf).reshape(8, 64)
        exp[1], exp[0], exp[3], exp[5], exp[7], exp[6] = b[0], b[1], b[2], b[4], b[6], b[7]
        assert peer.digest(rid) == digest(exp)

    def test_bad_indices_raise_usage_error(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, _buf, rid, reg = self.connect(agent, peer, 8 * 64, 64)
        before = peer.digest(rid)
        with pytest.raises(kvx.UsageError):
            agent.write(local, [0, 1], remote, [0])  # lengths differ
        with pytest.raises(kvx.UsageError):
            agent.write(local, [0], remote, [8])  # out of range
        with pytest.raises(kvx.UsageError):
            agent.write(local, [0.5], remote, [1])  # not an int
        with pytest.raises(kvx.UsageError):
            agent.write(local, [-9], remote, [1])  # negative beyond the list
        big = agent.prepare(kvx.DescList.blocks(reg, 128))
        with pytest.raises(kvx.UsageError):
            agent.write(big, [0], remote, [0])  # 128 vs 64 bytes
        with pytest.raises(kvx.UsageError):
            agent.write(remote, [0], local, [0])  # first list must be local
        assert peer.digest(rid) == before

    # ---- invariants -----------------------------------------------------------------------
    def test_forged_descriptors_are_refused(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        rid, rdescs = peer.register(self.mem, 4096)
        name = agent.add_peer(peer.meta)
        before = peer.digest(rid)
        a, n, dv, kind = int(rdescs.addr[0]), int(rdescs.nbytes[0]), int(rdescs.dev[0]), rdescs.kind
        forged = [
            (a - 4096, 64),  # before the region
            (a + n, 64),  # just past the end
            (a + n - 32, 64),  # straddling the end
            (a, n + 1),  # one byte too long
            ((1 << 63) - 64, 64),  # nowhere
            (a + 64, (1 << 62)),  # huge
        ]
        for addr, nb in forged:
            d = kvx.DescList.from_arrays(kind=kind, addr=[addr], nbytes=[nb], dev=[dv])
            with pytest.raises(kvx.RegistrationError):
                agent.prepare(d, peer=name)
        with pytest.raises(kvx.RegistrationError):  # wrong device id
            agent.prepare(kvx.DescList.from_arrays(kind=kind, addr=[a], nbytes=[64], dev=[dv + 3]), peer=name)
        other = kvx.MemoryKind.CUDA if kind is kvx.MemoryKind.HOST else kvx.MemoryKind.HOST
        with pytest.raises(kvx.RegistrationError):  # right bounds, wrong kind of memory
            agent.prepare(kvx.DescList.from_arrays(kind=other, addr=[a], nbytes=[64], dev=[dv]), peer=name)
        assert peer.digest(rid) == before

    def test_garbage_and_truncated_metadata(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        meta = peer.meta
        for bad in [b"", b"\x00", meta[: len(meta) // 2], meta[:-1], b"\xc1" * 10, meta + b"x", b"\x93\x01\x02\x03",
                    __import__("msgpack").packb({"v": 99, "t": "meta"}), __import__("msgpack").packb([1, 2])]:
            with pytest.raises(kvx.ProtocolError):
                agent.add_peer(bad)
        assert agent.peers() == []
        agent.add_peer(meta)  # the real one still works

    def test_notification_arrives_after_data(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, buf, rid, _ = self.connect(agent, peer, 1 << 20, 4096)
        n = len(remote)
        agent.write(local, np.arange(n), remote, np.arange(n)[::-1].copy(), notify=b"req-17").wait(10)
        got = peer.notifs(timeout=5.0)
        assert got == {"initiator": [b"req-17"]}
        exp = self.lm.read(buf).reshape(n, 4096)[::-1]
        assert peer.digest(rid) == digest(np.ascontiguousarray(exp))

    def test_release_racing_transfers(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        bs, n = 65536, 64
        local, remote, _buf, rid, _ = self.connect(agent, peer, bs * n, bs)
        # after release returned, no transfer may succeed any more
        outcomes, after = race_release(agent, local, remote, n, lambda: peer.call(cmd="release", id=rid))
        assert "done" in outcomes[:after] or after == 0
        tail = outcomes[after + 1:]  # one transfer may have been posted before the release
        assert tail and all(o == "failed" for o in tail)
        with pytest.raises(kvx.TransferError):
            agent.write(local, [0], remote, [0]).wait(10)

    def test_killed_peer_fails_within_bound(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, _buf, _rid, _ = self.connect(agent, peer, 1 << 20, 4096)
        agent.write(local, [0], remote, [0]).wait(10)
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises((kvx.PeerDisconnected, kvx.TransferError)):
            deadline = time.monotonic() + self.peer_timeout + 5
            while time.monotonic() < deadline:
                agent.write(local, np.arange(256), remote, np.arange(256)).wait(self.peer_timeout + 5)
                time.sleep(0.05)
        assert time.monotonic() - t0 < self.peer_timeout + 5

    def test_misuse_after_close(self, peer: PeerProcess) -> None:
        a = kvx.Agent("initiator", self.agent_config())
        local, remote, _buf, _rid, reg = self.connect(a, peer, 4096, 64)
        a.close()
        a.close()  # idempotent
        for call in (lambda: a.write(local, [0], remote, [0]), lambda: a.register(self.local_buffer(8)[0]),
                     lambda: a.prepare(reg.descs), a.metadata, lambda: a.add_peer(peer.meta),
                     lambda: a.notify("target", b"x"), a.notifications):
            with pytest.raises(kvx.UsageError):
                call()
        reg.release()  # releasing after close is harmless

    def test_released_local_registration(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, _buf, _rid, reg = self.connect(agent, peer, 4096, 64)
        reg.release()
        with pytest.raises(kvx.UsageError):
            agent.write(local, [0], remote, [0])
        with pytest.raises(kvx.RegistrationError):
            agent.prepare(reg.descs)

    def test_transfer_handle_api(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        local, remote, _buf, _rid, _ = self.connect(agent, peer, 1 << 22, 1 << 16)
        x = agent.write(local, np.arange(64), remote, np.arange(64))

        async def go() -> kvx.Transfer:
            return await x

        assert asyncio.run(go()) is x
        assert x.done() and x.status is kvx.Status.DONE and x.error is None
        assert x.cancel() is False
        assert "DONE" in repr(x)

    def test_notify_api(self, agent: kvx.Agent, peer: PeerProcess) -> None:
        name = agent.add_peer(peer.meta)
        agent.notify(name, b"hello")
        assert peer.notifs(timeout=5.0) == {"initiator": [b"hello"]}
        with pytest.raises(kvx.UsageError):
            agent.notify("nobody", b"x")
        with pytest.raises(kvx.UsageError):
            agent.notify(name, "text")  # type: ignore[arg-type]


class StorageConformance:
    """Local storage registrations (FILE, OBJECT) used as the other side of read/write."""

    backend: ClassVar[str] = "posix"
    config: ClassVar[dict[str, Any]] = {}

    def storage_regions(self, tmp_path: Any, nblocks: int, block_bytes: int) -> Any:
        """Return what to register: one FileRegion of nblocks*block_bytes, or a list of regions."""
        raise NotImplementedError

    @pytest.fixture
    def agent(self) -> Any:
        cfg = dict(self.config)
        cfg.setdefault("backends", ("host", self.backend))
        a = kvx.Agent("storage", kvx.AgentConfig(**cfg))
        yield a
        a.close()

    @pytest.mark.parametrize("bs", [4096, 65536, 4099])
    def test_write_then_read_permuted(self, agent: kvx.Agent, tmp_path: Any, bs: int) -> None:
        n = 32
        sreg = agent.register(self.storage_regions(tmp_path, n, bs))
        buf = np.zeros(n * bs, np.uint8)
        buf[:] = pattern(n * bs, bs)
        mreg = agent.register(buf)
        mem = agent.prepare(kvx.DescList.blocks(mreg, bs))
        sto = agent.prepare(kvx.DescList.blocks(sreg, bs))
        assert len(sto) == n
        perm = np.random.default_rng(bs).permutation(n)
        x = agent.write(mem, np.arange(n), sto, perm, backend=self.backend)
        x.wait(60)
        assert x.status is kvx.Status.DONE and x.backend == self.backend
        orig = buf.copy()
        buf[:] = 0
        agent.read(mem, np.arange(n), sto, perm, backend=self.backend).wait(60)
        assert np.array_equal(buf, orig)
        buf[:] = 0
        agent.read(mem, perm, sto, np.arange(n), backend=self.backend).wait(60)
        # read(mem[perm[i]] <- sto[i]); sto[perm[j]] holds orig block j, so sto[i] = orig[argsort(perm)[i]]
        want = np.empty_like(orig)
        want.reshape(n, bs)[perm] = orig.reshape(n, bs)[np.argsort(perm)]
        assert np.array_equal(buf, want)

    def test_out_of_range_is_refused(self, agent: kvx.Agent, tmp_path: Any) -> None:
        sreg = agent.register(self.storage_regions(tmp_path, 4, 4096))
        d = sreg.descs
        too_far = kvx.DescList.from_arrays(kind=d.kind, addr=[int(d.nbytes[0]) - 100], nbytes=[4096],
                                           dev=[int(d.dev[0])])
        with pytest.raises(kvx.RegistrationError):
            agent.prepare(too_far)
        unknown = kvx.DescList.from_arrays(kind=d.kind, addr=[0], nbytes=[4096], dev=[int(d.dev.max()) + 1000])
        with pytest.raises(kvx.RegistrationError):
            agent.prepare(unknown)

    def test_released_storage_registration(self, agent: kvx.Agent, tmp_path: Any) -> None:
        sreg = agent.register(self.storage_regions(tmp_path, 4, 4096))
        mreg = agent.register(np.zeros(4 * 4096, np.uint8))
        mem = agent.prepare(kvx.DescList.blocks(mreg, 4096))
        sto = agent.prepare(kvx.DescList.blocks(sreg, 4096))
        sreg.release()
        with pytest.raises(kvx.UsageError):
            agent.write(mem, [0], sto, [0])

    def test_misuse_after_close(self, tmp_path: Any) -> None:
        cfg = dict(self.config)
        cfg.setdefault("backends", ("host", self.backend))
        a = kvx.Agent("storage", kvx.AgentConfig(**cfg))
        sreg = a.register(self.storage_regions(tmp_path, 2, 4096))
        a.close()
        with pytest.raises(kvx.UsageError):
            a.register(np.zeros(4, np.uint8))
        with pytest.raises(kvx.UsageError):
            a.prepare(sreg.descs)
