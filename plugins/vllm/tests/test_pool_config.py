"""The pool keys of kv_connector_extra_config (kvx_vllm.pool): parsing, validation, and the
pools a worker and a scheduler open from them, against a real etcd (members in this process)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvx_vllm.config import KVXConnectorConfig
from kvx_vllm.pool import PoolLookup, PoolSettings, group_pool_tier, member_name, pool_name

import kvx
from kvx.pool import Pool, PoolTier
from kvx.testing.etcd import Etcd, etcd_server  # noqa: F401  (fixture)
from kvx.tiers import HostTier, TieredStore

BB = 4096


def test_pool_keys_parse_and_validate() -> None:
    assert KVXConnectorConfig.from_extra({"offload_host_gb": 1}).pool is None
    cfg = KVXConnectorConfig.from_extra({"offload_host_gb": 1, "pool_etcd": "http://10.0.0.5:2379",
                                         "pool_name": "llama", "pool_member": "node-3", "pool_capacity_gb": "2",
                                         "pool_host": "10.0.0.3", "pool_replicas": "2", "pool_timeout_s": 1.5})
    assert cfg.pool == PoolSettings("http://10.0.0.5:2379", "llama", "node-3", 2 << 30, "10.0.0.3", 2, 1.5)
    assert cfg.offload_host_bytes == 1 << 30  # the other keys still parse
    assert pool_name(cfg.pool, 2, 1, 0) == "llama.tp2r1.g0"
    assert member_name(cfg.pool, 1, 0) == "node-3-r1-g0"
    assert member_name(PoolSettings("http://e:1"), 0, 0).endswith("-r0-g0")  # host-pid default
    bad = [
        ({"pool_etcd": "http://e:1"}, "offloading on"),  # no host tier
        ({"offload_host_gb": 1, "offload": False, "pool_etcd": "http://e:1"}, "offloading on"),
        ({"offload_host_gb": 1, "pool_etcd": "e:2379"}, "http"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_replicas": 9}, "1..8"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_replicas": True}, "1..8"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_capacity_gb": -1}, "non-negative"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_capacity_gb": "lots"}, "number"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_timeout_s": 0}, "positive"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_name": "a/b"}, "without '/'"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_member": ""}, "non-empty"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_host": "0.0.0.0"}, "wildcard"),
        ({"offload_host_gb": 1, "pool_etcd": "http://e:1", "pool_size": 3}, "unknown"),
        ({"offload_host_gb": 1, "pool_name": "x"}, "without pool_etcd"),
        ({"offload_host_gb": 1, "pool": "x"}, "unknown"),
    ]
    for extra, msg in bad:
        with pytest.raises(ValueError, match=msg):
            KVXConnectorConfig.from_extra(extra)


@pytest.mark.services
def test_worker_tiers_and_scheduler_lookup_share_one_pool(etcd_server: Etcd) -> None:  # noqa: F811
    s = PoolSettings(etcd_server.endpoint, name=f"cfg-{time.monotonic_ns()}", member="eng-a",
                     capacity_bytes=32 * BB, timeout_s=3.0)
    sb = PoolSettings(s.etcd, name=s.name, member="eng-b", capacity_bytes=32 * BB, timeout_s=3.0)
    with kvx.Agent("worker-a") as wa, kvx.Agent("worker-b") as wb:
        ta = group_pool_tier(s, tp_size=1, rank=0, group=0, ngroups=1, block_bytes=BB, agent=wa)
        tb = group_pool_tier(sb, tp_size=1, rank=0, group=0, ngroups=1, block_bytes=BB, agent=wb)
        assert isinstance(ta, PoolTier) and isinstance(tb, PoolTier)
        look = PoolLookup(s, 1, (0,))
        sa = TieredStore([HostTier(blocks=8)], block_bytes=BB, agent=wa, remote=ta)
        sb_ = TieredStore([HostTier(blocks=8)], block_bytes=BB, agent=wb, remote=tb)
        try:
            pa: Pool = ta.pool
            assert pa.capacity == 32 * BB and pa.name == "eng-a-r0-g0"
            end = time.monotonic() + 5
            views = (look.pools[(0, 0)], ta.pool, tb.pool)  # each reads the member list every second
            while any(len(p.members()) < 2 for p in views) and time.monotonic() < end:
                time.sleep(0.05)
            assert all(p.members() == ["eng-a-r0-g0", "eng-b-r0-g0"] for p in views)
            src = kvx.alloc_host(6 * BB)
            src[:] = np.random.default_rng(1).integers(0, 256, src.size, dtype=np.uint8)
            keys = [i.to_bytes(32, "little") + b"\0\0\0\0" for i in range(6)]  # as vLLM's, with the group
            assert look.lookup([keys]) == 0
            sa.put(keys, wa.prepare(kvx.DescList.blocks(wa.register(src), BB)))
            assert look.lookup([keys]) == 6 and look.lookup([keys[:3] + [b"x" * 36]]) == 3
            dst = kvx.alloc_host(6 * BB)
            pd = wb.prepare(kvx.DescList.blocks(wb.register(dst), BB))
            assert sb_.get(keys, pd) == 6
            assert np.array_equal(src, dst)
            with pytest.raises(kvx.UsageError, match="only looks up"):
                look.pools[(0, 0)].get(keys, pd, range(6))
        finally:
            look.close()
            sb_.close()
            sa.close()
        assert ta.pool.closed and tb.pool.closed  # the store's close left the pool
        assert not wa.closed  # the worker's agent is the worker's


@pytest.mark.services
def test_scheduler_lookup_counts_what_every_rank_holds(etcd_server: Etcd) -> None:  # noqa: F811
    """TP 2: each rank keeps its heads in a pool of its own; the scheduler's lookup is the prefix
    that both ranks' pools hold (a block held by rank 0's pool only would be a failed load)."""
    s = PoolSettings(etcd_server.endpoint, name=f"tp2-{time.monotonic_ns()}", member="eng",
                     capacity_bytes=32 * BB, timeout_s=3.0)
    with kvx.Agent("w0") as w0, kvx.Agent("w1") as w1:
        tiers = [group_pool_tier(s, tp_size=2, rank=r, group=0, ngroups=1, block_bytes=BB, agent=w)
                 for r, w in ((0, w0), (1, w1))]
        look = PoolLookup(s, 2, (0,))
        try:
            assert sorted(look.pools) == [(0, 0), (0, 1)]
            end = time.monotonic() + 5
            while any(len(p.members()) < 1 for p in look.pools.values()) and time.monotonic() < end:
                time.sleep(0.05)
            keys = [i.to_bytes(32, "little") + b"\0\0\0\0" for i in range(6)]
            src = kvx.alloc_host(6 * BB)
            src[:] = np.random.default_rng(2).integers(0, 256, src.size, dtype=np.uint8)
            for t, w, n in ((tiers[0], w0, 6), (tiers[1], w1, 4)):
                p = t.pool
                ps = w.prepare(kvx.DescList.blocks(w.register(src), BB))
                assert p.put(keys[:n], ps, range(n)) == n
                if n == 6:  # rank 0 holds all six, rank 1 none yet
                    assert look.pools[(0, 0)].lookup(keys) == 6 and look.lookup([keys]) == 0
            assert look.lookup([keys]) == 4
        finally:
            look.close()
            for t in tiers:
                t.pool.close()
