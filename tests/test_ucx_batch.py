"""The ucx backend's batched active messages (HOST memory over transports without RDMA): the
target validates every entry of every batch against its own registrations, so forged, truncated
or oversized batches from a hostile peer are refused with an error answer and change no byte;
and through the agent, small blocks over tcp go batched and land byte-exact."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.backends import registry
from kvx.errors import RemoteError
from kvx.testing.conformance import pattern

_reason = registry.get("ucx").unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"ucx backend unavailable: {_reason}")

HDR = struct.Struct("<QQII")  # cookie, xid, batch, n
ENT = struct.Struct("<QQII")  # addr, len, slot, gen
ACK = struct.Struct("<QIi")  # xid, batch, status
COOKIE = 0x5EC2E7C00C1E
SLOT, GEN = 3, 7
_U64 = np.uint64


@pytest.fixture
def tcp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")


class Pair:
    """A target worker with one registered buffer and a cookie for the initiator's endpoint, and
    an initiator worker with an endpoint to it (raw kvx._ucx, to play a hostile peer)."""

    def __init__(self, m: Any, n: int = 1 << 16) -> None:
        self.m = m
        self.t = m.Worker([("RNDV_THRESH", "inf")], 2.0)
        self.i = m.Worker([("RNDV_THRESH", "inf")], 2.0)
        self.buf = pattern(n, 5)
        self.orig = self.buf.copy()
        self.base = self.buf.ctypes.data
        self.t.region_add(SLOT, GEN, self.base, n)
        self.back = self.t.ep_create(self.i.address(), True)  # target -> initiator (answers)
        self.t.cookie_add(COOKIE, self.back)
        self.ep = self.i.ep_create(self.t.address(), True)  # initiator -> target

    def close(self) -> None:
        self.i.close()
        self.t.close()

    def raw(self, amid: int, header: bytes, payload: bytes = b"") -> None:
        self.i.am_send_raw(self.ep, amid, header, payload)

    def refused_after(self, before: int, timeout: float = 5.0) -> int:
        """Wait until the target counted one more refusal; the count."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = int(self.t.stats()["refused"])
            if got > before:
                return got
            time.sleep(0.01)
        return int(self.t.stats()["refused"])


@pytest.fixture
def pair(tcp_env: None) -> Iterator[Pair]:
    from kvx.backends.ucx import load

    p = Pair(load())
    try:
        yield p
    finally:
        p.close()


def _hdr(n: int, cookie: int = COOKIE, xid: int = 99, batch: int = 0) -> bytes:
    return HDR.pack(cookie, xid, batch, n)


def _ent(off: int, length: int, slot: int = SLOT, gen: int = GEN, base: int = 0) -> bytes:
    return ENT.pack((base + off) % (1 << 64), length, slot, gen)


