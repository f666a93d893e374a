"""The write-back queue: demotions off the critical path, backpressure, readability in flight,
one transfer per tier, concurrency."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.tiers import DiskTier, HostTier, TieredStore

BB = 512


def content(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BB, dtype=np.uint8)


class GatedStore(TieredStore):
    """A real store whose write-back workers wait at a gate before each batch (so a test can
    hold demotions in flight), and which counts the agent transfers its gets make."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        self.gate = threading.Event()
        super().__init__(*a, **kw)

    def _move_batch(self, batch: list, staging: Any) -> list[bool]:  # type: ignore[override]
        assert self.gate.wait(30)
        return super()._move_batch(batch, staging)


def _flip(path: Path, offset: int, mask: int) -> None:
    """Corrupt one byte of a file (written through to the device: O_DIRECT readers see it too)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


def _eight_on_disk(st: TieredStore) -> np.ndarray:
    """Store blocks 0..7 (``content``), then 100..107 so that 0..7 go down to disk only."""
    buf, src = _lists(st, 8)
    for j in range(8):
        buf[j * BB:(j + 1) * BB] = content(j)
    st.put(list(range(8)), src)
    st.put(list(range(100, 108)), src)
    st.flush()
    assert st.lookup(list(range(8))).tiers == (1,) * 8
    return buf


def _lists(st: TieredStore, n: int) -> tuple[np.ndarray, kvx.PreparedList]:
    buf = np.zeros(n * BB, np.uint8)
    return buf, st.agent.prepare(kvx.DescList.blocks(st.agent.register(buf), BB))


def test_put_waits_only_when_queue_full_and_blocks_stay_readable(tmp_path: Path) -> None:
    st = GatedStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=64)], block_bytes=BB, policy="lru",
                    writeback_depth=4, writeback_workers=1)
    try:
        buf, src = _lists(st, 1)
        out, dst = _lists(st, 1)
        stored = []
        t0 = time.monotonic()
        with pytest.raises(kvx.TierError, match="write-back queue"):
            for k in range(100):
                buf[:] = content(k)
                st.put([k], src, timeout=0.3)
                stored.append(k)
        # the first demotions were queued without waiting; the queue bound stopped the rest
        assert 2 + 4 <= len(stored) <= 2 + 4 + 1 and time.monotonic() - t0 < 5
        assert st.stats().writeback_queued + st.stats().writeback_active >= 4
        for k in stored:  # in flight or not, every stored block reads back right
            assert k in st
            assert st.get([k], dst) == 1 and np.array_equal(out, content(k)), k
        st.gate.set()
        st.flush(10)
        assert st.stats().writeback_queued == 0
        assert all(k in st.tiers[1].index for k in stored[:4])
    finally:
        st.gate.set()
        st.close()


def test_close_drains_the_queue(tmp_path: Path) -> None:
    st = TieredStore([HostTier(blocks=4), DiskTier(tmp_path, blocks=256)], block_bytes=BB, policy="lru")
    buf, src = _lists(st, 8)
    for c in range(0, 200, 8):
        for j in range(8):
            buf[j * BB:(j + 1) * BB] = content(c + j)
        st.put(list(range(c, c + 8)), src)
    st.close()
    with TieredStore([HostTier(blocks=4), DiskTier(tmp_path, blocks=256)], block_bytes=BB, policy="lru") as st2:
        assert set(range(196)) <= set(st2.tiers[1].index)
        out, dst = _lists(st2, 8)
        assert st2.get(list(range(8)), dst) == 8
        assert all(np.array_equal(out[j * BB:(j + 1) * BB], content(j)) for j in range(8))


def test_get_is_one_transfer_per_tier(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=128), DiskTier(tmp_path, blocks=256)], block_bytes=BB, policy="lru") as st:
        buf, src = _lists(st, 64)
        for j in range(64):
            buf[j * BB:(j + 1) * BB] = content(j)
        st.put(list(range(64)), src)
        st.put(list(range(100, 164)), src)
        st.put(list(range(200, 264)), src)  # 0..63 are on disk now
        st.flush()
        assert st.lookup(list(range(64))).tiers == (1,) * 64
        calls = []
        real_read = st.agent.read

        def counting_read(*a: Any, **kw: Any) -> Any:
            if threading.current_thread() is threading.main_thread():  # not the write-back workers
                calls.append((a[0].kind, a[2].descs.kind))
            return real_read(*a, **kw)

        st.agent.read = counting_read  # type: ignore[method-assign]
        out, dst = _lists(st, 64)
        assert st.get(list(range(64)), dst) == 64
        assert np.array_equal(out, buf)
        # one read disk -> destination for all 64 (the promotion to the host tier is a write-back job)
        assert calls == [(kvx.MemoryKind.HOST, kvx.MemoryKind.FILE)]
        st.flush()
        assert st.lookup(list(range(64))).tiers == (0,) * 64  # promoted once the jobs landed
        calls.clear()
        out[:] = 0
        assert st.get(list(range(64)), dst) == 64
        assert np.array_equal(out, buf)
        assert calls == [(kvx.MemoryKind.HOST, kvx.MemoryKind.HOST)]  # one read host -> destination


def test_concurrent_puts_and_gets_never_return_wrong_bytes(tmp_path: Path) -> None:
    """Threads put and get overlapping chains while demotions and promotions fly."""
    st = TieredStore([HostTier(blocks=16), DiskTier(tmp_path, blocks=64)], block_bytes=BB, policy="lru",
                     writeback_depth=8, writeback_batch=4)
    errors: list[str] = []
    stop = time.monotonic() + 3.0

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf, src = _lists(st, 4)
        out, dst = _lists(st, 4)
        while time.monotonic() < stop:
            base = int(rng.integers(0, 60)) * 4
            keys = list(range(base, base + 4))
            if rng.random() < 0.5:
                for j, k in enumerate(keys):
                    buf[j * BB:(j + 1) * BB] = content(k)
                st.put(keys, src)
            else:
                try:
                    n = st.get(keys, dst)
                except kvx.BlockNotFound as exc:
                    n = exc.args[1]
                for j in range(n):
                    if not np.array_equal(out[j * BB:(j + 1) * BB], content(keys[j])):
                        errors.append(f"key {keys[j]}")

    try:
        ths = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(30)
        assert not errors, errors[:5]
        st.flush()
        s = st.stats()
        assert s.tiers[0]["demoted"] > 0 and s.tiers[1]["promoted"] > 0 and s.tiers[1]["corrupt"] == 0
        assert all(t["held"] == 0 for t in s.tiers)
    finally:
        st.close()


def test_prometheus_has_counters_queue_and_histograms(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru") as st:
        buf, src = _lists(st, 4)
        st.put([1, 2, 3, 4], src)
        st.flush()
        out, dst = _lists(st, 1)
        st.get([1], dst)  # promoted: one more block goes down
        st.flush()
        text = st.prometheus()
    assert 'kvx_store_demoted_total{tier="0",medium="CPU"} 3' in text
    assert 'kvx_store_promoted_total{tier="1",medium="DISK"} 1' in text
    assert "kvx_store_writeback_queue 0" in text
    assert 'kvx_store_writeback_latency_seconds_bucket{le="+Inf"} 3' in text
    assert "kvx_store_get_latency_seconds_count 1" in text and "kvx_store_put_latency_seconds_count 1" in text


def test_checksum_is_kvx_nh64() -> None:
    """The tiers' block checksum is kvx-nh64, the one the posix backend takes in a copy: the same
    values as the portable code, for any length and buffer type."""
    from kvx import _native
    from kvx.tiers.checksum import block_sum

    rng = np.random.default_rng(5)
    for n in (0, 1, 63, 4096, 65537, 1 << 20):
        b = rng.integers(0, 256, n, dtype=np.uint8)
        assert block_sum(b) == _native.nh64_portable(b.tobytes())
        assert block_sum(memoryview(b.tobytes())) == block_sum(b)
    a = rng.integers(0, 256, 4096, dtype=np.uint8)
    c = a.copy()
    c[100] ^= 1
    assert block_sum(a) != block_sum(c)


def test_tier_of_the_crc32_format_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A disk tier written by a release that checksummed with CRC-32 (``tier.meta`` without the
    checksum tag, ``KJ`` journal records with a 32-bit CRC) is dropped on open, with a warning:
    none of its blocks is served under a checksum of another function. The same journal under a
    current ``tier.meta`` is not replayed either (its records' magic differs)."""
    import struct
    import zlib

    slots = 16
    body = content(7)
    for meta in (f"{BB} {slots}\n", None):
        d = tmp_path / ("old" if meta else "mixed")
        d.mkdir()
        with open(d / "slab.bin", "wb") as f:
            f.write(body.tobytes() + bytes(BB * (slots - 1)))
        key = b"i" + (7).to_bytes(16, "big", signed=True)
        rec = struct.pack("<2sBHHIIQ", b"KJ", 1, len(key), 0, 0, zlib.crc32(body.tobytes()), BB) + key
        with open(d / "index.log", "wb") as f:
            f.write(rec + struct.pack("<I", zlib.crc32(rec)))
        if meta is None:  # a current tier.meta over the old journal
            with TieredStore([HostTier(blocks=2), DiskTier(d, blocks=8)], block_bytes=BB) as st:
                pass
            with open(d / "index.log", "wb") as f:
                f.write(rec + struct.pack("<I", zlib.crc32(rec)))
        else:
            (d / "tier.meta").write_text(meta)
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvx.tiers.tier"):
            with TieredStore([HostTier(blocks=2), DiskTier(d, blocks=8)], block_bytes=BB) as st:
                assert 7 not in st and len(st.tiers[1].index) == 0
                out, dst = _lists(st, 1)
                with pytest.raises(kvx.BlockNotFound):
                    st.get([7], dst)
        if meta is not None:
            assert any("checksum" in r.getMessage() for r in caplog.records)


