"""The ucx backend's staged path (:mod:`kvx.backends.ucx_staged`) on host memory.

``KVX_UCX_STAGE=host`` sends host memory through the same code that carries CUDA memory where
UCX cannot reach the GPU directly (``UCX_TLS=tcp,cuda_copy``): blocks gathered into pinned slots,
one ``ucp_get_nbx`` per slot by the receiving side, scattered there; the target checks every
block against its live registrations. The conformance suite runs over it, with slots small
enough that transfers take many chunks; the GPU classes of tests/test_ucx.py run it on CUDA
memory (``make gpu-check``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

import kvx
from kvx import wire
from kvx.backends import ucx_staged
from kvx.memory import MemoryKind
from kvx.testing.conformance import TransferConformance, pattern

ucx = pytest.importorskip("kvx.backends.ucx")
if ucx.UcxBackend.unavailable_reason() is not None:
    pytest.skip(f"ucx unavailable: {ucx.UcxBackend.unavailable_reason()}", allow_module_level=True)

STAGE = 64 << 10
ENV = {"UCX_TLS": "tcp,self", "KVX_UCX_STAGE": "host", "KVX_UCX_STAGE_BYTES": str(STAGE),
       "KVX_UCX_STAGE_SLOTS": "2"}


class TestUcxStaged(TransferConformance):
    backend = "ucx"
    mem = "numpy"
    env: ClassVar[dict[str, str]] = ENV
    config: ClassVar[dict[str, Any]] = {"handshake_timeout": 20.0}

    @pytest.fixture(autouse=True)
    def _ucx_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)


def test_when_staging_is_chosen() -> None:
    C, H = MemoryKind.CUDA, MemoryKind.HOST
    assert ucx_staged.wanted("auto", "tcp,cuda_copy", C, C)
    assert ucx_staged.wanted("auto", "tcp,cuda_copy,self", H, C)
    assert not ucx_staged.wanted("auto", "tcp,cuda_copy", H, H)
    assert not ucx_staged.wanted("auto", "rc,cuda_copy", C, C)  # RDMA (GPUDirect) reaches the GPU
    assert not ucx_staged.wanted("auto", "tcp,cuda_ipc,cuda_copy", C, C)
    assert not ucx_staged.wanted("auto", None, C, C)  # UCX's own choice
    assert not ucx_staged.wanted("auto", "all", C, C)
    assert ucx_staged.wanted("always", "rc", C, H)
    assert not ucx_staged.wanted("never", "tcp", C, C)
    assert ucx_staged.wanted("host", "tcp", H, H)


def test_split_and_chunks() -> None:
    nb = np.array([10, 300, 5], dtype=np.uint64)
    la, ra, ln, ld, rd = ucx_staged._split(np.array([0, 1000, 5000], np.uint64), np.array([7, 2007, 9007], np.uint64),
                                           nb, np.zeros(3, np.uint64), np.ones(3, np.uint64), 128)
    assert ln.tolist() == [10, 128, 128, 44, 5]
    assert la.tolist() == [0, 1000, 1128, 1256, 5000]
    assert ra.tolist() == [7, 2007, 2135, 2263, 9007]
    assert rd.tolist() == [1] * 5
    ch = ucx_staged._chunks(ln, 256)
    assert ch == [(0, 2), (2, 5)]  # 138 bytes, then 177
    assert all(int(ln[s:e].sum()) <= 256 for s, e in ch)


def _pair(monkeypatch: pytest.MonkeyPatch) -> tuple[kvx.Agent, kvx.Agent]:
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    cfg = kvx.AgentConfig(backends=("ucx",), peer_timeout=3.0)
    return kvx.Agent("a", cfg), kvx.Agent("b", cfg)


def test_large_blocks_split_across_slots_and_permuted(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(monkeypatch)
    with a, b:
        n, bs = 6, 3 * STAGE + 100  # every block is larger than a slot
        src = pattern(n * bs, 5)
        dst = np.zeros(n * bs, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(ra, bs))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
        perm = np.array([3, 0, 5, 1, 4, 2])
        a.write(loc, np.arange(n), rem, perm, notify=b"done").wait(20)
        assert [type(r) for r in loc.wroutes.values()] == [ucx_staged.StagedRoute]
        exp = np.zeros_like(dst).reshape(n, bs)
        exp[perm] = src.reshape(n, bs)
        assert np.array_equal(dst, exp.reshape(-1))
        assert b.notifications(timeout=5) == {"a": [b"done"]}
        back = np.zeros_like(src)
        lb = a.prepare(kvx.DescList.blocks(a.register(back), bs))
        a.read(lb, perm, rem, np.arange(n)).wait(20)
        assert np.array_equal(back.reshape(n, bs)[perm], dst.reshape(n, bs))


def _target_backend(agent: kvx.Agent) -> Any:
    return agent.backend("ucx")


@pytest.mark.parametrize("bad", ["outside", "oversized", "kind", "count", "truncated", "w-unopened", "w-slot",
                                 "w-outside"])
def test_target_refuses_forged_chunks(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    """A staged request naming memory the target did not register (or malformed) is refused with
    an error answer; the target's memory is untouched and it keeps serving."""
    a, b = _pair(monkeypatch)
    with a, b:
        dst = np.zeros(1 << 16, np.uint8)
        rb = b.register(dst)
        secret = np.full(1 << 12, 7, np.uint8)  # not registered anywhere
        peer = a.add_peer(b.metadata())
        ua = _target_backend(a)
        p = ua._peers[peer]
        st = ua.stager()
        good = np.array([rb.descs.addr[0]], np.uint64)
        ra, rn, rd = good, np.array([4096], np.uint64), np.zeros(1, np.uint64)
        kind = int(MemoryKind.HOST)
        if bad == "outside":
            ra = np.array([secret.ctypes.data], np.uint64)
        elif bad == "oversized":
            rn = np.array([STAGE + 1], np.uint64)
        elif bad == "kind":
            kind = int(MemoryKind.FILE)
        elif bad == "count":
            ra, rn, rd = np.zeros(0, np.uint64), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        if bad == "w-outside":
            ra = np.array([secret.ctypes.data], np.uint64)
        rid = ua._next_rid()
        msg: dict[str, Any] = {"rid": rid, "kind": kind, "ra": ra.tobytes(), "rn": rn.tobytes(), "rd": rd.tobytes()}
        if bad == "truncated":
            msg["rd"] = b"\x00" * 3
        if bad.startswith("w-"):
            if bad != "w-unopened":
                st._landing(p)  # the target gave us landing slots
            st._send(p, wire.pack("sw", ts=99 if bad == "w-slot" else 0, n=int(rn.sum()), **msg))
            with pytest.raises((kvx.RemoteError, kvx.ProtocolError)):
                st._reply(p, rid, "sw_rep")
        else:
            st._send(p, wire.pack("sr", a=0, k=b"\x00", **msg))
            with pytest.raises((kvx.RemoteError, kvx.ProtocolError)):
                st._reply(p, rid, "sr_rep")
        assert not dst.any() and (secret == 7).all()
        # the target still serves a good request
        src = pattern(1 << 16, 9)
        loc = a.prepare(kvx.DescList.blocks(a.register(src), 4096))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, 4096), peer=peer)
        a.write(loc, np.arange(16), rem, np.arange(16)).wait(20)
        assert np.array_equal(dst, src)


