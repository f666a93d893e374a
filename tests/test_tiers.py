"""TieredStore: replay equals the policy simulator, integrity, recovery, events, tiers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import kvx
from kvx.testing import seaweed as _seaweed
from kvx.tiers import DiskTier, HostTier, TieredStore
from kvx.tiers.events import BlockRemoved, BlockStored, decode_batch
from kvx.tiers.replay import load_requests, replay
from kvx.tiers.sim import simulate

seaweedfs = _seaweed.seaweedfs
s3_env = _seaweed.s3_env

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CONV = TRACES / "mooncake_conversation_trace.jsonl"
BB = 256


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n * BB, dtype=np.uint8)


def source(store: TieredStore, data: np.ndarray) -> kvx.PreparedList:
    return store.agent.prepare(kvx.DescList.blocks(store.agent.register(data), BB))


@pytest.mark.skipif(not CONV.exists(), reason="shared traces not present")
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "adaptive"])
def test_replay_through_store_matches_simulator(policy: str) -> None:
    reqs = load_requests(str(CONV), limit=1500)
    res = replay(reqs, 500, policy=policy)
    sim = simulate(reqs, 500, policy)
    assert res["block_refs"] == sim.block_refs
    assert res["hits"] == sim.hits and res["hit_rate"] == pytest.approx(sim.hit_rate)
    assert res["tiers"][0]["used"] <= 500


def test_put_get_roundtrip_and_lookup(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=4), DiskTier(tmp_path, blocks=16)], block_bytes=BB, policy="lru") as st:
        data = blocks(8)
        src = source(st, data)
        assert st.put([b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h"], src) == 8
        r = st.lookup([b"a", b"b", b"c", b"x", b"d"])
        assert r.hits == 3 and r.tiers == (1, 1, 1)  # the oldest four were demoted to disk
        assert st.lookup([b"e", b"f"]).tiers == (0, 0)
        out = np.zeros(8 * BB, np.uint8)
        dst = source(st, out)
        assert st.get([b"a", b"b", b"h"], dst, [0, 1, 7]) == 3
        assert np.array_equal(out[:2 * BB], data[:2 * BB]) and np.array_equal(out[7 * BB:], data[7 * BB:])
        assert st.lookup([b"a"]).tiers == (0,)  # promoted on hit
        with pytest.raises(kvx.BlockNotFound):
            st.get([b"zz"], dst, [0])
        s = st.stats()
        assert s.tiers[0]["used"] == 4 and s.tiers[1]["promoted"] >= 2
        assert 'kvx_store_used{tier="1",medium="DISK"}' in st.prometheus()


def test_chain_rule_descendants_go_first() -> None:
    with TieredStore([HostTier(blocks=6)], block_bytes=BB, policy="lru") as st:
        src = source(st, blocks(6))
        st.put([1, 2, 3], src, [0, 1, 2])  # chain 1 <- 2 <- 3
        st.put([10, 11, 12], src, [3, 4, 5])
        st.put([1], src, [0])  # touch the root of the first chain
        st.put([20, 21], src, [0, 1])
        # whatever was evicted, no stored block lacks its stored parent
        chain = {2: 1, 3: 2, 11: 10, 12: 11, 21: 20}
        for child, parent in chain.items():
            if child in st:
                assert parent in st, f"{child} kept while its parent {parent} was evicted"


def test_corrupt_block_is_a_miss_never_returned(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru") as st:
        data = blocks(4, seed=3)
        src = source(st, data)
        st.put([b"k0", b"k1", b"k2", b"k3"], src)
        st.flush()  # the demotions have landed: what we corrupt next is what the store will read
        slot = st.tiers[1].index[b"k0"][0]
        with open(tmp_path / "slab.bin", "r+b") as f:  # flip a byte behind the store's back
            f.seek(slot * BB + 17)
            b = f.read(1)
            f.seek(slot * BB + 17)
            f.write(bytes([b[0] ^ 0xFF]))
        out = np.full(BB, 7, np.uint8)
        dst = source(st, out)
        with pytest.raises(kvx.BlockNotFound, match="checksum"):
            st.get([b"k0"], dst, [0])
        # disk blocks are read straight into the destination and checked there: a failing one is
        # scrubbed (zeros), so no corrupt byte stays where the caller could take it for data
        assert (out == 0).all()
        assert b"k0" not in st and st.stats().tiers[1]["corrupt"] == 1
        st.get([b"k1"], dst, [0])
        assert np.array_equal(out, data[BB:2 * BB])


def test_verify_host_detects_host_corruption() -> None:
    with TieredStore([HostTier(blocks=2)], block_bytes=BB, verify_host=True) as st:
        st.put([b"x"], source(st, blocks(1)))
        slot = st.tiers[0].index[b"x"][0]
        st.tiers[0].pool[slot * BB] ^= 1  # type: ignore[attr-defined]
        with pytest.raises(kvx.BlockNotFound):
            st.get([b"x"], source(st, np.zeros(BB, np.uint8)), [0])


def test_disk_tier_recovers_after_kill_9(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, str(Path(__file__).parent / "tier_writer.py"), str(tmp_path)],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    from tier_writer import BB as WBB
    from tier_writer import content

    with TieredStore([HostTier(blocks=8), DiskTier(tmp_path, blocks=64)], block_bytes=WBB, policy="lru") as st:
        disk = st.tiers[1]
        assert len(disk.index) > 0, "nothing recovered"
        out = np.zeros(WBB, np.uint8)
        dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(out), WBB))
        intact = missing = 0
        for key in list(disk.index):
            try:
                st.get([key], dst, [0])
            except kvx.BlockNotFound:
                missing += 1  # torn: dropped by its checksum, never returned
                continue
            assert np.array_equal(out, content(key)), f"block {key} recovered with wrong bytes"
            intact += 1
        assert intact > 0 and missing <= 1
        seen: list = []
        st.events.subscribe(seen.extend)
        assert st.announce() == len(disk.index) + len(st.tiers[0].index)
        assert {(e.medium, len(e.block_hashes)) for e in seen} >= {("DISK", len(disk.index))}


def test_disk_tier_write_back_survives_many_kill_9(tmp_path: Path) -> None:
    """kill -9 at random moments of the write-back path (demotions, promotions, flushes), then
    recovery: every block the disk reports is byte-identical, and every block acknowledged
    durable (journaled after ``flush()``) is still there. The same directory is reopened by
    each next writer, so recovery-then-continue is exercised too."""
    from tier_writer import WB_BB, WB_DISK, content

    rng = np.random.default_rng(int(time.time()))
    writer = str(Path(__file__).parent / "tier_writer.py")
    durable: list[range] = []  # keys acknowledged durable, per writer
    start = 0
    kills = 12
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, writer, str(tmp_path), str(start), "writeback"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout is not None
            first = p.stdout.readline().strip()
            if first == "ready":
                time.sleep(float(rng.uniform(0.05, 0.8)))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            out, err = p.communicate(timeout=30)
        lines = out.splitlines()
        assert first == "ready", err[-2000:]
        assert not any(ln.startswith("WRONG") for ln in lines), (lines, err[-2000:])
        acks = [int(ln.split()[1]) for ln in lines if ln.startswith("durable ")]
        if acks:
            durable.append(range(start, acks[-1]))
        with TieredStore([HostTier(blocks=64), DiskTier(tmp_path, blocks=WB_DISK)], block_bytes=WB_BB,
                         policy="lru") as st:
            disk = st.tiers[1]
            keys = sorted(disk.index)  # type: ignore[type-var]
            missing = [k for r in durable for k in r if k not in disk.index]
            assert not missing, f"{len(missing)} blocks acknowledged durable were lost, e.g. {missing[:5]}"
            out_buf = np.zeros(64 * WB_BB, np.uint8)
            dst = st.agent.prepare(kvx.DescList.blocks(st.agent.register(out_buf), WB_BB))
            for c0 in range(0, len(keys), 64):
                chunk = keys[c0:c0 + 64]
                assert st.get(chunk, dst) == len(chunk)  # BlockNotFound here: a torn block
                for i, k in enumerate(chunk):
                    assert np.array_equal(out_buf[i * WB_BB:(i + 1) * WB_BB], content(int(k), WB_BB)), \
                        f"block {k} recovered with wrong bytes"
            start = max(keys) + 1000 if keys else start + 1000
            if len(keys) > WB_DISK // 2:  # keep the disk from evicting (durable = never evicted here)
                break
    assert sum(map(len, durable)) > 0, "no writer ever acknowledged a durable block"


def test_pins_and_lease_expiry() -> None:
    with TieredStore([HostTier(blocks=2)], block_bytes=BB, policy="lru", pin_lease=0.2) as st:
        src = source(st, blocks(4))
        st.put([b"p"], src, [0])
        st.put([b"q"], src, [1])
        assert st.pin([b"p", b"q"]) == 2
        with pytest.raises(kvx.TierFull):
            st.put([b"r"], src, [2])
        assert b"p" in st and b"q" in st
        time.sleep(0.3)  # leases expire
        st.put([b"r"], src, [2])
        assert b"r" in st
        st.pin([b"r"], lease=60)
        st.unpin([b"r"])
        st.put([b"s", b"t"], src, [0, 1])
        assert len(st) == 2


def test_events_callback_and_zmq(tmp_path: Path) -> None:
    zmq = pytest.importorskip("zmq")
    from kvx.tiers import ZmqEventPublisher

    got: list = []
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=4)], block_bytes=BB, policy="lru") as st:
        pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        time.sleep(0.3)  # slow joiner
        st.events.subscribe(got.extend)
        st.events.subscribe(pub)
        src = source(st, blocks(3))
        st.put([1, 2, 3], src)
        kinds = [(type(e).__name__, e.medium) for e in got]
        assert ("BlockStored", "CPU") in kinds and ("BlockRemoved", "CPU") in kinds and ("BlockStored", "DISK") in kinds
        assert sub.poll(3000)
        _topic, seq, payload = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        _ts, evs = decode_batch(payload)
        assert any(isinstance(e, (BlockStored, BlockRemoved)) for e in evs)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send((0).to_bytes(8, "big"))
        seqs = []
        while dealer.poll(3000):
            _, s, p = dealer.recv_multipart()
            if not p:
                break
            seqs.append(int.from_bytes(s, "big"))
        assert seqs and seqs[0] == 0
        for s in (sub, dealer):
            s.close(0)
        pub.close()


def test_write_through_and_delete(tmp_path: Path) -> None:
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=4)], block_bytes=BB, write_through=True) as st:
        src = source(st, blocks(2))
        st.put([b"w1", b"w2"], src)
        assert b"w1" in st.tiers[1].index and b"w2" in st.tiers[1].index
        assert st.delete([b"w1", b"nope"]) == 1
        assert b"w1" not in st and b"w1" not in st.tiers[1].index


def test_bad_arguments() -> None:
    with pytest.raises(kvx.UsageError):
        TieredStore([], block_bytes=BB)
    with pytest.raises(kvx.UsageError):
        TieredStore([HostTier(blocks=2)], block_bytes=0)
    with pytest.raises(kvx.UsageError):
        HostTier()
    with pytest.raises(kvx.UsageError):
        TieredStore([HostTier(blocks=2)], block_bytes=BB, policy="nope")
    st = TieredStore([HostTier(blocks=2)], block_bytes=BB)
    src = source(st, blocks(2))
    with pytest.raises(kvx.UsageError):
        st.put([1, 2], src, [0])
    st.close()
    with pytest.raises(kvx.UsageError):
        st.lookup([1])
    assert zlib.crc32(b"") == 0


def test_three_tiers_host_disk_s3(tmp_path: Path, s3_env: _seaweed.SeaweedFS) -> None:
    from kvx.tiers import ObjectTier

    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=2), ObjectTier("kvx-tiers", blocks=4,
                                                                                   prefix="t3")],
                     block_bytes=BB, policy="lru") as st:
        data = blocks(6, seed=9)
        src = source(st, data)
        assert st.put([f"k{i}" for i in range(6)], src) == 6
        assert st.lookup([f"k{i}" for i in range(6)]).tiers == (2, 2, 1, 1, 0, 0)  # oldest went deepest
        out = np.zeros(BB, np.uint8)
        dst = source(st, out)
        st.get(["k0"], dst, [0])  # from the object tier, verified, promoted
        assert np.array_equal(out, data[:BB])
        assert st.lookup(["k0"]).tiers == (0,)
        s = st.stats()
        assert [t["medium"] for t in s.tiers] == ["CPU", "DISK", "OBJECT"] and s.tiers[2]["promoted"] == 1
