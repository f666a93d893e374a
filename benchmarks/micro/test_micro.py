"""Hot-path micro-operations, timed with pytest-benchmark (``make bench-micro``).

Not part of ``make test``: these time things, they check little. ``make bench-micro`` runs them and
compares each median with ``benchmarks/micro/baseline.json`` (``compare.py``), so a change that
slows a hot path shows as a number. The operations:

- post -> done of one 4 KiB write, per same-node path (shm, cma, uds) and tcp over loopback, plain
  ``write().wait()`` and a ``make_transfer`` plan;
- ``prepare`` of 1,048,576 local descriptors (the vectorised validation);
- metadata encode and decode (``Agent.metadata`` / ``Agent.parse_metadata``);
- the default eviction policy and LRU over a fixed stream of 2,000 requests (``kvx.tiers.sim``;
  ``extra_info["accesses"]`` says how many block accesses that is);
- ``TieredStore.put`` and ``lookup`` of a 16-block chain in a host tier.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

import kvx
from kvx.tiers import DEFAULT_POLICY, HostTier, TieredStore
from kvx.tiers.sim import simulate

BS = 4096


@pytest.fixture(scope="module", params=[("host", "shm"), ("host", "cma"), ("host", "uds"), ("tcp", None)],
                ids=["shm", "cma", "uds", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[kvx.Agent, Any, Any]]:
    backend, path = request.param
    cfg: dict[str, Any] = {"backends": (backend,)}
    if path:
        cfg["host_path"] = path
    t = kvx.Agent("t", kvx.AgentConfig(**cfg))
    i = kvx.Agent("i", kvx.AgentConfig(**cfg))
    tmem = kvx.alloc_host(64 * BS) if path == "shm" else np.zeros(64 * BS, np.uint8)
    remote = kvx.DescList.blocks(t.register(tmem), BS)
    local = i.prepare(kvx.DescList.blocks(i.register(kvx.alloc_host(64 * BS)), BS))
    rl = i.prepare(remote, peer=i.add_peer(t.metadata()))
    i.write(local, [0], rl, [0]).wait(10)
    yield i, local, rl
    i.close()
    t.close()


def test_post_to_done_4k(benchmark: Any, pair: tuple[kvx.Agent, Any, Any]) -> None:
    i, local, remote = pair
    benchmark(lambda: i.write(local, [3], remote, [5]).wait(10))


def test_plan_post_to_done_4k(benchmark: Any, pair: tuple[kvx.Agent, Any, Any]) -> None:
    i, local, remote = pair
    plan = i.make_transfer("write", local, [3], remote, [5])
    benchmark(lambda: plan.post().wait(10))


def test_prepare_1m_descriptors(benchmark: Any) -> None:
    n = 1 << 20
    with kvx.Agent("a", kvx.AgentConfig(backends=("host",))) as a:
        reg = a.register(kvx.alloc_host(n * 64))
        blocks = kvx.DescList.blocks(reg, 64)
        benchmark.pedantic(lambda: a.prepare(blocks), rounds=5, iterations=1, warmup_rounds=1)


def test_metadata_encode_decode(benchmark: Any) -> None:
    with kvx.Agent("a") as a:
        for _ in range(64):
            a.register(np.zeros(4096, np.uint8))
        benchmark(lambda: kvx.Agent.parse_metadata(a.metadata()))


def _requests(n: int = 2000, seed: int = 0) -> list[list[int]]:
    """Chains sharing Zipf-popular prefixes: a fixed, seeded stream of block accesses."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = int(rng.zipf(1.3)) % 200
        out.append([p * 1000 + k for k in range(int(rng.integers(2, 12)))])
    return out


@pytest.mark.parametrize("policy", [DEFAULT_POLICY, "lru"])
def test_policy_replay_2000_requests(benchmark: Any, policy: str) -> None:
    reqs = _requests()
    accesses = sum(len(r) for r in reqs)
    benchmark.extra_info["accesses"] = accesses
    benchmark.pedantic(lambda: simulate(reqs, 500, policy), rounds=5, iterations=1, warmup_rounds=1)


def test_store_put_lookup_16(benchmark: Any) -> None:
    with kvx.Agent("s", kvx.AgentConfig(backends=("host",))) as a:
        store = TieredStore([HostTier(blocks=4096)], block_bytes=BS, agent=a)
        src = a.prepare(kvx.DescList.blocks(a.register(kvx.alloc_host(16 * BS)), BS))
        counter = iter(range(1 << 40))

        def put_lookup() -> None:
            base = next(counter) * 16
            hashes = [(base + k).to_bytes(8, "little") for k in range(16)]
            store.put(hashes, src)
            store.lookup(hashes)

        benchmark(put_lookup)
        store.close()
