"""Helper process for the crash tests: writes blocks through a host+disk store until killed.

    tier_writer.py PATH [START_KEY] [MODE]

MODE ``through`` (default): write-through to disk. MODE ``writeback``: a tiny host tier, so
nearly every block reaches the disk through the background write-back queue, with reads
(promotions) mixed in; after every ``store.flush()`` it prints ``durable N``: every key from
START_KEY below N is on disk and journaled (the disk tier never evicts in this mode).
MODE ``objects``: the same through a packed object tier (S3 from the environment, PATH holding
its journal) below a tiny host tier, reads mixed in, ``durable N`` after every flush.
"""

from __future__ import annotations

import sys

import numpy as np

import kvx
from kvx.tiers import DiskTier, HostTier, TieredStore

BB = 4096
WB_BB = 512
WB_DISK = 65536


def content(key: int, bb: int = BB) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, bb, dtype=np.uint8)


def through(path: str, key: int) -> None:
    store = TieredStore([HostTier(blocks=8), DiskTier(path, blocks=64)], block_bytes=BB, write_through=True,
                        policy="lru")
    buf = np.zeros(BB * 4, np.uint8)
    src = store.agent.prepare(kvx.DescList.blocks(store.agent.register(buf), BB))
    print("ready", flush=True)
    while True:  # killed by the test
        for j in range(4):
            buf[j * BB:(j + 1) * BB] = content(key + j)
        store.put([key, key + 1, key + 2, key + 3], src)
        key += 4


def writeback(path: str, key: int) -> None:
    store = TieredStore([HostTier(blocks=8), DiskTier(path, blocks=WB_DISK)], block_bytes=WB_BB, policy="lru",
                        writeback_depth=16, writeback_batch=8)
    buf = np.zeros(WB_BB * 4, np.uint8)
    src = store.agent.prepare(kvx.DescList.blocks(store.agent.register(buf), WB_BB))
    out = np.zeros(WB_BB * 4, np.uint8)
    dst = store.agent.prepare(kvx.DescList.blocks(store.agent.register(out), WB_BB))
    rng = np.random.default_rng(key)
    first = key
    print("ready", flush=True)
    n = 0
    while True:  # killed by the test
        for j in range(4):
            buf[j * WB_BB:(j + 1) * WB_BB] = content(key + j, WB_BB)
        store.put([key, key + 1, key + 2, key + 3], src)
        key += 4
        n += 1
        if n % 4 == 0 and key - first > 16:  # read back an older block (a promotion from disk)
            k = int(rng.integers(first, key - 12))
            store.get([k], dst, [0])
            if not np.array_equal(out[:WB_BB], content(k, WB_BB)):
                print(f"WRONG {k}", flush=True)
        if n % 8 == 0:
            store.flush()
            print(f"durable {key - 16}", flush=True)


OBJ_BB = 512
OBJ_BLOCKS = 32768


def object_store(path: str) -> TieredStore:
    from kvx.tiers import ObjectTier

    return TieredStore([HostTier(blocks=8), ObjectTier("kvx-crash", blocks=OBJ_BLOCKS, prefix="crash", pack_blocks=32,
                                                       journal=path)],
                       block_bytes=OBJ_BB, policy="lru", writeback_depth=64)


def objects(path: str, key: int) -> None:
    store = object_store(path)
    store.linger = 0.002
    buf = np.zeros(OBJ_BB * 4, np.uint8)
    src = store.agent.prepare(kvx.DescList.blocks(store.agent.register(buf), OBJ_BB))
    out = np.zeros(OBJ_BB, np.uint8)
    dst = store.agent.prepare(kvx.DescList.blocks(store.agent.register(out), OBJ_BB))
    rng = np.random.default_rng(key)
    first = key
    print("ready", flush=True)
    n = 0
    while True:  # killed by the test
        for j in range(4):
            buf[j * OBJ_BB:(j + 1) * OBJ_BB] = content(key + j, OBJ_BB)
        store.put([key, key + 1, key + 2, key + 3], src)
        key += 4
        n += 1
        if n % 4 == 0 and key - first > 16:  # read back an older block (ranged GET, or its source)
            k = int(rng.integers(first, key - 12))
            if k in store:
                print(f"read {k}", flush=True)  # a get moves it up: out of the object tier
                store.get([k], dst, [0])
                if not np.array_equal(out, content(k, OBJ_BB)):
                    print(f"WRONG {k}", flush=True)
        if n % 8 == 0:
            store.flush()
            print(f"durable {key - 16}", flush=True)


def main() -> None:
    path = sys.argv[1]
    key = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    mode = sys.argv[3] if len(sys.argv) > 3 else "through"
    {"writeback": writeback, "objects": objects}.get(mode, through)(path, key)


if __name__ == "__main__":
    main()
