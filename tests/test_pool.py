"""kvx.pool: placement, the owner's bookkeeping (fuzzed), and members over real etcd -- in this
process and in separate processes (kill -9) -- with real tcp transfers."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvx
from kvx._native import nh64
from kvx.errors import ProtocolError
from kvx.memory import MemoryKind
from kvx.pool import Placement, Pool, PoolConfig
from kvx.pool.owner import BUSY, HELD, LOCAL, REFUSED, Owner
from kvx.pool.placement import key64
from kvx.testing.etcd import Etcd, etcd_server  # noqa: F401  (fixture)

BB = 4096
FAST = PoolConfig(refresh=0.1, ttl=2, timeout=3.0, retry=0.5, policy="lru")


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(8, "little") for i in range(n)]


# ---- placement ---------------------------------------------------------------------------
def test_placement_is_deterministic_weighted_and_moves_only_what_it_must() -> None:
    names = [f"m{i}" for i in range(8)]
    k = key64(_keys(40000))
    a = Placement(names, [1.0] * 8).owners(k)[:, 0]
    b = Placement(list(reversed(names)), [1.0] * 8).owners(k)[:, 0]
    pa = Placement(names, [1.0] * 8)
    assert np.array_equal(np.asarray(pa.names)[a], np.asarray(Placement(list(reversed(names)), [1.0] * 8).names)[b])
    load = np.bincount(a, minlength=8)
    assert load.max() / load.mean() < 1.1
    # weights: a member of twice the capacity takes about twice the keys
    w = Placement(names, [2.0] + [1.0] * 7).owners(k)[:, 0]
    share = np.mean(w == Placement(names, [2.0] + [1.0] * 7).index("m0"))
    assert 0.9 * 2 / 9 < share < 1.1 * 2 / 9
    # a joining member takes ~1/N of the keys, all of them moving to it
    before = np.asarray(pa.names)[a]
    pj = Placement([*names, "new"], [1.0] * 9)
    after = np.asarray(pj.names)[pj.owners(k)[:, 0]]
    moved = before != after
    assert set(after[moved]) == {"new"}
    assert abs(moved.mean() - 1 / 9) < 0.02
    # a leaving member gives up only its own keys
    pl = Placement(names[1:], [1.0] * 7)
    left = np.asarray(pl.names)[pl.owners(k)[:, 0]]
    assert np.array_equal(left != before, before == "m0")
    # a key's digest is its own: the same alone and in any batch
    ks = [b"a", b"chk-0-2", b"x" * 64, b"a\0", (5).to_bytes(16, "little")]
    assert key64(ks).tolist() == [int(key64([x])[0]) for x in ks]
    assert len(set(key64(ks).tolist())) == len(ks)
    # replicas are distinct and the first is the single owner
    r = pa.owners(k[:1000], 3)
    assert r.shape == (1000, 3) and np.array_equal(r[:, 0], a[:1000])
    assert all(len(set(row)) == 3 for row in r.tolist())


# ---- the owner ------------------------------------------------------------------------------
def _owner(n: int = 8, **kw: Any) -> Owner:
    return Owner(n, BB, 1 << 20, policy="lru", **kw)


def test_owner_grant_commit_lookup_release_and_eviction() -> None:
    o = _owner(4)
    ks = _keys(6)
    gid, codes, why = o.grant(LOCAL, ks[:4], [None, *ks[:3]])
    assert codes == [codes[0], codes[1], codes[2], codes[3]] and min(codes) >= 0 and why == ""
    assert o.commit(LOCAL, gid, codes, [1, 2, 3, 4], True) == 4
    o.check()
    # replayed grant: refused, nothing changes
    with pytest.raises(ProtocolError):
        o.commit(LOCAL, gid, codes, [1, 2, 3, 4], True)
    n, slots, gens, sums, lid = o.lookup(LOCAL, ks[:5], True)
    assert n == 4 and sums == [1, 2, 3, 4] and lid is not None
    # everything leased: a put to the full owner is refused at once, with a reason
    gid2, codes2, why2 = o.grant(LOCAL, ks[4:6], [ks[3], ks[4]])
    assert codes2 == [REFUSED, REFUSED] and "full" in why2
    assert o.grant(LOCAL, ks[:1], [None])[1] == [HELD]
    assert o.release(LOCAL, lid) is True
    assert o.release(LOCAL, lid) is False  # spent
    # now it evicts (leaves first: the chain's tail goes before its head)
    gid3, codes3, _ = o.grant(LOCAL, ks[4:5], [ks[3]])
    assert codes3[0] >= 0 and o.stats.evicted == 1 and ks[3] not in o.index
    o.check()
    # a second client's grant for a block in flight is BUSY
    assert o.grant("other", ks[4:5], [None])[1] == [BUSY]
    # a foreign client cannot commit the grant; its owner aborts it cleanly
    with pytest.raises(ProtocolError):
        o.commit("other", gid3, codes3, [9], True)
    assert o.commit(LOCAL, gid3, codes3, [9], False) == 0
    o.check()
    assert o.lookup(LOCAL, ks, False)[0] == 3


def test_owner_expiry_and_lost_lease() -> None:
    o = _owner(2, grant_ttl=1.0, lease_ttl=1.0)
    ks = _keys(4)
    gid, codes, _ = o.grant(LOCAL, ks[:2], [None, ks[0]])
    o.expire(time.monotonic() + 2)  # the writer never committed: slots come back
    assert not o.grants and len(o.free) == 2
    with pytest.raises(ProtocolError):
        o.commit(LOCAL, gid, codes, [1, 2], True)
    gid, codes, _ = o.grant(LOCAL, ks[:2], [None, ks[0]])
    o.commit(LOCAL, gid, codes, [1, 2], True)
    n, slots, gens, sums, lid = o.lookup(LOCAL, ks[:2], True)
    assert lid is not None
    o.expire(time.monotonic() + 2)  # the lease ran out mid-read ...
    gid, c2, _ = o.grant(LOCAL, ks[2:4], [None, None])  # ... and its slots were reused
    assert sorted(c2) == sorted(slots)
    assert o.release(LOCAL, lid) is False  # the reader learns its bytes may be another block's
    o.check()
    o.drop_client(LOCAL)  # a client that goes away leaves nothing held
    assert not o.grants and not o.leases
    o.check()


def test_owner_guard_lets_the_data_plane_into_open_slots_only() -> None:
    o = _owner(8)
    base = o.base
    addr = np.array([base + 2 * BB, base + 2 * BB, base + 5 * BB, 0x10], dtype=np.uint64)
    nb = np.array([BB, 2 * BB, BB, 8], dtype=np.uint64)
    slots = np.array([1, 1, 1, 3], dtype=np.int64)
    assert (o.guard(MemoryKind.HOST, addr, nb, slots)[:3] == -1).all()
    gid, codes, _ = o.grant(LOCAL, _keys(1), [None])
    s = codes[0]
    a2 = np.array([base + s * BB, base + s * BB + 100, base + s * BB, 0x10], dtype=np.uint64)
    n2 = np.array([BB, 50, BB + 1, 8], dtype=np.uint64)
    out = o.guard(MemoryKind.HOST, a2, n2, slots)
    assert out.tolist() == [1, 1, -1, 3]  # inside the grant; spilling into the next slot; not the arena
    o.commit(LOCAL, gid, codes, [0], True)
    assert o.guard(MemoryKind.HOST, a2[:1], n2[:1], slots[:1]).tolist() == [-1]  # committed: closed again


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(0, 15), max_size=16),
       st.lists(st.tuples(st.integers(-2 * BB, 18 * BB), st.integers(1, 3 * BB)), min_size=1, max_size=12))
def test_owner_guard_fuzzed_against_a_reference(open_slots: set[int], descs: list[tuple[int, int]]) -> None:
    o = _owner(16)
    for s in open_slots:
        o.open[s] = 1
    addr = np.array([max(0, o.base + a) for a, _ in descs], dtype=np.uint64)
    nb = np.array([n for _, n in descs], dtype=np.uint64)
    slots = np.arange(1, len(descs) + 1, dtype=np.int64)
    out = o.guard(MemoryKind.HOST, addr, nb, slots)
    for i, (a, n) in enumerate(zip(addr.tolist(), nb.tolist())):
        lo, hi = o.base, o.base + 16 * BB
        if a + n <= lo or a >= hi:
            assert out[i] == slots[i]  # not the arena: left to the agent's own check
            continue
        first = (max(a, lo) - lo) // BB
        last = (min(a + n, hi) - 1 - lo) // BB
        ok = all(s in open_slots for s in range(first, last + 1))
        assert out[i] == (slots[i] if ok else -1), (a - lo, n, sorted(open_slots))


_bkey = st.binary(min_size=0, max_size=70)
_val = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 65), _bkey, st.text(max_size=8),
                 st.lists(st.one_of(_bkey, st.integers(-3, 20), st.none()), max_size=12))
_msg = st.fixed_dictionaries({"t": st.sampled_from(["grant", "commit", "lookup", "release", "x"])},
                             optional={f: _val for f in ("keys", "parents", "gid", "slots", "sums", "ok", "lease",
                                                         "lid")})
# the same-node requests (kvx.pool.near), their fields as random as the others
_near_msg = st.fixed_dictionaries({"t": st.sampled_from(["near", "fetch", "store"])},
                                  optional={f: _val for f in ("keys", "parents", "sums", "addrs", "addr", "rows",
                                                              "meta")})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_msg, min_size=1, max_size=12), st.integers(0, 3), st.sampled_from(["lru", "s3fifo", "adaptive"]))
def test_owner_fuzzed_requests_are_served_or_refused_and_never_break_it(msgs: list[dict[str, Any]], seed: int,
                                                                        policy: str) -> None:
    o = Owner(4, BB, 1 << 20, policy=policy, max_batch=8)
    rng = np.random.default_rng(seed)
    gids: list[bytes] = []
    for m in msgs:
        # now and then replay an id the owner handed out (a replayed grant / lease)
        if gids and rng.random() < 0.3:
            m = {**m, "gid": gids[int(rng.integers(len(gids)))]}
        try:
            t, rep = o.handle("c", m)
        except ProtocolError:
            o.check()
            continue
        if t == "granted":
            gids.append(rep["gid"])
        o.check()
    o.drop_client("c")
    o.check()
    assert not o.grants and not o.leases and (o.open == 0).all()


_op = st.tuples(st.sampled_from(["put", "commit", "abort", "lookup", "lease", "release", "expire", "drop"]),
                st.lists(st.integers(0, 9), min_size=1, max_size=5), st.integers(0, 2))


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, min_size=1, max_size=40), st.sampled_from(["lru", "s3fifo", "adaptive"]), st.booleans())
def test_owner_valid_sequences_keep_every_invariant(ops: list[tuple[str, list[int], int]], policy: str,
                                                    disk: bool) -> None:
    """Random but well-formed grant/commit/lookup/lease/release/expiry sequences of three
    clients over ten keys, with and without a disk tier (6 blocks) below the arena (4): the
    bookkeeping stays exact, a leased block is never evicted, a released lease that held reports
    so, and a block restored from disk is never corrupt."""
    import tempfile

    from kvx._native import nh64
    from kvx.pool.disk import DiskSpill

    if disk:
        arena = kvx.alloc_host(4 * BB)  # zeros: every block's checksum is the zero block's
        tmp = tempfile.TemporaryDirectory()
        spill = DiskSpill(os.path.join(tmp.name, "slab"), 6 * BB, BB, policy)
        o = Owner(4, BB, int(arena.ctypes.data), policy=policy, max_batch=8, disk=spill)
        want = nh64(memoryview(np.zeros(BB, np.uint8)))
    else:
        o = Owner(4, BB, 1 << 20, policy=policy, max_batch=8)
        want = 7
    grants: list[tuple[str, bytes, list[int]]] = []
    leases: list[tuple[str, bytes, list[bytes]]] = []
    for op, ks, who in ops:
        client = f"c{who}"
        keys = [b"key%d" % k for k in dict.fromkeys(ks)]
        if op == "put":
            gid, codes, _ = o.grant(client, keys, [None, *keys[:-1]])
            slots = [c for c in codes if c >= 0]
            if slots:
                grants.append((client, gid, slots))
        elif op in ("commit", "abort") and grants:
            client, gid, slots = grants.pop(0)
            try:
                o.commit(client, gid, slots, [want] * len(slots), op == "commit")
            except ProtocolError:
                pass  # expired meanwhile
        elif op in ("lookup", "lease"):
            n, slots, gens, sums, lid = o.lookup(client, keys, op == "lease")
            assert n <= len(keys) and all(x == want for x in sums)
            if lid is not None:
                leases.append((client, lid, keys[:n]))
        elif op == "release" and leases:
            client, lid, held = leases.pop(0)
            if o.release(client, lid):
                assert all(k in o.index for k in held)
        elif op == "expire":
            o.expire(time.monotonic() + 60)
            grants.clear()
            leases.clear()
        elif op == "drop":
            o.drop_client(client)
            grants = [g for g in grants if g[0] != client]
            leases = [x for x in leases if x[0] != client]
        o.check()
        for _c, _lid, held in leases:  # every live lease's blocks are still there
            assert all(k in o.index for k in held)
    if disk:
        assert spill.stats.corrupt == 0 and spill.stats.errors == 0
        spill.close()
        tmp.cleanup()


def test_owner_refuses_oversized_batches() -> None:
    o = _owner(4, max_batch=8)
    with pytest.raises(ProtocolError, match="batch limit"):
        o.handle("c", {"t": "lookup", "keys": _keys(9), "lease": True})
    with pytest.raises(ProtocolError):
        o.handle("c", {"t": "grant", "keys": [b"x" * 65], "parents": [None]})
    o.check()


# ---- members in this process (tcp over loopback) ------------------------------------------
@pytest.fixture()
def trio(etcd_server: Etcd, request: Any) -> Iterator[tuple[Pool, Pool, Pool]]:  # noqa: F811
    """Two storing members and a client in this process. Owners serve it the same-node way
    (``near``) unless the test is parametrized with ``trio="tcp"``."""
    name = request.node.name[-40:].replace("[", "_").replace("]", "_")
    kw = {"etcd": etcd_server.endpoint, "pool": name, "block_bytes": BB}
    opts = FAST if getattr(request, "param", "near") == "near" else dataclasses.replace(FAST, near=False)
    a = Pool("a", capacity=64 * BB, options=opts, **kw)  # type: ignore[arg-type]
    b = Pool("b", capacity=64 * BB, options=opts, **kw)  # type: ignore[arg-type]
    c = Pool("c", capacity=0, options=opts, **kw)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while any(p.members() != ["a", "b"] for p in (a, b, c)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.members() == ["a", "b"] for p in (a, b, c))
        yield a, b, c
    finally:
        for p in (c, b, a):
            p.close()


def _bufs(p: Pool, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, kvx.PreparedList, kvx.PreparedList]:
    src = kvx.alloc_host(n * BB)
    src[:] = np.random.default_rng(seed).integers(0, 256, src.size, dtype=np.uint8)
    dst = kvx.alloc_host(n * BB)
    ps = p.agent.prepare(kvx.DescList.blocks(p.agent.register(src), BB))
    pd = p.agent.prepare(kvx.DescList.blocks(p.agent.register(dst), BB))
    return src, dst, ps, pd


@pytest.mark.services
@pytest.mark.parametrize("trio", ["near", "tcp"], indirect=True)
def test_put_get_lookup_roundtrip_over_two_owners(trio: tuple[Pool, Pool, Pool]) -> None:
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 48)
    ks = _keys(48)
    assert c.lookup(ks) == 0
    assert c.get(ks, pd, range(48)) == 0
    assert c.put(ks, ps, range(48)) == 48
    assert c.put(ks, ps, range(48)) == 48  # held already: nothing written twice
    assert a.stats()["owner"]["blocks"] + b.stats()["owner"]["blocks"] == 48
    assert 0 < a.stats()["owner"]["blocks"] < 48
    assert c.lookup(ks) == 48 and a.lookup(ks) == 48
    assert c.get(ks, pd, np.arange(48)) == 48
    assert np.array_equal(src, dst)
    # scattered indices both sides, and a prefix
    dst[:] = 0
    assert c.get(ks[:10], pd, np.arange(10)[::-1]) == 10
    for i in range(10):
        assert np.array_equal(dst[(9 - i) * BB:(10 - i) * BB], src[i * BB:(i + 1) * BB])
    # the same from a storing member (its own blocks by local copy, the other's over tcp)
    s2, d2, ps2, pd2 = _bufs(a, 48, seed=1)
    assert a.get(ks, pd2, range(48)) == 48 and np.array_equal(d2, src)
    # a missing block ends the prefix
    ks2 = [*ks[:5], b"nope", *ks[6:]]
    assert c.get(ks2, pd, range(48)) == 5 and c.lookup(ks2) == 5
    for p in (a, b):
        p.owner.check()  # type: ignore[union-attr]
        assert p.stats()["owner"]["leases_active"] == 0


@pytest.mark.services
@pytest.mark.parametrize("trio", ["near", "tcp"], indirect=True)
def test_corrupt_block_is_a_miss_never_wrong_bytes(trio: tuple[Pool, Pool, Pool]) -> None:
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 16)
    ks = _keys(16, b"corrupt")
    assert c.put(ks, ps, range(16)) == 16
    # flip a byte of block 7 in its owner's arena (as a stray writer would)
    owner = next(p for p in (a, b) if ks[7] in p.owner.index)  # type: ignore[union-attr]
    slot = owner.owner.index[ks[7]]  # type: ignore[union-attr]
    owner._arena[slot * BB + 100] ^= 0xFF
    assert c.get(ks, pd, range(16)) == 7
    assert c.stats()["corrupt"] == 1
    assert np.array_equal(dst[:7 * BB], src[:7 * BB])
    if c.opts.near:  # the owners copied into the landings, the client checked as it took them
        assert c.stats()["near_blocks"] >= 8 and "sums_in_copy" not in c.stats()
    else:  # a client reads over tcp: the checksums were taken as the blocks landed, not re-read
        assert c.stats()["sums_in_copy"] >= 8 and c.stats().get("sums_reread", 0) == 0


@pytest.mark.services
@pytest.mark.parametrize("trio", ["tcp"], indirect=True)
def test_get_verifies_against_the_checksums_taken_in_the_receive(trio: tuple[Pool, Pool, Pool]) -> None:
    """The digests the tcp receive took are the nh64 of the landed blocks, and a get uses them
    (no second pass) for what it read over tcp."""
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 12)
    ks = _keys(12, b"digest")
    assert c.put(ks, ps, range(12)) == 12
    assert c.get(ks, pd, range(12)) == 12 and np.array_equal(src, dst)
    twin = c._twin(pd)
    assert twin is not None
    dig = twin[1]
    assert [int(d) for d in dig[:12]] == [nh64(dst[i * BB:(i + 1) * BB].tobytes()) for i in range(12)]
    assert c.stats()["sums_in_copy"] == 12
    # a storing member reads its own blocks by local copy: those are re-read
    _, d2, _, pd2 = _bufs(a, 12, seed=1)
    assert a.get(ks, pd2, range(12)) == 12 and np.array_equal(d2, src)
    st = a.stats()
    assert st["sums_reread"] == st["owner"]["blocks"] > 0 and st["sums_in_copy"] == 12 - st["sums_reread"]


@pytest.mark.services
@pytest.mark.parametrize("trio", ["tcp"], indirect=True)
def test_data_plane_refuses_slots_not_granted_or_leased(trio: tuple[Pool, Pool, Pool]) -> None:
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 4)
    ks = _keys(4, b"guard")
    assert c.put(ks, ps, range(4)) == 4
    conn = c._conn(c._place[1][0])  # type: ignore[index]
    assert conn is not None
    target = a if conn.member.name == "a" else b
    before = bytes(target._arena)
    # a forged write into any slot (held or free): refused by the target, nothing lands
    for slots in ([0], [5, 6], list(range(20))):
        with pytest.raises(kvx.RemoteError):
            c.agent.write(ps, [0] * len(slots), conn.arena, slots).wait(5)
        with pytest.raises(kvx.RemoteError):
            c.agent.read(pd, [0] * len(slots), conn.arena, slots).wait(5)
    assert bytes(target._arena) == before
    assert target.owner.stats.guard_refusals >= 6  # type: ignore[union-attr]
    # a replayed grant over the wire is refused, and oversized batches too
    call_rep = conn.chan.request("grant", 5.0, keys=[b"fresh"], parents=[None])[0]
    slots = [s for s in call_rep["codes"] if s >= 0]
    x = c.agent.write(ps, [0], conn.arena, slots)
    x.wait(5)
    assert conn.chan.request("commit", 5.0, gid=call_rep["gid"], slots=slots, sums=[1], ok=True)[0]["n"] == 1
    with pytest.raises(kvx.RemoteError, match="grant"):
        conn.chan.request("commit", 5.0, gid=call_rep["gid"], slots=slots, sums=[1], ok=True)
    with pytest.raises(kvx.RemoteError, match="batch"):
        conn.chan.request("lookup", 5.0, keys=_keys(5000), lease=True)
    with pytest.raises(kvx.RemoteError):
        conn.chan.request("lookup", 5.0, keys="no", lease=True)


@pytest.mark.services
@pytest.mark.parametrize("trio", ["tcp"], indirect=True)
def test_data_plane_binds_grants_and_leases_to_their_client(trio: tuple[Pool, Pool, Pool],
                                                            etcd_server: Etcd) -> None:  # noqa: F811
    a, b, c = trio
    pool = c._members.prefix.split("/")[3]  # type: ignore[union-attr]
    with Pool("x", etcd=etcd_server.endpoint, pool=pool, capacity=0, block_bytes=BB, options=FAST) as x:
        src, dst, ps, pd = _bufs(c, 2)
        xs, xd, xps, xpd = _bufs(x, 2, seed=5)
        m = next(mm for mm in c._place[1] if mm.name == "a")  # type: ignore[index]
        cc, xc = c._conn(m), x._conn(m)
        assert cc is not None and xc is not None
        rep = cc.chan.request("grant", 5.0, keys=[b"mine"], parents=[None])[0]
        slot = rep["codes"][0]
        before = bytes(a._arena[slot * BB:(slot + 1) * BB])
        with pytest.raises(kvx.RemoteError):  # x holds no grant on c's slot
            x.agent.write(xps, [0], xc.arena, [slot]).wait(5)
        assert bytes(a._arena[slot * BB:(slot + 1) * BB]) == before
        c.agent.write(ps, [0], cc.arena, [slot]).wait(5)  # c does
        assert cc.chan.request("commit", 5.0, gid=rep["gid"], slots=[slot], sums=[0], ok=True)[0]["n"] == 1
        found = cc.chan.request("lookup", 5.0, keys=[b"mine"], lease=True)[0]
        assert found["n"] == 1
        with pytest.raises(kvx.RemoteError):  # the lease is c's, not x's
            x.agent.read(xpd, [0], xc.arena, [slot]).wait(5)
        c.agent.read(pd, [0], cc.arena, [slot]).wait(5)
        assert np.array_equal(dst[:BB], src[:BB])
        cc.chan.request("release", 5.0, lid=found["lid"])
        a.owner.check()  # type: ignore[union-attr]


@pytest.mark.services
def test_wrong_token_cannot_reach_members(etcd_server: Etcd) -> None:  # noqa: F811
    kw = {"etcd": etcd_server.endpoint, "pool": "tok", "block_bytes": BB, "options": FAST}
    with Pool("m", capacity=16 * BB, config=kvx.AgentConfig(auth_token="s3cret"), **kw) as m, \
            Pool("x", capacity=0, config=kvx.AgentConfig(auth_token="wrong"), **kw) as x:  # type: ignore[arg-type]
        src, dst, ps, pd = _bufs(x, 2)
        assert x.members() == ["m"]
        assert x.put(_keys(2), ps, range(2)) == 0
        assert x.get(_keys(2), pd, range(2)) == 0
        assert m.owner.stats.grants == 0  # type: ignore[union-attr]
        deadline = time.monotonic() + 5  # the refusal is counted by the listener's thread
        while not m._server.refused.counts.get("connections") and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        assert m._server.refused.counts.get("connections", 0) >= 1  # type: ignore[union-attr]


@pytest.mark.services
def test_a_live_members_name_cannot_be_taken(trio: tuple[Pool, Pool, Pool], etcd_server: Etcd) -> None:  # noqa: F811
    a, b, c = trio
    pool = c._members.prefix.split("/")[3]  # type: ignore[union-attr]
    with pytest.raises(kvx.UsageError, match="in use"):
        Pool("a", etcd=etcd_server.endpoint, pool=pool, capacity=16 * BB, block_bytes=BB, options=FAST)
    assert c.members() == ["a", "b"] and a.lookup(_keys(1)) == 0  # the first "a" is untouched


@pytest.mark.services
def test_full_owner_refuses_with_a_reason_and_never_blocks(etcd_server: Etcd) -> None:  # noqa: F811
    kw = {"etcd": etcd_server.endpoint, "pool": "full", "block_bytes": BB, "options": FAST}
    with Pool("m", capacity=4 * BB, **kw) as m:  # type: ignore[arg-type]
        src, dst, ps, pd = _bufs(m, 8)
        ks = _keys(8)
        assert m.put(ks[:4], ps, range(4)) == 4
        n, _s, _g, _c, lid = m.owner.lookup("reader", ks[:4], True)  # type: ignore[union-attr]
        t = time.monotonic()
        assert m.put(ks[4:], ps, range(4, 8)) == 0
        assert time.monotonic() - t < 1.0 and m.stats()["refused"] == 4
        assert "full" in m.stats()["last_refusal"]
        m.owner.release("reader", lid)  # type: ignore[union-attr, arg-type]
        assert m.put(ks[4:], ps, range(4, 8)) == 4  # now it evicts
        assert m.stats()["owner"]["evicted"] == 4


# ---- members in separate processes ---------------------------------------------------------
def _member(endpoint: str, pool: str, name: str, capacity: int, *more: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-m", "kvx.pool.member", "--etcd", endpoint, "--pool", pool,
                          "--name", name, "--capacity", str(capacity), "--block-bytes", str(BB), "--ttl", "2",
                          "--policy", "lru", "--stdin", *more],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert json.loads(line).get("ready") == name, line
    return p


@pytest.mark.services
def test_member_processes_kill9_turns_into_misses_within_the_bound(etcd_server: Etcd) -> None:  # noqa: F811
    procs = [_member(etcd_server.endpoint, "procs", f"p{i}", 256 * BB) for i in range(3)]
    try:
        with Pool("client", etcd=etcd_server.endpoint, pool="procs", capacity=0, block_bytes=BB,
                  options=FAST) as c:
            deadline = time.monotonic() + 5
            while len(c.members()) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.members() == ["p0", "p1", "p2"]
            n = 128
            src, dst, ps, pd = _bufs(c, n)
            ks = _keys(n, b"proc")
            assert c.put(ks, ps, range(n)) == n
            assert c.get(ks, pd, range(n)) == n and np.array_equal(src, dst)
            own = c._owners(ks)
            first_dead = int(np.argmax(np.asarray([c._place[1][j].name for j in own[0][:, 0]]) == "p1"))  # type: ignore[index]
            procs[1].send_signal(signal.SIGKILL)
            procs[1].wait(5)
            dst[:] = 0
            t = time.monotonic()
            got = c.get(ks, pd, range(n))
            assert time.monotonic() - t < FAST.timeout + 1.0
            assert got == first_dead
            assert np.array_equal(dst[:got * BB], src[:got * BB])
            # the dead member's lease runs out: it leaves the list, its keys remap (and miss once)
            deadline = time.monotonic() + 6
            while "p1" in c.members() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert c.members() == ["p0", "p2"]
            assert c.lookup(ks) == first_dead
            assert c.put(ks, ps, range(n)) == n
            assert c.get(ks, pd, range(n)) == n and np.array_equal(src, dst)
    finally:
        for p in procs:
            if p.poll() is None:
                p.stdin.close()  # type: ignore[union-attr]
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()


# ---- a member's disk tier -------------------------------------------------------------------
def _commit(o: Owner, arena: np.ndarray, data: np.ndarray, ks: list[bytes]) -> None:
    """Write blocks ``ks`` (rows of ``data``) into ``o``'s arena as a client would."""
    from kvx._native import nh64

    gid, codes, _ = o.grant(LOCAL, ks, [None] * len(ks))
    slots = [c for c in codes if c >= 0]
    assert len(slots) == len(ks), codes
    for i, sl in enumerate(slots):
        arena[sl * BB:(sl + 1) * BB] = data[i * BB:(i + 1) * BB]
    assert o.commit(LOCAL, gid, slots, [nh64(memoryview(data[i * BB:(i + 1) * BB])) for i in range(len(ks))],
                    True) == len(ks)


