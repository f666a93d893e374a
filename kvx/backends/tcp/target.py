"""The tcp backend's target side: registrations as the target sees them and the pins of serving
threads, the listener, and serving requests (host memory in place, CUDA memory through staging
slots)."""

from __future__ import annotations

import bisect
import collections
import logging
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ... import wire
from ..._slots import MAX_SLOTS
from ...errors import BackendUnavailable, KVXError, ProtocolError, RegistrationError
from ...memory import MemoryKind, Region
from ...net import MAX_HANDSHAKES, RefusalLog, accept_loop, send_frame, server_handshake
from .common import _BIG_ENDIAN, _U64, FAST_MAX, SMALL_DESCS, _coalesce, _frame, _native_u64, _net, tune_socket
from .staging import MAX_STAGED_DESCS, Copier, HostCopier, SlotRing, Ticket, cuda_copier

if TYPE_CHECKING:
    from ..base import BackendContext

log = logging.getLogger(__name__)

#: What a serving thread serves right now, for an agent's own checks in ``ctx.validate_local``
#: (a kvx.pool owner's): ``peer_id``, the agent id its peer proved in the handshake, and ``op``,
#: ``"w"`` or ``"r"`` for the request being checked.
SERVING = threading.local()


class _ServeStaging:
    """A serving connection's staged frames: its slots, and the requests whose copy runs (a
    write's scatter, a read's gather; each with its own pins, so frames pipelined on one
    connection never share a pin count)."""

    def __init__(self) -> None:
        self.rings: dict[int, SlotRing] = {}
        #: (ticket, rid, slot, ring, pinned regions, bytes to send back: -1 for a write)
        self.pending: collections.deque[tuple[Ticket, int, Any, SlotRing, set[int], int]] = collections.deque()

    def ring(self, be: "_Target", copier: Copier) -> SlotRing:
        r = self.rings.get(id(copier))
        if r is None:
            r = self.rings[id(copier)] = SlotRing(copier, be.stage_bytes, be.stage_slots)
        return r