def _forged(p: Pair) -> list[tuple[str, int, bytes, bytes]]:
    b, blk = p.base, 4096
    data = bytes(range(256)) * 16
    W, R = p.m.AM_WREQ, p.m.AM_RREQ
    return [
        ("header shorter than its fixed part", W, b"\x01\x02", data),
        ("no header", W, b"", data),
        ("entry count larger than the header", W, _hdr(1000) + _ent(0, blk, base=b), data),
        ("huge entry count", W, _hdr(0xFFFFFFFF) + _ent(0, blk, base=b), data),
        ("zero entries", W, _hdr(0), b""),
        ("header with a partial entry", W, _hdr(1) + _ent(0, blk, base=b)[:-3], data),
        ("unknown cookie", W, _hdr(1, cookie=0xBAD) + _ent(0, blk, base=b), data),
        ("cookie 0", W, _hdr(1, cookie=0) + _ent(0, blk, base=b), data),
        ("slot out of range", W, _hdr(1) + _ent(0, blk, slot=1 << 20, base=b), data),
        ("unregistered slot", W, _hdr(1) + _ent(0, blk, slot=SLOT + 1, base=b), data),
        ("stale generation", W, _hdr(1) + _ent(0, blk, gen=GEN + 1, base=b), data),
        ("before the region", W, _hdr(1) + _ent(-blk, blk, base=b), data),
        ("past the region's end", W, _hdr(1) + _ent(len(p.buf) - 100, blk, base=b), data),
        ("address wraps around", W, _hdr(1) + ENT.pack((1 << 64) - 100, blk, SLOT, GEN), data),
        ("length wraps around", W, _hdr(1) + ENT.pack(b + 8, (1 << 64) - 4, SLOT, GEN), data),
        ("zero length", W, _hdr(1) + _ent(0, 0, base=b), b""),
        ("overlapping destinations", W, _hdr(2) + _ent(0, blk, base=b) + _ent(blk // 2, blk, base=b), data * 2),
        ("same destination twice", W, _hdr(2) + _ent(blk, blk, base=b) + _ent(blk, blk, base=b), data * 2),
        ("truncated payload", W, _hdr(2) + _ent(0, blk, base=b) + _ent(blk, blk, base=b), data),
        ("payload longer than the entries", W, _hdr(1) + _ent(0, blk, base=b), data * 2),
        ("read past the region's end", R, _hdr(1) + _ent(len(p.buf) - 1, 2, base=b), b""),
        ("read of a stale generation", R, _hdr(1) + _ent(0, blk, gen=0, base=b), b""),
        ("read request with a payload", R, _hdr(1) + _ent(0, blk, base=b), data),
        ("read of more than a batch may carry", R,
         _hdr(2) + _ent(0, len(p.buf), base=b) + ENT.pack(b, (64 << 20), SLOT, GEN), b""),
    ]


def test_forged_batches_are_refused_and_change_nothing(pair: Pair) -> None:
    p = pair
    before = int(p.t.stats()["refused"])
    for what, amid, header, payload in _forged(p):
        p.raw(amid, header, payload)
        got = p.refused_after(before)
        assert got == before + 1, f"{what}: not refused"
        before = got
        assert np.array_equal(p.buf, p.orig), f"{what}: the target's memory changed"
    # the same channel still takes a well-formed batch (the refusals above were the checks, not a
    # broken channel): two blocks land where their entries say
    blk = 4096
    data = bytes(range(256)) * 16 * 2
    p.raw(p.m.AM_WREQ, _hdr(2) + _ent(blk * 3, blk, base=p.base) + _ent(0, blk, base=p.base), data)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not np.array_equal(p.buf[:blk], np.frombuffer(data[blk:], np.uint8)):
        time.sleep(0.01)
    exp = p.orig.copy()
    exp[blk * 3:blk * 4] = np.frombuffer(data[:blk], np.uint8)
    exp[:blk] = np.frombuffer(data[blk:], np.uint8)
    assert np.array_equal(p.buf, exp)
    assert int(p.t.stats()["refused"]) == before


def test_forged_answers_are_dropped(pair: Pair) -> None:
    """Answers for no transfer in flight, of the wrong size or kind, are dropped by the
    initiator (the target plays the hostile side here)."""
    p = pair
    before = int(p.i.stats()["dropped"])
    for amid, header, payload in [
        (p.m.AM_ACK, ACK.pack(12345, 0, 0), b""),
        (p.m.AM_RDATA, ACK.pack(12345, 0, 0), b"x" * 100),
        (p.m.AM_ACK, b"\x00" * 3, b""),
        (p.m.AM_RDATA, b"", b"y" * 10),
    ]:
        p.t.am_send_raw(p.back, amid, header, payload)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and int(p.i.stats()["dropped"]) < before + 4:
        time.sleep(0.01)
    assert int(p.i.stats()["dropped"]) == before + 4


def _post(p: Pair, op: int, laddr: np.ndarray, lslot: int, raddr: list[int], rlen: list[int],
          rslot: int = SLOT, rgen: int = GEN, cookie: int = COOKIE) -> Any:
    n = len(raddr)
    nb = np.asarray(rlen, dtype=_U64)
    return p.i.post_am(op, p.ep, np.arange(n, dtype=np.int64), laddr.astype(_U64), nb,
                       np.full(n, lslot, _U64), np.arange(n, dtype=np.int64), np.asarray(raddr, dtype=_U64), nb,
                       np.full(n, rslot, _U64), np.full(n, rgen, _U64), None, cookie, 1 << 20, None)


@pytest.mark.parametrize("op", [0, 1], ids=["write", "read"])
def test_posted_batches_outside_the_target_fail_the_transfer(pair: Pair, op: int) -> None:
    """The initiator's own post with remote entries outside the target's registrations (what a
    buggy or hostile initiator could post): the target refuses, the transfer fails with the
    target's refusal, and the target's memory is unchanged."""
    p = pair
    src = pattern(8192, 9)
    p.i.region_add(1, 1, src.ctypes.data, src.nbytes)
    la = np.array([src.ctypes.data, src.ctypes.data + 4096], dtype=_U64)
    for raddr, rlen, kw in [
        ([p.base + len(p.buf) - 4096, p.base + len(p.buf)], [4096, 4096], {}),  # second past the end
        ([p.base, p.base + 4096], [4096, 4096], {"rgen": GEN + 1}),  # released and registered again
        ([p.base, p.base + 4096], [4096, 4096], {"rslot": 9}),  # not registered
    ]:
        x = _post(p, op, la, 1, raddr, rlen, **kw)
        with pytest.raises(OSError) as ei:
            x.wait(5.0)
        assert ei.value.errno == p.m.ERR_INVALID_ADDR
        assert np.array_equal(p.buf, p.orig)
        assert np.array_equal(src, pattern(8192, 9))
    # and a good one goes through (both directions checked against the buffers)
    x = _post(p, op, la, 1, [p.base + 8192, p.base], [4096, 4096])
    assert x.wait(5.0)
    if op == 0:
        assert np.array_equal(p.buf[8192:12288], src[:4096]) and np.array_equal(p.buf[:4096], src[4096:])
    else:
        assert np.array_equal(src[:4096], p.orig[8192:12288]) and np.array_equal(src[4096:], p.orig[:4096])


def test_local_block_outside_local_registrations_is_refused(pair: Pair) -> None:
    p = pair
    src = pattern(4096, 1)
    with pytest.raises(ValueError, match="live host registration"):
        _post(p, 0, np.array([src.ctypes.data], dtype=_U64), 2, [p.base], [4096])


def test_unknown_cookie_gets_no_answer_and_fails_within_the_bound(pair: Pair) -> None:
    p = pair
    src = pattern(4096, 1)
    p.i.region_add(1, 1, src.ctypes.data, src.nbytes)
    t0 = time.monotonic()
    x = _post(p, 0, np.array([src.ctypes.data], dtype=_U64), 1, [p.base], [4096], cookie=0xBAD)
    with pytest.raises(OSError):
        x.wait(15.0)
    assert time.monotonic() - t0 < 12.0  # peer_timeout 2 s plus the watchdog's slack
    assert np.array_equal(p.buf, p.orig)


# ---- through the agent -----------------------------------------------------------------------
def _agent(name: str, **kw: Any) -> kvx.Agent:
    kw.setdefault("peer_timeout", 3.0)
    return kvx.Agent(name, kvx.AgentConfig(backends=("ucx",), **kw))


def _backend(a: kvx.Agent) -> Any:
    (b,) = [b for b in a.backends if b.name == "ucx"]
    return b


@pytest.mark.parametrize("bs,batched", [(4096, True), (64 << 10, False)])
def test_small_blocks_over_tcp_go_batched(tcp_env: None, bs: int, batched: bool) -> None:
    """Over tcp, writes of small blocks travel as batched messages (many blocks per message),
    larger ones as UCX puts; reads go batched at every block size (a 64 KiB block in two 32 KiB
    pieces, one answer each); bytes exact either way."""
    with _agent("a") as a, _agent("b") as b:
        n = 64
        src = pattern(n * bs, 3)
        dst = np.zeros(n * bs, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(ra, bs))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
        perm = np.random.default_rng(4).permutation(n)
        w = _backend(a).w
        s0 = int(w.stats()["batches"])
        a.write(loc, np.arange(n), rem, perm, notify=b"w").wait(10)
        sent = int(w.stats()["batches"]) - s0
        assert (0 < sent < n) if batched else sent == 0
        exp = np.zeros_like(dst).reshape(n, bs)
        exp[perm] = src.reshape(n, bs)
        assert np.array_equal(dst, exp.reshape(-1))
        assert b.notifications(timeout=5) == {"a": [b"w"]}
        back = np.zeros_like(src)
        lb = a.prepare(kvx.DescList.blocks(a.register(back), bs))
        s1 = int(w.stats()["batches"])
        a.read(lb, perm, rem, np.arange(n)).wait(10)
        # reads: one zero-copy segment (64 KiB - 64) per answer, so 64 KiB blocks take two
        assert (0 < int(w.stats()["batches"]) - s1 < n) if batched else int(w.stats()["batches"]) - s1 == 2 * n
        assert np.array_equal(back.reshape(n, bs)[perm], dst.reshape(n, bs))


def _lists(reg: kvx.Registration, sizes: list[int]) -> kvx.DescList:
    """Consecutive blocks of the given sizes from the start of ``reg``."""
    d = reg.descs
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    return kvx.DescList.from_arrays(kind=d.kind, addr=int(d.addr[0]) + off, nbytes=np.array(sizes, np.uint64))


def test_batched_reads_cut_large_blocks_into_pieces(tcp_env: None) -> None:
    """Over tcp a read of blocks larger than one answer asks for them in pieces: odd sizes
    around the piece boundaries (one byte over, a few pieces, a 4 KiB-rounded piece that would
    not fit) arrive byte-exact in a permuted order; a pair of blocks of
    different sizes is a UsageError and moves nothing."""
    bb = (64 << 10) - 64
    sizes = [1, bb, bb + 1, 2 * bb, 130000, 300001, 4096, 1 << 20]
    total = sum(sizes)
    with _agent("a") as a, _agent("b") as b:
        src = pattern(total, 9)
        back = np.zeros(total, np.uint8)
        rb, ra = b.register(src), a.register(back)
        peer = a.add_peer(b.metadata())
        rem = a.prepare(_lists(rb, sizes), peer=peer)
        perm = np.random.default_rng(2).permutation(len(sizes))
        # local block i receives remote block perm[i]: local sizes follow the permutation
        lsizes = [sizes[j] for j in perm]
        loc = a.prepare(_lists(ra, lsizes))
        w = _backend(a).w
        s0 = int(w.stats()["batches"])
        a.read(loc, np.arange(len(sizes)), rem, perm).wait(10)
        # every answer carries at most bb bytes (unsplit, the 1 MiB block would be one answer)
        assert int(w.stats()["batches"]) - s0 >= -(-total // bb)
        offs = np.concatenate([[0], np.cumsum(sizes)])
        loffs = np.concatenate([[0], np.cumsum(lsizes)])
        for i, j in enumerate(perm):
            assert np.array_equal(back[loffs[i]:loffs[i + 1]], src[offs[j]:offs[j + 1]]), (i, j)
        back[:] = 0
        with pytest.raises(kvx.UsageError):
            a.read(loc, [0, 1], rem, [perm[1], perm[0]]).wait(10)
        assert not back.any()


def test_batched_write_after_target_release_is_refused(tcp_env: None) -> None:
    with _agent("a") as a, _agent("b") as b:
        bs, n = 4096, 16
        src = pattern(n * bs, 3)
        dst = np.zeros(n * bs, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(ra, bs))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
        a.write(loc, np.arange(n), rem, np.arange(n)).wait(10)
        rb.release()
        dst[:] = 0
        with pytest.raises(RemoteError):
            a.write(loc, np.arange(n), rem, np.arange(n)).wait(10)
        assert not dst.any()


def test_batch_options_are_checked() -> None:
    from kvx.backends.ucx import UcxOptions
    from kvx.errors import UsageError

    with pytest.raises(UsageError):
        UcxOptions(batch="yes")
    with pytest.raises(UsageError):
        UcxOptions(batch_bytes=0)
    assert UcxOptions(batch="never").batch == "never"
