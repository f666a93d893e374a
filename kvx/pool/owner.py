"""The owner side of a pool member: its arena of slots, the index of the blocks it holds, grants,
leases, eviction by the tiers' policy, and the checks every control message passes.

A member that stores blocks registers one arena (``nslots`` slots of ``block_bytes``) with its
agent. Clients reach a slot only through the owner:

- ``grant`` hands out slots for blocks to write, under a grant id bound to the client's
  connection and a deadline; ``commit`` (once per grant: a replayed or foreign grant id is refused)
  files the blocks with the client's checksums, or gives the slots back;
- ``lookup`` answers how many leading blocks of a list it holds and, asked to, takes a *lease* on
  their slots (the policy never evicts a leased block) returning each slot's generation and
  checksum; ``release`` ends the lease and tells whether it was still held (a lease that ran out
  may have let the slot be reused: the reader then counts the blocks as misses).

The data plane checks the same state: :meth:`Owner.guard` lets a target-side descriptor into the
arena only while its slots are granted (a write) or leased (a read) to the agent asking, so a
forged slot id, a replayed grant or another client's slot is refused by the target before a byte
moves (``PoolConfig.strict``). Grants and leases that outlive
their deadline, or whose client disconnects, are undone by the owner itself: nothing waits
forever on a client.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.tcp.target import SERVING
from ..errors import ProtocolError, TierFull
from ..memory import MemoryKind
from ..tiers.policies import EvictionPolicy, make_policy
from .disk import DiskSpill
from .placement import MAX_KEY

__all__ = ["Owner", "OwnerStats", "HELD", "REFUSED", "BUSY", "LOCAL"]

log = logging.getLogger(__name__)

#: grant codes besides a slot number (>= 0)
HELD = -1  # already stored here
REFUSED = -2  # no room (everything leased or in flight) or the policy declined it
BUSY = -3  # another client's grant for the same block is in flight

#: the client id of this process's own pool (calls that do not cross a connection)
LOCAL = "local"

_U64_MAX = (1 << 64) - 1


@dataclass(slots=True)
class OwnerStats:
    grants: int = 0
    granted: int = 0
    refused: int = 0
    committed: int = 0
    aborted: int = 0
    evicted: int = 0
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    leases: int = 0
    leases_expired: int = 0
    grants_expired: int = 0
    bad_requests: int = 0
    guard_refusals: int = 0


@dataclass(slots=True)
class _Grant:
    client: Any
    keys: list[bytes]
    parents: list[bytes | None]
    slots: list[int]
    deadline: float


@dataclass(slots=True)
class _Lease:
    client: Any
    slots: list[int]
    gens: list[int]
    deadline: float
    keys: list[bytes] = field(default_factory=list)


def _keys(v: Any, what: str, max_batch: int, none_ok: bool = False) -> list[Any]:
    if not isinstance(v, list):
        raise ProtocolError(f"{what} must be a list")
    if len(v) > max_batch:
        raise ProtocolError(f"{what}: {len(v)} blocks exceed the batch limit of {max_batch}")
    for k in v:
        if k is None and none_ok:
            continue
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY:
            raise ProtocolError(f"{what}: a block hash must be 1..{MAX_KEY} bytes")
    return v


def _ints(v: Any, what: str, n: int, lo: int, hi: int) -> list[int]:
    if not isinstance(v, list) or len(v) != n:
        raise ProtocolError(f"{what} must be a list of {n} ints")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
            raise ProtocolError(f"{what}: value out of range")
    return v


def _token(v: Any, what: str) -> bytes:
    if not isinstance(v, bytes) or len(v) != 16:
        raise ProtocolError(f"{what} must be 16 bytes")
    return v


class Owner:
    """Slots, index, grants and leases of one storing member (thread-safe).

    Parameters
    ----------
    nslots, block_bytes
        The arena's geometry.
    base
        Address of the arena (slot ``i`` is ``base + i * block_bytes``).
    policy
        Eviction policy name (:func:`kvx.tiers.policies.make_policy`).
    grant_ttl, lease_ttl
        Seconds a grant / a lease lasts before the owner undoes it.
    max_batch
        Most blocks in one request.
    disk
        A disk tier below the arena (:class:`~kvx.pool.disk.DiskSpill`): evicted blocks go
        there, and a lookup brings them back into the arena. The owner closes it.
    """

    def __init__(self, nslots: int, block_bytes: int, base: int, policy: str = "lru", grant_ttl: float = 10.0,
                 lease_ttl: float = 10.0, max_batch: int = 4096, disk: DiskSpill | None = None) -> None:
        self.nslots = int(nslots)
        self.block_bytes = int(block_bytes)
        self.base = int(base)
        self.grant_ttl = float(grant_ttl)
        self.lease_ttl = float(lease_ttl)
        self.max_batch = int(max_batch)
        self.policy: EvictionPolicy = make_policy(policy, self.nslots)
        self._lock = threading.Lock()
        self.index: dict[bytes, int] = {}
        self.key_of: list[bytes | None] = [None] * self.nslots
        self.gen = np.zeros(self.nslots, dtype=np.int64)
        self.sums = np.zeros(self.nslots, dtype=np.uint64)
        self.readers = np.zeros(self.nslots, dtype=np.int32)
        #: grants + leases per slot: what the data plane may touch
        self.open = np.zeros(self.nslots, dtype=np.int32)
        self.free: list[int] = list(range(self.nslots - 1, -1, -1))
        self.pending: dict[bytes, int] = {}  # key -> slot granted, not committed yet
        #: slot -> the agent id of the client a grant on it went to (the only one that may write it)
        self.writer: dict[int, str] = {}
        #: slot -> {agent id: leases} of the clients that may read it
        self.lessees: dict[int, dict[str, int]] = {}
        self.grants: dict[bytes, _Grant] = {}
        self.leases: dict[bytes, _Lease] = {}
        self.stats = OwnerStats()
        self.disk = disk

    # ---- grants ------------------------------------------------------------------------------
    def grant(self, client: Any, keys: list[bytes], parents: list[bytes | None]) -> tuple[bytes, list[int], str]:
        """Slots for the blocks of ``keys`` not held yet: ``(grant id, codes, why)``, a code per
        key (a slot, or HELD / REFUSED / BUSY); ``why`` says why blocks were refused."""
        gid = os.urandom(16)
        codes: list[int] = []
        slots: list[int] = []
        gkeys: list[bytes] = []
        gpar: list[bytes | None] = []
        why = ""
        with self._lock:
            self.stats.grants += 1
            full = False
            disk = self.disk
            for k, p in zip(keys, parents):
                if k in self.index:
                    self.policy.hit(k)
                    codes.append(HELD)
                    continue
                if disk is not None and k in disk:
                    disk.policy.hit(k)
                    codes.append(HELD)
                    continue
                if k in self.pending:
                    codes.append(BUSY)
                    continue
                if full:
                    codes.append(REFUSED)
                    continue
                self.policy.miss(k)
                if p is not None and p not in self.index:
                    p = None  # its parent lives on another member: a root here
                if not self.policy.admit(k, p):
                    codes.append(REFUSED)
                    why = why or "the eviction policy declined the block"
                    continue
                if not self.free and not self._evict_one():
                    full = True
                    why = "full: every block is leased or being written"
                    codes.append(REFUSED)
                    continue
                s = self.free.pop()
                self.gen[s] += 1
                self.open[s] += 1
                self.writer[s] = _cid(client)
                self.pending[k] = s
                codes.append(s)
                slots.append(s)
                gkeys.append(k)
                gpar.append(p)
            nref = codes.count(REFUSED)
            self.stats.refused += nref
            self.stats.granted += len(slots)
            if slots:
                self.grants[gid] = _Grant(client, gkeys, gpar, slots, time.monotonic() + self.grant_ttl)
        return gid, codes, why

    def _evict_one(self) -> bool:
        """Evict the policy's victim (caller holds the lock); False if nothing is evictable."""
        try:
            k = self.policy.victim()
        except TierFull:
            return False
        s = self.index.pop(k)  # type: ignore[call-overload]
        if self.readers[s]:  # pragma: no cover - leased keys are pinned in the policy
            self.index[k] = s  # type: ignore[index]
            log.error("pool: the policy offered a leased block as its victim")
            return False
        self.policy.removed(k)
        self.key_of[s] = None
        if self.disk is not None:  # down to the disk tier, not dropped (a failed write drops it)
            self.disk.spill(k, self.base + s * self.block_bytes, int(self.sums[s]))  # type: ignore[arg-type]
        self.gen[s] += 1
        self.free.append(s)
        self.stats.evicted += 1
        return True

    def _restore(self, k: bytes) -> int | None:
        """Bring block ``k`` back from the disk tier into an arena slot (lock held); its slot, or
        None (not on disk, no arena slot to be had, or its bytes failed their checksum)."""
        disk = self.disk
        got = disk.take(k) if disk is not None else None
        if got is None:
            return None
        assert disk is not None
        dslot, crc = got
        if not self.free and not self._evict_one():
            disk.give_back(k, dslot, crc)
            return None
        s = self.free.pop()
        self.gen[s] += 1
        if not disk.restore(dslot, crc, self.base + s * self.block_bytes):
            self.free.append(s)
            return None
        self.index[k] = s
        self.key_of[s] = k
        self.sums[s] = crc
        self.policy.inserted(k, None)
        return s

    def commit(self, client: Any, gid: bytes, slots: list[int], sums: list[int], ok: bool) -> int:
        """File the blocks of grant ``gid`` (``ok``) or give its slots back; returns blocks filed.

        Raises
        ------
        ProtocolError
            If the grant is unknown, spent, expired, another client's, or ``slots`` is not its
            slot list (a forged commit also gives the grant's slots back).
        """
        with self._lock:
            g = self.grants.get(gid)
            if g is None or g.client is not client:
                raise ProtocolError("unknown, spent or expired grant")
            del self.grants[gid]
            if slots != g.slots or len(sums) != len(g.slots):
                self._abort(g)
                raise ProtocolError("commit names slots other than the grant's")
            if not ok:
                self._abort(g)
                return 0
            for k, p, s, c in zip(g.keys, g.parents, g.slots, sums):
                self.open[s] -= 1
                del self.writer[s]
                del self.pending[k]
                self.index[k] = s
                self.key_of[s] = k
                self.sums[s] = c
                self.policy.inserted(k, p if p is not None and p in self.index else None)
            self.stats.committed += len(g.slots)
            return len(g.slots)

    def _abort(self, g: _Grant) -> None:
        for k, s in zip(g.keys, g.slots):
            self.open[s] -= 1
            self.writer.pop(s, None)
            self.pending.pop(k, None)
            self.gen[s] += 1
            self.free.append(s)
        self.stats.aborted += len(g.slots)

    # ---- leases -------------------------------------------------------------------------------
    def lookup(self, client: Any, keys: list[bytes], lease: bool
               ) -> tuple[int, list[int], list[int], list[int], bytes | None]:
        """How many leading ``keys`` are held: ``(n, slots, gens, sums, lease id)``; with
        ``lease`` the n slots are leased (not evicted, open to the data plane) until release."""
        slots: list[int] = []
        disk = self.disk
        with self._lock:
            self.stats.lookups += 1
            if disk is not None:  # an access: the disk's victims, while it restores, are other blocks
                for k in keys:
                    if k in disk:
                        disk.policy.hit(k)
            for k in keys:
                s = self.index.get(k)
                if s is None and disk is not None and k in disk:
                    s = self._restore(k)  # may evict (and spill) others: not this lookup's blocks
                if s is None:
                    self.policy.miss(k)
                    break
                self.policy.hit(k)
                if disk is not None:
                    self.policy.set_evictable(k, False)
                slots.append(s)
            n = len(slots)
            if disk is not None:
                for s in slots:
                    if not self.readers[s]:
                        self.policy.set_evictable(self.key_of[s], True)  # type: ignore[arg-type]
            self.stats.hits += n
            self.stats.misses += len(keys) - n
            gens = self.gen[slots].tolist()
            sums = self.sums[slots].tolist()
            lid = None
            if lease and n:
                lid = os.urandom(16)
                cid = _cid(client)
                for s in slots:
                    self._pin(s, cid)
                self.leases[lid] = _Lease(client, slots, gens, time.monotonic() + self.lease_ttl)
                self.stats.leases += 1
        return n, slots, gens, sums, lid

    def _pin(self, s: int, cid: str) -> None:
        if self.readers[s] == 0:
            k = self.key_of[s]
            if k is not None:
                self.policy.set_evictable(k, False)
        self.readers[s] += 1
        self.open[s] += 1
        by = self.lessees.setdefault(s, {})
        by[cid] = by.get(cid, 0) + 1

    def _unpin(self, s: int, cid: str) -> None:
        by = self.lessees[s]
        if by[cid] == 1:
            del by[cid]
            if not by:
                del self.lessees[s]
        else:
            by[cid] -= 1
        self.readers[s] -= 1
        self.open[s] -= 1
        if self.readers[s] == 0:
            k = self.key_of[s]
            if k is not None:
                self.policy.set_evictable(k, True)

    def release(self, client: Any, lid: bytes) -> bool:
        """End lease ``lid``: True if it was still held (its slots kept their blocks throughout)."""
        with self._lock:
            ls = self.leases.get(lid)
            if ls is None or ls.client is not client:
                return False
            del self.leases[lid]
            cid = _cid(client)
            for s in ls.slots:
                self._unpin(s, cid)
            return all(int(self.gen[s]) == g for s, g in zip(ls.slots, ls.gens))

    # ---- housekeeping ------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> None:
        """Undo grants and leases past their deadline."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for gid in [g for g, v in self.grants.items() if v.deadline <= now]:
                self._abort(self.grants.pop(gid))
                self.stats.grants_expired += 1
            for lid in [x for x, v in self.leases.items() if v.deadline <= now]:
                ls = self.leases.pop(lid)
                for s in ls.slots:
                    self._unpin(s, _cid(ls.client))
                self.stats.leases_expired += 1

    def drop_client(self, client: Any) -> None:
        """A client disconnected: undo its grants, end its leases."""
        with self._lock:
            for gid in [g for g, v in self.grants.items() if v.client is client]:
                self._abort(self.grants.pop(gid))
            for lid in [x for x, v in self.leases.items() if v.client is client]:
                for s in self.leases.pop(lid).slots:
                    self._unpin(s, _cid(client))

    def guard(self, kind: MemoryKind, addr: np.ndarray, nbytes: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The data plane's check: ``slots`` (the agent's region slot per descriptor, -1 refused)
        with every descriptor that reaches into the arena outside open (granted or leased) slots
        set to -1. Vectorised; a descriptor may span several arena slots."""
        if kind != MemoryKind.HOST or len(addr) == 0:
            return slots
        a = addr.astype(np.uint64)
        end = a + nbytes.astype(np.uint64)
        hi = self.base + self.nslots * self.block_bytes
        inside = (end > self.base) & (a < hi)
        if not inside.any():
            return slots
        bb = self.block_bytes
        first = ((np.maximum(a[inside], self.base) - self.base) // bb).astype(np.int64)
        last = ((np.minimum(end[inside], hi) - 1 - self.base) // bb).astype(np.int64)
        lo = int(first.min())
        with self._lock:  # open slots counted over the window the request touches only
            cs = np.concatenate(([0], np.cumsum(self.open[lo:int(last.max()) + 1] > 0)))
        ok = (cs[last - lo + 1] - cs[first - lo]) == (last - first + 1)
        pid, op = getattr(SERVING, "peer_id", None), getattr(SERVING, "op", None)
        if ok.all() and pid is not None and op in ("w", "r"):
            # served by a tcp target thread: the slots must be granted (a write) or leased (a
            # read) to the very agent asking
            with self._lock:
                writer, lessees = self.writer, self.lessees
                for i, (f, la) in enumerate(zip(first.tolist(), last.tolist())):
                    for sl in range(f, la + 1):
                        if (writer.get(sl) != pid) if op == "w" else (pid not in lessees.get(sl, ())):
                            ok[i] = False
                            break
        if ok.all():
            return slots
        out = slots.copy()
        idx = np.flatnonzero(inside)[~ok]
        out[idx] = -1
        with self._lock:
            self.stats.guard_refusals += 1
        return out

    # ---- the wire ------------------------------------------------------------------------------
    def handle(self, client: Any, msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Serve one control message (already a checked msgpack envelope); returns the reply's
        type and fields (type ``""``: no reply, a ``release`` sent with ``ack=False``). Raises
        ProtocolError on a malformed or refused request (nothing changed)."""
        t = msg.get("t")
        try:
            if t == "grant":
                keys = _keys(msg.get("keys"), "grant.keys", self.max_batch)
                parents = _keys(msg.get("parents"), "grant.parents", self.max_batch, none_ok=True)
                if len(parents) != len(keys):
                    raise ProtocolError("grant.parents must match grant.keys")
                gid, codes, why = self.grant(client, keys, parents)
                return "granted", {"gid": gid, "codes": codes, "why": why}
            if t == "commit":
                gid = _token(msg.get("gid"), "commit.gid")
                slots = msg.get("slots")
                if not isinstance(slots, list) or len(slots) > self.max_batch:
                    raise ProtocolError("commit.slots must be a list within the batch limit")
                _ints(slots, "commit.slots", len(slots), 0, self.nslots - 1)
                sums = _ints(msg.get("sums"), "commit.sums", len(slots), 0, _U64_MAX)
                ok = msg.get("ok")
                if not isinstance(ok, bool):
                    raise ProtocolError("commit.ok must be a bool")
                return "committed", {"n": self.commit(client, gid, slots, sums, ok)}
            if t == "lookup":
                keys = _keys(msg.get("keys"), "lookup.keys", self.max_batch)
                lease = msg.get("lease")
                if not isinstance(lease, bool):
                    raise ProtocolError("lookup.lease must be a bool")
                n, slots, gens, sums, lid = self.lookup(client, keys, lease)
                return "found", {"n": n, "slots": slots, "gens": gens, "sums": sums, "lid": lid}
            if t == "release":
                lid = _token(msg.get("lid"), "release.lid")
                ack = msg.get("ack", True)
                if not isinstance(ack, bool):
                    raise ProtocolError("release.ack must be a bool")
                ok = self.release(client, lid)
                return ("released", {"ok": ok}) if ack else ("", {})
            raise ProtocolError(f"unknown pool request {str(t)[:40]!r}")
        except ProtocolError:
            self.stats.bad_requests += 1
            raise

    def check(self) -> None:
        """Assert the bookkeeping's invariants (tests)."""
        with self._lock:
            used = set(self.index.values()) | set(self.pending.values())
            assert len(used) == len(self.index) + len(self.pending), "a slot holds two blocks"
            assert used.isdisjoint(self.free), "a used slot is free"
            assert len(used) + len(self.free) == self.nslots, "a slot leaked"
            assert len(self.policy) == len(self.index), "policy and index disagree"
            want = np.zeros(self.nslots, dtype=np.int32)
            for g in self.grants.values():
                for s in g.slots:
                    want[s] += 1
            for ls in self.leases.values():
                for s in ls.slots:
                    want[s] += 1
            assert (want == self.open).all(), "open counts disagree with grants and leases"
            assert set(self.writer) == {sl for g in self.grants.values() for sl in g.slots}
            for sl, by in self.lessees.items():
                assert sum(by.values()) == self.readers[sl] and all(v > 0 for v in by.values())
            assert set(self.lessees) == set(np.flatnonzero(self.readers).tolist())
            assert (self.readers >= 0).all()
            for k, s in self.index.items():
                assert self.key_of[s] == k
            if self.disk is not None:
                self.disk.check()
                assert not set(self.disk.index) & set(self.index), "a block both in the arena and on disk"


def _cid(client: Any) -> str:
    """The agent id a client proved (a control connection's), or the client's own name (local
    calls, tests)."""
    extra = getattr(client, "extra", None)
    if isinstance(extra, dict) and isinstance(extra.get("peer_id"), str):
        return str(extra["peer_id"])
    return str(client)