class _Target:
    """The target's half of :class:`~kvx.backends.tcp.TcpBackend` (a mixin): what it serves, and
    how. Every request is validated against the live registrations and pinned before a byte moves."""

    if TYPE_CHECKING:  # set by TcpBackend.__init__
        ctx: BackendContext
        cfg: Any
        timeout: float
        max_msg: int
        serve_spin: float
        rcv_lowat: int
        stage_bytes: int
        stage_slots: int
        _host_copier: HostCopier | None
        cuda_order: str
        _closed: bool
        _lock: threading.RLock
        _lsock: socket.socket

    def _init_target(self) -> None:
        # registrations as the target sees them, and pins held by serving threads
        self._cv = threading.Condition()
        self._lo = np.zeros(MAX_SLOTS, dtype=_U64)
        self._hi = np.zeros(MAX_SLOTS, dtype=_U64)
        self._live = np.zeros(MAX_SLOTS, dtype=bool)
        self._pins = np.zeros(MAX_SLOTS, dtype=np.int64)
        self._kind = np.zeros(MAX_SLOTS, dtype=np.int64)
        self._dev = np.zeros(MAX_SLOTS, dtype=_U64)
        self._view: list[tuple[int, int, int]] = []
        self._starts: list[int] = []
        self._served: dict[int, tuple[socket.socket, threading.Thread, set[int]]] = {}
        self._hs = threading.BoundedSemaphore(MAX_HANDSHAKES)
        #: refused connections and requests: logged a few at a time, counted per kind
        self.refused = RefusalLog(log)
        #: hook for kvx.discovery.SideChannel sharing this listener: handler(sock, hello)
        self.side_handler: Callable[[socket.socket, dict[str, Any]], None] | None = None
        #: False: every request is checked through ``ctx.validate_local`` (an agent that adds its own
        #: checks there, as a kvx.pool member does), none by the scalar path of a few descriptors
        self.scalar_checks = True

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if not isinstance(region, Region) or region.kind not in (MemoryKind.HOST, MemoryKind.CUDA):
            raise RegistrationError("tcp backend registers HOST and CUDA memory only")
        if region.kind == MemoryKind.CUDA:
            try:
                cuda_copier(self.cuda_order)
            except BackendUnavailable as exc:
                raise RegistrationError(f"tcp cannot stage this GPU memory: {exc}") from exc
        with self._cv:
            self._lo[slot] = region.addr
            self._hi[slot] = region.addr + region.nbytes
            self._kind[slot] = int(region.kind)
            self._dev[slot] = region.dev
            self._live[slot] = True
            self._rebuild_view()
        return slot

    def deregister(self, region: Any, handle: Any) -> None:
        slot = int(handle)
        with self._cv:
            if self._lo[slot] != region.addr:
                return
            self._live[slot] = False
            self._rebuild_view()
            if self._cv.wait_for(lambda: self._pins[slot] == 0, self.timeout):
                self._lo[slot] = self._hi[slot] = 0
                return
            # a serving thread is stuck in I/O on this region: cut its connection to wake it
            stuck = [s for s, _t, pinned in self._served.values() if slot in pinned]
        for s in stuck:
            log.error("a peer did not finish a transfer on a released region within %.1f s; disconnecting it",
                      self.timeout)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._cv:
            if not self._cv.wait_for(lambda: self._pins[slot] == 0, 10.0):  # pragma: no cover
                log.error("tcp: region slot %d still pinned after cutting its connections", slot)
            self._lo[slot] = self._hi[slot] = 0

    def _pin(self, addr: np.ndarray, nb: np.ndarray, pinned: set[int], kind: MemoryKind = MemoryKind.HOST,
             dev: np.ndarray | None = None) -> tuple[str | None, np.ndarray | None]:
        """Validate target descriptors (of ``kind``, on devices ``dev``) and pin their regions;
        return (a refusal reason or None, the region slot of each descriptor)."""
        if addr.shape[0] == 0:
            return "empty descriptor list", None
        slots = self.ctx.validate_local(kind, addr, nb, np.zeros_like(addr) if dev is None else dev)
        bad = slots < 0
        if bad.any():
            i = int(np.argmax(bad))
            return f"descriptor {i} (0x{int(addr[i]):x}+{int(nb[i])}) is outside registered memory", None
        used = np.unique(slots)
        with self._cv:  # re-check against our own view, atomically with pinning
            ok = (self._live[used].all() and bool(np.all(self._kind[used] == int(kind)))
                  and bool(np.all(addr >= self._lo[slots])) and bool(np.all(addr + nb <= self._hi[slots])))
            if not ok:
                return "the region was released", None
            self._pins[used] += 1
        pinned.update(used.tolist())
        return None, slots

    def _pin_small(self, ab: bytes, nbb: bytes, pinned: set[int]) -> tuple[str | None, int]:
        """``_pin`` for a few descriptors, without numpy: each descriptor must lie inside one
        live registration of ours (the view ``register``/``deregister`` keep, which a release
        updates before it returns); pins under the same lock. Returns (refusal or None, bytes)."""
        k = len(ab) // 8
        if k == 0:
            return "empty descriptor list", 0
        addrs = struct.unpack(f"<{k}Q", ab)
        nbs = struct.unpack(f"<{k}Q", nbb)
        total = sum(nbs)
        slots = []
        with self._cv:
            starts, view = self._starts, self._view
            for i, (a, n) in enumerate(zip(addrs, nbs)):
                j = bisect.bisect_right(starts, a) - 1
                if j < 0 or a + n > view[j][1]:
                    return (f"descriptor {i} (0x{a:x}+{n}) is outside registered memory"
                            " (or the region was released)"), total
                slots.append(view[j][2])
            used = set(slots)  # one pin per distinct region, as ``_unpin`` drops one per region
            for sl in used:
                self._pins[sl] += 1
        pinned.update(used)
        return None, total

    def _rebuild_view(self) -> None:
        """Sorted (start, end, slot) of live regions (caller holds ``_cv``)."""
        live = sorted((int(self._lo[sl]), int(self._hi[sl]), int(sl)) for sl in np.flatnonzero(self._live)
                      if self._kind[sl] == int(MemoryKind.HOST))
        self._view = live
        self._starts = [r[0] for r in live]

    def _unpin(self, pinned: set[int]) -> None:
        if not pinned:
            return
        with self._cv:
            self._pins[np.fromiter(pinned, dtype=np.int64)] -= 1
            self._cv.notify_all()
        pinned.clear()

    def _accept_loop(self) -> None:
        accept_loop(self._lsock, lambda: self._closed, self._hs, self._start_serving, "tcp", self.refused)

    def _start_serving(self, s: socket.socket, addr: Any) -> None:
        t = threading.Thread(target=self._serve, args=(s, addr), name="kvx-tcp-serve", daemon=True)
        with self._lock:
            self._served[id(s)] = (s, t, set())
        t.start()

    def _serve(self, s: socket.socket, addr: Any) -> None:
        key = id(s)
        pinned = self._served[key][2]
        st = _ServeStaging()
        who = f"{addr[0]}:{addr[1]}"
        try:
            try:
                hello = server_handshake(s, self.cfg.auth_token, self.ctx.agent_id, self.ctx.agent_name,
                                         float(self.cfg.handshake_timeout))
            except (KVXError, OSError) as exc:
                self.refused("connections", "tcp: refused a connection from %s: %s", who, exc)
                return
            finally:
                self._hs.release()
            if hello["svc"] != "data":
                h = self.side_handler
                if h is None:
                    self.refused("connections", "tcp: refused %r request from %s: no side channel here",
                                 hello["svc"], who)
                    return
                h(s, hello)
                return
            name = hello["name"]
            tune_socket(s, self.timeout)
            send_frame(s, wire.pack("welcome", name=self.ctx.agent_name, id=self.ctx.agent_id))
            s.setblocking(False)
            SERVING.peer_id = hello["id"]
            self._serve_loop(s, name, pinned, st)
        except (KVXError, OSError) as exc:
            log.info("tcp: connection from %s ended: %s", who, exc)
        finally:
            while st.pending:  # scatters already started still land; their pins go when they did
                tk, _rid, slot, ring, fp, _n = st.pending.popleft()
                try:
                    tk.wait(self.timeout)
                except KVXError:
                    log.error("tcp: a staging scatter did not finish")
                ring.give(slot)
                self._unpin(fp)
            for ring in st.rings.values():
                ring.close()
            self._unpin(pinned)
            with self._lock:
                self._served.pop(key, None)
            try:
                s.close()
            except OSError:
                pass

    def _copier_for(self, kind: int) -> Copier | None:
        """The copier staging target memory of ``kind``, or None when it is received in place."""
        if kind == int(MemoryKind.CUDA):
            return cuda_copier(self.cuda_order)
        return self._host_copier

    def _reap(self, fd: int, st: _ServeStaging, block: bool) -> None:
        """Answer the staged requests whose copy finished, oldest first (``block``: wait for the
        oldest): a write's scatter is acknowledged, a read's gathered slot is sent."""
        while st.pending:
            tk, rid, slot, ring, fp, total = st.pending[0]
            why = None
            if not tk.done():
                if not block:
                    return
                try:
                    tk.wait(self.timeout)
                except KVXError as exc:
                    why = f"staging copy failed: {exc}"
            block = False
            st.pending.popleft()
            try:
                if why is not None:
                    _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, self.timeout)
                elif total < 0:  # a write
                    _net.sendv(fd, _frame(wire.pack("ok", re=rid)), None, None, self.timeout)
                else:
                    _net.sendv(fd, _frame(wire.pack("rd", re=rid, n=total)), np.array([slot.addr], dtype=_U64),
                               np.array([total], dtype=_U64), self.timeout)
            finally:
                ring.give(slot)
                self._unpin(fp)

    def _serve_kind(self, fd: int, t: str, rid: int, ab: bytes, nbb: bytes, kind: Any, devb: Any,
                    st: _ServeStaging, peer: str) -> None:
        """A request naming its target memory kind (``k``; CUDA) or any request while host memory
        is staged too: checked, then served through the staging slots."""
        if kind is None:
            kind = int(MemoryKind.HOST)
        if kind not in (int(MemoryKind.HOST), int(MemoryKind.CUDA)) or isinstance(kind, bool):
            raise ProtocolError(f"bad memory kind {kind!r} in a tcp request")
        if kind == int(MemoryKind.CUDA):
            if not isinstance(devb, bytes):
                raise ProtocolError("a request on CUDA memory lacks its device array")
        else:
            devb = None
        try:
            copier = self._copier_for(kind)
        except BackendUnavailable as exc:  # nothing here can hold CUDA memory: refuse
            self._refuse(fd, t, rid, nbb, peer, f"no GPU staging here: {exc}")
            return
        if copier is None:  # pragma: no cover - HOST kind is staged only with a host copier
            raise ProtocolError("unexpected memory kind in a tcp request")
        self._serve_staged(fd, t, rid, ab, nbb, kind, devb, copier, st, peer)

    def _refuse(self, fd: int, t: str, rid: int, nbb: bytes, peer: str, why: str) -> None:
        """Refuse a request: a write's payload is drained (never into registered memory)."""
        self.refused("requests", "tcp: refused a %s from %s: %s", "write" if t == "w" else "read", peer, why)
        if t == "w":
            total = int(np.frombuffer(nbb, dtype=_U64).sum(dtype=np.float64))
            if total > self.max_msg:
                raise ProtocolError(f"refused write of {total} bytes: {why}")
            _net.discard(fd, total, self.timeout)
        _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, self.timeout)

    def _serve_staged(self, fd: int, t: str, rid: int, ab: bytes, nbb: bytes, kind: int, devb: bytes | None,
                      copier: Copier, st: _ServeStaging, peer: str) -> None:
        """A request on target memory staged through a pinned slot (CUDA memory): validated and
        pinned like any other; a write lands in a slot and is acknowledged once scattered, a read
        is gathered into a slot and sent once gathered; the connection goes on meanwhile, so the
        next request's copy overlaps this one's socket time (answers leave in request order)."""
        to = self.timeout
        addr = np.frombuffer(ab, dtype=_U64)
        nb = np.frombuffer(nbb, dtype=_U64)
        total = int(nb.sum(dtype=np.float64))
        why: str | None = None
        slots = None
        fp: set[int] = set()
        if devb is not None and len(devb) != len(ab):
            raise ProtocolError("malformed device array")
        dev = np.frombuffer(devb, dtype=_U64) if devb is not None else None
        if total > self.stage_bytes or addr.shape[0] > MAX_STAGED_DESCS:
            why = (f"a staged frame of {total} bytes in {addr.shape[0]} descriptors exceeds "
                   f"{self.stage_bytes} bytes or {MAX_STAGED_DESCS} descriptors")
        else:
            why, slots = self._pin(addr, nb, fp, MemoryKind(kind), dev)
        ring = st.ring(self, copier)
        slot = None
        if why is None:
            if len(st.pending) >= self.stage_slots:  # every slot holds a copy in flight: finish the oldest
                self._reap(fd, st, True)
            try:
                slot = ring.take(to)
            except KVXError as exc:
                self._unpin(fp)
                why = str(exc)
        if why is not None:
            self._refuse(fd, t, rid, nbb, peer, why)
            return
        assert slot is not None and slots is not None
        devs = self._dev[slots] if kind == int(MemoryKind.CUDA) else None
        # a write lands in the slot and is acknowledged once scattered; a read is sent once
        # gathered: either way the connection goes on (the next request's copy overlaps)
        try:
            if t == "w":
                _net.recvv(fd, np.array([slot.addr], dtype=_U64), np.array([total], dtype=_U64), to, 0.0,
                           self.rcv_lowat)
                tk = copier.scatter(slot, addr, nb, devs)
            else:
                tk = copier.gather(slot, addr, nb, devs)
        except BaseException:
            ring.give(slot)
            self._unpin(fp)
            raise
        st.pending.append((tk, rid, slot, ring, fp, -1 if t == "w" else total))

    def _serve_loop(self, s: socket.socket, peer: str, pinned: set[int], st: _ServeStaging) -> None:
        fd = s.fileno()
        to = self.timeout
        spin = 0.0
        while not self._closed:
            if st.pending:  # staged writes scattering: acknowledge those done, never sleep on the socket
                self._reap(fd, st, False)
            try:
                body = _net.recv_frame(fd, self.max_msg, to, 0.0 if st.pending else 0.5, spin)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            if body == -1:
                spin = 0.0
                if st.pending:
                    self._reap(fd, st, True)
                continue
            if body == 0:
                return
            msg = wire.unpack(body, max_bytes=self.max_msg)
            t = msg["t"]
            SERVING.op = t
            if t in ("w", "r"):
                wire.check(msg, t, {"rid": int, "addr": bytes, "nbytes": bytes})
                rid = msg["rid"]
                ab, nbb = msg["addr"], msg["nbytes"]
                if len(ab) != len(nbb) or len(ab) % 8:
                    raise ProtocolError("malformed descriptor arrays")
                kind = msg.get("k")
                if kind is not None or self._host_copier is not None:  # staged (CUDA memory)
                    spin = 0.0
                    self._serve_kind(fd, t, rid, ab, nbb, kind, msg.get("dev"), st, peer)
                    continue
                a2: Any
                n2: Any
                if self.scalar_checks and len(ab) <= 8 * SMALL_DESCS:
                    # scalar path: same checks against our live registrations, no numpy
                    why, total = self._pin_small(ab, nbb, pinned)
                    a2, n2 = ab, nbb
                    if _BIG_ENDIAN:  # pragma: no cover - the wire is little-endian
                        a2, n2 = _native_u64(ab), _native_u64(nbb)
                else:
                    addr = np.frombuffer(ab, dtype=_U64)
                    nb = np.frombuffer(nbb, dtype=_U64)
                    total = int(nb.sum(dtype=np.float64))
                    why, _slots = self._pin(addr, nb, pinned)
                    if why is None:
                        a2, n2 = _coalesce(addr, nb)
                spin = self.serve_spin if total <= FAST_MAX else 0.0
                if t == "w":
                    if why is None:
                        try:
                            _net.recvv(fd, a2, n2, to, 0.0, self.rcv_lowat)
                        finally:
                            self._unpin(pinned)
                        _net.sendv(fd, _frame(wire.pack("ok", re=rid)), None, None, to)
                    else:
                        self.refused("requests", "tcp: refused a write from %s: %s", peer, why)
                        if total > self.max_msg:
                            raise ProtocolError(f"refused write of {total} bytes: {why}")
                        _net.discard(fd, total, to)
                        _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, to)
                else:
                    if why is None:
                        try:
                            _net.sendv(fd, _frame(wire.pack("rd", re=rid, n=total)), a2, n2, to)
                        finally:
                            self._unpin(pinned)
                    else:
                        self.refused("requests", "tcp: refused a read from %s: %s", peer, why)
                        _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=why)), None, None, to)
            elif t == "notif":
                wire.check(msg, "notif", {"msg": bytes})
                self.ctx.deliver(peer, msg["msg"])
            elif t == "regions":
                wire.check(msg, "regions", {"rid": int})
                rows = [[int(r.kind), r.addr, r.nbytes, r.dev, slot, gen]
                        for slot, (r, gen) in self.ctx.regions().items()
                        if isinstance(r, Region) and r.kind in (MemoryKind.HOST, MemoryKind.CUDA)]
                _net.sendv(fd, _frame(wire.pack("rows", re=msg["rid"], rows=rows)), None, None, to)
            else:
                rid = msg.get("rid")
                if isinstance(rid, int):
                    _net.sendv(fd, _frame(wire.pack("err", re=rid, msg=f"unknown request {t!r}")), None, None, to)