def test_owner_disk_tier_keeps_evicted_blocks_and_serves_them_checked(tmp_path: Any) -> None:
    from kvx.pool.disk import DiskSpill

    arena = kvx.alloc_host(4 * BB)
    disk = DiskSpill(str(tmp_path / "slab"), 8 * BB, BB)
    o = Owner(4, BB, int(arena.ctypes.data), policy="lru", disk=disk)
    data = np.random.default_rng(5).integers(0, 256, 12 * BB, dtype=np.uint8)
    ks = _keys(12, b"dsk")
    for i in range(0, 12, 2):  # two at a time: the arena of 4 spills the oldest to disk
        _commit(o, arena, data[i * BB:(i + 2) * BB], ks[i:i + 2])
        o.check()
    assert len(o.index) == 4 and len(disk) == 8 and disk.stats.spilled == 8 and disk.stats.evicted == 0
    # held (on disk) blocks are not granted again
    _, codes, _ = o.grant(LOCAL, ks[:1], [None])
    assert codes == [HELD]
    # a lookup brings a disk block back into the arena, leased; its bytes are exactly as written
    n, slots, gens, sums, lid = o.lookup("reader", ks[:2], lease=True)
    assert n == 2 and lid is not None
    for i, sl in enumerate(slots):
        assert np.array_equal(arena[sl * BB:(sl + 1) * BB], data[i * BB:(i + 1) * BB])
    assert disk.stats.restored == 2 and ks[0] in o.index and ks[0] not in disk
    o.check()
    # the two it evicted for them went down to disk (full: its LRU victim dropped)
    assert len(o.index) == 4 and disk.stats.spilled == 10 and disk.stats.evicted == 1 and len(disk) == 7
    o.release("reader", lid)
    # a lookup of a run longer than the arena serves what fits, never a block twice in a slot
    assert ks[2] not in disk and ks[2] not in o.index  # the disk's victim: gone
    n, slots, *_ = o.lookup("reader", ks[3:11], lease=False)
    assert n == 4 and len(set(slots)) == n
    o.check()
    # a block whose bytes changed on disk is a miss (dropped), never served
    victim = next(k for k in ks if k in disk)
    dslot, _ = disk.index[victim]
    with open(tmp_path / "slab", "r+b") as f:
        f.seek(dslot * BB + 7)
        f.write(b"\xff\x00")
    n, *_ = o.lookup("reader", [victim], lease=True)
    assert n == 0 and disk.stats.corrupt == 1 and victim not in disk and victim not in o.index
    o.check()
    disk.close()
    assert not (tmp_path / "slab").exists()


