"""posix: buffered reads through the file mapping (OP_MMREAD) and block checksums taken in the copy
(kvx-nh64, ``PosixBackend.keep_digests``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvx
from kvx import _native
from kvx.backends.posix import PosixOptions
from kvx.testing.conformance import pattern

M64 = (1 << 64) - 1


def _splitmix(x: int) -> tuple[int, int]:
    x = (x + 0x9E3779B97F4A7C15) & M64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return x, z ^ (z >> 31)


def _fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


def nh64_reference(data: bytes) -> int:
    """kvx-nh64 as native/kvx_hash.c specifies it, in plain Python."""
    x, key = 0x6B76782D6E683634, []
    for _ in range(64):
        x, v = _splitmix(x)
        key.append(v)
    acc = key[56:60]
    n = len(data)
    stripes = [data[i:i + 32].ljust(32, b"\0") for i in range(0, n, 32)]
    for s, st in enumerate(stripes):
        w = [int.from_bytes(st[8 * i:8 * i + 8], "little") for i in range(4)]
        for i in range(4):
            d = w[i] ^ key[4 * (s % 16) + i]
            acc[i] = (acc[i] + (d & 0xFFFFFFFF) * (d >> 32) + w[i ^ 1]) & M64
        if s % 16 == 15 and s + 1 != len(stripes):
            for i in range(4):
                a = acc[i] ^ (acc[i] >> 47) ^ key[i]
                acc[i] = (a * 0x9E3779B1) & M64
    h = (n * 0x9E3779B97F4A7C15) & M64
    for i in range(4):
        h = ((h ^ _fmix(acc[i] ^ key[60 + i])) * 0xC2B2AE3D27D4EB4F) & M64
    return _fmix(h)


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 511, 512, 513, 1024, 1000, 4103])
def test_nh64_matches_its_specification(n: int) -> None:
    data = pattern(max(n, 1), n)[:n].tobytes()
    want = nh64_reference(data)
    assert _native.nh64(data) == want
    assert _native.nh64_portable(data) == want  # the AVX2 and the portable code agree


def test_nh64_sees_order_and_single_bits() -> None:
    data = bytearray(pattern(8192, 3).tobytes())
    h = _native.nh64(bytes(data))
    swapped = data[512:1024] + data[:512] + data[1024:]  # two 512-byte blocks exchanged
    assert _native.nh64(bytes(swapped)) != h
    for pos in (0, 7, 4095, 8191):
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert _native.nh64(bytes(data)) != h
            data[pos] ^= 1 << bit


def _agent(**posix: Any) -> kvx.Agent:
    return kvx.Agent("digests", kvx.AgentConfig(backends=("posix",), options={"posix": PosixOptions(**posix)}))


def _posix(agent: kvx.Agent) -> Any:
    return next(b for b in agent.backends if b.name == "posix")


def _setup(agent: kvx.Agent, tmp_path: Path, n: int, bs: int, seed: int) -> tuple[Any, Any, np.ndarray, Path]:
    buf = pattern(n * bs, seed)
    mem = agent.prepare(kvx.DescList.blocks(agent.register(buf), bs))
    p = tmp_path / "kv.bin"
    sto = agent.prepare(kvx.DescList.blocks(agent.register(kvx.FileRegion(p, n * bs)), bs))
    return mem, sto, buf, p


def _evict(p: Path) -> None:
    """Drop the file's pages from the page cache (reads must take preadv)."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("bs,inline", [(4096, 0), (3000, 0), (65536, 0), (4096, 1 << 30)])
@pytest.mark.parametrize("cached", [True, False])
def test_digests_are_of_the_bytes_moved(tmp_path: Path, mmap: bool, bs: int, inline: int, cached: bool) -> None:
    """Writes and reads (through the mapping, or preadv/pwritev) leave the nh64 of each moved block
    at its memory row, whatever the order of the rows; reads land byte-exact."""
    n = 48
    with kvx.Agent("d", kvx.AgentConfig(backends=("posix",), inline_bytes=inline,
                                         options={"posix": PosixOptions(mmap=mmap)})) as a:
        mem, sto, buf, p = _setup(a, tmp_path, n, bs, 5)
        dig = _posix(a).keep_digests(mem)
        assert dig.shape == (n,) and not dig.any()
        rows = np.random.default_rng(1).permutation(n)[:40]
        a.write(mem, rows, sto, np.arange(40)).wait(10)
        want = [_native.nh64(buf[r * bs:(r + 1) * bs].tobytes()) for r in rows]
        assert dig[rows].tolist() == want
        untouched = np.setdiff1d(np.arange(n), rows)
        assert not dig[untouched].any()
        if not cached:
            _evict(p)
        dig[:] = 0
        back = np.arange(n)[::-1][:40].copy()  # into other rows
        buf[back * bs] ^= 1  # (their old bytes differ from what is read)
        a.read(mem, back, sto, np.arange(40)).wait(10)
        assert dig[back].tolist() == want
        for r, src in zip(back, rows):
            assert _native.nh64(buf[r * bs:(r + 1) * bs].tobytes()) == dig[r]


