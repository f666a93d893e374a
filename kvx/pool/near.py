"""Same-node pool traffic: the owner moves the bytes itself, one copy, no socket in between.

A client on the owner's node (same boot id) offers its agent's metadata and a *landing* buffer on
its control connection (``near``). From then on:

- ``fetch`` replaces lookup + one-sided read + release: the owner looks the blocks up under a
  lease, copies their slots into the client's landing rows with its own agent (the ``host``
  backend: a shared mapping of the client's memfd, or CMA), ends the lease and answers the prefix
  length and the committed checksums. The client checks each landed block against its checksum as
  it copies it from the landing into ``dst``.
- ``store`` replaces grant + one-sided write + commit: the owner grants slots, reads the blocks
  from the client's ``src`` into them, checks each block's checksum in the arena and commits the
  blocks only if every one matches (otherwise gives the slots back).

The strict pool's rule is kept: the client never reaches the arena (the owner's serving agent
accepts no peer: :attr:`~kvx.backends._samenode.SameNodeLink.accept_peers`), the owner decides
which slots it copies, and it touches only memory the client registered and named. The landing,
not ``dst``, is what the owner writes: a client that gave up on an owner (timeout) drops that
connection's landing (deregistered, which waits for copies in flight and cuts off a stuck owner)
and never reuses it, so a copy that lands late lands in memory nobody reads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._native import nh64
from .._slots import BOOT_ID
from ..agent import Agent, PreparedList, Registration
from ..config import AgentConfig
from ..errors import KVXError, ProtocolError
from ..memory import DescList, MemoryKind, alloc_host
from .owner import HELD, REFUSED, Owner, _ints, _keys

__all__ = ["NearServer", "Landing", "NEAR_WINDOW", "on_this_node", "slot_rows"]

log = logging.getLogger(__name__)

#: Bytes of a client's landing buffer per same-node owner (rows of ``block_bytes``, at least one).
NEAR_WINDOW = 32 << 20


def on_this_node(meta: bytes, host: bool = False) -> bool:
    """Whether the agent of ``meta`` runs on this node (and, with ``host``, offers the host backend)."""
    try:
        info = Agent.parse_metadata(meta)
    except KVXError:
        return False
    return info.sections.get("_boot") == BOOT_ID and (not host or "host" in info.sections)


def slot_rows(base: int, n: int, bb: int) -> DescList:
    """``n`` host blocks of ``bb`` bytes from ``base`` on (an arena's slots, a landing's rows)."""
    return DescList.blocks(DescList.from_arrays(kind=MemoryKind.HOST, addr=[base], nbytes=[n * bb]), bb)


@dataclass(slots=True)
class _Client:
    peer: str
    landing: PreparedList
    rows: int


class NearServer:
    """The owner side: a serving agent (host backend only, accepting no peer) over ``arena``, and
    the ``near`` / ``fetch`` / ``store`` requests of same-node clients."""

    TYPES = ("near", "fetch", "store")

    def __init__(self, name: str, cfg: AgentConfig, arena: np.ndarray, owner: Owner, timeout: float) -> None:
        self.owner = owner
        self.timeout = float(timeout)
        self.bb = owner.block_bytes
        self.agent = Agent(f"{name}/near", dataclasses.replace(cfg, backends=("host",), listen=None, options={}))
        try:
            hb = self.agent.backend("host")
            hb.accept_peers = False  # type: ignore[attr-defined]
            with hb._lock:  # type: ignore[attr-defined]  # none can have come yet: its id was never published
                early = list(hb._accepted)  # type: ignore[attr-defined]
            for ch in early:
                ch.close()
            self._reg: Registration = self.agent.register(arena)
            self.arena = self.agent.prepare(slot_rows(owner.base, owner.nslots, self.bb))
        except BaseException:
            self.agent.close()
            raise
        self._lock = threading.Lock()
        self._clients: dict[int, _Client] = {}
        self._names: dict[str, int] = {}  # peer name -> connections using it

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, ch: Any, msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        t = msg.get("t")
        try:
            if t == "near":
                return self._near(ch, msg)
            with self._lock:
                c = self._clients.get(id(ch))
            if c is None:
                raise ProtocolError(f"{t} before a near handshake on this connection")
            if t == "fetch":
                return self._fetch(ch, c, msg)
            return self._store(ch, c, msg)
        except ProtocolError:
            self.owner.stats.bad_requests += 1
            raise

    def _peer_meta(self, ch: Any, meta: Any) -> bytes:
        if not isinstance(meta, bytes):
            raise ProtocolError("near.meta must be bytes")
        info = Agent.parse_metadata(meta)
        if info.agent_id != ch.extra.get("peer_id"):
            raise ProtocolError("near.meta names another agent than the connection's")
        return meta

    def _near(self, ch: Any, msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        meta = self._peer_meta(ch, msg.get("meta"))
        addr = _ints([msg.get("addr")], "near.addr", 1, 1, (1 << 64) - 1)[0]
        rows = _ints([msg.get("rows")], "near.rows", 1, 1, self.owner.max_batch)[0]
        if not on_this_node(meta, host=True):
            return "near", {"ok": False, "why": "not on this node"}
        try:
            peer = self.agent.add_peer(meta)
            landing = self.agent.prepare(slot_rows(addr, rows, self.bb), peer=peer)
        except KVXError as exc:
            return "near", {"ok": False, "why": str(exc)[:200]}
        with self._lock:
            old = self._clients.pop(id(ch), None)
            self._clients[id(ch)] = _Client(peer, landing, rows)
            self._names[peer] = self._names.get(peer, 0) + 1 - (old is not None and old.peer == peer)
        return "near", {"ok": True, "why": ""}

    def _fetch(self, ch: Any, c: _Client, msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        keys = _keys(msg.get("keys"), "fetch.keys", c.rows)
        n, slots, _gens, sums, lid = self.owner.lookup(ch, keys, lease=True)
        try:
            if n:
                x = None
                try:
                    x = self.agent.write(self.arena, slots, c.landing, np.arange(n))
                    x.wait(self.timeout)
                except KVXError as exc:
                    if x is not None:
                        x.cancel()
                    raise ProtocolError(f"the copy into the client's landing failed: {str(exc)[:160]}") from None
        finally:
            if lid is not None:
                self.owner.release(ch, lid)
        return "fetched", {"n": n, "sums": sums}

    def _store(self, ch: Any, c: _Client, msg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        keys = _keys(msg.get("keys"), "store.keys", self.owner.max_batch)
        parents = _keys(msg.get("parents"), "store.parents", self.owner.max_batch, none_ok=True)
        n = len(keys)
        if len(parents) != n:
            raise ProtocolError("store.parents must match store.keys")
        sums = _ints(msg.get("sums"), "store.sums", n, 0, (1 << 64) - 1)
        addrs = _ints(msg.get("addrs"), "store.addrs", n, 1, (1 << 64) - 1)
        meta = msg.get("meta")
        if meta is not None:  # the client registered memory since: refresh its regions
            try:
                self.agent.add_peer(self._peer_meta(ch, meta))
            except KVXError as exc:
                raise ProtocolError(f"store.meta: {str(exc)[:160]}") from None
        gid, codes, why = self.owner.grant(ch, keys, parents)
        g = [i for i, s in enumerate(codes) if s >= 0]
        if not g:
            return "stored", {"codes": codes, "why": why}
        slots = [codes[i] for i in g]
        gsums = [sums[i] for i in g]
        ok = False
        try:
            src = self.agent.prepare(DescList.from_arrays(
                kind=MemoryKind.HOST, addr=np.array([addrs[i] for i in g], dtype=np.uint64),
                nbytes=np.full(len(g), self.bb, dtype=np.uint64), dev=0), peer=c.peer)
            x = self.agent.read(self.arena, slots, src, np.arange(len(g)))
            try:
                x.wait(self.timeout)
            except KVXError:
                x.cancel()
                raise
            block = ctypes.c_char * self.bb
            base = self.owner.base
            ok = all(nh64(block.from_address(base + s * self.bb)) == want for s, want in zip(slots, gsums))
            if not ok:
                why = "a block read from the client did not match its checksum"
        except KVXError as exc:
            why = f"the copy from the client failed: {str(exc)[:160]}"
        self.owner.commit(ch, gid, slots, gsums, ok)
        for i in g:
            codes[i] = HELD if ok else REFUSED
        return "stored", {"codes": codes, "why": why}

    # ---- the rest ------------------------------------------------------------------------------
    def drop(self, ch: Any) -> None:
        """A control connection closed: forget its landing (and the peer, if no other uses it)."""
        with self._lock:
            c = self._clients.pop(id(ch), None)
            if c is None:
                return
            left = self._names.get(c.peer, 0) - 1
            if left > 0:
                self._names[c.peer] = left
                return
            self._names.pop(c.peer, None)
        try:
            self.agent.remove_peer(c.peer)
        except KVXError:
            log.debug("pool near: removing %s", c.peer, exc_info=True)

    def close(self) -> None:
        self.agent.close()


class Landing:
    """The client side: one same-node owner's landing buffer, registered with the client's agent,
    and a lock (one fetch at a time uses it; a busy landing sends the fetch the tcp way)."""

    def __init__(self, agent: Agent, rows: int, bb: int) -> None:
        self.agent = agent
        self.rows = rows
        self.bb = bb
        self.mem = alloc_host(rows * bb)
        self.reg = agent.register(self.mem)
        self.addr = int(self.reg.descs.addr[0])
        self.lock = threading.Lock()
        #: (slot, generation) of the client's registrations the owner was told of (metadata sent)
        self.known: set[tuple[int, int]] = set()

    def take(self, dst: PreparedList, didx: np.ndarray, sums: list[int]) -> int:
        """Copy rows ``0..`` into ``dst[didx]``, each checked in ``dst`` (what the caller gets)
        against ``sums`` right after its copy; returns the index of the first block that failed
        (``len`` if none; the blocks after it are not copied)."""
        block = ctypes.c_char * self.bb
        bb = self.bb
        for i, (a, want) in enumerate(zip(dst.descs.addr[didx].tolist(), sums)):
            ctypes.memmove(a, self.addr + i * bb, bb)
            if nh64(block.from_address(a)) != want:
                return i
        return len(sums)

    def close(self) -> None:
        """Deregister (waits, bounded, for the owner's copies in flight; cuts off a stuck one);
        the memory goes with the last reference."""
        try:
            self.reg.release()
        except KVXError:
            log.debug("pool near: releasing a landing", exc_info=True)