@pytest.mark.services
def test_member_process_with_a_disk_tier_serves_what_its_memory_evicted(etcd_server: Etcd,  # noqa: F811
                                                                       tmp_path: Any) -> None:
    slab = tmp_path / "m.slab"
    proc = _member(etcd_server.endpoint, "disk", "d0", 8 * BB, "--disk", str(slab), "--disk-capacity",
                   str(128 * BB))
    try:
        assert slab.stat().st_size == 128 * BB
        with Pool("client", etcd=etcd_server.endpoint, pool="disk", capacity=0, block_bytes=BB,
                  options=FAST) as c:
            deadline = time.monotonic() + 5
            while not c.members() and time.monotonic() < deadline:
                time.sleep(0.05)
            n = 64  # 8 times the member's memory
            src, dst, ps, pd = _bufs(c, n, seed=3)
            ks = _keys(n, b"spill")
            for i in range(0, n, 8):
                assert c.put(ks[i:i + 8], ps, range(i, i + 8)) == 8
            assert c.lookup(ks[:4]) == 4  # the oldest: on disk only
            for i in range(0, n, 4):  # gets of a few blocks, each read from the arena after a restore
                assert c.get(ks[i:i + 4], pd, range(i, i + 4)) == 4
            assert np.array_equal(src, dst)
            assert c.stats().get("corrupt", 0) == 0 and c.stats()["hits"] == n
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(10)
    assert not slab.exists()  # scratch space: removed when the member leaves


