"""Strided descriptor lists (``DescList.strided``): count pieces of nbytes at a stride, per descriptor.

The host backend copies them natively (one job entry per descriptor pair; a memcpy loop in C, or
the pieces as CMA iovecs) on its memcpy and CMA paths; every other path (AF_UNIX, tcp, posix)
moves their expansion through the agent's FlatRoute. Each path is checked byte for byte
against numpy with odd counts, lengths and strides, and every prepare checks a descriptor's whole
span against the registrations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvx
from kvx.backends.base import FlatRoute, piece_index
from kvx.testing.memory import memory
from kvx.testing.procs import PeerProcess

H = kvx.MemoryKind.HOST
# 7 descriptors of 5 pieces of 13 bytes; strides 29 here, 37 there; descriptors 200 / 300 apart
N, COUNT, LEN, LS, RS, LSTEP, RSTEP = 7, 5, 13, 29, 37, 200, 300


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def pieces(buf: np.ndarray, i: int, step: int, stride: int) -> np.ndarray:
    """The bytes of descriptor ``i`` (all its pieces, in order)."""
    return np.concatenate([buf[i * step + k * stride: i * step + k * stride + LEN] for k in range(COUNT)])


def strided(base: int, step: int, stride: int, kind: kvx.MemoryKind = H, dev: int = 0) -> kvx.DescList:
    return kvx.DescList.strided(kind=kind, addr=base + np.arange(N, dtype=np.uint64) * step, nbytes=LEN,
                                count=COUNT, stride=stride, dev=dev)


# ---- the list itself ----------------------------------------------------------------------------

def test_strided_list_shape_and_wire() -> None:
    d = strided(4096, LSTEP, LS)
    assert d.is_strided and len(d) == N and d.total_bytes == N * COUNT * LEN
    assert int(d.span[0]) == (COUNT - 1) * LS + LEN
    sub = d[np.array([3, 1])]
    assert sub.is_strided and list(sub.addr) == [4096 + 3 * LSTEP, 4096 + LSTEP] and list(sub.count) == [COUNT] * 2
    assert kvx.DescList.from_bytes(d.to_bytes()) == d
    assert kvx.DescList.from_bytes(d.flatten().to_bytes()) != d  # the same bytes, another list
    flat = d.flatten()
    assert not flat.is_strided and len(flat) == N * COUNT
    assert list(flat.addr[:COUNT]) == [4096 + k * LS for k in range(COUNT)]
    plain = kvx.DescList.from_arrays(kind=H, addr=[8, 64], nbytes=8)
    assert not plain.is_strided and list(plain.count) == [1, 1] and plain.flatten() is plain
    # piece_index: descriptor i's pieces in the expansion
    first = np.array([0, 3, 4], np.int64)
    count = np.array([3, 1, 2], np.int64)
    assert list(piece_index([2, 0, 1], first, count)) == [4, 5, 0, 1, 2, 3]
    with pytest.raises(kvx.UsageError):
        piece_index([3], first, count)


@pytest.mark.parametrize("kw, what", [
    ({"count": 0}, "count"),
    ({"count": (1 << 32) + 1}, "count"),
    ({"stride": 12}, "stride must be at least"),  # overlapping pieces
    ({"stride": (1 << 48) + 1}, "stride"),
    ({"count": [2, 2]}, "count must be one int"),
    ({"addr": [(1 << 63) - 50]}, "past address"),
])
def test_bad_strided_lists_are_refused(kw: dict[str, Any], what: str) -> None:
    args = {"kind": H, "addr": [4096], "nbytes": 13, "count": 4, "stride": 20, **kw}
    with pytest.raises(kvx.UsageError, match=what):
        kvx.DescList.strided(**args)


def test_malformed_strided_wire_is_a_protocol_error() -> None:
    import msgpack

    good = msgpack.unpackb(strided(4096, LSTEP, LS).to_bytes())
    for k, v in (("count", np.zeros(N, np.uint64).tobytes()),  # count 0
                 ("stride", np.full(N, 3, np.uint64).tobytes()),  # overlapping pieces
                 ("stride", b"\0" * 8),  # wrong length
                 ("count", 17)):  # wrong type
        msg = dict(good)
        msg[k] = v
        with pytest.raises(kvx.ProtocolError):
            kvx.DescList.from_bytes(msgpack.packb(msg))
    msg = dict(good)
    del msg["stride"]
    with pytest.raises(kvx.ProtocolError):
        kvx.DescList.from_bytes(msgpack.packb(msg))


# ---- one agent (loopback) -------------------------------------------------------------------------

def test_local_strided_copy_is_native_and_exact() -> None:
    src = pattern(4096, 1)
    dst = np.zeros(4096, np.uint8)
    with kvx.Agent("a", kvx.AgentConfig(backends=("host",))) as ag:
        ag.register(src)
        ag.register(dst)
        s = ag.prepare(strided(src.ctypes.data, LSTEP, LS))
        d = ag.prepare(strided(dst.ctypes.data, RSTEP, RS))
        perm = [4, 0, 6, 2]
        x = ag.read(d, perm, s, [0, 1, 2, 3])
        assert x.wait(5).status is kvx.Status.DONE and x.nbytes == 4 * COUNT * LEN
        assert not isinstance(d.rroutes[s], FlatRoute)  # the memcpy loop in C, one triplet per pair
        exp = np.zeros_like(dst)
        for di, si in zip(perm, range(4)):
            for k in range(COUNT):
                d0, s0 = di * RSTEP + k * RS, si * LSTEP + k * LS
                exp[d0: d0 + LEN] = src[s0: s0 + LEN]
        assert np.array_equal(dst, exp)
        # a plan posts the same
        dst[:] = 0
        ag.make_transfer("read", d, perm, s, [0, 1, 2, 3]).post().wait(5)
        assert np.array_equal(dst, exp)
        # pairs must agree in count and length
        other = ag.prepare(kvx.DescList.strided(kind=H, addr=[dst.ctypes.data], nbytes=LEN, count=COUNT - 1,
                                                stride=RS))
        with pytest.raises(kvx.UsageError):
            ag.read(other, [0], s, [0])
        with pytest.raises(kvx.UsageError):
            ag.read(d, [7], s, [0])
        # a descriptor whose last piece leaves the registration is refused before anything moves
        with pytest.raises(kvx.RegistrationError):
            ag.prepare(kvx.DescList.strided(kind=H, addr=[dst.ctypes.data + 4096 - (COUNT - 1) * RS - LEN + 1],
                                            nbytes=LEN, count=COUNT, stride=RS))
        ok = ag.prepare(kvx.DescList.strided(kind=H, addr=[dst.ctypes.data + 4096 - (COUNT - 1) * RS - LEN],
                                             nbytes=LEN, count=COUNT, stride=RS))
        assert len(ok) == 1


def test_large_strided_copy_runs_on_the_pool() -> None:
    """Large enough for the thread pool (not inline); a plain list pairs with a strided one of count 1."""
    n, rows, row, piece = 64, 16, 4096, 1024
    src = pattern(n * rows * row, 2)
    dst = np.zeros(n * rows * piece, np.uint8)
    with kvx.Agent("a", kvx.AgentConfig(backends=("host",))) as ag:
        ag.register(src)
        ag.register(dst)
        s = ag.prepare(kvx.DescList.strided(kind=H, addr=src.ctypes.data + 1024 + np.arange(n) * rows * row,
                                            nbytes=piece, count=rows, stride=row))
        d = ag.prepare(kvx.DescList.strided(kind=H, addr=dst.ctypes.data + np.arange(n) * rows * piece,
                                            nbytes=piece, count=rows, stride=piece))
        perm = np.random.default_rng(0).permutation(n)
        assert ag.read(d, perm, s, np.arange(n)).wait(10).status is kvx.Status.DONE
        want = src.reshape(n, rows, row)[:, :, 1024:2048]
        assert np.array_equal(dst.reshape(n, rows, piece)[perm], want)
        one = ag.prepare(kvx.DescList.strided(kind=H, addr=[src.ctypes.data], nbytes=piece, count=1, stride=0))
        plain = ag.prepare(kvx.DescList.from_arrays(kind=H, addr=[dst.ctypes.data], nbytes=piece))
        ag.read(plain, [0], one, [0]).wait(5)
        assert np.array_equal(dst[:piece], src[:piece])


def test_storage_moves_the_expansion(tmp_path: Any) -> None:
    """A FILE list can be strided too (posix moves its pieces): host -> file -> host, byte-exact."""
    size = N * RSTEP + 64
    src = pattern(4096, 3)
    back = np.zeros(4096, np.uint8)
    with kvx.Agent("a", kvx.AgentConfig(backends=("posix", "host"))) as ag:
        ag.register(src)
        ag.register(back)
        freg = ag.register(kvx.FileRegion(str(tmp_path / "f"), size))
        f = ag.prepare(strided(0, RSTEP, RS, kvx.MemoryKind.FILE, int(freg.descs.dev[0])))
        s = ag.prepare(strided(src.ctypes.data, LSTEP, LS))
        b = ag.prepare(strided(back.ctypes.data, LSTEP, LS))
        ag.write(s, np.arange(N), f, np.arange(N)[::-1]).wait(10)
        raw = np.fromfile(tmp_path / "f", np.uint8)
        for i in range(N):
            assert np.array_equal(pieces(raw, N - 1 - i, RSTEP, RS), pieces(src, i, LSTEP, LS))
        assert isinstance(s.wroutes[f], FlatRoute)
        ag.read(b, np.arange(N), f, np.arange(N)[::-1]).wait(10)
        for i in range(N):
            assert np.array_equal(pieces(back, i, LSTEP, LS), pieces(src, i, LSTEP, LS))
        with pytest.raises(kvx.RegistrationError):  # past the file's end
            ag.prepare(kvx.DescList.strided(kind=kvx.MemoryKind.FILE, addr=[size - RS], nbytes=LEN, count=2,
                                            stride=RS, dev=int(freg.descs.dev[0])))


# ---- another process --------------------------------------------------------------------------------

PATHS = [("host", {"host_path": "auto"}, "alloc", True),  # shared mapping: native
         ("host", {"host_path": "cma"}, "numpy", True),  # CMA: native (the pieces as iovecs)
         ("host", {"host_path": "uds"}, "numpy", False),
         ("tcp", {}, "numpy", False),
         ("ucx", {}, "numpy", False)]


@pytest.mark.parametrize("backend, config, mem, native", PATHS, ids=["host-shm", "host-cma", "host-uds", "tcp", "ucx"])
def test_strided_transfers_with_a_peer(backend: str, config: dict[str, Any], mem: str, native: bool) -> None:
    nbytes = 4096
    if backend == "ucx":
        from kvx.backends.registry import get

        why = get("ucx").unavailable_reason()
        if why is not None:
            pytest.skip(why)
    peer = PeerProcess("target", {**config, "backends": [backend]})
    try:
        with kvx.Agent("initiator", kvx.AgentConfig(backends=(backend,), **config)) as ag:
            rid, rdescs = peer.register(mem, nbytes)
            name = ag.add_peer(peer.meta)
            obj, buf = memory(mem).alloc(nbytes)
            src = pattern(nbytes, 5)
            memory(mem).fill(buf, src)
            reg = ag.register(obj)
            base = int(reg.descs.addr[0])
            local = ag.prepare(strided(base, LSTEP, LS))
            rbase = int(rdescs.addr[0])
            remote = ag.prepare(strided(rbase, RSTEP, RS), peer=name)
            perm = [5, 2, 0, 6]
            x = ag.write(local, [0, 1, 2, 3], remote, perm)
            assert x.wait(10).status is kvx.Status.DONE and x.nbytes == 4 * COUNT * LEN
            assert isinstance(local.wroutes[remote], FlatRoute) is not native
            there = np.frombuffer(peer.peek(rid, 0, nbytes), np.uint8)
            for i, j in zip(range(4), perm):
                assert np.array_equal(pieces(there, j, RSTEP, RS), pieces(src, i, LSTEP, LS))
            # untouched between the pieces
            mask = np.zeros(nbytes, bool)
            for j in perm:
                for k in range(COUNT):
                    mask[j * RSTEP + k * RS: j * RSTEP + k * RS + LEN] = True
            assert not there[~mask].any()
            memory(mem).fill(buf, np.zeros(nbytes, np.uint8))
            ag.read(local, [3, 2, 1, 0], remote, perm).wait(10)
            got = memory(mem).read(buf)
            for i, j in zip([3, 2, 1, 0], perm):
                assert np.array_equal(pieces(got, i, LSTEP, LS), pieces(there, j, RSTEP, RS))
            # the last piece of a remote descriptor past the peer's registration: refused at prepare
            with pytest.raises(kvx.RegistrationError):
                ag.prepare(kvx.DescList.strided(kind=H, addr=[rbase + nbytes - 2 * RS], nbytes=LEN, count=3,
                                                stride=RS), peer=name)
    finally:
        peer.close()


def test_native_strided_submit_refuses_bad_input() -> None:
    """kvx._native.submit_strided checks its arrays and indices before anything moves."""
    from kvx import _native

    buf = np.zeros(4096, np.uint8)
    a = np.array([buf.ctypes.data, buf.ctypes.data + 1024], np.uint64)
    ln = np.array([16, 16], np.uint64)
    c = np.array([4, 4], np.uint64)
    s = np.array([64, 64], np.uint64)
    i = np.array([0, 1], np.int64)

    def go(**kw: Any) -> Any:
        args = {"da": a, "dl": ln, "dc": c, "ds": s, "di": i, "sa": a[::-1].copy(), "sl": ln, "sc": c, "ss": s,
                "si": i, **kw}
        return _native.submit_strided(_native.OP_MEMCPY, 0, args["da"], args["dl"], args["dc"], args["ds"],
                                      args["di"], args["sa"], args["sl"], args["sc"], args["ss"], args["si"], None, 1,
                                      1 << 20)

    assert go() == 2 * 4 * 16
    for kw, exc in (({"di": np.array([0, 2], np.int64)}, IndexError),
                    ({"si": np.array([-1, 0], np.int64)}, IndexError),
                    ({"di": np.array([0], np.int64)}, ValueError),
                    ({"di": np.array([0, 1], np.int32)}, TypeError),
                    ({"dl": np.array([16], np.uint64)}, ValueError),
                    ({"dc": np.array([4, 3], np.uint64)}, ValueError),
                    ({"ds": None}, ValueError),
                    ({"dl": None}, ValueError),
                    ({"sl": np.array([16, 17], np.uint64)}, ValueError),
                    ({"da": np.zeros(3, np.uint8)}, TypeError)):
        with pytest.raises(exc):
            go(**kw)
    # a plain side (no counts) pairs with a strided side of count 1
    one = np.array([1, 1], np.uint64)
    assert go(dc=one, sc=None, ss=None) == 2 * 16
    with pytest.raises(ValueError):  # CMA needs a process
        _native.submit_strided(_native.OP_CMA_READ, 0, a, ln, c, s, i, a, ln, c, s, i, None, 1, 1 << 20)
    with pytest.raises(ValueError):  # file ops are not strided
        _native.submit_strided(_native.OP_PWRITE, 1, a, ln, c, s, i, a, ln, c, s, i, None, 1, 1 << 20)
    # CMA from this very process: the pieces as iovecs
    import os

    src = np.arange(4096, dtype=np.uint32).view(np.uint8)[:4096].copy()
    dst = np.zeros(4096, np.uint8)
    sa_ = np.array([src.ctypes.data, src.ctypes.data + 2048], np.uint64)
    da_ = np.array([dst.ctypes.data + 100, dst.ctypes.data + 3000], np.uint64)
    try:
        got = _native.submit_strided(_native.OP_CMA_READ, os.getpid(), da_, ln, c, np.array([20, 17], np.uint64),
                                     i, sa_, ln, c, s, i, None, 1, 1 << 20)
    except PermissionError:
        pytest.skip("process_vm_readv not permitted here")
    assert got == 2 * 4 * 16
    for p, (d0, ds_) in enumerate(((100, 20), (3000, 17))):
        for k in range(4):
            s0 = p * 2048 + k * 64
            assert np.array_equal(dst[d0 + k * ds_: d0 + k * ds_ + 16], src[s0:s0 + 16])