def test_release_during_traffic_and_no_leaked_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair(monkeypatch)
    with a, b:
        bs, n = 8192, 64
        src = pattern(n * bs, 2)
        dst = np.zeros(n * bs, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(ra, bs))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
        for _ in range(3):
            a.write(loc, np.arange(n), rem, np.arange(n)).wait(20)
        assert np.array_equal(dst, src)
        rb.release()
        with pytest.raises(kvx.KVXError):
            a.write(loc, np.arange(n), rem, np.arange(n)).wait(20)
        sa = _target_backend(a).stager()
        sb = _target_backend(b).stager()
        rings = list(sa._rings.values()) + list(sb._rings.values())
        assert rings and all(r.allocated <= 2 for r in rings)
    # closing freed every slot and its UCX mapping
    assert not sa._rings and not sa._regs and not sb._rings and not sb._regs


# ---- CUDA memory (make gpu-check): staged with small slots, and the direct path kept tested ----
CUDA_STAGED = {"UCX_TLS": "tcp,cuda_copy,self", "KVX_UCX_STAGE": "auto", "KVX_UCX_STAGE_BYTES": str(STAGE),
               "KVX_UCX_STAGE_SLOTS": "3", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
CUDA_DIRECT = {**CUDA_STAGED, "KVX_UCX_STAGE": "never"}


@pytest.mark.gpu
class TestUcxStagedAcrossGpus(TestUcxStaged):
    env = CUDA_STAGED
    mem, local_mem = "vram:1", "vram:0"


@pytest.mark.gpu
class TestUcxStagedToPinnedHost(TestUcxStaged):
    env = CUDA_STAGED
    mem, local_mem = "pinned", "vram:0"


@pytest.mark.gpu
class TestUcxStagedHostToCuda(TestUcxStaged):
    env = CUDA_STAGED
    mem, local_mem = "vram:1", "numpy"


@pytest.mark.gpu
class TestUcxDirectAcrossGpus(TestUcxStaged):
    env = CUDA_DIRECT
    mem, local_mem = "vram:1", "vram:0"