# ---- the pool as the last tier of a store ------------------------------------------------
@pytest.mark.services
def test_pool_tier_serves_what_another_instance_stored(trio: tuple[Pool, Pool, Pool]) -> None:
    from kvx.pool import PoolTier
    from kvx.tiers import HostTier, TieredStore

    a, b, c = trio
    s1 = TieredStore([HostTier(blocks=8), PoolTier(a)], block_bytes=BB, policy="lru")
    s2 = TieredStore([HostTier(blocks=8)], block_bytes=BB, policy="lru", remote=PoolTier(c))
    try:
        assert isinstance(s1.remote, PoolTier) and s1.agent is a.agent and len(s1.tiers) == 1
        src, dst, ps, pd = _bufs(a, 24)
        s3, d2, ps2, pd2 = _bufs(c, 24)
        ks = _keys(24, b"tier")
        s1.put(ks, ps, np.arange(24))
        # instance 2 has nothing locally: the whole prefix comes from the pool
        r = s2.lookup(ks)
        assert r.hits == 24 and set(r.tiers) == {1}
        assert s2.get(ks, pd2, np.arange(24)) == 24
        assert np.array_equal(d2, src)
        assert s2.remote.hits == 24  # type: ignore[union-attr]
        # instance 1's host tier (8 blocks) evicted the first 16 blocks: they come from the pool
        got_before = s1.remote.hits  # type: ignore[union-attr]
        assert s1.get(ks, pd, np.arange(24)) == 24 and np.array_equal(dst, src)
        assert s1.remote.hits - got_before >= 16  # type: ignore[union-attr]
        assert s1.stats().remote["pool"]["hits"] >= 16  # type: ignore[index]
        with pytest.raises(kvx.BlockNotFound) as ei:
            s2.get([*ks[:3], b"absent"], pd2, np.arange(4))
        assert ei.value.args[1] == 3
    finally:
        s2.close()
        s1.close()


