"""HiCacheKVX against SGLang's own storage factory and host pools (CPU, no model)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from kvx_sglang.hicache import HiCacheKVX
from kvx_sglang.layout import LayoutError
from pools import MHA_LAYOUTS, fill, mha_pool, mla_pool, page_bytes, storage_config, token_indices
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.observability.metrics_collector import StorageMetrics

import kvx
from kvx.testing.etcd import etcd_server  # noqa: F401  (fixture)

EXTRA = {"backend_name": "kvx", "module_path": "kvx_sglang.hicache", "class_name": "HiCacheKVX",
         "interface_v1": 1}


def make(tmp_path, pool, store="file", **kw):
    extra = dict(EXTRA, **kw)
    gb = 64 * pool.page_size * pool.size_per_token / (1 << 30)  # as much as the host pool holds
    if store == "file":
        extra.setdefault("path", str(tmp_path / "slab"))
        extra.setdefault("capacity_gb", gb)
    else:  # a host tier of half that, then disk
        extra["store"] = "tiered"
        extra.setdefault("host_gb", gb / 2)
        extra.setdefault("disk_path", str(tmp_path / "disk"))
        extra.setdefault("disk_gb", gb)
    cfg = storage_config(extra)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def keys(n, tag="k"):
    return [f"{tag}{i:062x}" for i in range(n)]


def test_factory_builds_from_cli_json(tmp_path):
    pool = mha_pool("page_first")
    b = make(tmp_path, pool)
    try:
        assert isinstance(b, HiCacheKVX)
        assert b.geom is not None and b.geom.nfrag == 2 and b.geom.page_bytes == pool.page_size * pool.size_per_token
    finally:
        b.close()


POOLS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", "page_first"), ("mla", "layer_first")]


@pytest.mark.parametrize("store", ["file", "tiered"])
@pytest.mark.parametrize("kind,layout", POOLS)
def test_roundtrip_set_evict_get(tmp_path, kind, layout, store):
    pool = mha_pool(layout) if kind == "mha" else mla_pool(layout)
    fill(pool, 1)
    b = make(tmp_path, pool, store)
    try:
        src = [3, 7, 8, 20, 41, 63, 0, 1]
        ks = keys(len(src))
        want = [page_bytes(pool, p) for p in src]
        assert b.batch_set_v1(ks, token_indices(src, pool.page_size)) == [True] * len(src)
        fill(pool, 2)  # the host copies are gone (evicted and reused)
        dst = [50, 2, 30, 31, 5, 6, 62, 9]
        assert [page_bytes(pool, p) for p in dst] != want
        assert b.batch_get_v1(ks, token_indices(dst, pool.page_size)) == [True] * len(src)
        assert [page_bytes(pool, p) for p in dst] == want
    finally:
        b.close()


def test_file_store_survives_restart(tmp_path):
    pool = mha_pool("page_first")
    fill(pool, 3)
    ks = keys(4)
    want = [page_bytes(pool, p) for p in range(4)]
    b = make(tmp_path, pool)
    assert all(b.batch_set_v1(ks, token_indices([0, 1, 2, 3], pool.page_size)))
    b.close()
    fill(pool, 4)
    b = make(tmp_path, pool)
    try:
        assert b.batch_exists(ks) == 4
        assert all(b.batch_get_v1(ks, token_indices([10, 11, 12, 13], pool.page_size)))
        assert [page_bytes(pool, p) for p in (10, 11, 12, 13)] == want
    finally:
        b.close()


@pytest.mark.parametrize("store", ["file", "tiered"])
def test_batch_exists_is_a_prefix(tmp_path, store):
    pool = mha_pool("page_first")
    fill(pool, 5)
    b = make(tmp_path, pool, store)
    try:
        a, c, d, x = keys(4)
        assert b.batch_exists([a, c, d]) == 0
        assert all(b.batch_set_v1([a, c, d], token_indices([1, 2, 3], pool.page_size)))
        assert b.batch_exists([a, c, d]) == 3
        assert b.batch_exists([a, c, x, d]) == 2
        assert b.batch_exists([x, a]) == 0
        assert b.exists(c) and not b.exists(x)
        # a get stops at the first missing page as well
        assert b.batch_get_v1([a, x, c], token_indices([4, 5, 6], pool.page_size)) == [True, False, False]
    finally:
        b.close()


@pytest.mark.parametrize("direct_io", [False, True])  # checksums taken by the posix copy / in Python
def test_corrupt_page_is_a_miss(tmp_path, direct_io):
    pool = mha_pool("page_first")
    fill(pool, 6)
    b = make(tmp_path, pool, direct_io=direct_io)
    try:
        ks = keys(3)
        want = [page_bytes(pool, p) for p in (0, 1, 2)]
        assert all(b.batch_set_v1(ks, token_indices([0, 1, 2], pool.page_size)))
        slot, _ = b.pages._index[ks[1] + b.config_suffix]
        with open(b.pages.slab_path, "r+b") as f:  # flip one byte of the middle page on disk
            f.seek(slot * b.geom.page_bytes + b.geom.page_bytes // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x5A]))
        ok = b.batch_get_v1(ks, token_indices([10, 11, 12], pool.page_size))
        assert ok == [True, False, True]
        assert page_bytes(pool, 10) == want[0] and page_bytes(pool, 12) == want[2]
        assert b.batch_exists(ks) == 1  # the corrupt page was dropped
        assert all(b.batch_set_v1(ks, token_indices([0, 1, 2], pool.page_size)))  # and can be stored again
        assert b.batch_exists(ks) == 3
    finally:
        b.close()


@pytest.mark.parametrize("inline", [True, False])
def test_batches_on_the_io_threads_or_inline(tmp_path, inline):
    """Both ways of running a batch (calling thread, kvx's I/O threads) store, reuse and load
    the same bytes, first writes and rewrites of slots alike."""
    pool = mha_pool("page_first", pages=64)
    fill(pool, 8)
    b = make(tmp_path, pool, inline=inline, capacity_gb=10 * pool.page_size * pool.size_per_token / (1 << 30))
    try:
        for r in range(3):  # 10 slots, 6 pages a round: later rounds evict and rewrite slots
            ks = keys(6, f"r{r}")
            src = [r, r + 10, r + 20, r + 30, r + 40, r + 50]
            want = [page_bytes(pool, p) for p in src]
            assert all(b.batch_set_v1(ks, token_indices(src, pool.page_size)))
            assert b.batch_get_v1(ks, token_indices([60, 61, 62, 63, 59, 58], pool.page_size)) == [True] * 6
            assert [page_bytes(pool, p) for p in (60, 61, 62, 63, 59, 58)] == want
    finally:
        b.close()


def test_checksums_agree_between_buffered_and_direct(tmp_path):
    """Pages stored through the buffered slab (checksums from the copy) load through O_DIRECT
    (checksums in Python) and the other way round: one checksum, however it is taken."""
    pool = mha_pool("page_first")
    fill(pool, 7)
    ks, src = keys(6), [4, 9, 13, 27, 40, 2]
    want = [page_bytes(pool, p) for p in src]
    b = make(tmp_path, pool)
    assert all(b.batch_set_v1(ks, token_indices(src, pool.page_size)))
    b.close()
    b = make(tmp_path, pool, direct_io=True)
    try:
        assert b.batch_exists(ks) == 6
        assert b.batch_get_v1(ks, token_indices([50, 51, 52, 53, 54, 55], pool.page_size)) == [True] * 6
        assert [page_bytes(pool, p) for p in range(50, 56)] == want
        assert all(b.batch_set_v1(keys(2, "d"), token_indices([1, 3], pool.page_size)))
    finally:
        b.close()
    b = make(tmp_path, pool)
    try:
        assert b.batch_get_v1(keys(2, "d"), token_indices([60, 61], pool.page_size)) == [True, True]
        assert [page_bytes(pool, p) for p in (60, 61)] == [page_bytes(pool, 1), page_bytes(pool, 3)]
    finally:
        b.close()


def test_unsupported_layout_is_refused(tmp_path):
    pool = mha_pool("page_unified")  # SGLang's fused K/V layout: no zero-copy page meta
    cfg = storage_config(dict(EXTRA, path=str(tmp_path), capacity_gb=0.01))
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    with pytest.raises(LayoutError, match="page_unified.*supported"):
        b.register_mem_pool_host(pool)
    b.close()


@pytest.mark.parametrize("extra,msg", [
    ({"interface_v1": 0}, "interface_v1"),
    ({"capcity_gb": 2}, "unknown kvx HiCache setting 'capcity_gb'"),
    ({"capacity_gb": -1}, "positive number"),
    ({"store": "nvme"}, "store must be one of"),
    ({"fsync": "yes"}, "must be a bool"),
    ({"prefault_gb": -1}, "must be a number >= 0"),
    ({"capacity_gb": float("inf")}, "positive number"),
    ({"pool_name": "x"}, "need pool_etcd"),
    ({"pool_etcd": "http://e:1"}, "tiered"),
    ({"store": "tiered", "pool_etcd": "e:1"}, "http"),
    ({"store": "tiered", "pool_etcd": "http://e:1", "pool_replicas": 1.5}, "1..8"),
    ({"store": "tiered", "pool_etcd": "http://e:1", "pool_host": "0.0.0.0"}, "wildcard"),
    ({"store": "tiered", "pool_etcd": "http://e:1", "pool_member": "a/b"}, "without '/'"),
    ({"store": "tiered", "pool_etcd": "http://e:1", "pool_capacity_gb": -1}, "number >= 0"),
])
def test_bad_extra_config_is_a_clear_error(tmp_path, extra, msg):
    cfg = storage_config(dict(EXTRA, path=str(tmp_path), **extra))
    with pytest.raises(kvx.UsageError, match=msg):
        StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_keys_are_scoped_by_rank_and_mla_has_one_writer(tmp_path):
    extra = dict(EXTRA, path=str(tmp_path), capacity_gb=0.01)
    pools = [mha_pool("page_first"), mha_pool("page_first")]
    fill(pools[0], 7)
    r0, r1 = (StorageBackendFactory.create_backend("dynamic", storage_config(extra, tp_rank=r, tp_size=2), None)
              for r in (0, 1))
    r0.register_mem_pool_host(pools[0])
    r1.register_mem_pool_host(pools[1])
    try:
        ks = keys(2)
        assert all(r0.batch_set_v1(ks, token_indices([0, 1], 16)))
        assert r0.batch_exists(ks) == 2 and r1.batch_exists(ks) == 0  # TP shards differ: no sharing
    finally:
        r0.close()
        r1.close()
    # MLA: the KV is the same on every rank; rank 0 writes, the others read its pages
    mp = [mla_pool("page_first"), mla_pool("page_first")]
    fill(mp[0], 8)
    m0, m1 = (StorageBackendFactory.create_backend("dynamic", storage_config(extra, tp_rank=r, tp_size=2, mla=True),
                                                    None) for r in (0, 1))
    m0.register_mem_pool_host(mp[0])
    m1.register_mem_pool_host(mp[1])
    try:
        ks = keys(3, "m")
        assert m1.batch_set_v1(ks, token_indices([0, 1, 2], 16)) == [True] * 3  # not the writer: skipped
        assert m1.batch_exists(ks) == 0
        assert all(m0.batch_set_v1(ks, token_indices([0, 1, 2], 16)))
        assert m1.batch_exists(ks) == 3
        assert all(m1.batch_get_v1(ks, token_indices([5, 6, 7], 16)))
        assert [page_bytes(mp[1], p) for p in (5, 6, 7)] == [page_bytes(mp[0], p) for p in (0, 1, 2)]
    finally:
        m0.close()
        m1.close()


def test_full_slab_evicts_least_recently_used(tmp_path):
    pool = mha_pool("page_first")
    fill(pool, 9)
    pb = pool.page_size * pool.size_per_token
    b = make(tmp_path, pool, capacity_gb=4 * pb / (1 << 30))
    try:
        ks = keys(6)
        assert all(b.batch_set_v1(ks[:4], token_indices([0, 1, 2, 3], 16)))
        assert b.batch_exists(ks[:1]) == 1
        assert all(b.batch_get_v1(ks[:1], token_indices([9], 16)))  # k0 is now the most recent
        assert all(b.batch_set_v1(ks[4:], token_indices([4, 5], 16)))  # evicts k1, k2
        assert [b.exists(k) for k in ks] == [True, False, False, True, True, True]
        assert all(b.batch_get_v1([ks[4], ks[5]], token_indices([20, 21], 16)))
        assert [page_bytes(pool, p) for p in (20, 21)] == [page_bytes(pool, p) for p in (4, 5)]
    finally:
        b.close()


def test_stats_clear_and_close(tmp_path):
    pool = mha_pool("page_first")
    fill(pool, 10)
    b = make(tmp_path, pool)
    ks = keys(3)
    assert all(b.batch_set_v1(ks, token_indices([0, 1, 2], 16)))
    assert all(b.batch_get_v1(ks, token_indices([3, 4, 5], 16)))
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3] and m.prefetch_bandwidth[0] > 0
    assert b.get_stats().backup_pgs == []  # drained
    b.clear()
    assert b.batch_exists(ks) == 0
    b.close()
    b.close()
    with pytest.raises(kvx.UsageError, match="closed"):
        b.batch_exists(ks)


def test_bad_host_indices_are_refused(tmp_path):
    pool = mha_pool("page_first")
    b = make(tmp_path, pool)
    try:
        with pytest.raises(kvx.UsageError, match="whole pages"):
            b.batch_set_v1(keys(1), torch.arange(0, 5))
        with pytest.raises(kvx.UsageError, match="outside the host pool"):
            b.batch_set_v1(keys(1), torch.arange(64 * 16, 65 * 16))
        with pytest.raises(kvx.UsageError, match="2 keys but 1 pages"):
            b.batch_get_v1(keys(2), token_indices([0], 16))
    finally:
        b.close()


def test_journal_is_compacted_and_readers_follow(tmp_path):
    pool = mha_pool("page_first")
    fill(pool, 11)
    pb = pool.page_size * pool.size_per_token
    b = make(tmp_path, pool, capacity_gb=2 * pb / (1 << 30))
    try:
        st = b.pages
        limit = 4 * st.capacity + 4096
        i = 0
        while st._records <= limit - 4:  # each set of a new key past capacity: a DEL and a PUT
            assert all(b.batch_set_v1([f"j{i:063x}"], token_indices([i % 64], 16)))
            i += 1
        size_before = os.path.getsize(st.log_path)
        for j in range(4):
            assert all(b.batch_set_v1([f"j{i + j:063x}"], token_indices([j], 16)))
        assert os.path.getsize(st.log_path) < size_before / 100  # one record per stored page now
        assert st._records <= 2 * st.capacity + 2
    finally:
        b.close()
    b = make(tmp_path, pool, capacity_gb=2 * pb / (1 << 30))  # and the compacted journal replays
    try:
        assert b.batch_exists([f"j{i + 2:063x}", f"j{i + 3:063x}"]) == 2
        assert all(b.batch_get_v1([f"j{i + 3:063x}"], token_indices([40], 16)))
        assert page_bytes(pool, 40) == page_bytes(pool, 3)
        b.clear()
        assert b.batch_exists([f"j{i + 3:063x}"]) == 0
    finally:
        b.close()


def test_direct_io_roundtrip(tmp_path):
    pool = mha_pool("page_first", page_size=64)  # K and V halves of 32 KiB: O_DIRECT without bounces
    fill(pool, 12)
    b = make(tmp_path, pool, direct_io=True)
    try:
        ks = keys(3)
        want = [page_bytes(pool, p) for p in (1, 2, 3)]
        assert all(b.batch_set_v1(ks, token_indices([1, 2, 3], 64)))
        fill(pool, 13)
        assert all(b.batch_get_v1(ks, token_indices([7, 8, 9], 64)))
        assert [page_bytes(pool, p) for p in (7, 8, 9)] == want
    finally:
        b.close()



def _resident(path, start: int, end: int) -> list[bool]:
    """Page-cache residency of the file's pages in [start, end) (mincore over a mapping of our own;
    ``start`` page-aligned). Mapping and asking fault nothing in."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = -(-(end - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), end)
        try:
            c = ctypes.c_char.from_buffer(m)
            rc = libc.mincore(ctypes.addressof(c) + start, end - start, vec)
            del c
        finally:
            m.close()
    assert rc == 0, os.strerror(ctypes.get_errno())
    return [bool(v & 1) for v in vec]


