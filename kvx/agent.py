"""The north-bound API: :class:`Agent`, :class:`Registration`, :class:`PreparedList`."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
import weakref
from collections import defaultdict
from typing import Any, Callable

import numpy as np

from . import _args as arg
from . import wire
from ._slots import BOOT_ID, MAX_SLOTS
from .backends import registry
from .backends.base import (
    Backend,
    BackendContext,
    DoneRequest,
    FlatRoute,
    Op,
    PeerInfo,
    Request,
    Route,
    index_array,
    region_rows,
    validate,
)
from .config import AgentConfig
from .errors import (
    ArgumentTypeError,
    ArgumentValueError,
    BackendUnavailable,
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    UsageError,
)
from .memory import DescList, FileRegion, MemoryKind, ObjectRegion, Region, regions_of
from .transfer import Transfer, TransferPlan

__all__ = ["Agent", "Registration", "PreparedList", "MAX_SLOTS"]

log = logging.getLogger(__name__)

_U64 = np.uint64
#: ``PreparedList.bdata[name]`` of a strided list that backend ``name`` moves as its expansion
#: (prepared on ``PreparedList.flat`` at the first route through that backend)
_FLAT = object()


class Registration:
    """Memory registered with an agent. ``descs`` has one descriptor per region.

    Release with :meth:`release` (or a ``with`` block): after it returns, no peer can read or
    write the memory any more.
    """

    def __init__(self, agent: "Agent", slots: list[int], descs: DescList, objs: Any) -> None:
        if not isinstance(agent, Agent) or not isinstance(descs, DescList):
            raise ArgumentTypeError("a Registration is made by Agent.register(), not built directly")
        self._agent_ref = weakref.ref(agent)
        self.slots = slots
        self.descs = descs
        self._objs = objs  # keeps the memory alive
        self.released = False

    @property
    def kind(self) -> MemoryKind:
        """The memory kind of every region in this registration."""
        return self.descs.kind

    def release(self) -> None:
        """Deregister. Idempotent. Transfers racing the release fail cleanly."""
        if self.released:
            return
        agent = self._agent_ref()
        self.released = True
        if agent is not None and not agent.closed:
            agent._release(self)
        self._objs = None

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "live"
        return f"<Registration {self.descs.kind.name} regions={len(self.descs)} {state}>"


class PreparedList:
    """A descriptor list validated once against registrations, ready for many transfers.

    Attributes
    ----------
    descs
        The descriptors.
    peer
        The peer's name, or None for a local list.
    slots
        Per descriptor, the registration slot (region) that contains it.
    """

    __slots__ = ("__weakref__", "agent", "bdata", "descs", "epoch", "flat", "fmap", "froutes", "gens", "peer", "pinfo",
                 "rroutes", "slots", "used", "wroutes")

    def __init__(self, agent: "Agent", peer: str | None, descs: DescList, slots: np.ndarray, gens: dict[int, int],
                 pinfo: PeerInfo | None) -> None:
        if not isinstance(agent, Agent) or not isinstance(descs, DescList):
            raise ArgumentTypeError("a PreparedList is made by Agent.prepare(), not built directly")
        self.agent = agent
        self.peer = peer
        self.descs = descs
        self.slots = slots
        self.gens = gens  # slot -> generation at prepare time
        self.used = np.fromiter(gens.keys(), dtype=np.int64, count=len(gens))
        self.bdata: dict[str, Any] = {}
        self.pinfo = pinfo
        self.epoch = agent._epoch
        # remote list -> the Route of the backend that serves the pair for reads / for writes,
        # made at the pair's first post
        self.rroutes: dict[PreparedList, Route] = {}
        self.wroutes: dict[PreparedList, Route] = {}
        # the same for posts that name their backend, by (op, remote list, backend name)
        self.froutes: dict[tuple[Op, PreparedList, str], Route] = {}
        # a strided list's expansion (one descriptor per piece) for backends that move plain
        # descriptors only, and the map from a descriptor to its pieces: (first piece, count)
        self.flat: PreparedList | None = None
        self.fmap: tuple[np.ndarray, np.ndarray] | None = None

    def routes(self, op: Op) -> dict[PreparedList, Route]:
        """The routes of this (local) list for ``op``, by remote list."""
        return self.wroutes if op is Op.WRITE else self.rroutes

    @property
    def kind(self) -> MemoryKind:
        return self.descs.kind

    def __len__(self) -> int:
        return len(self.descs)

    def __repr__(self) -> str:
        where = f"peer={self.peer!r}" if self.peer else "local"
        return f"<PreparedList {self.descs.kind.name} n={len(self.descs)} {where}>"


class Agent:
    """One endpoint of kvx: registers memory, connects to peers, posts transfers.

    Parameters
    ----------
    name
        Unique name of this agent among its peers.
    config
        Settings; defaults come from ``KVX_*`` environment variables.

    Examples
    --------
    >>> with kvx.Agent("a") as a:                         # doctest: +SKIP
    ...     reg = a.register(kvx.alloc_host(1 << 20))
    """

    def __init__(self, name: str, config: AgentConfig | None = None) -> None:
        arg.name(name, "agent name", max_len=256)
        if config is not None and not isinstance(config, AgentConfig):
            raise ArgumentTypeError(f"config must be a kvx.AgentConfig or None, not {type(config).__name__}")
        self.name = name
        self.config = config if config is not None else AgentConfig()
        self.id = uuid.uuid4().hex
        self.closed = False
        self._lock = threading.RLock()
        self._regions: dict[int, tuple[Region | Any, int]] = {}  # slot -> (region, gen)
        self._gens = np.zeros(MAX_SLOTS, dtype=np.int64)  # current generation per slot (0: free)
        self._gen_counter = 0
        self._free: list[int] = []
        self._next_slot = 1  # slot 0 is never used
        self._table_cache: list[tuple[int, int, int, int, int, int]] | None = None
        self._peers: dict[str, PeerInfo] = {}
        self._adding: dict[str, threading.Lock] = {}  # peer name -> held while add_peer connects it
        self._notifs: dict[str, list[bytes]] = defaultdict(list)
        self._notif_lock = threading.Lock()
        self._notif_cv = threading.Condition(self._notif_lock)
        self._epoch = 0  # bumped by every release: prepared lists re-check liveness only then
        self._handles: dict[int, list[tuple[Backend, Any]]] = {}
        ctx = BackendContext(
            agent_name=name,
            agent_id=self.id,
            config=self.config,
            deliver=self._deliver,
            validate_local=self._validate_local,
            regions=self._region_map,
        )
        self.backends: list[Backend] = []
        for bname, opts in self.config.options.items():
            try:
                cls = registry.get(bname)
            except BackendUnavailable as exc:
                raise UsageError(f"options for {bname!r}: {exc}") from None
            if cls.Options is None:
                raise UsageError(f"options for {bname!r}: this backend takes no options")
            if type(opts) is not cls.Options:
                raise UsageError(f"options for {bname!r} must be a {cls.Options.__name__}, not {type(opts).__name__}")
        try:
            self._start_backends(ctx)
        except BaseException:
            Agent._shutdown(self.backends)  # the ones already started: their threads and sockets
            raise
        if not self.backends:
            raise BackendUnavailable("no kvx backend is available here")
        self._side: Any = None
        if self.config.listen is not None:
            from .discovery import SideChannel

            try:
                self._side = SideChannel(self, *self.config.listen)
            except BaseException:
                Agent._shutdown(self.backends)
                raise
        self._finalizer = weakref.finalize(self, Agent._shutdown, list(self.backends))

    def _start_backends(self, ctx: BackendContext) -> None:
        for bname, cls in registry.ordered(self.config.backends):
            reason = cls.unavailable_reason()
            if reason is not None:
                if self.config.backends:
                    raise BackendUnavailable(f"backend {bname!r} is unavailable: {reason}")
                log.debug("backend %s unavailable: %s", bname, reason)
                continue
            try:
                opts = self.config.options.get(bname)
                if opts is None and cls.Options is not None:
                    opts = cls.Options()
                self.backends.append(cls(dataclasses.replace(ctx, options=opts)))
            except BackendUnavailable:
                if self.config.backends:
                    raise
                log.debug("backend %s failed to start", bname, exc_info=True)

    # ------------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.closed:
            raise UsageError(f"agent {self.name!r} is closed")

    def backend(self, name: str) -> Backend:
        """Return the running backend called ``name``."""
        arg.name(name, "backend name")
        for b in self.backends:
            if b.name == name:
                return b
        raise BackendUnavailable(f"backend {name!r} is not running in agent {self.name!r}")

    def _deliver(self, peer: str, msg: bytes) -> None:
        with self._notif_cv:
            self._notifs[peer].append(msg)
            self._notif_cv.notify_all()

    def _region_map(self) -> dict[int, tuple[Any, int]]:
        with self._lock:
            return dict(self._regions)

    def regions(self) -> dict[int, tuple[Any, int]]:
        """This agent's live registrations, a snapshot: ``{slot: (region, generation)}``.

        ``region`` is what was registered at that slot: a :class:`kvx.Region` (its ``owner``
        keeps the memory alive) or a storage region (FILE, OBJECT); ``generation`` is the one a
        :class:`PreparedList` records for the slot (``gens``), so a caller can tell a
        registration released and replaced since it prepared a list. Backends read the same map.
        """
        return self._region_map()

    def table(self) -> list[tuple[int, int, int, int, int, int]]:
        """Live regions as ``(kind, addr, nbytes, dev, slot, gen)`` rows."""
        with self._lock:
            if self._table_cache is None:
                rows = []
                for slot, (r, gen) in self._regions.items():
                    if isinstance(r, Region):
                        rows.append((int(r.kind), r.addr, r.nbytes, r.dev, slot, gen))
                    else:  # storage region: (kind, nbytes)
                        rows.append((int(r.kind), 0, r.nbytes, slot, slot, gen))
                self._table_cache = rows
            return self._table_cache

    def _validate_local(self, kind: MemoryKind, addr: np.ndarray, nbytes: np.ndarray, dev: np.ndarray) -> np.ndarray:
        slots, ok = validate(kind, addr, nbytes, dev, self.table())
        return np.where(ok, slots, -1)

    # ------------------------------------------------------------------------------------------
    def register(self, obj: Any) -> Registration:
        """Register memory so that transfers (and peers) can reach it.

        Parameters
        ----------
        obj
            A numpy array, buffer or memoryview, ``kvx.alloc_host(n)`` memory, a torch CPU or
            CUDA tensor, a cupy array, ``kvx.FileRegion``, ``kvx.ObjectRegion``,
            ``kvx.RawRegion``, or a list of these (all of one memory kind).

        Raises
        ------
        RegistrationError
            If the memory cannot be registered (empty, read-only, non-contiguous, overlapping
            an existing registration, mixed kinds).
        BackendUnavailable
            If no running backend serves this kind of memory.
        """
        self._check()
        regs = regions_of(obj)
        kinds = {self._kind_of(r) for r in regs}
        if len(kinds) != 1:
            raise RegistrationError("a registration holds one memory kind; register the kinds separately")
        kind = kinds.pop()
        serving = [b for b in self.backends if kind in b.kinds]
        if not serving:
            raise BackendUnavailable(f"no running backend serves {kind.name} memory "
                                     f"(running: {', '.join(b.name for b in self.backends)})")
        with self._lock:
            self._check_overlap(regs)
            if len(self._regions) + len(regs) >= MAX_SLOTS - 1:
                raise RegistrationError(f"too many registered regions (at most {MAX_SLOTS - 2})")
            slots: list[int] = []
            done: list[tuple[int, Any, list[tuple[Backend, Any]]]] = []
            try:
                for r in regs:
                    slot = self._free.pop() if self._free else self._next_slot
                    if slot == self._next_slot:
                        self._next_slot += 1
                    self._gen_counter += 1
                    gen = self._gen_counter
                    if isinstance(r, (FileRegion, ObjectRegion)):
                        r = _StorageRegion.of(r, slot)
                    handles: list[tuple[Backend, Any]] = []
                    done.append((slot, r, handles))
                    for b in serving:
                        handles.append((b, b.register(r, slot, gen)))
                    self._regions[slot] = (r, gen)
                    self._gens[slot] = gen
                    slots.append(slot)
            except BaseException:
                for slot, r, handles in done:
                    for b, h in handles:
                        try:
                            b.deregister(r, h)
                        except Exception:
                            log.exception("undoing a failed registration")
                    self._regions.pop(slot, None)
                    self._gens[slot] = 0
                    self._free.append(slot)
                self._table_cache = None
                raise
            self._table_cache = None
            for slot, r, handles in done:
                self._handles[slot] = handles
        if kind in (MemoryKind.FILE, MemoryKind.OBJECT):
            descs = DescList.from_arrays(kind=kind, addr=np.zeros(len(regs), dtype=_U64),
                                         nbytes=[r.nbytes for r in regs], dev=slots)
        else:
            descs = DescList.from_arrays(kind=kind, addr=[r.addr for r in regs], nbytes=[r.nbytes for r in regs],
                                         dev=[r.dev for r in regs])
        return Registration(self, slots, descs, obj)

    @staticmethod
    def _kind_of(r: Any) -> MemoryKind:
        if isinstance(r, FileRegion):
            return MemoryKind.FILE
        if isinstance(r, ObjectRegion):
            return MemoryKind.OBJECT
        return r.kind

    def _check_overlap(self, regs: list[Any]) -> None:
        mem = [r for r in regs if isinstance(r, Region)]
        files = [r for r in regs if isinstance(r, FileRegion)]
        objs = [r for r in regs if isinstance(r, ObjectRegion)]
        if mem:
            have = [(r.kind, r.dev, r.addr, r.addr + r.nbytes) for r, _ in self._regions.values()
                    if isinstance(r, Region)]
            new = [(r.kind, r.dev, r.addr, r.addr + r.nbytes) for r in mem]
            allr = sorted(have + new, key=lambda x: (x[0], x[1], x[2]))
            for a, b in zip(allr, allr[1:]):
                if a[0] == b[0] and a[1] == b[1] and b[2] < a[3]:
                    raise RegistrationError(
                        f"memory at 0x{b[2]:x} overlaps memory already registered (or listed twice)")
        have_files = {s.path for s, _ in self._regions.values() if isinstance(s, _StorageRegion)}
        have_objs = {(s.bucket, s.key) for s, _ in self._regions.values() if isinstance(s, _StorageRegion)}
        for fr in files:
            if os.path.realpath(fr.path) in have_files:
                raise RegistrationError(f"file {fr.path!r} is already registered")
        for orr in objs:
            if (orr.bucket, orr.key) in have_objs:
                raise RegistrationError(f"object {orr.bucket}/{orr.key} is already registered")

    def _release(self, reg: Registration) -> None:
        with self._lock:
            self._epoch += 1
            for slot in reg.slots:
                entry = self._regions.pop(slot, None)
                if entry is None:
                    continue
                r, _gen = entry
                self._gens[slot] = 0
                self._table_cache = None
                for b, h in self._handles.pop(slot, []):
                    try:
                        b.deregister(r, h)
                    except KVXError:
                        log.warning("backend %s failed to deregister a region", b.name, exc_info=True)
                self._free.append(slot)

    # ------------------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """Everything a peer needs to reach this agent (versioned msgpack bytes)."""
        self._check()
        sections = {}
        for b in self.backends:
            m = b.metadata()
            if m is not None:
                sections[b.name] = m
        return wire.pack("meta", name=self.name, id=self.id, boot=BOOT_ID, pid=os.getpid(),
                         backends=sections, regions=[list(r) for r in self.table()])

    @staticmethod
    def parse_metadata(meta: bytes) -> PeerInfo:
        """Decode and check peer metadata; raise ProtocolError if malformed."""
        msg = wire.unpack(meta)
        wire.check(msg, "meta", {"name": str, "id": str, "boot": str, "pid": int, "backends": dict,
                                 "regions": list})
        if not msg["name"] or len(msg["name"]) > 256:
            raise ProtocolError("peer name is empty or too long")
        rows = region_rows(msg["regions"], "metadata")
        for k, v in msg["backends"].items():
            if not isinstance(k, str) or not isinstance(v, dict):
                raise ProtocolError("malformed backend section in metadata")
        info = PeerInfo(name=msg["name"], agent_id=msg["id"], sections=msg["backends"], regions=rows)
        info.sections = dict(info.sections)
        info.sections["_boot"] = msg["boot"]
        info.sections["_pid"] = msg["pid"]
        return info

    def add_peer(self, meta: bytes) -> str:
        """Connect to the agent described by ``meta`` (from its :meth:`metadata`).

        Returns the peer's name. Adding the same agent again refreshes its registrations.

        Raises
        ------
        ProtocolError
            If ``meta`` is malformed or of an incompatible version.
        BackendUnavailable
            If no running backend can reach the peer.
        """
        self._check()
        if not isinstance(meta, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"add_peer takes a peer's metadata() bytes, not {type(meta).__name__}")
        info = self.parse_metadata(meta)
        # one add_peer at a time per peer name: concurrent calls for the same agent (a burst of
        # pulls from a fresh decode instance) connect it once and the rest refresh it; connecting
        # it once per call replaced a connection other threads were starting or using
        with self._lock:
            adding = self._adding.setdefault(info.name, threading.Lock())
        with adding:
            return self._add_peer(info)

    def _add_peer(self, info: PeerInfo) -> str:
        with self._lock:
            old = self._peers.get(info.name)
            if old is not None and old.agent_id == info.agent_id:
                old.regions = info.regions
                return info.name
            if old is not None:
                self.remove_peer(info.name)
        if info.agent_id == self.id:
            raise UsageError("an agent cannot add itself as a peer; use local prepared lists")
        reached = []
        for b in self.backends:
            if not b.remote:
                continue
            try:
                if b.connect(info):
                    reached.append(b.name)
            except KVXError:
                log.debug("backend %s cannot reach %s", b.name, info.name, exc_info=True)
                raise
        if not reached:
            raise BackendUnavailable(f"no running backend reaches peer {info.name!r}")
        info.sections["_reached"] = reached
        with self._lock:
            self._peers[info.name] = info
        return info.name

    @property
    def side_channel(self) -> Any:
        """The :class:`kvx.discovery.SideChannel` serving this agent's metadata (``listen=``), or None."""
        return self._side

    def fetch_peer(self, host: str, port: int, timeout: float | None = None) -> str:
        """Fetch a peer's metadata from its side channel (``AgentConfig(listen=...)``) and add it.

        Authenticates with this agent's ``auth_token``; returns the peer's name.
        """
        self._check()
        arg.name(host, "fetch_peer host")
        port = arg.integer(port, "fetch_peer port", 1, 65535)
        if timeout is not None:
            timeout = arg.seconds(timeout, "fetch_peer timeout", positive=True)
        from .discovery import fetch_metadata

        meta = fetch_metadata(host, port, token=self.config.auth_token or "",
                              timeout=self.config.handshake_timeout if timeout is None else timeout)
        return self.add_peer(meta)

    def peers(self) -> list[str]:
        """Names of the connected peers."""
        with self._lock:
            return list(self._peers)

    def remove_peer(self, name: str) -> None:
        """Disconnect from a peer; its pending transfers fail with PeerDisconnected."""
        if not isinstance(name, str):
            raise ArgumentTypeError(f"remove_peer takes a peer name (str), not {type(name).__name__}")
        with self._lock:
            info = self._peers.pop(name, None)
        if info is None:
            return
        for b in self.backends:
            if b.remote:
                b.disconnect(name)

    def _peer(self, name: str) -> PeerInfo:
        with self._lock:
            info = self._peers.get(name)
        if info is None:
            raise UsageError(f"unknown peer {name!r}: call add_peer() with its metadata first")
        return info

    # ------------------------------------------------------------------------------------------
    def prepare(self, descs: DescList | Registration, peer: str | None = None) -> PreparedList:
        """Validate a descriptor list once (local, or against ``peer``'s registrations).

        A strided list (:meth:`DescList.strided`) is checked over each descriptor's whole span;
        backends that do not move strided descriptors natively get its expansion (one descriptor
        per piece) at the first transfer that routes through them.

        Raises
        ------
        RegistrationError
            If a descriptor lies outside the (live) registrations of this agent or the peer.
        """
        self._check()
        if isinstance(descs, Registration):
            descs = descs.descs
        if not isinstance(descs, DescList):
            raise ArgumentTypeError(f"prepare() takes a DescList or Registration, not {type(descs).__name__}")
        if peer is not None and not isinstance(peer, str):
            raise ArgumentTypeError(f"prepare() peer must be a peer name (str) or None, not {type(peer).__name__}")
        if len(descs) == 0:
            raise ArgumentValueError("cannot prepare an empty descriptor list")
        pinfo = None
        if peer is None:
            table = self.table()
        else:
            pinfo = self._peer(peer)
            table = pinfo.regions
        # a strided descriptor is checked over its whole span: every piece inside one registration
        span = descs.span
        slots, ok = validate(descs.kind, descs.addr, span, descs.dev, table)
        if not ok.all() and peer is not None:
            # the peer may have registered more since we saw its metadata: refresh once
            for b in self.backends:
                if b.name in pinfo.sections.get("_reached", ()):  # type: ignore[union-attr]
                    rows = b.refresh_regions(peer)
                    if rows is not None:
                        pinfo.regions = table = rows  # type: ignore[union-attr]
                        slots, ok = validate(descs.kind, descs.addr, span, descs.dev, rows)
                        break
        if not ok.all():
            bad = int(np.argmin(ok))
            where = f"peer {peer!r}" if peer else f"agent {self.name!r}"
            raise RegistrationError(
                f"descriptor {bad} ({descs.kind.name} 0x{int(descs.addr[bad]):x}+{int(span[bad])} "
                f"dev {int(descs.dev[bad])}) is outside the live registrations of {where}"
            )
        # the generations of the very table the descriptors were checked against: another thread's
        # add_peer of the same agent may replace pinfo.regions meanwhile (with older metadata rows)
        genof = {r[4]: r[5] for r in table}
        used = np.unique(slots)
        gens = {int(s): int(genof[int(s)]) for s in used}
        pl = PreparedList(self, peer, descs, slots, gens, pinfo)
        for b in self.backends:
            if descs.kind in b.kinds and (peer is None or b.name in pinfo.sections.get("_reached", ())):  # type: ignore[union-attr]
                try:
                    if descs.is_strided and not (b.strided and b.takes_strided(pl)):
                        pl.bdata[b.name] = _FLAT
                        continue
                    pl.bdata[b.name] = b.prepare(pl)
                except RegistrationError:
                    raise  # the target itself refuses a descriptor that its metadata claimed
                except KVXError:
                    log.debug("backend %s cannot prepare %r", b.name, pl, exc_info=True)
        return pl

    def _flat(self, pl: PreparedList, b: Backend) -> PreparedList | None:
        """``pl`` as backend ``b`` moves it: itself if plain or prepared natively, else its
        expansion (made once per list, prepared by ``b`` at its first use); None if ``b``
        cannot prepare the expansion."""
        if not pl.descs.is_strided:
            return pl
        with self._lock:
            fl = pl.flat
            if fl is None:
                count = pl.descs.count.astype(np.int64)
                fl = PreparedList(self, pl.peer, pl.descs.flatten(), np.repeat(pl.slots, count), pl.gens, pl.pinfo)
                fl.epoch = pl.epoch
                pl.fmap = (np.cumsum(count) - count, count)
                pl.flat = fl
        if b.name not in fl.bdata:
            try:
                fl.bdata[b.name] = b.prepare(fl)
            except RegistrationError:
                raise
            except KVXError:
                log.debug("backend %s cannot prepare the expansion of %r", b.name, pl, exc_info=True)
                return None
        return fl

    def _check_live(self, pl: PreparedList) -> None:
        if pl.epoch == self._epoch:
            return
        epoch = self._epoch
        if pl.peer is None:
            g = self._gens
            for s, gen in pl.gens.items():
                if g[s] != gen:
                    raise UsageError("a registration under this prepared list was released; prepare again")
        pl.epoch = epoch

    def _check_post(self, local: PreparedList, remote: PreparedList) -> None:
        """Checks every post makes: open agent, live local registrations, connected peer."""
        if self.closed:
            raise UsageError(f"agent {self.name!r} is closed")
        if local.epoch != self._epoch:
            self._check_live(local)
        if remote.peer is None:
            if remote.epoch != self._epoch:
                self._check_live(remote)
        elif self._peers.get(remote.peer) is not remote.pinfo:
            if remote.peer not in self._peers:
                raise PeerDisconnected(f"peer {remote.peer!r} was removed")
            # a list is bound to one incarnation of its peer: after remove_peer/add_peer, or a new
            # agent under the same name, its descriptors and mappings describe memory that is gone
            raise UsageError(f"peer {remote.peer!r} was removed and added again since this list was prepared; "
                             "prepare again")

    def _drop_stale(self, routes: dict[Any, Route], remote_of: Callable[[Any], PreparedList]) -> None:
        """Forget cached routes to lists of a peer incarnation that is gone (removed, or added again):
        no post can use them any more, and each holds that incarnation's mappings alive."""
        peers = self._peers
        stale = [k for k in routes if (rl := remote_of(k)).peer is not None and peers.get(rl.peer) is not rl.pinfo]
        for k in stale:
            del routes[k]

    def _route(self, op: Op, local: PreparedList, remote: PreparedList, backend: str | None) -> Route:
        """The route of a checked list pair: cached on the local list, made at the first post."""
        routes = local.routes(op)
        r = routes.get(remote)
        if r is not None and (backend is None or r.backend.name == backend):
            return r
        if backend is not None:
            r = local.froutes.get((op, remote, backend))
            if r is not None:
                return r
        loopback = remote.peer is None
        cands = [self.backend(backend)] if backend else self.backends
        for b in cands:
            if b.name not in local.bdata or b.name not in remote.bdata:
                continue
            if b.serves(local.kind, remote.kind, loopback):
                if local.bdata[b.name] is _FLAT or remote.bdata[b.name] is _FLAT:
                    lf, rf = self._flat(local, b), self._flat(remote, b)
                    if lf is None or rf is None:
                        continue
                    r = FlatRoute(b.route(op, lf, rf), local, remote, local.fmap if lf is not local else None,
                                  remote.fmap if rf is not remote else None)
                else:
                    r = b.route(op, local, remote)
                if backend is None:
                    self._drop_stale(routes, lambda k: k)
                    if len(routes) >= 64:
                        routes.clear()
                    routes[remote] = r
                else:
                    self._drop_stale(local.froutes, lambda k: k[1])
                    if len(local.froutes) >= 64:
                        local.froutes.clear()
                    local.froutes[(op, remote, backend)] = r
                return r
        raise BackendUnavailable(
            f"no backend moves {local.kind.name} -> {remote.kind.name}"
            + (" locally" if loopback else f" to peer {remote.peer!r}")
            + (f" (asked for {backend!r})" if backend else "")
        )

    def _args(self, local: PreparedList, remote: PreparedList, notify: bytes | None, backend: str | None) -> None:
        if type(local) is not PreparedList or type(remote) is not PreparedList:
            raise ArgumentTypeError("read/write take PreparedList objects from prepare()")
        if local.agent is not self or remote.agent is not self:
            raise UsageError("prepared lists belong to another agent")
        if local.peer is not None:
            raise UsageError("the first list must be local (prepared without peer=)")
        if notify is not None and not isinstance(notify, (bytes, bytearray)):
            raise ArgumentTypeError(f"notify must be bytes or None, not {type(notify).__name__}")
        if backend is not None:
            arg.name(backend, "backend")

    def _transfer(self, req: Request, backend: str) -> Transfer:
        if type(req) is DoneRequest:
            return Transfer._completed(req.nbytes, backend)
        return Transfer(req, req.nbytes, backend, self.config.transfer_timeout)

    def _post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
              notify: bytes | None, backend: str | None) -> Transfer:
        """A post of a pair without a usable cached route (or with notify/backend): every check."""
        self._args(local, remote, notify, backend)
        self._check_post(local, remote)
        r = self._route(op, local, remote, backend)
        return self._transfer(r.post(lidx, ridx, bytes(notify) if notify is not None else None), r.backend.name)

    def make_transfer(self, op: str, local: PreparedList, local_idx: Any, remote: PreparedList, remote_idx: Any,
                      *, notify: bytes | None = None, backend: str | None = None) -> TransferPlan:
        """Prepare a transfer once to post it many times (like NIXL's ``make_prepped_xfer``).

        Parameters
        ----------
        op
            ``"read"`` or ``"write"``.
        local, local_idx, remote, remote_idx, notify, backend
            As for :meth:`read` / :meth:`write`; indices are checked now, not at each post.

        Returns
        -------
        TransferPlan
            ``plan.post()`` starts the transfer and returns a :class:`Transfer`. Posting still
            checks that the agent is open, the registrations live and the peer connected.
        """
        if not isinstance(op, str):
            raise ArgumentTypeError(f"op must be 'read' or 'write', not {type(op).__name__}")
        if op not in ("read", "write"):
            raise ArgumentValueError(f"op must be 'read' or 'write', not {op!r:.40}")
        self._args(local, remote, notify, backend)
        self._check_post(local, remote)
        r = self._route(Op(op), local, remote, backend)
        post = r.plan(local_idx, remote_idx, bytes(notify) if notify is not None else None)
        nb = int(local.descs.piece_bytes[index_array(local_idx, len(local), "local index")].sum())
        return TransferPlan(self, post, r.backend.name, (local, remote), nb)

    def read(self, local: PreparedList, local_idx: Any, remote: PreparedList, remote_idx: Any, *,
             notify: bytes | None = None, backend: str | None = None) -> Transfer:
        """Copy ``remote[remote_idx]`` into ``local[local_idx]``; nonblocking.

        Parameters
        ----------
        local, remote
            Prepared lists (``remote`` from ``prepare(..., peer=...)``, or local for loopback
            and storage).
        local_idx, remote_idx
            Equal-length index lists or integer arrays; paired descriptors must have equal
            lengths.
        notify
            Bytes delivered to the peer's ``notifications()`` after the data has landed.
        backend
            Force a backend by name.
        """
        if notify is None and backend is None and type(local) is PreparedList and local.agent is self:
            try:
                r = local.rroutes.get(remote)
            except TypeError:  # an unhashable ``remote``: the checks of _post name it
                r = None
            ep = self._epoch  # what _check_post checks, as four identity compares (the latency path)
            if r is not None and not self.closed and local.epoch == ep and (
                    remote.epoch == ep if remote.peer is None else self._peers.get(remote.peer) is remote.pinfo):
                req = r.post(local_idx, remote_idx, None)
                if type(req) is DoneRequest:
                    return Transfer._completed(req.nbytes, r.backend.name)
                return Transfer(req, req.nbytes, r.backend.name, self.config.transfer_timeout)
        return self._post(Op.READ, local, local_idx, remote, remote_idx, notify, backend)

    def write(self, local: PreparedList, local_idx: Any, remote: PreparedList, remote_idx: Any, *,
              notify: bytes | None = None, backend: str | None = None) -> Transfer:
        """Copy ``local[local_idx]`` into ``remote[remote_idx]``; nonblocking. See :meth:`read`."""
        if notify is None and backend is None and type(local) is PreparedList and local.agent is self:
            try:
                r = local.wroutes.get(remote)
            except TypeError:  # an unhashable ``remote``: the checks of _post name it
                r = None
            ep = self._epoch  # what _check_post checks, as four identity compares (the latency path)
            if r is not None and not self.closed and local.epoch == ep and (
                    remote.epoch == ep if remote.peer is None else self._peers.get(remote.peer) is remote.pinfo):
                req = r.post(local_idx, remote_idx, None)
                if type(req) is DoneRequest:
                    return Transfer._completed(req.nbytes, r.backend.name)
                return Transfer(req, req.nbytes, r.backend.name, self.config.transfer_timeout)
        return self._post(Op.WRITE, local, local_idx, remote, remote_idx, notify, backend)

    # ------------------------------------------------------------------------------------------
    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer``'s notification queue.

        Two notifications to one peer may arrive in either order: the ``tcp`` backend spreads
        its frames over several connections (``KVX_TCP_STREAMS``). A protocol built on them
        must not depend on their order (or must send what depends on another in one message).
        """
        self._check()
        if not isinstance(peer, str):
            raise ArgumentTypeError(f"notify peer must be a peer name (str), not {type(peer).__name__}")
        if not isinstance(message, (bytes, bytearray)):
            raise ArgumentTypeError(f"notification must be bytes, not {type(message).__name__}")
        info = self._peer(peer)
        for b in self.backends:
            if b.notifications and b.name in info.sections.get("_reached", ()):
                b.notify(peer, bytes(message))
                return
        raise BackendUnavailable(f"no backend carries notifications to {peer!r}")

    def notifications(self, timeout: float | None = None) -> dict[str, list[bytes]]:
        """Drain received notifications: ``{peer_name: [bytes, ...]}``.

        With ``timeout`` (seconds, from 0 to 1e7), wait up to that long for at least one to arrive.
        """
        if timeout is not None:
            timeout = arg.seconds(timeout, "notifications timeout")
        self._check()
        with self._notif_cv:
            if timeout is not None and not self._notifs:
                self._notif_cv.wait_for(lambda: bool(self._notifs) or self.closed, timeout)
            out = dict(self._notifs)
            self._notifs = defaultdict(list)
        return out

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _shutdown(backends: list[Backend]) -> None:
        for b in backends:
            try:
                b.close()
            except Exception:
                log.exception("closing backend %s", b.name)

    def close(self) -> None:
        """Disconnect peers, release registrations, stop backends. Idempotent."""
        if self.closed:
            return
        if self._side is not None:
            self._side.close()
        with self._lock:
            for p in list(self._peers):
                self.remove_peer(p)
            for slot in list(self._regions):
                r, _ = self._regions.pop(slot)
                for b, h in self._handles.pop(slot, []):
                    try:
                        b.deregister(r, h)
                    except Exception:
                        log.debug("deregister at close", exc_info=True)
            self._gens[:] = 0
            self.closed = True
        with self._notif_cv:
            self._notif_cv.notify_all()
        self._finalizer()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Agent {self.name!r} backends={[b.name for b in self.backends]}{' closed' if self.closed else ''}>"


class _StorageRegion:
    """A registered file or object, as the agent and storage backends see it."""

    __slots__ = ("bucket", "key", "kind", "nbytes", "path", "slot", "spec")

    def __init__(self, kind: MemoryKind, nbytes: int, slot: int, spec: Any, path: str | None = None,
                 bucket: str | None = None, key: str | None = None) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.slot = slot
        self.spec = spec
        self.path = path
        self.bucket = bucket
        self.key = key

    @classmethod
    def of(cls, r: FileRegion | ObjectRegion, slot: int) -> "_StorageRegion":
        if isinstance(r, FileRegion):
            return cls(MemoryKind.FILE, r.nbytes, slot, r, path=os.path.realpath(r.path))
        return cls(MemoryKind.OBJECT, r.nbytes, slot, r, bucket=r.bucket, key=r.key)

    @property
    def dev(self) -> int:
        return self.slot