@pytest.mark.services
def test_pool_moves_blocks_with_a_given_agent(trio: tuple[Pool, Pool, Pool], etcd_server: Etcd) -> None:  # noqa: F811
    a, b, c = trio
    with kvx.Agent("engine") as eng:
        with Pool("eng", etcd=etcd_server.endpoint, pool=c._members.prefix.split("/")[3],  # type: ignore[union-attr]
                  capacity=0, block_bytes=BB, options=FAST, agent=eng) as p:
            assert p.agent is eng
            src, dst, ps, pd = _bufs(p, 8)
            assert p.put(_keys(8, b"eng"), ps, range(8)) == 8
            assert c.lookup(_keys(8, b"eng")) == 8
            assert p.get(_keys(8, b"eng"), pd, range(8)) == 8 and np.array_equal(src, dst)
        assert not eng.closed and not eng.peers()


@pytest.mark.services
def test_lookup_only_client_sees_members_of_any_block_size(trio: tuple[Pool, Pool, Pool],
                                                           etcd_server: Etcd) -> None:  # noqa: F811
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 8)
    assert c.put(_keys(8, b"lo"), ps, range(8)) == 8
    name = c._members.prefix.split("/")[3]  # type: ignore[union-attr]
    with pytest.raises(kvx.UsageError, match="block_bytes"):
        Pool("x", etcd=etcd_server.endpoint, pool=name, capacity=BB, block_bytes=0, options=FAST)
    with Pool("look", etcd=etcd_server.endpoint, pool=name, capacity=0, block_bytes=0, options=FAST) as lo:
        assert lo.members() == ["a", "b"]
        assert lo.lookup(_keys(8, b"lo")) == 8 and lo.lookup([*_keys(3, b"lo"), b"absent"]) == 3
        with pytest.raises(kvx.UsageError, match="only looks up"):
            lo.put(_keys(1), ps, [0])


