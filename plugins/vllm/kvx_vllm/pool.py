"""The cluster-wide KV pool (:mod:`kvx.pool`) as the last tier of the connector's offload stores.

Turned on by ``pool_etcd`` in ``kv_connector_extra_config`` (offloading must be on too: the pool
sits below the host tier)::

    "kv_connector_extra_config": {"offload_host_gb": 8, "pool_etcd": "http://10.0.0.5:2379",
                                  "pool_name": "llama-70b", "pool_member": "node-3",
                                  "pool_capacity_gb": 64, "pool_host": "10.0.0.3"}

Every worker (TP rank) keeps one pool per KV cache group, because the blocks of a rank hold
its own heads and a group has a block size of its own: pool ``{pool_name}.tp{T}r{R}.g{G}``,
member ``{pool_member}-r{R}-g{G}``. So only engines of the same model, TP size and block size
share blocks, rank by rank; give each model its own ``pool_name``. A worker with
``pool_capacity_gb`` > 0 stores blocks for the pool (the capacity is split across its groups);
0 makes it a client that reads and writes the others' memory.

The scheduler asks the pool (every rank's pool of every group, through clients of its own that
store nothing) how many blocks beyond the ones its own stores hold it can load, so an engine
loads a prefix another engine computed: the prefix every rank's pool holds, since each rank loads
its own heads. A block the pool loses in between is a failed load, which vLLM recomputes.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import kvx
from kvx.pool import Pool, PoolConfig, PoolTier

__all__ = ["PoolSettings", "KEYS", "pool_name", "member_name", "open_pool", "group_pool_tier"]

log = logging.getLogger(__name__)

#: the ``kv_connector_extra_config`` keys of the pool
KEYS = ("pool_etcd", "pool_name", "pool_member", "pool_capacity_gb", "pool_host", "pool_replicas",
        "pool_timeout_s")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """The pool keys of ``kv_connector_extra_config``.

    Parameters
    ----------
    etcd
        ``pool_etcd``: etcd endpoint(s) of the pool's membership, ``http://host:2379`` (comma
        separated: the first that answers). Setting it turns the pool on.
    name
        ``pool_name``: the pool's name (one per model; default ``"kvx"``).
    member
        ``pool_member``: this engine's member name, unique among the engines of the pool
        (default: host name and process id).
    capacity_bytes
        ``pool_capacity_gb``: host memory each worker stores for the pool (0, the default: a
        client that stores nothing).
    host
        ``pool_host``: the address a storing worker listens on for the pool and that other
        members dial (default ``127.0.0.1``: one machine).
    replicas
        ``pool_replicas``: owners per block (1..8, default 1).
    timeout_s
        ``pool_timeout_s``: bound on one round with one owner (default 5 s); the scheduler's
        lookups wait at most this long for a slow member, then skip it for a while.
    """

    etcd: str
    name: str = "kvx"
    member: str = ""
    capacity_bytes: int = 0
    host: str = "127.0.0.1"
    replicas: int = 1
    timeout_s: float = 5.0

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "PoolSettings | None":
        """Take (pop) the ``pool_*`` keys out of ``extra`` (the rest of the connector's settings);
        None when ``pool_etcd`` is not set. Raises ``ValueError`` on an unknown ``pool_*`` key, a
        bad value, or a pool without offloading."""
        got = {k: extra.pop(k) for k in [k for k in extra if isinstance(k, str) and k.startswith("pool_")]}
        bad = sorted(set(got) - set(KEYS))
        if bad:
            raise ValueError(f"unknown kv_connector_extra_config key for KVXConnector: {bad[0]!r} "
                             f"(the pool's keys: {', '.join(KEYS)})")
        etcd = got.pop("pool_etcd", None)
        if etcd in (None, ""):
            if got:
                raise ValueError(f"{', '.join(sorted(got))} given without pool_etcd (the pool's etcd endpoint)")
            return None
        if not isinstance(etcd, str) or not all(e.strip().startswith(("http://", "https://"))
                                                for e in etcd.split(",")):
            raise ValueError(f"pool_etcd must be http(s)://host:port endpoints, comma separated, not {etcd!r}")
        host_size = extra.get("offload_host_gb", extra.get("offload_host_bytes", 0))
        try:
            host_ok = float(host_size) > 0
        except (TypeError, ValueError):
            host_ok = True  # the offload keys' own check says what is wrong
        off = extra.get("offload")
        if not host_ok or (off is not None and str(off).strip().lower() in ("0", "false", "no", "off")):
            raise ValueError("pool_etcd needs offloading on (offload_host_gb > 0): the pool is the last tier "
                             "of the offload store, below its host tier")
        kw: dict[str, Any] = {"etcd": etcd.strip()}
        for key, field in (("pool_name", "name"), ("pool_member", "member"), ("pool_host", "host")):
            if key in got:
                v = got[key]
                if not isinstance(v, str) or not v or "/" in v or len(v) > 100:
                    raise ValueError(f"{key} must be a non-empty string without '/' (at most 100 characters), "
                                     f"not {v!r}")
                kw[field] = v
        if kw.get("host") in ("0.0.0.0", "::"):
            raise ValueError("pool_host is the address other members dial: give this machine's address, "
                             "not a wildcard")
        if "pool_capacity_gb" in got:
            kw["capacity_bytes"] = int(_number(got["pool_capacity_gb"], "pool_capacity_gb", 0.0) * (1 << 30))
        if "pool_replicas" in got:
            r = got["pool_replicas"]
            if isinstance(r, str) and r.strip().isdigit():
                r = int(r)
            if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 8:
                raise ValueError(f"pool_replicas must be an int in 1..8, not {r!r}")
            kw["replicas"] = r
        if "pool_timeout_s" in got:
            kw["timeout_s"] = _number(got["pool_timeout_s"], "pool_timeout_s", 0.0, strict=True)
        return cls(**kw)

    def member_base(self) -> str:
        return self.member or f"{socket.gethostname()}-{os.getpid()}"


def _number(v: Any, key: str, lo: float, strict: bool = False) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, not {v!r}") from None
    if isinstance(v, bool) or x != x or x < lo or (strict and x == lo) or x == float("inf"):
        raise ValueError(f"{key} must be a {'positive' if strict else 'non-negative'} number, not {v!r}")
    return x


def pool_name(s: PoolSettings, tp_size: int, rank: int, group: int) -> str:
    """The pool that rank ``rank`` of a TP ``tp_size`` engine uses for KV cache group ``group``."""
    return f"{s.name}.tp{tp_size}r{rank}.g{group}"


def member_name(s: PoolSettings, rank: int, group: int, role: str = "") -> str:
    return f"{s.member_base()}{'-' + role if role else ''}-r{rank}-g{group}"


def open_pool(s: PoolSettings, *, tp_size: int, rank: int, group: int, block_bytes: int, capacity: int,
              agent: kvx.Agent | None = None, role: str = "") -> Pool:
    """Join (``capacity`` > 0) or use the pool of one rank and group."""
    opts = PoolConfig(host=s.host, replicas=s.replicas, timeout=s.timeout_s)
    cap = capacity - capacity % block_bytes if block_bytes and capacity >= block_bytes else 0
    if capacity and not cap:
        log.warning("kvx_vllm: pool capacity %d holds no block of %d bytes: this worker only uses the pool",
                    capacity, block_bytes)
    return Pool(member_name(s, rank, group, role), etcd=s.etcd, pool=pool_name(s, tp_size, rank, group),
                capacity=cap, block_bytes=block_bytes, options=opts, agent=agent)


def group_pool_tier(s: PoolSettings | None, *, tp_size: int, rank: int, group: int, ngroups: int,
                    block_bytes: int, agent: kvx.Agent) -> PoolTier | None:
    """The remote tier of one worker's offload store of group ``group`` (None: no pool). The pool
    moves blocks with the worker's ``agent``; the store's close leaves the pool."""
    if s is None:
        return None
    pool = open_pool(s, tp_size=tp_size, rank=rank, group=group, block_bytes=block_bytes,
                     capacity=s.capacity_bytes // max(1, ngroups), agent=agent)
    log.info("kvx_vllm: %s in pool %s (%d members)", pool.name, pool_name(s, tp_size, rank, group),
             len(pool.members()))
    return PoolTier(pool, close_pool=True)


def worker_pool_tier(worker: Any, group: int, block_bytes: int) -> PoolTier | None:
    """:func:`group_pool_tier` for a :class:`kvx_vllm.worker.KVXWorker`'s store of ``group``."""
    return group_pool_tier(worker.cfg.pool, tp_size=int(worker.vllm_config.parallel_config.tensor_parallel_size),
                           rank=worker.tp_rank, group=group, ngroups=max(1, len(worker.groups)),
                           block_bytes=block_bytes, agent=worker.agent)


class PoolLookup:
    """The scheduler's view of the pool: clients that only look up (no memory, no blocks moved),
    one per TP rank's pool of every group (``pools[(group, rank)]``)."""

    def __init__(self, s: PoolSettings, tp_size: int, groups: tuple[int, ...]) -> None:
        self.pools: dict[tuple[int, int], Pool] = {}
        self.groups = tuple(groups)
        self.tp_size = tp_size
        try:
            for g in groups:
                for r in range(tp_size):
                    self.pools[(g, r)] = open_pool(s, tp_size=tp_size, rank=r, group=g, block_bytes=0, capacity=0,
                                                   role="sched")
        except BaseException:
            self.close()
            raise
        self.lookups = 0
        self.hits = 0

    def lookup(self, keys: list[list[bytes]]) -> int:
        """Blocks of the prefix ``keys`` (one key list per group, in the order given at start)
        that every rank's pool of every group holds (0 on any failure)."""
        n = min((len(k) for k in keys), default=0)
        for g, ks in zip(self.groups, keys):
            for r in range(self.tp_size):
                if not n:
                    break
                try:
                    n = min(n, self.pools[(g, r)].lookup(ks[:n]))
                except kvx.KVXError as exc:
                    log.warning("kvx_vllm: pool lookup failed: %s", exc)
                    n = 0
        self.lookups += 1
        self.hits += n
        return n

    def close(self) -> None:
        for p in self.pools.values():
            p.close()
        self.pools.clear()
