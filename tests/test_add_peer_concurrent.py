"""``Agent.add_peer`` called concurrently for the same peer (issue 17).

A fresh vLLM decode instance that gets a burst of requests pulls them on several threads, each
of which adds the prefill worker as a peer. Concurrent ``add_peer`` calls of one peer used to
connect it once per call: the later connection replaced the earlier one while that one's reader
thread had not started yet ("cannot join thread before it is started"), and transfers already
posted on the replaced connection failed. Every call must succeed, leave one connection, and
transfers through it must work.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvx
from kvx.testing.conformance import digest, pattern
from kvx.testing.procs import PeerProcess

THREADS = 16


@pytest.fixture
def peer():
    p = PeerProcess("prefill", {"backends": ["host"]})
    yield p
    p.close()


@pytest.mark.parametrize("rounds", [3])
def test_concurrent_add_peer_of_one_peer(peer: PeerProcess, rounds: int) -> None:
    bs, n = 4096, THREADS
    rid, rdescs = peer.register("alloc", n * bs)
    for r in range(rounds):
        with kvx.Agent(f"decode-{r}", kvx.AgentConfig(backends=("host",))) as agent:
            buf = kvx.alloc_host(n * bs)
            buf[:] = pattern(n * bs, r)
            reg = agent.register(buf)
            local = agent.prepare(kvx.DescList.blocks(reg, bs))
            barrier = threading.Barrier(THREADS)
            names: list[str] = []
            errors: list[BaseException] = []
            lock = threading.Lock()

            def pull(i: int) -> None:
                try:
                    barrier.wait(10)
                    name = agent.add_peer(peer.meta)
                    remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer=name)
                    # each thread writes its own block right away, as a pull would read it
                    agent.write(local, [i], remote, [i]).wait(10)
                    with lock:
                        names.append(name)
                except BaseException as exc:  # reported below
                    with lock:
                        errors.append(exc)

            threads = [threading.Thread(target=pull, args=(i,)) for i in range(THREADS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not any(t.is_alive() for t in threads), "an add_peer call did not return"
            assert not errors, f"{len(errors)} of {THREADS} concurrent add_peer calls failed: {errors[0]!r}"
            assert names == ["prefill"] * THREADS
            assert agent.peers() == ["prefill"]
            assert peer.digest(rid) == digest(buf)
            # and the connection left behind still carries transfers both ways
            remote = agent.prepare(kvx.DescList.blocks(rdescs, bs), peer="prefill")
            back = np.zeros_like(buf)
            breg = agent.register(back)
            agent.read(agent.prepare(kvx.DescList.blocks(breg, bs)), np.arange(n), remote, np.arange(n)).wait(10)
            assert np.array_equal(back, buf)
