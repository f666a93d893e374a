"""The packed object tier against a real SeaweedFS: one PUT per pack, ranged reads, checksums,
compaction, journal recovery and kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.testing import seaweed as _seaweed
from kvx.tiers import HostTier, ObjectTier, TieredStore

seaweedfs = _seaweed.seaweedfs
s3_env = _seaweed.s3_env

BB = 512
BUCKET = "kvx-packs"


def content(key: int) -> np.ndarray:
    return np.random.default_rng(key + 1000).integers(0, 256, BB, dtype=np.uint8)


def lists(st: TieredStore, n: int) -> tuple[np.ndarray, kvx.PreparedList]:
    buf = np.zeros(n * BB, np.uint8)
    return buf, st.agent.prepare(kvx.DescList.blocks(st.agent.register(buf), BB))


def put_keys(st: TieredStore, keys: list[int]) -> int:
    buf, src = lists(st, len(keys))
    for i, k in enumerate(keys):
        buf[i * BB:(i + 1) * BB] = content(k)
    return st.put(keys, src)


def check_all(st: TieredStore, keys: list[int]) -> None:
    """Every key reads back byte-identical (one get per key: each may promote)."""
    out, dst = lists(st, 1)
    for k in keys:
        assert st.get([k], dst, [0]) == 1
        assert np.array_equal(out, content(k)), f"block {k} came back wrong"


def objects(sw: _seaweed.SeaweedFS, prefix: str) -> dict[str, int]:
    c = sw.client()
    out: dict[str, int] = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = o["Size"]
    return out


class CountingStore(TieredStore):
    """Counts whole-pack writes (each is one PUT)."""

    pack_writes = 0

    def _move_pack(self, batch: list, staging: Any) -> list[bool]:  # type: ignore[override]
        type(self).pack_writes += 1
        return super()._move_pack(batch, staging)


def test_demotions_are_one_put_per_pack_and_read_back_by_range(s3_env: _seaweed.SeaweedFS) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    CountingStore.pack_writes = 0
    with CountingStore([HostTier(blocks=4), ObjectTier(BUCKET, blocks=256, prefix=prefix, pack_blocks=16)],
                       block_bytes=BB, policy="lru") as st:
        st.linger = 30.0  # packs are written when full (or by flush), never early
        assert put_keys(st, list(range(100))) == 100
        st.flush()
        assert CountingStore.pack_writes == 6  # 96 demoted blocks, 16 per object
        objs = objects(s3_env, prefix)
        assert len(objs) == 6 and set(objs.values()) == {16 * BB}
        assert st.lookup(list(range(100))).tiers == (1,) * 96 + (0,) * 4
        check_all(st, list(range(100)))  # ranged GETs of single blocks inside the packs
        assert st.stats().tiers[1]["promoted"] >= 96


def test_flush_writes_a_partial_pack(s3_env: _seaweed.SeaweedFS) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    CountingStore.pack_writes = 0
    with CountingStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=64, prefix=prefix, pack_blocks=16)],
                       block_bytes=BB, policy="lru") as st:
        st.linger = 30.0
        put_keys(st, [1, 2, 3, 4, 5])
        st.flush(timeout=10)
        assert CountingStore.pack_writes == 1 and len(objects(s3_env, prefix)) == 1
        check_all(st, [1, 2, 3])


def test_a_corrupt_pack_is_a_miss_never_returned(s3_env: _seaweed.SeaweedFS) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    with TieredStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=64, prefix=prefix, pack_blocks=8)],
                     block_bytes=BB, policy="lru") as st:
        put_keys(st, list(range(18)))  # 16 demoted: two full packs
        st.flush()
        t = st.tiers[1]
        slot = t.index[3][0]
        name = f"{prefix}/pack-{slot // 8}"
        c = s3_env.client()
        image = bytearray(c.get_object(Bucket=BUCKET, Key=name)["Body"].read())
        image[(slot % 8) * BB + 7] ^= 0xFF  # one bit of block 3, behind the store's back
        c.put_object(Bucket=BUCKET, Key=name, Body=bytes(image))
        out, dst = lists(st, 1)
        out[:] = 7
        with pytest.raises(kvx.BlockNotFound):
            st.get([3], dst, [0])
        assert (out == 7).all() and 3 not in st and st.stats().tiers[1]["corrupt"] == 1
        check_all(st, [k for k in range(18) if k != 3])  # its pack neighbours are intact


def test_compaction_frees_fragmented_packs(s3_env: _seaweed.SeaweedFS) -> None:
    """Hot blocks kept alive in the object tier by hits, cold ones streaming through: packs end
    up mostly dead, the store compacts them, the tier never holds more objects than its packs,
    and every stored block reads back intact."""
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    with TieredStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=64, prefix=prefix, pack_blocks=8)],
                     block_bytes=BB, policy="lru", writeback_depth=16, get_chunk=8) as st:
        t = st.tiers[1]
        assert isinstance(t, ObjectTier)
        hot: list[int] = []
        key = 0
        for rnd in range(150):
            new = list(range(key, key + 6))
            key += 6
            put_keys(st, new)
            if len(hot) < 24:
                hot.append(new[0])  # one per round: each hot block pins a different pack
            put_keys(st, [h for h in hot if h in st])  # hits: the policy keeps them
        st.flush()
        assert t.stats.compacted > 0, "no compaction happened"
        assert len(objects(s3_env, prefix)) <= t.npacks
        assert len(t.index) <= t.capacity
        assert len(t.index) > 40
        packs: dict[int, bytes] = {}  # every stored block, read straight from its pack object
        c = s3_env.client()
        for k, (slot, _crc) in t.index.items():
            p = slot // 8
            if p not in packs:
                packs[p] = c.get_object(Bucket=BUCKET, Key=f"{prefix}/pack-{p}")["Body"].read()
            got = np.frombuffer(packs[p], np.uint8)[(slot % 8) * BB:(slot % 8 + 1) * BB]
            assert np.array_equal(got, content(int(k))), f"block {k} wrong in its pack"  # type: ignore[call-overload]
        check_all(st, hot[:4])  # and through the store


def test_journal_recovers_the_object_tier(s3_env: _seaweed.SeaweedFS, tmp_path: Path) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"

    def store() -> TieredStore:
        return TieredStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=64, prefix=prefix, pack_blocks=8,
                                                           journal=tmp_path)], block_bytes=BB, policy="lru")

    with store() as st:
        put_keys(st, list(range(30)))
    with store() as st:
        assert st.lookup(list(range(28))).tiers == (1,) * 28  # the host tier's two are gone
        check_all(st, list(range(28)))
    # another pack layout: the old journal means nothing, nothing is served from it
    with TieredStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=64, prefix=prefix, pack_blocks=4,
                                                     journal=tmp_path)], block_bytes=BB, policy="lru") as st:
        assert len(st) == 0


def test_object_tier_survives_many_kill_9(s3_env: _seaweed.SeaweedFS, tmp_path: Path) -> None:
    """kill -9 of a writer whose blocks go down to packed objects (with reads mixed in) at random
    moments; then recovery: every block the object tier reports is byte-identical, and every block
    acknowledged durable (flushed, and not moved up by a read since) is still there."""
    from tier_writer import OBJ_BB, OBJ_BLOCKS, object_store
    from tier_writer import content as wcontent

    rng = np.random.default_rng(int(time.time()))
    writer = str(Path(__file__).parent / "tier_writer.py")
    jdir = tmp_path / "journal"
    durable: set[int] = set()
    acked = 0
    start = 0
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for _ in range(8):
        p = subprocess.Popen([sys.executable, writer, str(jdir), str(start), "objects"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert p.stdout is not None
            first = p.stdout.readline().strip()
            if first == "ready":
                time.sleep(float(rng.uniform(0.3, 2.0)))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=30)
        lines = out.splitlines()
        assert first == "ready", err[-2000:]
        assert not any(ln.startswith("WRONG") for ln in lines), (lines, err[-2000:])
        read = {int(ln.split()[1]) for ln in lines if ln.startswith("read ")}
        acks = [int(ln.split()[1]) for ln in lines if ln.startswith("durable ")]
        durable -= read
        if acks:
            durable |= set(range(start, acks[-1])) - read
            acked += 1
        with object_store(str(jdir)) as st:
            obj = st.tiers[1]
            assert isinstance(obj, ObjectTier)
            keys = sorted(obj.index)  # type: ignore[type-var]
            missing = sorted(durable - set(keys))
            assert not missing, f"{len(missing)} blocks acknowledged durable were lost, e.g. {missing[:5]}"
            c = s3_env.client()
            pb = obj.pack_blocks
            packs: dict[int, bytes] = {}
            for k in keys:  # every block the tier reports, straight from its pack: byte-identical
                slot = obj.index[k][0]
                if slot // pb not in packs:
                    packs[slot // pb] = c.get_object(Bucket="kvx-crash", Key=f"crash/pack-{slot // pb}")["Body"].read()
                got = np.frombuffer(packs[slot // pb], np.uint8)[(slot % pb) * OBJ_BB:(slot % pb + 1) * OBJ_BB]
                assert np.array_equal(got, wcontent(int(k), OBJ_BB)), f"block {k} recovered with wrong bytes"
            buf = np.zeros(OBJ_BB, np.uint8)
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(buf), OBJ_BB))
            for k in keys[:: max(1, len(keys) // 5)]:  # and a few through the store (checksummed)
                assert st.get([k], dst, [0]) == 1
                assert np.array_equal(buf, wcontent(int(k), OBJ_BB))
                durable.discard(int(k))  # the get moved it up
            start = (max(keys) + 1000) if keys else start + 1000
            if len(keys) > OBJ_BLOCKS // 2:  # keep the tier from evicting (durable = never evicted here)
                break
    assert acked, "no writer ever acknowledged a durable block"


@pytest.mark.parametrize("kw", [{"pack_blocks": 0}, {"pack_blocks": True}, {"pack_blocks": "8"}, {"journal": 12},
                                {"prefix": None}, {"bucket": ""}])
def test_object_tier_arguments_are_checked(kw: dict) -> None:
    args = {"bucket": BUCKET, "blocks": 8, **kw}
    with pytest.raises(kvx.UsageError):
        ObjectTier(**args)


def test_one_block_per_object_still_works(s3_env: _seaweed.SeaweedFS) -> None:
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    with TieredStore([HostTier(blocks=2), ObjectTier(BUCKET, blocks=16, prefix=prefix, pack_blocks=1)],
                     block_bytes=BB, policy="lru") as st:
        put_keys(st, list(range(10)))
        st.flush()
        assert set(objects(s3_env, prefix).values()) == {BB} and len(objects(s3_env, prefix)) == 8
        check_all(st, list(range(10)))