def test_cli_pool_bench_refuses_other_comparisons(capsys: pytest.CaptureFixture[str]) -> None:
    from kvx.cli import main

    assert main(["bench", "--backend", "pool", "--compare", "nixl"]) == 2
    assert "mooncake-store only" in capsys.readouterr().err


@pytest.mark.services
def test_replicas_serve_when_an_owner_is_gone(etcd_server: Etcd) -> None:  # noqa: F811
    opts = PoolConfig(refresh=0.1, ttl=2, timeout=3.0, retry=0.5, policy="lru", replicas=2)
    kw = {"etcd": etcd_server.endpoint, "pool": "rep", "block_bytes": BB, "options": opts}
    a = Pool("a", capacity=64 * BB, **kw)  # type: ignore[arg-type]
    b = Pool("b", capacity=64 * BB, **kw)  # type: ignore[arg-type]
    c = Pool("c", capacity=0, **kw)  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while any(p.members() != ["a", "b"] for p in (a, b, c)) and time.monotonic() < deadline:
            time.sleep(0.05)
        src, dst, ps, pd = _bufs(c, 16)
        ks = _keys(16, b"rep")
        assert c.put(ks, ps, range(16)) == 16
        assert a.stats()["owner"]["blocks"] == b.stats()["owner"]["blocks"] == 16  # every block twice
        a.close()  # its lease is revoked: gone from the list at the next refresh
        deadline = time.monotonic() + 5
        while c.members() != ["b"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get(ks, pd, range(16)) == 16 and np.array_equal(src, dst)
    finally:
        for p in (c, b, a):
            p.close()


@pytest.mark.services
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(frames=st.lists(st.one_of(st.binary(max_size=64), _msg.map(lambda m: {**m, "rid": 1}),
                                 _near_msg.map(lambda m: {**m, "rid": 1})), min_size=1,
                       max_size=6))
def test_control_channel_survives_fuzzed_frames(trio: tuple[Pool, Pool, Pool], frames: list[Any]) -> None:
    """Authenticated garbage on a control connection: refused or dropped, the owner's books stay
    exact and the next honest client is served."""
    import socket as _socket

    from kvx import wire
    from kvx.net import client_handshake
    from kvx.pool.server import SVC

    a, b, c = trio
    srv = a._server
    assert srv is not None
    s = _socket.create_connection(srv.address, timeout=5)
    try:
        client_handshake(s, None, "fuzzer", "fuzzer", SVC, 5.0)
        for f in frames:
            try:
                body = f if isinstance(f, bytes) else wire.pack(str(f.get("t")), **{k: v for k, v in f.items()
                                                                                  if k not in ("t", "v")})
            except OverflowError:  # not encodable as msgpack: nothing to send
                continue
            try:
                s.sendall(wire.frame_header(1, len(body)) + body)
            except OSError:
                break  # dropped: fine
    finally:
        s.close()
    a.owner.check()  # type: ignore[union-attr]
    src, dst, ps, pd = _bufs(c, 2)
    ks = _keys(2, b"after-fuzz")
    assert c.put(ks, ps, range(2)) == 2 and c.get(ks, pd, range(2)) == 2


# ---- the get path: one-way release, checked answers, answers taken as they come -------------
def test_owner_release_without_answer_ends_the_lease_quietly() -> None:
    o = Owner(8, BB, 1 << 20, "lru")
    gid, codes, _ = o.grant(LOCAL, [b"x"], [None])
    o.commit(LOCAL, gid, codes, [7], True)
    n, _s, _g, _sums, lid = o.lookup(LOCAL, [b"x"], True)
    assert n == 1 and lid is not None and len(o.leases) == 1
    with pytest.raises(ProtocolError):  # a malformed ack changes nothing
        o.handle(LOCAL, {"t": "release", "lid": lid, "ack": 1})
    assert len(o.leases) == 1
    assert o.handle(LOCAL, {"t": "release", "lid": lid, "ack": False}) == ("", {})
    assert not o.leases and o.readers.sum() == 0
    assert o.handle(LOCAL, {"t": "release", "lid": lid, "ack": False}) == ("", {})  # spent: quiet, harmless
    assert o.handle(LOCAL, {"t": "release", "lid": lid}) == ("released", {"ok": False})  # old clients: answered
    o.check()


def test_lookup_answers_are_checked_item_by_item() -> None:
    from kvx.pool.pool import _ints

    assert _ints([0, 3, 5], 3, 0, 5, "x") == [0, 3, 5] and _ints([], 0, 0, 5, "x") == []
    assert _ints([(1 << 64) - 1, 0], 2, 0, (1 << 64) - 1, "x")
    for bad in ([0, True, 2], [0, 1.0, 2], [0, 1, 6], [-1, 1, 2], [0, 1], (0, 1, 2), [0, None, 1], [1 << 70, 0, 0],
                [0, b"1", 2]):
        with pytest.raises(ProtocolError):
            _ints(bad, 3, 0, 5, "x")
    with pytest.raises(ProtocolError):
        _ints([-1, 0], 2, 0, (1 << 64) - 1, "x")


def test_arrivals_come_in_answer_order_and_stop_at_the_deadline() -> None:
    import queue

    q: queue.SimpleQueue[int] = queue.SimpleQueue()
    for g in (2, 0, 2, 1):  # a repeated tag counts once
        q.put(g)
    assert list(Pool._arrivals(q, 3, time.monotonic() + 5)) == [2, 0, 1]
    q.put(1)
    t = time.monotonic()
    assert list(Pool._arrivals(q, 3, t + 0.2)) == [1, 0, 2]  # 0 and 2 never answer: given up at the deadline
    assert time.monotonic() - t < 2.0


@pytest.mark.services
def test_one_way_release_over_the_wire_gets_no_answer(trio: tuple[Pool, Pool, Pool]) -> None:
    import threading

    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 8)
    ks = _keys(8, b"oneway")
    assert c.put(ks, ps, range(8)) == 8
    m = next(mm for mm in c._place[1] if mm.name == "a")  # type: ignore[index]
    cc = c._conn(m)
    assert cc is not None
    found = cc.chan.request("lookup", 5.0, keys=[k for k in ks if a.owner.index.get(k) is not None],  # type: ignore[union-attr]
                            lease=True)[0]
    assert found["n"] > 0 and a.stats()["owner"]["leases_active"] == 1
    rid = next(cc.chan._ids)
    slot: list[Any] = [threading.Event(), None]
    with cc.chan._wlock:
        cc.chan._waiters[rid] = slot
    from kvx import wire

    cc.chan.send(wire.pack("release", rid=rid, pl=False, lid=found["lid"], ack=False))
    deadline = time.monotonic() + 5
    while a.stats()["owner"]["leases_active"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.stats()["owner"]["leases_active"] == 0
    assert not slot[0].wait(0.3)  # and no answer came
    with cc.chan._wlock:
        cc.chan._waiters.pop(rid, None)
    # a get's own releases: no lease left behind on either owner
    assert c.get(ks, pd, range(8)) == 8 and np.array_equal(src, dst)
    deadline = time.monotonic() + 5
    while any(p.stats()["owner"]["leases_active"] for p in (a, b)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(p.stats()["owner"]["leases_active"] == 0 for p in (a, b))
    a.owner.check()  # type: ignore[union-attr]


@pytest.mark.services
@pytest.mark.parametrize("trio", ["tcp"], indirect=True)
def test_a_slow_owner_does_not_hold_back_the_others_reads(trio: tuple[Pool, Pool, Pool],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 32)
    ks = _keys(32, b"slow")
    assert c.put(ks, ps, range(32)) == 32
    assert 0 < a.stats()["owner"]["blocks"] < 32
    events: list[tuple[str, float]] = []
    assert a.owner is not None
    slow_lookup = a.owner.lookup

    def lookup(*args: Any, **kw: Any) -> Any:
        time.sleep(0.4)
        out = slow_lookup(*args, **kw)
        events.append(("a answered", time.monotonic()))
        return out

    real_read = c._read

    def read(m: Any, *args: Any) -> Any:
        events.append((f"read {m.name}", time.monotonic()))
        return real_read(m, *args)

    monkeypatch.setattr(a.owner, "lookup", lookup)
    monkeypatch.setattr(c, "_read", read)
    assert c.get(ks, pd, range(32)) == 32 and np.array_equal(src, dst)
    order = [e for e, _ in sorted(events, key=lambda x: x[1])]
    assert order.index("read b") < order.index("a answered"), order
    assert "read a" in order


# ---- same-node owners copy themselves (kvx.pool.near) ---------------------------------------
@pytest.mark.services
def test_near_owners_serve_in_one_round_and_accept_no_peer(trio: tuple[Pool, Pool, Pool]) -> None:
    """A client on the owners' node: puts are one ``store`` round per owner and gets one
    ``fetch`` round, the owner moving the bytes; its serving agent, which holds the arena,
    refuses every peer (no client can map or read the arena one-sided)."""
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 40, seed=3)
    ks = _keys(40, b"near")
    assert c.put(ks, ps, range(40)) == 40
    st = c.stats()
    assert st["near_stores"] == 2 and "busy" in st and st.get("put_failed", 0) == 0
    for p in (a, b):
        o = p.owner
        assert o is not None and o.stats.granted == o.stats.committed == p.stats()["owner"]["blocks"] > 0
        assert not o.grants and not o.leases
        o.check()
    assert c.get(ks, pd, range(40)) == 40 and np.array_equal(src, dst)
    assert c.stats()["near_blocks"] == 40 and "sums_in_copy" not in c.stats()
    for p in (a, b):
        assert not p.owner.leases  # type: ignore[union-attr]  # taken and ended within the fetch
    # nobody reaches an owner's serving agent: it dials out only
    near = a._near
    assert near is not None
    with kvx.Agent("intruder") as x:
        with pytest.raises(kvx.KVXError):
            x.add_peer(near.agent.metadata())
    assert near.agent.backend("host").refused.counts.get("connections", 0) >= 1  # type: ignore[attr-defined]


@pytest.mark.services
def test_near_store_keeps_nothing_that_fails_its_checksum_or_lies_outside_the_client(
        trio: tuple[Pool, Pool, Pool], etcd_server: Etcd) -> None:  # noqa: F811
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 4, seed=4)
    m = next(mm for mm in c._place[1] if mm.name == "a")  # type: ignore[index]
    conn = c._conn(m)
    assert conn is not None and conn.near is not None
    addr = [int(x) for x in ps.descs.addr[:2]]
    good = [nh64(src[i * BB:(i + 1) * BB].tobytes()) for i in range(2)]
    # a checksum that does not match the bytes: the owner checks after its copy, keeps nothing
    rep = conn.chan.request("store", 5.0, keys=[b"s0", b"s1"], parents=[None, b"s0"], sums=[good[0], 1],
                            addrs=addr)[0]
    assert rep["codes"] == [REFUSED, REFUSED] and "checksum" in rep["why"]
    # memory the client did not register (the owner's own arena, a wild address): refused, not read
    for bad in ([int(a._reg.descs.addr[0])] * 2, [8192, 8192 + BB]):
        rep = conn.chan.request("store", 5.0, keys=[b"s0", b"s1"], parents=[None, None], sums=good,
                                addrs=bad)[0]
        assert rep["codes"] == [REFUSED, REFUSED] and "copy from the client failed" in rep["why"]
    assert a.owner.lookup("t", [b"s0"], False)[0] == 0  # type: ignore[union-attr]
    a.owner.check()  # type: ignore[union-attr]
    assert not a.owner.grants  # type: ignore[union-attr]
    # a fetch of more blocks than the landing holds, and an oversized store: refused, nothing moved
    with pytest.raises(kvx.RemoteError, match="batch|must be"):
        conn.chan.request("fetch", 5.0, keys=_keys(conn.near.rows + 1))
    with pytest.raises(kvx.RemoteError, match="batch|must be"):
        conn.chan.request("store", 5.0, keys=_keys(5000), parents=[None] * 5000, sums=[0] * 5000,
                          addrs=[addr[0]] * 5000)
    assert not a.owner.leases and not a.owner.grants  # type: ignore[union-attr]
    # the honest store still works, and a fetch on a connection without a near handshake is refused
    rep = conn.chan.request("store", 5.0, keys=[b"s0", b"s1"], parents=[None, b"s0"], sums=good, addrs=addr)[0]
    assert rep["codes"] == [HELD, HELD]
    pool = c._members.prefix.split("/")[3]  # type: ignore[union-attr]
    with Pool("t", etcd=etcd_server.endpoint, pool=pool, capacity=0, block_bytes=BB,
              options=dataclasses.replace(FAST, near=False)) as t:
        tc = t._conn(m)
        assert tc is not None and tc.near is None
        with pytest.raises(kvx.RemoteError, match="near handshake"):
            tc.chan.request("fetch", 5.0, keys=[b"s0"])
        with pytest.raises(kvx.RemoteError, match="another agent"):  # c's metadata on t's connection
            tc.chan.request("near", 5.0, meta=c.agent.metadata(), addr=addr[0], rows=2)
    a.owner.check()  # type: ignore[union-attr]


