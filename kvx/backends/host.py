"""``host``: host memory between processes of one machine (and within one process).

Paths, chosen per prepared remote list (``KVX_HOST_PATH=auto``) or forced:

- **shm** -- the target's ``alloc_host`` memory is a memfd; the initiator receives the fd over
  an AF_UNIX socket (SCM_RIGHTS), maps it once, and copies one-sided with native threads.
- **cma** -- any other memory: ``process_vm_readv/writev`` with batched iovecs, one-sided.
- **uds** -- where CMA is not permitted: two-sided over the AF_UNIX socket; the target checks
  every descriptor against its live registrations before it touches memory.

One-sided safety: each agent publishes a control table (a memfd the peers map) holding, per
registration slot, ``state = generation << 1 | live`` and the region's bounds, and gives each
peer a page of in-flight counters. A copy increments the counters of the slots it touches,
checks their states, copies, and decrements; ``release`` clears the live bit and waits for the
counters to drain before it returns, so after release no peer reaches the memory.
Only processes of the same user may connect (SO_PEERCRED), plus the HMAC token if configured.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _native, config, wire
from .._slots import BOOT_ID, MAX_SLOTS
from ..channel import Channel
from ..copy import copy_blocking, staging_offsets
from ..errors import (
    BackendUnavailable,
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    RemoteError,
    TransferError,
    UsageError,
)
from ..memory import MemoryKind, Region
from ._samenode import SameNodeLink
from .base import (
    BAD_INDEX,
    Backend,
    BackendContext,
    DoneRequest,
    ErrorMap,
    JobRequest,
    Op,
    PeerInfo,
    PreparedList,
    Request,
    Route,
    ThreadRequest,
    index_vector,
    indices,
    native_form,
    paired_nbytes,
    validate,
)

__all__ = ["HostBackend"]

log = logging.getLogger(__name__)

_ENTRY = 32  # bytes per control-table entry: state, addr, nbytes, flags
_F_SHM = 1
_CTRL_BYTES = MAX_SLOTS * _ENTRY
_INFL_BYTES = MAX_SLOTS * 4


def _u64view(addr: int, n: int) -> np.ndarray:
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(addr))


def _who(peer: str | None) -> str:
    return f"peer {peer!r}" if peer else "local memory"


#: The host backend's error map: a native copy's errno (``where`` is the peer's name, or None).
ERRORS = ErrorMap(
    (OSError, frozenset({errno.ESTALE}),
     lambda e, p: RemoteError(f"{_who(p)}: the target released (or re-registered) the memory")),
    (OSError, frozenset({errno.ESRCH}), lambda e, p: PeerDisconnected(f"{_who(p)}: the process is gone")),
    (OSError, frozenset({errno.EFAULT, errno.EPERM}),
     lambda e, p: RemoteError(f"{_who(p)}: memory not accessible ({os.strerror(e.errno)})")),
    (OSError, frozenset({errno.ECANCELED}), lambda e, p: TransferError("transfer cancelled")),
    default=lambda e, p: TransferError(f"{_who(p)}: copy failed: "
                                       f"{os.strerror(getattr(e, 'errno', None) or errno.EIO)}"),
)
#: The name the other modules knew it by.
translate_oserror = ERRORS


@dataclass(slots=True)
class _Prep:
    mode: str  # local, shm, cma, uds
    addr: np.ndarray  # addresses to use with the native layer (translated for shm)
    nbytes: np.ndarray
    guards: np.ndarray | None = None
    raw: np.ndarray | None = None  # target-side addresses (uds)
    maps: "_Maps | None" = None  # keeps the peer's mappings that ``addr``/``guards`` point into
    count: np.ndarray | None = None  # strided lists (memcpy modes only): pieces per descriptor
    stride: np.ndarray | None = None


_PAGE = os.sysconf("SC_PAGE_SIZE")


class _Maps:
    """A peer's memory mapped into this process: its control table, our in-flight counter page
    in it, and the shared mappings of its regions.

    Guards and translated addresses of prepared lists, plans and routes point into these
    mappings, and copies may still run on the native pool after the peer is removed or the agent
    closed. So nothing here is unmapped while it can be reached: every prepared side, plan and
    route of this peer holds this object, and when the last reference goes, a reaper waits for our
    in-flight counters in the peer to drain (each copy that entered its guards has left them)
    before it unmaps. A removed peer's lists are refused by the agent before they reach a backend.
    """

    __slots__ = ("__weakref__", "ctrl", "data", "infl", "lock")

    def __init__(self, ctrl: int, infl: int) -> None:
        self.ctrl = ctrl
        self.infl = infl
        self.data: dict[tuple[int, int], tuple[int, int, int]] = {}  # (slot, gen) -> (base, size, delta)
        self.lock = threading.Lock()
        weakref.finalize(self, _Maps._reap, ctrl, infl, self.data)

    @staticmethod
    def _reap(ctrl: int, infl: int, data: dict[tuple[int, int], tuple[int, int, int]]) -> None:
        def run() -> None:
            counters = np.uint64(infl) + np.arange(MAX_SLOTS, dtype=np.uint64) * np.uint64(4)
            # copies end by themselves (a dead target makes CMA fail at once; memcpy into a shared
            # mapping always ends), so this wait is long only while a huge copy runs
            while not _native.drain(counters, 60.0):
                log.warning("copies into a removed peer's memory are still running after 60 s; "
                            "its mappings stay until they end")
            for base, size in [(b, sz) for b, sz, _ in data.values()] + [(ctrl, _CTRL_BYTES), (infl, _INFL_BYTES)]:
                try:
                    _native.unmap(base, size)
                except OSError:
                    pass
            data.clear()

        threading.Thread(target=run, name="kvx-host-unmap", daemon=True).start()


class _Peer:
    """An initiated connection to a same-node peer, with its mapped control table."""

    def __init__(self, name: str, chan: Channel, pid: int, ctrl: int, infl: int, cma: bool) -> None:
        self.name = name
        self.chan = chan
        self.pid = pid
        self.ctrl = ctrl  # mapped address of the peer's control table
        self.infl = infl  # mapped address of our in-flight counters in the peer
        self.cma = cma
        self.m = _Maps(ctrl, infl)

    def table(self) -> list[tuple[int, int, int, int, int, int]]:
        """The peer's live regions as its own control table states them (not its metadata)."""
        t = _u64view(self.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        st = t[:, 0].copy()
        live = np.nonzero(st & 1)[0]
        rows = []
        for s in live.tolist():
            state, addr, nb, _fl = (int(x) for x in t[s])
            if state != int(st[s]):  # changed while reading
                continue
            rows.append((int(MemoryKind.HOST), addr, nb, 0, s, state >> 1))
        return rows


class HostBackend(SameNodeLink, Backend):
    """Host memory on one machine: shared mappings, CMA, AF_UNIX; see the module docstring."""

    name = "host"
    kinds = frozenset({MemoryKind.HOST})
    _CTRL_BYTES = _CTRL_BYTES
    _INFL_BYTES = _INFL_BYTES
    remote = True
    local = True
    notifications = True
    strided = True  # natively on its memcpy and CMA paths

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        self.max_msg = int(config.get("KVX_MAX_MESSAGE"))
        self.threads = int(self.cfg.copy_threads)
        self.inline = int(self.cfg.inline_bytes)
        self._lock = threading.RLock()
        self._closed = False
        # control table
        self._ctrl_fd = os.memfd_create("kvx-ctrl", os.MFD_CLOEXEC)
        os.ftruncate(self._ctrl_fd, _CTRL_BYTES)
        self._ctrl = _native.map_fd(self._ctrl_fd, _CTRL_BYTES, 0, True)
        self._table = _u64view(self._ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        self._slots: dict[int, tuple[Region, int]] = {}
        self._draining = 0  # deregister calls waiting on peers' in-flight counters
        self._dead_infl: list[int] = []  # counters of peers gone meanwhile: unmapped after the drains
        # listener
        self._addr = f"\0kvx-{ctx.agent_id}" if self.name == "host" else f"\0kvx-{self.name}-{ctx.agent_id}"
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._lsock.bind(self._addr)
        self._lsock.listen(64)
        self._accepted: list[Channel] = []  # connections peers opened to us
        self._peers: dict[str, _Peer] = {}  # connections we opened
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvx-{self.name}-{ctx.agent_name}",
                                          daemon=True)
        self._acceptor.start()

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if not isinstance(region, Region) or region.kind != MemoryKind.HOST:
            raise RegistrationError("host backend registers HOST memory only")
        with self._lock:
            e = self._table[slot]
            e[1] = region.addr
            e[2] = region.nbytes
            e[3] = _F_SHM if region.shm is not None else 0
            _native.store64(self._ctrl + slot * _ENTRY, (gen << 1) | 1)
            self._slots[slot] = (region, gen)
        return gen

    def deregister(self, region: Any, handle: Any) -> None:
        gen = int(handle)
        slot = None
        with self._lock:
            for s, (r, g) in self._slots.items():
                if r is region and g == gen:
                    slot = s
                    break
            if slot is None:
                return
            del self._slots[slot]
            _native.store64(self._ctrl + slot * _ENTRY, gen << 1)  # not live: new copies fail
            pairs = [(c, int(c.extra["infl"]) + 4 * slot) for c in self._accepted if c.alive and "infl" in c.extra]
            chans = [c for c in self._accepted if c.alive]
            # a peer that disconnects meanwhile must not have its counters unmapped under the drain
            # (_on_close defers the unmap to the last drain's end)
            self._draining += 1
        try:
            if pairs and not _native.drain(np.array([a for _c, a in pairs], dtype=np.uint64),
                                           float(self.cfg.peer_timeout)):
                # a peer is stuck inside a copy: cut it off so it can start no more
                for c, addr in pairs:
                    if _native.load32(addr):
                        log.error("peer %s did not finish copying from a released region within %.1f s; "
                                  "disconnecting", c.peer_name, self.cfg.peer_timeout)
                        c.close()
        finally:
            with self._lock:
                self._draining -= 1
                dead, self._dead_infl = (self._dead_infl, []) if not self._draining else ([], self._dead_infl)
            for infl in dead:
                _native.unmap(infl, _INFL_BYTES)
        for c in chans:
            try:
                c.send(wire.pack("revoke", slot=slot, gen=gen))
            except PeerDisconnected:
                pass

    # ---- peers -----------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {"uds": self._addr[1:], "pid": os.getpid(), "uid": os.getuid(), "ctrl": self._ctrl}

    @staticmethod
    def check_metadata(sec: Any, peer_name: str) -> dict[str, Any]:
        """Check a peer's host metadata section (what :meth:`metadata` gives) before any use.

        Returns
        -------
        dict
            ``sec`` itself.

        Raises
        ------
        ProtocolError
            Not a dict of ``uds``, ``pid``, ``uid`` and ``ctrl`` within their ranges, whether or
            not this agent would use it (a peer on another host included).
        """
        try:
            if not isinstance(sec, dict):
                raise ProtocolError("not a map")
            wire.check(dict(sec, t="host"), "host", {"uds": str, "pid": int, "uid": int, "ctrl": int})
            if not (0 < sec["pid"] < 1 << 31 and 0 <= sec["uid"] < 1 << 32 and 0 <= sec["ctrl"] < 1 << 64
                    and 0 < len(sec["uds"]) <= 100):
                raise ProtocolError("value out of range")
        except ProtocolError:
            raise ProtocolError(f"malformed host section in {peer_name!r} metadata") from None
        return sec

    def connect(self, peer: PeerInfo) -> bool:
        sec = peer.sections.get(self.name)
        if sec is None:
            return False
        sec = self.check_metadata(sec, peer.name)
        if peer.sections.get("_boot") != BOOT_ID:
            return False
        # _dial checks that the listener we reached is this pid's (the kernel says which process
        # holds it): one-sided copies never go to a process that only the metadata names
        chan, ctrl, infl = self._dial(peer, sec["uds"])
        pid = sec["pid"]
        cma = False
        if self.cfg.host_path in ("auto", "cma"):
            try:
                _native.cma_probe(pid, sec["ctrl"])
                cma = True
            except (OSError, OverflowError) as exc:
                log.info("CMA to %s not permitted (%s); using %s", peer.name, exc,
                         "shared mappings/AF_UNIX" if self.cfg.host_path == "auto" else "nothing")
        p = _Peer(peer.name, chan, pid, ctrl, infl, cma)
        self._adopt(peer.name, p, chan)
        return True

    def path_to(self, peer_name: str) -> str:
        """The default path this backend takes to ``peer_name`` for non-alloc_host memory."""
        p = self._peers.get(peer_name)
        if p is None:
            raise UsageError(f"not connected to {peer_name!r}")
        if self.cfg.host_path in ("shm", "uds"):
            return self.cfg.host_path
        return "cma" if p.cma else "uds"

    def refresh_regions(self, peer_name: str) -> list[tuple[int, int, int, int, int, int]] | None:
        p = self._peers.get(peer_name)
        return p.table() if p is not None else None

    def _drop(self, p: _Peer) -> None:
        # the mappings go when nothing refers to them any more (see _Maps), not here: copies of
        # this peer may still be running, and prepared lists may still point into them
        p.chan.close()

    def disconnect(self, peer_name: str) -> None:
        with self._lock:
            p = self._peers.pop(peer_name, None)
        if p is not None:
            self._drop(p)

    def _on_close(self, chan: Channel) -> None:
        with self._lock:
            if chan in self._accepted:
                self._accepted.remove(chan)
                infl = chan.extra.pop("infl", None)
                if infl is not None:
                    # the peer is gone: its counters no longer hold releases back (a deregister
                    # reading them now unmaps them when it is done)
                    if self._draining:
                        self._dead_infl.append(int(infl))
                    else:
                        threading.Thread(target=_native.unmap, args=(infl, _INFL_BYTES), daemon=True).start()

    # ---- messages --------------------------------------------------------------------------
    def _on_message(self, chan: Channel, msg: dict[str, Any], payload: memoryview | None, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        t = msg["t"]
        if t == "notif":
            wire.check(msg, "notif", {"msg": bytes})
            self.ctx.deliver(chan.peer_name, msg["msg"])
        elif t == "revoke":
            wire.check(msg, "revoke", {"slot": int, "gen": int})
            p = chan.extra.get("peer")
            if p is not None:
                # the target sends this after its counters drained and the slot went dead: no copy
                # is inside the region, and every later one fails its guard before touching it
                with p.m.lock:
                    m = p.m.data.pop((msg["slot"], msg["gen"]), None)
                if m is not None:
                    _native.unmap(m[0], m[1])
        elif t == "getfd":
            self._serve_getfd(chan, msg)
        elif t == "xfer":
            self._serve_xfer(chan, msg, payload)
        else:
            rid = msg.get("rid")
            if isinstance(rid, int):
                chan.reply_error(rid, f"unknown request {t!r}")

    def _serve_getfd(self, chan: Channel, msg: dict[str, Any]) -> None:
        wire.check(msg, "getfd", {"rid": int, "slot": int, "gen": int})
        with self._lock:
            ent = self._slots.get(msg["slot"])
        if ent is None or ent[1] != msg["gen"]:
            chan.reply_error(msg["rid"], "region is not registered (released?)")
            return
        region, _ = ent
        if region.shm is None:
            chan.reply_error(msg["rid"], "region is not shareable (not from kvx.alloc_host)")
            return
        fd, off, size = region.shm
        chan.reply(msg["rid"], "fd", off=off, size=size, fds=[fd])

    def _serve_xfer(self, chan: Channel, msg: dict[str, Any], payload: memoryview | None) -> None:
        wire.check(msg, "xfer", {"rid": int, "op": str, "addr": bytes, "nbytes": bytes})
        rid = msg["rid"]
        if len(msg["addr"]) % 8 or len(msg["addr"]) != len(msg["nbytes"]) or msg["op"] not in ("read", "write"):
            chan.reply_error(rid, "malformed transfer request")
            return
        addr = np.frombuffer(msg["addr"], dtype=np.uint64)
        nb = np.frombuffer(msg["nbytes"], dtype=np.uint64)
        if addr.shape != nb.shape:
            chan.reply_error(rid, "malformed transfer request")
            return
        # the target checks what it serves: every descriptor inside a live registration
        slots = self.ctx.validate_local(MemoryKind.HOST, addr, nb, np.zeros_like(addr))
        if (slots < 0).any():
            bad = int(np.argmax(slots < 0))
            chan.reply_error(rid, f"descriptor {bad} (0x{int(addr[bad]):x}+{int(nb[bad])}) is outside "
                                  "registered memory")
            return
        total = int(nb.sum())
        ar = np.arange(len(addr), dtype=np.int64)
        if msg["op"] == "write":
            if payload is None or len(payload) != total:
                chan.reply_error(rid, "payload length does not match the descriptors")
                return
            staged = staging_offsets(nb, np.frombuffer(payload, dtype=np.uint8).ctypes.data)
            copy_blocking(addr, nb, ar, staged, nb, ar, self.threads)
            chan.reply(rid, "ok")
        else:
            buf = bytearray(total)
            staged = staging_offsets(nb, np.frombuffer(buf, dtype=np.uint8).ctypes.data)
            copy_blocking(staged, nb, ar, addr, nb, ar, self.threads)
            chan.reply(rid, "ok", payload=buf)

    # ---- preparation -----------------------------------------------------------------------
    def _mode(self, p: _Peer, plist: PreparedList) -> str:
        """The path to a peer's list: shm (its memory mapped here), cma or uds."""
        t = _u64view(p.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        shareable = bool(np.all(t[plist.used, 3] & _F_SHM))
        mode = self.cfg.host_path
        if mode == "auto":
            mode = "shm" if shareable else ("cma" if p.cma else "uds")
        if mode == "shm" and not shareable:
            raise BackendUnavailable("KVX_HOST_PATH=shm needs target memory from kvx.alloc_host")
        if mode == "cma" and not p.cma:
            raise BackendUnavailable("KVX_HOST_PATH=cma but process_vm_* is not permitted to this peer")
        return mode

    def takes_strided(self, plist: PreparedList) -> bool:
        """Strided lists are copied natively by memcpy (local lists, a peer's shared mappings) and
        CMA (the pieces as iovecs); the AF_UNIX path moves their expansion."""
        if plist.peer is None:
            return True
        p = self._peers.get(plist.peer)
        if p is None or not p.chan.alive:
            return False
        try:
            return self._mode(p, plist) in ("shm", "cma")
        except KVXError:
            return False

    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        addr = np.ascontiguousarray(d.addr, dtype=np.uint64)
        nb = np.ascontiguousarray(d.nbytes, dtype=np.uint64)
        cnt = stride = None
        if d.is_strided:
            cnt, stride = np.ascontiguousarray(d.count), np.ascontiguousarray(d.stride)
        if plist.peer is None:
            return _Prep("local", addr, nb, count=cnt, stride=stride)
        p = self._peers.get(plist.peer)
        if p is None or not p.chan.alive:
            raise PeerDisconnected(f"not connected to {plist.peer!r}")
        self._check_table(p, plist, addr, np.ascontiguousarray(d.span, dtype=np.uint64))
        t = _u64view(p.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        used = plist.used
        mode = self._mode(p, plist)
        if cnt is not None and mode == "uds":
            raise BackendUnavailable(f"the host backend's {mode} path moves plain descriptors only")
        g3 = np.empty((len(used), 3), dtype=np.uint64)
        for i, s in enumerate(used.tolist()):
            g3[i] = (p.ctrl + s * _ENTRY, (plist.gens[s] << 1) | 1, p.infl + 4 * s)
        guards = g3.reshape(-1)
        if mode == "uds":
            return _Prep("uds", addr, nb, None, raw=addr, maps=p.m)
        if mode == "cma":
            return _Prep("cma", addr, nb, guards, maps=p.m, count=cnt, stride=stride)
        delta = np.zeros(MAX_SLOTS, dtype=np.uint64)
        for s in used.tolist():
            delta[s] = np.uint64(self._map(p, s, plist.gens[s], int(t[s, 1]), int(t[s, 2]))[2])
        xaddr = addr + delta[plist.slots]
        return _Prep("shm", np.ascontiguousarray(xaddr), nb, guards, maps=p.m, count=cnt, stride=stride)

    @staticmethod
    def _check_table(p: _Peer, plist: PreparedList, addr: np.ndarray, nb: np.ndarray) -> None:
        """Check a remote list against the bounds the target publishes in its control table.

        The agent checked it against the peer's metadata, which anyone who can write to the
        discovery store can forge; one-sided copies trust only what the target process itself
        wrote in the table it shared with us in the handshake.
        """
        rows = p.table()
        slots, ok = validate(MemoryKind.HOST, addr, nb, np.zeros_like(addr), rows)
        live = {r[4]: r[5] for r in rows}
        if not ok.all() or not np.array_equal(slots, plist.slots) or any(
                live.get(s) != g for s, g in plist.gens.items()):
            bad = int(np.argmin(ok)) if not ok.all() else int(np.argmax(slots != plist.slots)) \
                if not np.array_equal(slots, plist.slots) else 0
            raise RegistrationError(
                f"descriptor {bad} (HOST 0x{int(addr[bad]):x}+{int(nb[bad])}) is outside the registrations that "
                f"peer {plist.peer!r} publishes in its control table (its metadata is stale or was altered)")

    def _map(self, p: _Peer, slot: int, gen: int, start: int, nbytes: int) -> tuple[int, int, int]:
        """Map the pages of the peer's region ``slot`` (only those), once per generation.

        Returns ``(base, size, delta)``: the region's address plus ``delta`` (mod 2**64) is the
        same byte in this process.
        """
        with p.m.lock:
            m = p.m.data.get((slot, gen))
        if m is not None:
            return m
        msg, _, fds = p.chan.request("getfd", self.cfg.handshake_timeout, slot=slot, gen=gen)
        try:
            wire.check(msg, "fd", {"off": int, "size": int})
            if len(fds) != 1:
                raise ProtocolError("getfd reply without a descriptor")
            off = msg["off"]
            if not 0 <= off < 1 << 62 or os.fstat(fds[0]).st_size < off + nbytes:
                raise ProtocolError("getfd reply with inconsistent sizes")
            lo = off - off % _PAGE
            size = -(-(off + nbytes - lo) // _PAGE) * _PAGE
            base = _native.map_fd(fds[0], size, lo, True)
        finally:
            for fd in fds:
                os.close(fd)
        m = (base, size, (base + off - lo - start) % (1 << 64))
        with p.m.lock:
            if (slot, gen) in p.m.data:
                _native.unmap(base, size)
                return p.m.data[(slot, gen)]
            p.m.data[(slot, gen)] = m
        return m

    # ---- transfers -------------------------------------------------------------------------
    def _route(self, op: Op, local: PreparedList, remote: PreparedList
               ) -> tuple[_Prep, _Prep, _Peer | None, int, int]:
        lp: _Prep = local.bdata[self.name]
        rp: _Prep = remote.bdata[self.name]
        peer = None
        pid = 0
        code = 0  # memcpy
        if rp.mode != "local":
            peer = self._peers.get(remote.peer)  # type: ignore[arg-type]
            if peer is None or not peer.chan.alive:
                raise PeerDisconnected(f"peer {remote.peer!r} is not connected")
            if rp.maps is not peer.m:
                raise UsageError(f"this list was prepared for an earlier connection to {remote.peer!r}; prepare again")
            if rp.mode == "cma":
                code = 1 if op is Op.WRITE else 2
                pid = peer.pid
        return lp, rp, peer, code, pid

    def _notifier(self, peer: _Peer | None, notify: bytes | None) -> Any:
        if notify is None:
            return None
        if peer is None:  # loopback: the agent notifies itself
            return lambda: self.ctx.deliver(self.ctx.agent_name, notify)
        chan = peer.chan
        msg = wire.pack("notif", msg=notify)
        return lambda: chan.send(msg)

    def _finish(self, res: Any, name: str | None, send_notif: Any) -> Request:
        if type(res) is int:
            if send_notif is not None:
                send_notif()
            return DoneRequest(res)
        req = JobRequest(res, name, translate_oserror)
        if send_notif is not None:
            # deliver the notification once the data has landed, even if nobody polls
            def waiter() -> None:
                try:
                    if res.wait(float(self.cfg.transfer_timeout)):
                        req._fired = True
                        send_notif()
                except (OSError, KVXError):
                    pass

            threading.Thread(target=waiter, daemon=True).start()
        return req

    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        return _HostRoute(self, op, local, remote)

    def _post_uds(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any, peer: _Peer,
                  notify: bytes | None) -> Request:
        li, ri = index_vector(lidx), index_vector(ridx)
        ln = paired_nbytes(li, ri, lp.nbytes, rp.nbytes)
        total = int(ln.sum())
        ar = np.arange(len(li), dtype=np.int64)
        raddr = rp.raw[ri].tobytes()  # type: ignore[index]
        req = ThreadRequest(total)
        buf = bytearray(total)

        def run() -> None:
            try:
                if op is Op.WRITE:
                    staged = staging_offsets(ln, np.frombuffer(buf, dtype=np.uint8).ctypes.data)
                    copy_blocking(staged, ln, ar, lp.addr, lp.nbytes, li, self.threads)
                    peer.chan.request("xfer", self.cfg.transfer_timeout, payload=buf, op="write", addr=raddr,
                                      nbytes=ln.tobytes())
                else:
                    _, pl, _ = peer.chan.request("xfer", self.cfg.transfer_timeout, op="read", addr=raddr,
                                                 nbytes=ln.tobytes())
                    if pl is None or len(pl) != total:
                        raise ProtocolError("read reply of the wrong size")
                    staged = staging_offsets(ln, np.frombuffer(pl, dtype=np.uint8).ctypes.data)
                    copy_blocking(lp.addr, lp.nbytes, li, staged, ln, ar, self.threads)
                if notify is not None:
                    peer.chan.send(wire.pack("notif", msg=notify))
                req.finish()
            except KVXError as exc:
                req.finish(exc if isinstance(exc, TransferError) else TransferError(str(exc)))
            except OSError as exc:
                req.finish(translate_oserror(exc, peer.name))

        threading.Thread(target=run, daemon=True).start()
        return req

    def notify(self, peer_name: str, message: bytes) -> None:
        p = self._peers.get(peer_name)
        if p is None:
            raise PeerDisconnected(f"peer {peer_name!r} is not connected")
        p.chan.send(wire.pack("notif", msg=message))

    def close(self) -> None:
        if not self._close_link():
            return
        # leave the control mapping in place: peers may still hold it; the fd goes
        for s in list(self._slots):
            _native.store64(self._ctrl + s * _ENTRY, 0)
        os.close(self._ctrl_fd)


class _HostRoute(Route):
    """A list pair resolved once: address arrays, guards, the peer's channel, the copy mode."""

    __slots__ = ("_a", "_chan", "_code", "_guards", "_inline", "_lp", "_name", "_peer", "_pid", "_rp", "_s",
                 "_threads", "_uds", "_write")

    def __init__(self, backend: HostBackend, op: Op, local: PreparedList, remote: PreparedList) -> None:
        super().__init__(backend, op, local, remote)
        lp, rp, peer, code, pid = backend._route(op, local, remote)
        self._lp, self._rp, self._peer, self._code, self._pid = lp, rp, peer, code, pid
        self._uds = rp.mode == "uds"
        self._chan = peer.chan if peer is not None else None
        self._name = remote.peer
        self._guards = rp.guards
        self._write = op is Op.WRITE
        self._threads, self._inline = backend.threads, backend.inline
        # (dst addr, dst nbytes, src addr, src nbytes)
        self._a = (rp.addr, rp.nbytes, lp.addr, lp.nbytes) if self._write else (lp.addr, lp.nbytes, rp.addr, rp.nbytes)
        # strided lists (memcpy and CMA): (dst count, dst stride, src count, src stride), else None
        self._s = None
        if lp.count is not None or rp.count is not None:
            if self._uds:
                raise BackendUnavailable("the host backend's AF_UNIX path moves plain descriptors only")
            d, s = (rp, lp) if self._write else (lp, rp)
            self._s = (d.count, d.stride, s.count, s.stride)

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        chan = self._chan
        if chan is not None and not chan.alive:
            raise PeerDisconnected(f"peer {self._name!r} is not connected")
        try:
            try:
                res = self._submit(lidx, ridx, notify)
            except BAD_INDEX:
                # C takes ints, lists, tuples and contiguous 64-bit vectors as they are (checking them
                # before anything moves); another form (an int32 array, a slice of an array, a numpy
                # scalar) is converted once and posted; for a form C takes, its error stands
                if native_form(lidx) and native_form(ridx):
                    raise
                res = self._submit(indices(lidx), indices(ridx), notify)
        except OSError as exc:
            raise translate_oserror(exc, self._name) from exc
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None
        if notify is None:
            if type(res) is int:
                return DoneRequest(res)
            return res if self._uds else JobRequest(res, self._name, translate_oserror)
        if self._uds:
            return res  # type: ignore[no-any-return]  # the uds request notifies by itself
        b: HostBackend = self.backend  # type: ignore[assignment]
        return b._finish(res, self._name, b._notifier(self._peer, notify))

    def _submit(self, lidx: Any, ridx: Any, notify: bytes | None) -> Any:
        """The native submit (an int when done inline, else a job), or the uds path's Request."""
        if self._uds:
            assert self._peer is not None
            return self.backend._post_uds(self.op, self._lp, index_vector(lidx), self._rp,  # type: ignore[attr-defined]
                                          index_vector(ridx), self._peer, notify)
        da, dl, sa, sl = self._a
        if self._s is not None:
            dc, ds, sc, ss = self._s
            di, si = (ridx, lidx) if self._write else (lidx, ridx)
            return _native.submit_strided(self._code, self._pid, da, dl, dc, ds, index_vector(di), sa, sl, sc, ss,
                                          index_vector(si), self._guards, self._threads, self._inline)
        if self._write:
            return _native.submit(self._code, self._pid, da, dl, ridx, sa, sl, lidx, None, self._guards,
                                  self._threads, self._inline, 0)
        return _native.submit(self._code, self._pid, da, dl, lidx, sa, sl, ridx, None, self._guards,
                              self._threads, self._inline, 0)

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        if self._uds or self._s is not None:
            return super().plan(lidx, ridx, notify)
        b: HostBackend = self.backend  # type: ignore[assignment]
        da, dl, sa, sl = self._a
        di, si = (indices(ridx), indices(lidx)) if self._write else (indices(lidx), indices(ridx))
        try:
            plan = _native.plan(self._code, self._pid, da, dl, di, sa, sl, si, None, self._guards, b.threads,
                                b.inline, 0)
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None
        send_notif = b._notifier(self._peer, notify)
        start, finish, name, chan = plan.start, b._finish, self._name, self._chan
        if send_notif is None and self._code == 0:  # memcpy (local, or a peer's mapped memory)
            done = DoneRequest(int(plan.nbytes))  # immutable: every inline completion of the plan shares it

            def post_local() -> Request:  # (the peer's mapping outlives its link: no liveness check here)
                try:
                    res = start()
                except OSError as exc:
                    raise translate_oserror(exc, name) from exc
                return done if type(res) is int else JobRequest(res, name, translate_oserror)

            return post_local

        def post() -> Request:
            if chan is not None and not chan.alive:
                raise PeerDisconnected(f"peer {name!r} is not connected")
            try:
                res = start()
            except OSError as exc:
                raise translate_oserror(exc, name) from exc
            return finish(res, name, send_notif)

        return post
