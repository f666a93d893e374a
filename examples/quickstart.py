"""Two agents in two processes: the decode side pulls permuted KV blocks from the prefill side.

Run: python examples/quickstart.py
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

import kvx

BLOCK = 32 * 1024  # bytes per KV block
NBLOCKS = 64


def prefill(conn: "mp.connection.Connection") -> None:
    with kvx.Agent("prefill-0") as agent:
        kv = kvx.alloc_host(BLOCK * NBLOCKS)  # shareable host memory: the fast same-node path
        kv[:] = np.arange(kv.size) % 251
        reg = agent.register(kv)
        conn.send((agent.metadata(), reg.descs.to_bytes()))
        # wait for the decode side to say it is done with our blocks
        while not agent.notifications(timeout=10.0):
            pass
        conn.send("freed")


def main() -> None:
    parent, child = mp.Pipe()
    p = mp.get_context("spawn").Process(target=prefill, args=(child,))
    p.start()
    meta, descs = parent.recv()
    with kvx.Agent("decode-0") as agent:
        peer = agent.add_peer(meta)  # connect; returns the peer's name
        remote_blocks = kvx.DescList.blocks(kvx.DescList.from_bytes(descs), BLOCK)
        cache = kvx.alloc_host(BLOCK * NBLOCKS)
        local = agent.prepare(kvx.DescList.blocks(agent.register(cache), BLOCK))
        remote = agent.prepare(remote_blocks, peer=peer)  # checked against the peer's registrations
        src_ids = np.random.default_rng(0).permutation(NBLOCKS)  # paged KV is never contiguous
        x = agent.read(local, np.arange(NBLOCKS), remote, src_ids, notify=b"req-17")
        x.wait(timeout=5.0)
        expect = (np.arange(BLOCK * NBLOCKS) % 251).astype(np.uint8).reshape(NBLOCKS, BLOCK)[src_ids]
        assert np.array_equal(cache.reshape(NBLOCKS, BLOCK), expect)
        print(f"{x.status.name}: {x.nbytes} bytes via {x.backend}; prefill says {parent.recv()}")
    p.join(10)


if __name__ == "__main__":
    main()