@pytest.mark.services
def test_near_fetch_past_the_bound_is_a_miss_and_drops_its_landing(trio: tuple[Pool, Pool, Pool],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An owner that answers a fetch too late: its blocks miss within the bound, the client drops
    that connection and its landing (a late copy lands in memory nobody reads), then recovers."""
    a, b, c = trio
    src, dst, ps, pd = _bufs(c, 16, seed=6)
    ks = _keys(16, b"late")
    assert c.put(ks, ps, range(16)) == 16
    assert c.get(ks, pd, range(16)) == 16
    first = next(i for i, k in enumerate(ks) if k in a.owner.index)  # type: ignore[union-attr]
    m = next(mm for mm in c._place[1] if mm.name == "a")  # type: ignore[index]
    conn = c._conn(m)
    assert conn is not None and conn.near is not None
    land = conn.near
    assert a._near is not None
    real = a._near._fetch

    def slow(*args: Any) -> Any:
        time.sleep(c.opts.timeout + 0.5)
        return real(*args)

    monkeypatch.setattr(a._near, "_fetch", slow)
    dst[:] = 0
    t0 = time.monotonic()
    got = c.get(ks, pd, range(16))
    took = time.monotonic() - t0
    assert got == first and took < c.opts.timeout + 2.0, (got, first, took)
    assert np.array_equal(dst[:got * BB], src[:got * BB])
    assert land.reg.released and c.stats()["member_failures"] >= 1
    monkeypatch.setattr(a._near, "_fetch", real)
    time.sleep(c.opts.retry + 0.1)
    dst[:] = 0
    assert c.get(ks, pd, range(16)) == 16 and np.array_equal(src, dst)
    conn2 = c._conn(m)
    assert conn2 is not None and conn2.near is not None and conn2.near is not land
