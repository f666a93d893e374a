"""TieredStore's remote last tier (kvx.tiers.RemoteTier): asked only for what the local tiers
miss, written through on put, its failures a miss. The remote here is another real TieredStore
("another node's"), moved by the same agent; kvx.pool.PoolTier is tested in test_pool.py."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.errors import TierError, UsageError
from kvx.tiers import HostTier, RemoteTier, TieredStore

BB = 256


class StoreRemote(RemoteTier):
    """A TieredStore of another "node" as a remote tier (``fail``: every call raises)."""

    medium = "peer-store"

    def __init__(self, store: TieredStore, write_through: bool = True) -> None:
        self.store = store
        self.agent = store.agent
        self.write_through = write_through
        self.fail: BaseException | None = None
        self.calls: list[tuple[str, int]] = []
        self.bad_answer: Any = None
        self.closed = False

    def bind(self, block_bytes: int) -> None:
        if block_bytes != self.store.block_bytes:
            raise UsageError("block size differs")

    def _enter(self, op: str, n: int) -> None:
        self.calls.append((op, n))
        if self.fail is not None:
            raise self.fail

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        self._enter("lookup", len(hashes))
        return self.bad_answer if self.bad_answer is not None else self.store.lookup(hashes).hits

    def get(self, hashes: Sequence[Hashable], dst: kvx.PreparedList, idx: np.ndarray) -> int:
        self._enter("get", len(hashes))
        try:
            return self.store.get(hashes, dst, idx)
        except kvx.BlockNotFound as exc:
            return int(exc.args[1])

    def put(self, hashes: Sequence[Hashable], src: kvx.PreparedList, idx: np.ndarray) -> int:
        self._enter("put", len(hashes))
        self.store.put(hashes, src, idx)
        return self.store.lookup(hashes).hits

    def stats(self) -> dict[str, Any]:
        return {"medium": self.medium, "calls": len(self.calls)}

    def close(self) -> None:
        self.closed = True


@pytest.fixture()
def pair() -> Any:
    """A remote store (32 blocks) and its RemoteTier; the caller's store shares its agent."""
    far = TieredStore([HostTier(blocks=32)], block_bytes=BB, policy="lru")
    try:
        yield far, StoreRemote(far)
    finally:
        far.close()


def _data(store: TieredStore, n: int, seed: int = 0) -> tuple[np.ndarray, kvx.PreparedList]:
    a = kvx.alloc_host(n * BB)
    a[:] = np.random.default_rng(seed).integers(0, 256, n * BB, dtype=np.uint8)
    return a, store.agent.prepare(kvx.DescList.blocks(store.agent.register(a), BB))


def _keys(n: int, tag: bytes = b"k") -> list[bytes]:
    return [tag + i.to_bytes(4, "little") for i in range(n)]


def test_remote_is_asked_only_for_what_local_tiers_miss(pair: Any) -> None:
    far, rt = pair
    with TieredStore([HostTier(blocks=16)], block_bytes=BB, policy="lru", remote=rt) as st:
        assert st.agent is far.agent and st.remote is rt
        src, ps = _data(st, 12)
        ks = _keys(12)
        assert st.put(ks, ps) == 12
        assert rt.calls == [("put", 12)] and far.lookup(ks).hits == 12
        rt.calls.clear()
        assert st.delete(ks[:8]) == 8  # gone here (evicted, say), still held remotely
        assert far.lookup(ks).hits == 12
        # the local prefix is empty: the remote's follows
        r = st.lookup(ks)
        assert r.hits == 12 and r.tiers == (1,) * 12
        assert rt.calls == [("lookup", 12)]
        rt.calls.clear()
        assert st.lookup(ks[8:]).tiers == (0,) * 4 and not rt.calls  # all local: not asked
        out, pd = _data(st, 12, seed=1)
        assert st.get(ks, pd) == 12
        assert np.array_equal(out, src)
        assert rt.calls == [("get", 12)]
        rt.calls.clear()
        # what the remote served was admitted locally (promote): not asked again
        assert st.lookup(ks[:4]).tiers == (0,) * 4
        assert st.get(ks[:4], pd) == 4 and not rt.calls
        assert st.delete(ks[2:4]) == 2
        s = st.stats()
        assert s.remote is not None and s.remote["medium"] == "peer-store"
        assert s.remote["store"]["hits"] == 12 and s.remote["store"]["promoted"] == 8
        assert "kvx_store_used" in st.prometheus()  # the remote is not a slot tier there
        # a local prefix: the remote serves from the first local miss on
        rt.calls.clear()
        out[:] = 0
        assert st.get(ks[:4], pd, [0, 1, 2, 3]) == 4
        assert rt.calls == [("get", 2)]
        assert np.array_equal(out[:4 * BB], src[:4 * BB])
    assert rt.closed  # the store closes its remote tier (which keeps what it holds)