def test_get_promotes_after_it_returns_or_not_at_all(tmp_path: Path) -> None:
    """A get of disk blocks into host memory returns before their promotion to the host tier is
    decided; flush() (or the store's next operation) makes it. promote=False keeps them on disk."""
    for promote in (True, False):
        d = tmp_path / str(promote)
        with TieredStore([HostTier(blocks=8), DiskTier(d, blocks=64)], block_bytes=BB, policy="lru",
                         promote=promote) as st:
            buf = _eight_on_disk(st)
            out, dst = _lists(st, 8)
            assert st.get(list(range(8)), dst) == 8
            assert np.array_equal(out, buf)
            st.flush()
            assert st.lookup(list(range(8))).tiers == ((0,) if promote else (1,)) * 8
            assert st.stats().tiers[1]["promoted"] == (8 if promote else 0)
            out[:] = 0
            assert st.get(list(range(8)), dst) == 8  # from the host tier now, or from disk again
            assert np.array_equal(out, buf)


def test_direct_get_checks_o_direct_slab(tmp_path: Path) -> None:
    """With an O_DIRECT slab the posix backend takes no checksums in the copy: the get checks the
    destination after the read instead, and still refuses a corrupt block."""
    from kvx.backends.posix import PosixOptions

    bb = 4096
    ag = kvx.Agent("tier-direct", kvx.AgentConfig(options={"posix": PosixOptions(direct=True)}))
    try:
        with TieredStore([HostTier(blocks=4), DiskTier(tmp_path, blocks=64)], block_bytes=bb, policy="lru",
                         agent=ag) as st:
            buf = kvx.alloc_host(4 * bb)
            buf[:] = np.random.default_rng(3).integers(0, 256, 4 * bb, dtype=np.uint8)
            src = st.agent.prepare(kvx.DescList.blocks(st.agent.register(buf), bb))
            st.put([1, 2, 3, 4], src)
            st.put([11, 12, 13, 14], src)
            st.flush()
            assert st.lookup([1, 2, 3, 4]).tiers == (1,) * 4
            out = kvx.alloc_host(4 * bb)
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(out), bb))
            assert st.get([1, 2, 3, 4], dst) == 4 and np.array_equal(out, buf)
            st.put([21, 22, 23, 24], src)  # 1..4 back down to disk only
            st.flush()
            _flip(tmp_path / "slab.bin", st.tiers[1].index[3][0] * bb + 9, 1)
            with pytest.raises(kvx.BlockNotFound, match="checksum") as ei:
                st.get([1, 2, 3, 4], dst)
            assert ei.value.args[1] == 2
    finally:
        ag.close()


