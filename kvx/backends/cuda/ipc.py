"""Reaching a peer's memory: the control table each agent publishes, a peer as the initiator sees
it, and importing the peer's regions here (GPU memory with CUDA IPC, opened once per handle and
reference counted; pinned host memory as its memfd, mapped and registered with CUDA) and closing
those imports again."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, Callable

import numpy as np

from ... import _native, wire
from ..._slots import MAX_SLOTS
from ...channel import Channel
from ...errors import BackendUnavailable, PeerDisconnected, ProtocolError
from ...memory import MemoryKind
from .driver import _HOST_REGISTER_FLAGS, _IPC_LAZY_PEER
from .errors import ERRORS
from .prep import _Prep

log = logging.getLogger(__name__)

_ENTRY = 32  # control-table entry: state, addr, nbytes, info
_CTRL_BYTES = MAX_SLOTS * _ENTRY
_CNT = 8  # bytes per in-flight counter (the low 32 bits are what drain() reads)
_INFL_BYTES = MAX_SLOTS * _CNT
_F_SHM = 1 << 0  # HOST region inside an alloc_host memfd
_F_PINNED = 1 << 1  # HOST region page-locked and registered with CUDA
_F_IPC = 1 << 2  # CUDA region exportable through cudaIpcGetMemHandle


class _Peer:
    """A connection this agent opened to a same-node peer, with its control table mapped."""

    def __init__(self, name: str, chan: Channel, pid: int, ctrl: int, infl: int, devmap: list[int]) -> None:
        self.name = name
        self.chan = chan
        self.pid = pid
        self.same_process = pid == os.getpid()
        self.ctrl = ctrl
        self.infl = infl
        self.devmap = devmap  # peer device ordinal -> local ordinal (-1: not visible here)
        self.lock = threading.Lock()
        self.clock = threading.Lock()  # counters
        # (slot, gen) -> (kind, key, delta) of the first import; (slot, gen, dev) of another GPU's
        self.maps: dict[tuple[int, ...], tuple[str, Any, int]] = {}
        self.ipc: dict[tuple[bytes, int], list[int]] = {}  # (handle, dev) -> [opened pointer, references]
        self.hostmaps: dict[tuple[int, int], tuple[int, int]] = {}  # (slot, gen) -> (base, size)
        self.dropped = False

    @property
    def alive(self) -> bool:
        return self.chan.alive and not self.dropped

    def table(self) -> list[tuple[int, int, int, int, int, int]]:
        t = _u64view(self.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        st = t[:, 0].copy()
        rows = []
        for s in np.nonzero(st & 1)[0].tolist():
            state, addr, nb, info = (int(x) for x in t[s])
            if state != int(st[s]):
                continue
            kind = info & 0xFF
            if kind not in (int(MemoryKind.HOST), int(MemoryKind.CUDA)):
                continue
            rows.append((kind, addr, nb, (info >> 8) & 0xFFFFFFFF, s, state >> 1))
        return rows


def _u64view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(addr))



class _Imports:
    """The backend's imports of peers' regions (a part of :class:`CudaBackend`)."""

    cp: Any
    cfg: Any
    exec_on: str
    _home: int | None
    _home_dev: Callable[[], int]

    def _unmap(self, p: _Peer, slot: int, gen: int) -> None:
        """Drop every import of the peer's region (slot, gen): the first one and those on other GPUs."""
        with p.lock:
            ms = [p.maps.pop(k) for k in [k for k in p.maps if k[0] == slot and k[1] == gen]]
        for m in ms:
            self._unmap_one(p, slot, gen, m)

    def _unmap_one(self, p: _Peer, slot: int, gen: int, m: tuple[str, Any, int]) -> None:
        with p.lock:
            kind, key, _delta = m
            if kind == "ipc":
                ent = p.ipc.get((key[0], key[1]))
                if ent is None:
                    return
                ent[1] -= 1
                if ent[1] > 0:
                    return
                del p.ipc[(key[0], key[1])]
                ptr = ent[0]
                host = None
            else:
                host = p.hostmaps.pop((slot, gen), None)
                ptr = 0
        try:
            if ptr:
                with self.cp.cuda.Device(key[1]):
                    self.cp.cuda.runtime.ipcCloseMemHandle(ptr)
            if host is not None:
                try:
                    self.cp.cuda.runtime.hostUnregister(host[0])
                finally:
                    _native.unmap(host[0], host[1])
        except Exception:
            log.debug("closing a mapping of %s", p.name, exc_info=True)

    def _map(self, p: _Peer, slot: int, gen: int, region_addr: int,
             want: int | None = None) -> tuple[str, int, int, int]:
        """Import the peer's region (slot, gen) (GPU memory: on GPU ``want``, else by ``exec_on``);
        return (kind, local device or -1, address delta, GPU holding the memory here or -1)."""
        with p.lock:
            m = p.maps.get((slot, gen) if want is None else (slot, gen, want))
            if m is None and want is not None:
                m0 = p.maps.get((slot, gen))
                if m0 is not None and (m0[0] != "ipc" or int(m0[1][1]) == want or p.same_process):
                    m = m0
        if m is not None:
            return m[0], int(m[1][1]) if m[0] == "ipc" else -1, m[2], int(m[1][2]) if m[0] == "ipc" else -1
        msg, _, fds = p.chan.request("cuget", self.cfg.handshake_timeout, slot=slot, gen=gen)
        try:
            wire.check(msg, "cumem", {"kind": int})
            if msg["kind"] == int(MemoryKind.CUDA):
                wire.check(msg, "cumem", {"handle": bytes, "base": int, "bsize": int, "dev": int})
                if not (msg["base"] <= region_addr < msg["base"] + msg["bsize"]):
                    raise ProtocolError("cuget reply does not contain the region")
                return self._map_ipc(p, slot, gen, msg, want)
            wire.check(msg, "cumem", {"off": int, "size": int})
            if len(fds) != 1:
                raise ProtocolError("cuget reply without a descriptor")
            size, off = msg["size"], msg["off"]
            if os.fstat(fds[0]).st_size < size or off >= size:
                raise ProtocolError("cuget reply with inconsistent sizes")
            base = _native.map_fd(fds[0], size, 0, True)
            try:
                self.cp.cuda.runtime.hostRegister(base, size, _HOST_REGISTER_FLAGS)
            except self.cp.cuda.runtime.CUDARuntimeError as exc:
                _native.unmap(base, size)
                raise ERRORS(exc, (BackendUnavailable, f"cannot pin {p.name!r}'s host memory here")) from exc
            dp = int(self.cp.cuda.runtime.pointerGetAttributes(base).devicePointer) or base
            delta = (dp + off - region_addr) % (1 << 64)
            with p.lock:
                if (slot, gen) in p.maps:  # raced with another thread
                    dup = True
                else:
                    dup = False
                    p.maps[(slot, gen)] = ("host", None, delta)
                    p.hostmaps[(slot, gen)] = (base, size)
            if dup:
                self.cp.cuda.runtime.hostUnregister(base)
                _native.unmap(base, size)
                return "host", -1, p.maps[(slot, gen)][2], -1
            return "host", -1, delta, -1
        finally:
            for fd in fds:
                os.close(fd)

    def _map_ipc(self, p: _Peer, slot: int, gen: int, msg: dict[str, Any],
                 want: int | None = None) -> tuple[str, int, int, int]:
        handle, base = msg["handle"], msg["base"]
        owner = p.devmap[msg["dev"]] if 0 <= msg["dev"] < len(p.devmap) else -1
        if p.same_process:
            dev = owner if owner >= 0 else self._home_dev()
            with p.lock:
                p.maps.setdefault((slot, gen), ("ipc", (b"", dev, owner), 0))
            return "ipc", dev, 0, owner
        # import on the GPU that will run the copies: the one holding this agent's own GPU memory,
        # else the memory's own GPU when it is visible here
        if want is not None:
            dev = want
        elif self.exec_on == "owner" and owner >= 0:
            dev = owner
        else:
            dev = self._home if self._home is not None else (owner if owner >= 0 else self._home_dev())
        mkey: tuple[int, ...] = (slot, gen) if want is None else (slot, gen, dev)
        with p.lock:
            ent = p.ipc.get((handle, dev))
            if ent is not None:
                ent[1] += 1
                ptr = ent[0]
        if ent is None:
            with self.cp.cuda.Device(dev):
                try:
                    ptr = int(self.cp.cuda.runtime.ipcOpenMemHandle(handle, _IPC_LAZY_PEER))
                except self.cp.cuda.runtime.CUDARuntimeError as exc:
                    raise ERRORS(exc, (BackendUnavailable, f"cannot open {p.name!r}'s GPU memory with CUDA IPC on "
                                                           f"GPU {dev}")) from exc
            with p.lock:
                got = p.ipc.get((handle, dev))
                if got is not None:  # another thread opened it meanwhile
                    got[1] += 1
                    dup, ptr2 = ptr, got[0]
                    ptr = ptr2
                else:
                    p.ipc[(handle, dev)] = [ptr, 1]
                    dup = 0
            if dup:
                with self.cp.cuda.Device(dev):
                    self.cp.cuda.runtime.ipcCloseMemHandle(dup)
        delta = (ptr - base) % (1 << 64)
        with p.lock:
            if mkey in p.maps:
                p.ipc[(handle, dev)][1] -= 1
                m = p.maps[mkey]
                return "ipc", int(m[1][1]), m[2], owner
            p.maps[mkey] = ("ipc", (handle, dev, owner), delta)
        return "ipc", dev, delta, owner

    def _translate_remote(self, prep: _Prep) -> None:
        p, plist = prep.peer, prep.plist
        starts = {}
        with p.clock:
            if not p.alive or not p.ctrl:
                raise PeerDisconnected(f"peer {p.name!r} is not connected")
            t = _u64view(p.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
            for s in plist.used.tolist():
                starts[s] = int(t[s, 1])
        delta = np.zeros(MAX_SLOTS, dtype=np.uint64)
        devs, owners = set(), set()
        for s in plist.used.tolist():
            _kind, dev, dl, own = self._map(p, s, plist.gens[s], starts[s])
            delta[s] = np.uint64(dl)
            if dev >= 0:
                devs.add(dev)
            owners.add(own)
        if len(devs) > 1:
            raise BackendUnavailable("remote GPU memory of one prepared list was imported on several GPUs")
        prep.addr = np.ascontiguousarray(prep.addr + delta[plist.slots])
        prep.dev = devs.pop() if devs else -1
        prep.owner = owners.pop() if len(owners) == 1 else -1
        prep.pending_host = False

    def _import_on(self, prep: _Prep, dev: int) -> None:
        """Import a remote GPU list on GPU ``dev`` too (``pull``: the copies run on either GPU)."""
        p, plist = prep.peer, prep.plist
        with p.clock:
            if not p.alive or not p.ctrl:
                raise PeerDisconnected(f"peer {p.name!r} is not connected")
            t = _u64view(p.ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
            starts = {s: int(t[s, 1]) for s in plist.used.tolist()}
        delta = np.zeros(MAX_SLOTS, dtype=np.uint64)
        for s in plist.used.tolist():
            _kind, got, dl, _own = self._map(p, s, plist.gens[s], starts[s], want=dev)
            if got != dev:
                raise BackendUnavailable(f"could not import {p.name!r}'s GPU memory on GPU {dev}")
            delta[s] = np.uint64(dl)
        prep.alt[dev] = np.ascontiguousarray(np.asarray(plist.descs.addr, dtype=np.uint64) + delta[plist.slots])