def test_prefault_populates_the_page_cache_ahead_of_the_fill(tmp_path):
    """With prefault_gb, the slots next in line for a first write are brought into the page cache by
    a background thread that starts when the store is built (building does not wait for it) and
    keeps that window ahead of the fill; pages stay exact. Without it, nothing is populated."""
    import threading

    pool = mha_pool("page_first")
    fill(pool, 12)
    pb = pool.page_size * pool.size_per_token
    cap, window = 4096 * pb, 64 * pb  # a 64 MiB slab, a 1 MiB window
    off = make(tmp_path / "off", pool, capacity_gb=cap / (1 << 30), prefault_gb=0)
    try:
        if all(_resident(off.pages.slab_path, 0, cap)):
            pytest.skip("this file system keeps preallocated files in memory (tmpfs): nothing to prefault")
        assert not all(_resident(off.pages.slab_path, 0, window))
        assert off.pages.prefault_seconds == 0
    finally:
        off.close()
    b = make(tmp_path / "on", pool, capacity_gb=cap / (1 << 30), prefault_gb=window / (1 << 30))
    try:
        slab = b.pages
        assert slab.prefault_idle(30.0)
        assert all(_resident(slab.slab_path, 0, window))
        at_creation = slab.prefault_seconds
        assert at_creation > 0
        src = list(range(64))
        for r in range(12):  # 12 batches of fresh keys: the fill moves 12 MiB into the slab
            assert all(b.batch_set_v1(keys(64, f"r{r:02d}"), token_indices(src, pool.page_size)))
        assert slab.prefault_idle(30.0)
        assert slab.prefault_seconds > at_creation
        assert all(_resident(slab.slab_path, 12 * window, 13 * window))
        want = [page_bytes(pool, p) for p in src]
        fill(pool, 13)
        for tag in ("r00", "r11"):
            assert all(b.batch_get_v1(keys(64, tag), token_indices(src, pool.page_size)))
            assert [page_bytes(pool, p) for p in src] == want
    finally:
        b.close()
    assert not any(t.name == "kvx-slab-prefault" and t.is_alive() for t in threading.enumerate())