def test_digest_of_a_changed_file_differs(tmp_path: Path) -> None:
    bs, n = 8192, 8
    with _agent() as a:
        mem, sto, buf, p = _setup(a, tmp_path, n, bs, 6)
        dig = _posix(a).keep_digests(mem)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        stored = dig.copy()
        with open(p, "r+b") as f:  # one byte of block 3 changes on disk
            f.seek(3 * bs + 100)
            b = f.read(1)
            f.seek(3 * bs + 100)
            f.write(bytes([b[0] ^ 0x10]))
        a.read(mem, np.arange(n), sto, np.arange(n)).wait(10)
        assert (dig != stored).tolist() == [i == 3 for i in range(n)]


def test_keep_digests_is_refused_where_it_cannot_work(tmp_path: Path) -> None:
    bs, n = 4096, 4
    with _agent(direct=True) as a:
        mem, sto, _, _ = _setup(a, tmp_path, n, bs, 7)
        with pytest.raises(kvx.UsageError, match="HOST list"):
            _posix(a).keep_digests(sto)
        _posix(a).keep_digests(mem)
        with pytest.raises(kvx.BackendUnavailable, match="O_DIRECT"):
            a.write(mem, [0], sto, [0]).wait(10)


def test_keep_digests_through_the_public_route(tmp_path: Path) -> None:
    """``kvx.tiers.checksum.keep_digests(agent, plist)`` is the posix backend's array for that list;
    without a posix backend it is refused."""
    from kvx.tiers.checksum import block_sum, keep_digests

    bs, n = 4096, 8
    with _agent() as a:
        mem, sto, buf, _ = _setup(a, tmp_path, n, bs, 8)
        dig = keep_digests(a, mem)
        assert dig is _posix(a).keep_digests(mem)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        assert dig.tolist() == [block_sum(buf[i * bs:(i + 1) * bs].tobytes()) for i in range(n)]
        with pytest.raises(kvx.UsageError, match="HOST list"):
            keep_digests(a, sto)
    with kvx.Agent("no-posix", kvx.AgentConfig(backends=("host",))) as h:
        with pytest.raises(kvx.BackendUnavailable, match="posix"):
            keep_digests(h, h.prepare(kvx.DescList.blocks(h.register(np.zeros(bs, np.uint8)), bs)))


def test_native_digest_arguments_are_checked(tmp_path: Path) -> None:
    u = np.zeros(4, dtype=np.uint64)
    short = np.zeros(2, dtype=np.uint64)
    ln = np.full(4, 8, dtype=np.uint64)
    idx = np.arange(4, dtype=np.int64)
    fds = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="file jobs only"):
        _native.submit(_native.OP_MEMCPY, 0, u, ln, idx, u, ln, idx, None, None, 1, 0, 0, None, u)
    with pytest.raises(ValueError, match="2 entries"):
        _native.submit(_native.OP_PREAD, 0, u, ln, idx, u, ln, idx, fds, None, 1, 0, 0, None, short)
    with pytest.raises(TypeError, match="64-bit"):
        _native.submit(_native.OP_PREAD, 0, u, ln, idx, u, ln, idx, fds, None, 1, 0, 0, None,
                       np.zeros(4, dtype=np.float64))
    with pytest.raises(ValueError, match="descriptors and file offsets"):
        _native.submit(_native.OP_MMREAD, 0, u, ln, idx, u, ln, idx, fds, None, 1, 0, 0)
    with pytest.raises(ValueError, match="as long as src_addr"):
        _native.submit(_native.OP_MMREAD, 0, u, ln, idx, u, ln, idx, fds, None, 1, 0, 0, short)


@pytest.mark.parametrize("flags", [3, 0])
def test_mapped_read_of_a_truncated_file_fails_cleanly(tmp_path: Path, flags: int) -> None:
    """Truncated under the registration: the read FAILS naming the file (preadv past the end, or the
    SIGBUS of the copy caught by the guard when the residency check is off); the process lives on."""
    bs, n = 4096, 64
    before = _native.mmwrite_flags(flags)
    try:
        with _agent() as a:
            mem, sto, buf, p = _setup(a, tmp_path, n, bs, 8)
            a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
            os.truncate(p, 8 * bs)
            with pytest.raises(kvx.TransferError, match="truncated") as ei:
                a.read(mem, np.arange(n), sto, np.arange(n)).wait(10)
            assert str(p) in str(ei.value)
            assert isinstance(ei.value.__cause__, OSError)
            assert ei.value.__cause__.errno in (errno.EFAULT, errno.ENODATA)
            a.read(mem, np.arange(8), sto, np.arange(8)).wait(10)  # what is left still reads
    finally:
        _native.mmwrite_flags(before)
