"""tcp reads that take each block's kvx-nh64 as it lands (``TcpBackend.keep_digests``)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvx
from kvx import _net  # type: ignore[attr-defined]
from kvx._native import nh64
from kvx.backends.tcp import TcpBackend, TcpOptions
from kvx.errors import BackendUnavailable, UsageError


def _digests_of(buf: np.ndarray, offs: list[int], sizes: list[int]) -> list[int]:
    return [nh64(buf[o:o + n].tobytes()) for o, n in zip(offs, sizes)]


def test_recvv_digests_match_nh64_for_odd_sizes_offsets_and_partial_segments() -> None:
    """The native receive: every descriptor's digest is the nh64 of its bytes, with the sender
    cutting the stream at odd places (partial descriptors per recvmsg) and descriptors of
    0, 1, 31, 33, 513, 64 KiB + 7 and 600000 bytes at odd offsets."""
    rng = np.random.default_rng(3)
    sizes = [1, 0, 31, 33, 513, 65536 + 7, 600000, 1000, 4096]
    offs, at = [], 3
    for n in sizes:
        offs.append(at)
        at += n + int(rng.integers(1, 64))
    buf = np.zeros(at + 64, np.uint8)
    base = buf.ctypes.data
    addr = np.array([base + o for o in offs], dtype=np.uint64)
    nb = np.array(sizes, dtype=np.uint64)
    src = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    try:
        a.setblocking(False)

        def send() -> None:
            cut = 0
            while cut < len(src):  # pieces of 1..3000 bytes: frames end mid-descriptor and mid-stripe
                k = int(rng.integers(1, 3000))
                b.sendall(src[cut:cut + k])
                cut += k

        t = threading.Thread(target=send)
        t.start()
        dig = np.zeros(len(sizes), dtype=np.uint64)
        _net.recvv(a.fileno(), addr, nb, 10.0, 0.0, 0, dig)
        t.join(10)
        cum = np.concatenate(([0], np.cumsum(sizes)))
        assert [int(d) for d in dig] == [nh64(src[cum[i]:cum[i + 1]]) for i in range(len(sizes))]
        assert [int(d) for d in dig] == _digests_of(buf, offs, sizes)
        assert buf[offs[-1]:offs[-1] + sizes[-1]].tobytes() == src[-sizes[-1]:]
    finally:
        a.close()
        b.close()


def test_recvv_digests_shape_is_checked_and_an_early_eof_raises() -> None:
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        buf = np.zeros(4096, np.uint8)
        addr = np.array([buf.ctypes.data, buf.ctypes.data + 2048], dtype=np.uint64)
        nb = np.array([2048, 2048], dtype=np.uint64)
        with pytest.raises(ValueError, match="one uint64 per descriptor"):
            _net.recvv(a.fileno(), addr, nb, 1.0, 0.0, 0, np.zeros(3, dtype=np.uint64))
        with pytest.raises(BufferError):
            _net.recvv(a.fileno(), addr, nb, 1.0, 0.0, 0, b"\0" * 16)  # read-only
        b.sendall(b"x" * 3000)
        b.close()
        with pytest.raises(ConnectionResetError):
            _net.recvv(a.fileno(), addr, nb, 5.0, 0.0, 0, np.zeros(2, dtype=np.uint64))
    finally:
        a.close()


@pytest.fixture()
def pair() -> Iterator[tuple[kvx.Agent, kvx.Agent]]:
    """Two agents over tcp with small frames (64 KiB: a read spans many frames) and the fast
    path up to 16 KiB."""
    opts = {"tcp": TcpOptions(chunk=1 << 16, fast_max=16384)}
    ini = kvx.Agent("ini", kvx.AgentConfig(backends=("tcp",), peer_timeout=5.0, options=opts))
    tgt = kvx.Agent("tgt", kvx.AgentConfig(backends=("tcp",), peer_timeout=5.0, options=opts))
    try:
        yield ini, tgt
    finally:
        ini.close()
        tgt.close()


def _lists(ini: kvx.Agent, tgt: kvx.Agent, sizes: list[int], seed: int) -> tuple[Any, ...]:
    rng = np.random.default_rng(seed)
    offs, at = [], 5
    for n in sizes:
        offs.append(at)
        at += n + int(rng.integers(1, 40))
    rbuf = rng.integers(0, 256, at, dtype=np.uint8)
    lbuf = np.zeros(at, np.uint8)
    rreg, lreg = tgt.register(rbuf), ini.register(lbuf)
    mk = lambda reg: kvx.DescList.from_arrays(  # noqa: E731
        kind=kvx.MemoryKind.HOST, addr=np.array([int(reg.descs.addr[0]) + o for o in offs], dtype=np.uint64),
        nbytes=np.array(sizes, dtype=np.uint64))
    name = ini.add_peer(tgt.metadata())
    loc = ini.prepare(mk(lreg))
    rem = ini.prepare(mk(rreg), peer=name)
    return rbuf, lbuf, offs, loc, rem


def test_reads_fill_digests_of_the_landed_blocks(pair: tuple[kvx.Agent, kvx.Agent]) -> None:
    ini, tgt = pair
    sizes = [7, 4096, 65536, 1, 12345, 65536, 333, 40000, 65535, 2, 9000]
    rbuf, lbuf, offs, loc, rem = _lists(ini, tgt, sizes, 1)
    tcp = ini.backend("tcp")
    assert isinstance(tcp, TcpBackend)
    dig = tcp.keep_digests(loc)
    assert tcp.keep_digests(loc) is dig and dig.shape == (len(sizes),)
    # the general path (many frames of at most 64 KiB), scattered and permuted rows
    li = np.array([3, 0, 5, 2, 10, 7, 1, 9, 8, 6, 4])
    x = ini.read(loc, li, rem, li)
    assert x.backend == "tcp"
    x.wait(10)
    want = _digests_of(lbuf, offs, sizes)
    assert [int(dig[i]) for i in li] == [want[i] for i in li]
    # the fast path (a few small descriptors)
    dig[:] = 0
    ini.read(loc, [9, 0], rem, [9, 0]).wait(10)
    assert int(dig[9]) == nh64(rbuf[offs[9]:offs[9] + 2].tobytes())
    assert int(dig[0]) == nh64(rbuf[offs[0]:offs[0] + 7].tobytes())
    assert int(dig[1]) == 0  # rows not read stay as they were
    # a plan posts through the same paths
    dig[:] = 0
    ini.make_transfer("read", loc, [4, 6], rem, [4, 6]).post().wait(10)
    assert [int(dig[4]), int(dig[6])] == [want[4], want[6]]


def test_a_plan_made_before_keep_digests_still_fills_them(pair: tuple[kvx.Agent, kvx.Agent]) -> None:
    ini, tgt = pair
    sizes = [100, 2000, 5000]
    rbuf, lbuf, offs, loc, rem = _lists(ini, tgt, sizes, 5)
    small = ini.make_transfer("read", loc, [0, 2], rem, [0, 2])  # the fast path's descriptors, frozen
    dig = ini.backend("tcp").keep_digests(loc)  # type: ignore[attr-defined]
    small.post().wait(10)
    assert [int(dig[0]), int(dig[2])] == [nh64(rbuf[offs[i]:offs[i] + sizes[i]].tobytes()) for i in (0, 2)]


def test_read_of_the_same_sized_rows_moves_bytes_and_digests(pair: tuple[kvx.Agent, kvx.Agent]) -> None:
    """Rows paired with other rows of the remote list: each digest is of what landed in its row."""
    ini, tgt = pair
    sizes = [4096] * 40
    rbuf, lbuf, offs, loc, rem = _lists(ini, tgt, sizes, 2)
    dig = ini.backend("tcp").keep_digests(loc)  # type: ignore[attr-defined]
    li, ri = np.arange(40), np.arange(40)[::-1].copy()
    ini.read(loc, li, rem, ri).wait(10)
    for i, j in zip(li, ri):
        assert lbuf[offs[i]:offs[i] + 4096].tobytes() == rbuf[offs[j]:offs[j] + 4096].tobytes()
        assert int(dig[i]) == nh64(rbuf[offs[j]:offs[j] + 4096].tobytes())


def test_keep_digests_refuses_what_it_cannot_checksum(pair: tuple[kvx.Agent, kvx.Agent]) -> None:
    ini, tgt = pair
    sizes = [70000, 100]  # one descriptor longer than a 64 KiB frame
    rbuf, lbuf, offs, loc, rem = _lists(ini, tgt, sizes, 4)
    tcp = ini.backend("tcp")
    with pytest.raises(UsageError):
        tcp.keep_digests(rem)  # type: ignore[attr-defined]
    dig = tcp.keep_digests(loc)  # type: ignore[attr-defined]
    with pytest.raises(BackendUnavailable, match="KVX_TCP_CHUNK"):
        ini.read(loc, [0, 1], rem, [0, 1]).wait(10)
    ini.read(loc, [1], rem, [1]).wait(10)  # short ones still go
    assert int(dig[1]) == nh64(rbuf[offs[1]:offs[1] + 100].tobytes())
    ini.write(loc, [0], rem, [0]).wait(10)  # writes take no digests and are not refused