def test_direct_get_stops_at_a_corrupt_disk_block(tmp_path: Path) -> None:
    """Disk blocks go straight into the destination and are checked there: a corrupt one in the
    middle ends the get at its position, is scrubbed from the destination, and is dropped from
    the disk and from the host tier (its background promotion does not bring it back)."""
    with TieredStore([HostTier(blocks=8), DiskTier(tmp_path, blocks=64)], block_bytes=BB, policy="lru") as st:
        buf, src = _lists(st, 8)
        for j in range(8):
            buf[j * BB:(j + 1) * BB] = content(j)
        st.put(list(range(8)), src)
        st.put(list(range(100, 108)), src)  # 0..7 go down to disk
        st.flush()
        assert st.lookup(list(range(8))).tiers == (1,) * 8
        _flip(tmp_path / "slab.bin", st.tiers[1].index[5][0] * BB + 3, 0x55)
        out, dst = _lists(st, 8)
        out[:] = 9
        with pytest.raises(kvx.BlockNotFound, match="checksum") as ei:
            st.get(list(range(8)), dst)
        assert ei.value.args[1] == 5
        assert np.array_equal(out[:5 * BB], buf[:5 * BB])
        assert (out[5 * BB:6 * BB] == 0).all()  # scrubbed, not the corrupt bytes
        st.flush()
        assert 5 not in st and 5 not in st.tiers[0].index and 5 not in st.tiers[1].index
        assert st.stats().tiers[1]["corrupt"] == 1
        out[:] = 0
        assert st.get([6, 7], dst) == 2  # the blocks after it are intact
        assert np.array_equal(out[:2 * BB], buf[6 * BB:8 * BB])


