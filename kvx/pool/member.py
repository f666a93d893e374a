"""Run one storing pool member until SIGTERM/SIGINT (or, with ``--stdin``, until stdin closes)::

    python -m kvx.pool.member --etcd http://10.0.0.5:2379 --pool llama-70b --name node-3 \\
        --capacity 64GiB --block-bytes 524288 --host 10.0.0.3 [--disk /nvme/pool.slab --disk-capacity 1TiB]

It prints one JSON line (``{"ready": name, "ctl": [host, port]}``) once it is listed in etcd.
``KVX_AUTH_TOKEN`` (the shared secret of every member and client) and the other ``KVX_*``
settings apply as for any agent.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from ..errors import KVXError, UsageError
from .pool import Pool, PoolConfig

__all__ = ["main", "parse_size"]

_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40}


def parse_size(s: str) -> int:
    """``"64GiB"``, ``"512k"``, ``"1048576"`` -> bytes."""
    t = s.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if unit.endswith("b") and unit not in _UNITS:
        unit = unit[:-1]
    if unit not in _UNITS or not num.isdigit():
        raise UsageError(f"not a size: {s!r}")
    return int(num) * _UNITS[unit]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvx.pool.member", description=__doc__.split("\n")[0])
    p.add_argument("--etcd", required=True)
    p.add_argument("--pool", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--capacity", required=True, type=parse_size)
    p.add_argument("--block-bytes", required=True, type=parse_size)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--advertise", default=None)
    p.add_argument("--policy", default=None)
    p.add_argument("--ttl", type=int, default=5)
    p.add_argument("--lease-ttl", type=float, default=10.0)
    p.add_argument("--namespace", default="kvx")
    p.add_argument("--disk", default=None, help="slab file of a disk tier below the arena (created empty)")
    p.add_argument("--disk-capacity", type=parse_size, default=0)
    p.add_argument("--stdin", action="store_true", help="exit when stdin closes (a parent test's pipe)")
    a = p.parse_args(argv)
    kw = {} if a.policy is None else {"policy": a.policy}
    opts = PoolConfig(host=a.host, advertise=a.advertise, ttl=a.ttl, lease_ttl=a.lease_ttl, namespace=a.namespace,
                      **kw)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        pool = Pool(a.name, etcd=a.etcd, pool=a.pool, capacity=a.capacity, block_bytes=a.block_bytes, options=opts,
                    disk=a.disk, disk_capacity=a.disk_capacity)
    except KVXError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    with pool:
        srv = pool._server
        print(json.dumps({"ready": a.name, "ctl": list(srv.address) if srv else None}), flush=True)
        if a.stdin:
            def until_eof() -> None:
                sys.stdin.read()
                stop.set()

            threading.Thread(target=until_eof, daemon=True).start()
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
