"""Helper process for the crash test: writes blocks through a host+disk store until killed."""

from __future__ import annotations

import sys

import numpy as np

import kvx
from kvx.tiers import DiskTier, HostTier, TieredStore

BB = 4096


def content(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BB, dtype=np.uint8)


def main() -> None:
    path = sys.argv[1]
    store = TieredStore([HostTier(blocks=8), DiskTier(path, blocks=64)], block_bytes=BB, write_through=True,
                        policy="lru")
    buf = np.zeros(BB * 4, np.uint8)
    src = store.agent.prepare(kvx.DescList.blocks(store.agent.register(buf), BB))
    key = 0
    print("ready", flush=True)
    while True:  # killed by the test
        for j in range(4):
            buf[j * BB:(j + 1) * BB] = content(key + j)
        store.put([key, key + 1, key + 2, key + 3], src)
        key += 4


if __name__ == "__main__":
    main()