def test_a_put_waits_for_the_prefault_step_over_its_slots(tmp_path, monkeypatch):
    """The prefault zeroes slots ahead of the fill; a put handed slots inside the step being
    zeroed waits for that step to end before it writes, so no zero lands on a stored page (without
    the wait the zeros would overwrite the batch: its pages would fail their checksums)."""
    import threading

    from kvx_sglang.slab import SlabStore

    pool = mha_pool("page_first")
    fill(pool, 14)
    pb = pool.page_size * pool.size_per_token
    entered, release = threading.Event(), threading.Event()
    real = SlabStore._pf_write

    def slow_step(self, zeros, a, n):  # the first step holds until released
        if not release.is_set():
            entered.set()
            assert release.wait(30)
        real(self, zeros, a, n)

    monkeypatch.setattr(SlabStore, "_pf_write", slow_step)
    b = make(tmp_path, pool, capacity_gb=256 * pb / (1 << 30), prefault_gb=64 * pb / (1 << 30))
    try:
        assert entered.wait(30)  # the thread is zeroing slots 0.. (the first step)
        src = list(range(16))
        done: list[list[bool]] = []
        idx = token_indices(src, pool.page_size)
        t = threading.Thread(target=lambda: done.append(b.batch_set_v1(keys(16, "w"), idx)))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not done  # its slots lie in the step: it waits
        release.set()
        t.join(30)
        assert done and all(done[0])
        assert b.pages.prefault_idle(30.0)
        want = [page_bytes(pool, p) for p in src]
        fill(pool, 15)
        assert all(b.batch_get_v1(keys(16, "w"), token_indices(src, pool.page_size)))
        assert [page_bytes(pool, p) for p in src] == want
    finally:
        release.set()
        b.close()


