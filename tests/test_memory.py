"""DescList, regions, alloc_host."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import kvx
from kvx.memory import regions_of, shm_of


def test_blocks_carves_every_region() -> None:
    with kvx.Agent("m", kvx.AgentConfig(backends=("host",))) as a:
        x = np.zeros(10_000, np.uint8)
        y = np.zeros(4096 * 3, np.uint8)
        reg = a.register([x, y])
        b = kvx.DescList.blocks(reg, 4096)
        assert len(b) == 2 + 3
        assert b.kind is kvx.MemoryKind.HOST
        assert b.addr.tolist() == [x.ctypes.data, x.ctypes.data + 4096] + [y.ctypes.data + i * 4096 for i in range(3)]
        assert set(b.nbytes.tolist()) == {4096}
        with pytest.raises(kvx.UsageError):
            kvx.DescList.blocks(reg, 0)
        with pytest.raises(kvx.UsageError):
            kvx.DescList.blocks(reg, 1 << 20)


def test_million_blocks_prepare() -> None:
    with kvx.Agent("m", kvx.AgentConfig(backends=("host",))) as a:
        buf = kvx.alloc_host(1 << 30)  # memfd pages are not touched
        reg = a.register(buf)
        blocks = kvx.DescList.blocks(reg, 1024)
        assert len(blocks) == 1 << 20
        pl = a.prepare(blocks)
        assert len(pl) == 1 << 20 and pl.used.tolist() == reg.slots
        assert int(blocks.addr[-1]) == buf.ctypes.data + (1 << 30) - 1024


def test_indexing_and_views() -> None:
    d = kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=np.arange(10) * 16 + 16, nbytes=16)
    s = d[2:5]
    assert len(s) == 3 and np.shares_memory(s.addr, d.addr)
    g = d[np.array([9, 0])]
    assert g.addr.tolist() == [160, 16]
    assert len(d[3]) == 1 and d[3].addr.tolist() == [64]
    with pytest.raises(IndexError):
        d[np.array([10])]
    with pytest.raises(kvx.UsageError):
        d[np.array([True, False])]
    with pytest.raises(kvx.UsageError):
        kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=[1, 2], nbytes=[0, 1])
    with pytest.raises(kvx.UsageError):
        kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=[-1], nbytes=[1])
    assert "n=10" in repr(d)
    assert list(d[0:1]) == [(16, 16, 0)]


def test_regions_of_rejects_bad_memory() -> None:
    for bad in [np.zeros(0, np.uint8), np.zeros((4, 4))[:, 0], b"readonly", [], [[np.zeros(4)]], object()]:
        with pytest.raises(kvx.RegistrationError):
            regions_of(bad)
    ro = np.zeros(8)
    ro.flags.writeable = False
    with pytest.raises(kvx.RegistrationError):
        regions_of(ro)
    r = regions_of([bytearray(16), memoryview(bytearray(8)), np.zeros(3)])
    assert [x.nbytes for x in r] == [16, 8, 24]


def test_alloc_host_is_shareable_and_views_are_too() -> None:
    a = kvx.alloc_host(3 * mmap.PAGESIZE)
    assert a.dtype == np.uint8 and a.nbytes == 3 * mmap.PAGESIZE and a.ctypes.data % mmap.PAGESIZE == 0
    assert (a == 0).all()
    fd, off, size = shm_of(a.ctypes.data + 100, 50)  # type: ignore[misc]
    assert off == 100 and size == a.nbytes and fd >= 0
    assert shm_of(np.zeros(8).ctypes.data, 8) is None
    assert shm_of(a.ctypes.data + a.nbytes - 4, 8) is None
    with pytest.raises(kvx.UsageError):
        kvx.alloc_host(0)


def test_alloc_host_pinned_without_gpu_is_clear() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(kvx.BackendUnavailable, match="kvx\\[cuda\\]"):
            kvx.alloc_host(4096, pinned=True)


def test_file_and_object_region_validation() -> None:
    # bad arguments of the region constructors are usage errors (ValueError too), raised at once
    with pytest.raises(kvx.ArgumentValueError, match="FileRegion nbytes"):
        kvx.FileRegion("/tmp/x", 0)
    with pytest.raises(kvx.ArgumentValueError, match="ObjectRegion bucket"):
        kvx.ObjectRegion("", "k", 1)
    with pytest.raises(kvx.ArgumentValueError, match="RawRegion addr"):
        kvx.RawRegion(0, 10)
    assert kvx.FileRegion(__import__("pathlib").Path("/tmp/y"), 5).path == "/tmp/y"


def test_desclist_constructor_refuses_what_from_arrays_refuses() -> None:
    """NaN, float, negative and out-of-range descriptors are a UsageError when the DescList is built
    (the public constructor too), not a ValueError later at prepare."""
    H = kvx.MemoryKind.HOST
    bad = [
        (np.array([np.nan]), np.array([16.0]), np.array([0])),
        (np.array([4096.0]), np.array([16], np.uint64), np.array([0], np.uint64)),
        (np.array([-1]), np.array([16]), np.array([0])),
        (np.array([(1 << 64) - 1], np.uint64), np.array([16], np.uint64), np.array([0], np.uint64)),
        (np.array([4096], np.uint64), np.array([0], np.uint64), np.array([0], np.uint64)),
        (np.array([4096, 8192], np.uint64), np.array([16], np.uint64), np.array([0, 0], np.uint64)),
        (np.array([[4096]], np.uint64), np.array([16], np.uint64), np.array([0], np.uint64)),
        (np.array([object()]), np.array([16], np.uint64), np.array([0], np.uint64)),
    ]
    for addr, nbytes, dev in bad:
        with pytest.raises(kvx.UsageError):
            kvx.DescList(H, addr, nbytes, dev)
    for addr in ([float("nan")], [np.inf], ["4096"], [None]):
        with pytest.raises(kvx.UsageError):
            kvx.DescList.from_arrays(kind=H, addr=addr, nbytes=16)
    with pytest.raises(kvx.UsageError):
        kvx.DescList.from_arrays(kind=H, addr=[4096], nbytes=[float("nan")])
    d = kvx.DescList(H, np.array([4096]), np.array([16]), np.array([0]))  # plain ints are converted
    assert d.addr.dtype == np.uint64 and d.addr.tolist() == [4096]
    with kvx.Agent("m", kvx.AgentConfig(backends=("host",))) as a:
        x = np.zeros(4096, np.uint8)
        a.register(x)
        ok = kvx.DescList(H, np.array([x.ctypes.data], np.uint64), np.array([4096], np.uint64),
                          np.array([0], np.uint64))
        assert len(a.prepare(ok)) == 1
        with pytest.raises(AttributeError):
            ok.addr = np.array([np.nan])  # type: ignore[misc]


def test_register_refuses_memory_holding_python_objects() -> None:
    """Object arrays hold PyObject pointers: a peer writing into them would crash the process."""
    objs = np.array([object()] * 512)
    rec = np.zeros(64, dtype=[("x", np.int64), ("o", object)])
    with kvx.Agent("m", kvx.AgentConfig(backends=("host",))) as a:
        for bad in (objs, memoryview(objs), rec, rec.view(np.ndarray), [np.zeros(8, np.uint8), objs]):
            with pytest.raises(kvx.RegistrationError, match="Python objects"):
                a.register(bad)
        assert a.register(np.zeros(64, dtype=[("x", np.int64), ("y", np.float32)])).descs.total_bytes == 64 * 12