def test_a_miss_everywhere_and_a_failing_remote_are_misses(pair: Any) -> None:
    far, rt = pair
    with TieredStore([HostTier(blocks=8)], block_bytes=BB, remote=rt, promote=False) as st:
        src, ps = _data(st, 4)
        ks = _keys(4)
        st.put(ks[:2], ps, [0, 1])
        out, pd = _data(st, 4, seed=2)
        with pytest.raises(kvx.BlockNotFound) as ei:
            st.get(ks, pd)
        assert ei.value.args[1] == 2
        far.put(ks[2:3], ps, [2])  # only the remote has the third
        with pytest.raises(kvx.BlockNotFound) as ei:
            st.get(ks, pd)
        assert ei.value.args[1] == 3 and np.array_equal(out[:3 * BB], src[:3 * BB])
        assert ks[2] not in st  # promote=False: not admitted locally
        rt.fail = kvx.TransferTimeout("cut off")
        assert st.lookup(ks).hits == 2
        with pytest.raises(kvx.BlockNotFound) as ei:
            st.get(ks, pd)
        assert ei.value.args[1] == 2
        assert st.put(_keys(2, b"z"), ps, [0, 1]) == 2  # the local put stands
        assert st.stats().remote["store"]["errors"] == 3  # type: ignore[index]
        rt.fail = None
        rt.bad_answer = 99  # a remote that answers nonsense is a bug, not a miss
        with pytest.raises(TierError):
            st.lookup(ks)
    assert rt.closed


def test_read_only_remote_is_never_written(pair: Any) -> None:
    far, rt = pair
    rt.write_through = False
    with TieredStore([HostTier(blocks=8), rt], block_bytes=BB) as st:  # as the last tier
        assert st.remote is rt and len(st.tiers) == 1
        src, ps = _data(st, 4)
        st.put(_keys(4), ps)
        assert not rt.calls and far.lookup(_keys(4)).hits == 0


def test_remote_tier_arguments_are_checked(pair: Any) -> None:
    far, rt = pair
    with pytest.raises(UsageError, match="twice"):
        TieredStore([HostTier(blocks=4), rt], block_bytes=BB, remote=rt)
    with pytest.raises(UsageError, match="last"):
        TieredStore([HostTier(blocks=4), rt, HostTier(blocks=4)], block_bytes=BB)
    with pytest.raises(UsageError, match="local tier"):
        TieredStore([rt], block_bytes=BB)
    with pytest.raises(UsageError, match="RemoteTier"):
        TieredStore([HostTier(blocks=4)], block_bytes=BB, remote=object())  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="block size"):
        TieredStore([HostTier(blocks=4)], block_bytes=2 * BB, remote=rt)
    with kvx.Agent("other") as other, pytest.raises(UsageError, match="same one"):
        TieredStore([HostTier(blocks=4)], block_bytes=BB, remote=rt, agent=other)
    assert not far.agent.closed  # a failed store does not close the remote's agent