def test_every_write_goes_through_pwritev(tmp_path):
    """Pages are written by the pwritev agent (posix without a mapping), alternate slots per
    transfer, both into never-written slots and into slots reused after eviction (whose pages
    were read back through the mapping: mapped read-only); nothing through the main agent's
    mapping. Every page reads back exact, also after the store is opened again."""
    pool = mha_pool("page_first")
    fill(pool, 21)
    pb = pool.page_size * pool.size_per_token
    b = make(tmp_path, pool, capacity_gb=8 * pb / (1 << 30))  # 8 slots: the third batch evicts
    calls: dict[str, list[np.ndarray]] = {"fill": [], "main": []}
    try:
        slab = b.pages
        assert slab._fill is not None and b.pages.prefault_seconds == 0  # the default: no prefault
        for who, agent in (("fill", slab._fill.agent), ("main", b.agent)):
            real = agent.write

            def spy(local, lidx, remote, ridx, *a, _real=real, _who=who, **kw):
                calls[_who].append(np.asarray(ridx).copy())
                return _real(local, lidx, remote, ridx, *a, **kw)

            agent.write = spy
        src = list(range(4))
        want = {}
        nf = slab.geom.nfrag
        for r in range(3):
            ks = keys(4, f"f{r}")
            fill(pool, 30 + r)
            want[r] = [page_bytes(pool, p) for p in src]
            assert all(b.batch_set_v1(ks, token_indices(src, pool.page_size)))
            assert len(calls["fill"]) == 2 * (r + 1) and not calls["main"]  # two transfers: even, odd slots
            for ridx in calls["fill"][-2:]:
                slots = np.unique(ridx // nf)
                assert len(set((slots % 2).tolist())) == 1 and len(ridx) == 2 * nf  # no two adjacent pages
            if r == 0:
                assert all(b.batch_get_v1(ks, token_indices(src, pool.page_size)))  # read back: mapped
        reused = np.unique(np.concatenate(calls["fill"][-2:]) // nf)
        assert set(reused.tolist()) <= set(np.unique(np.concatenate(calls["fill"][:2]) // nf).tolist())
        fill(pool, 99)
        for r in (1, 2):
            assert all(b.batch_get_v1(keys(4, f"f{r}"), token_indices(src, pool.page_size)))
            assert [page_bytes(pool, p) for p in src] == want[r]
    finally:
        b.close()
    b = make(tmp_path, pool, capacity_gb=8 * pb / (1 << 30))  # reopened: the pages survive
    try:
        fill(pool, 98)
        assert all(b.batch_get_v1(keys(4, "f2"), token_indices(src, pool.page_size)))
        assert [page_bytes(pool, p) for p in src] == want[2]
    finally:
        b.close()


def test_two_instances_share_pages_through_a_kvx_pool(tmp_path, etcd_server):  # noqa: F811
    """Two HiCache backends of two instances (their own host pools and members) over one kvx
    pool in a real etcd: what A stores, B finds and loads, byte for byte."""
    import time

    common = {"pool_etcd": etcd_server.endpoint, "pool_name": f"sg{time.monotonic_ns()}", "pool_timeout_s": 3}
    pa, pb = mha_pool("page_first"), mha_pool("page_first")
    fill(pa, 3)
    cap = 64 * pa.page_size * pa.size_per_token / (1 << 30)
    a = make(tmp_path, pa, "tiered", disk_path=str(tmp_path / "disk-a"), pool_member="inst-a", pool_capacity_gb=cap,
             **common)
    b = make(tmp_path, pb, "tiered", disk_path=str(tmp_path / "disk-b"), pool_member="inst-b", pool_capacity_gb=cap,
             **common)
    try:
        pools = [x.pages.store.remote.pool for x in (a, b)]
        end = time.monotonic() + 5
        while any(len(p.members()) < 2 for p in pools) and time.monotonic() < end:
            time.sleep(0.05)
        assert all(len(p.members()) == 2 for p in pools)
        src = [3, 7, 8, 20, 41, 63]
        ks = keys(len(src), "pool")
        assert b.batch_exists(ks) == 0
        assert a.batch_set_v1(ks, token_indices(src, pa.page_size)) == [True] * len(src)
        assert b.batch_exists(ks) == len(src)  # B's own tiers hold nothing: the pool does
        dst = [50, 2, 30, 31, 5, 6]
        assert b.batch_get_v1(ks, token_indices(dst, pb.page_size)) == [True] * len(src)
        assert [page_bytes(pb, p) for p in dst] == [page_bytes(pa, p) for p in src]
        assert b.pages.store.stats().remote["store"]["hits"] == 2 * len(src)  # two fragments a page
    finally:
        b.close()
        a.close()