def test_get_into_a_released_destination_fails_cleanly(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=4), DiskTier(tmp_path, blocks=64)], block_bytes=BB, policy="lru") as st:
        buf, src = _lists(st, 8)
        for j in range(8):
            buf[j * BB:(j + 1) * BB] = content(j)
        st.put(list(range(8)), src)
        st.flush()
        gone = np.zeros(8 * BB, np.uint8)
        reg = st.agent.register(gone)
        dst = st.agent.prepare(kvx.DescList.blocks(reg, BB))
        reg.release()
        with pytest.raises(kvx.KVXError):
            st.get(list(range(8)), dst)
        st.flush()
        out, live = _lists(st, 8)
        assert st.get(list(range(8)), live) == 8  # nothing was lost or left half-promoted
        assert np.array_equal(out, buf)


def test_disk_get_takes_checksums_in_the_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get of disk blocks into host memory (buffered slab) checks them with the checksums the
    posix read took while copying: no checksum pass over the destination afterwards."""
    import kvx.tiers.store as store_mod

    with TieredStore([HostTier(blocks=8), DiskTier(tmp_path, blocks=64)], block_bytes=BB, policy="lru",
                     promote=False) as st:
        buf = _eight_on_disk(st)
        calls = []
        real = store_mod.block_sum
        monkeypatch.setattr(store_mod, "block_sum", lambda b: calls.append(1) or real(b))
        out, dst = _lists(st, 8)
        for _ in range(2):
            out[:] = 0
            assert st.get(list(range(8)), dst) == 8
            assert np.array_equal(out, buf)
        assert calls == []
        assert st.stats().tiers[1]["hits"] >= 16
