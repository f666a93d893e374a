"""The ``cuda`` backend itself: registration and the control table, the peer links (listener and
initiator side), preparing lists, and posting transfers (see the package docstring)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import _native, wire
from ..._cuda import host_device_pointer, import_cupy, unavailable
from ..._slots import BOOT_ID, MAX_SLOTS
from ...channel import Channel
from ...config import get as _config_get
from ...errors import (
    BackendUnavailable,
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    RemoteError,
    UsageError,
)
from ...memory import MemoryKind, Region
from .._samenode import SameNodeLink
from ..base import Backend, BackendContext, DoneRequest, Op, PeerInfo, PreparedList, Request
from .device import _Device
from .driver import _driver
from .errors import ERRORS
from .indices import _I32_MAX, _count, _index, _stageable
from .ipc import _CNT, _CTRL_BYTES, _ENTRY, _F_IPC, _F_PINNED, _F_SHM, _INFL_BYTES, _Imports, _Peer, _u64view
from .launch import _Launcher
from .options import COPY_PATHS, EXEC_POLICIES, CudaOptions
from .prep import _Prep
from .reaper import _Reaper
from .request import _CudaRequest
from .route import CudaRoute

log = logging.getLogger(__name__)


class CudaBackend(_Imports, _Launcher, SameNodeLink, Backend):
    """GPU and pinned host memory on one machine: CUDA IPC, a batched copy kernel or the copy
    engines, events for completion. See the module docstring."""

    name = "cuda"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.CUDA})
    strided = True  # lists of one count and one piece length: the strided kernel expands the pieces
    _CTRL_BYTES = _CTRL_BYTES
    _INFL_BYTES = _INFL_BYTES
    _INFL_NAME = "kvx-cuda-inflight"
    _LINK_WHAT = "same-node GPU"
    remote = True
    local = True
    notifications = True
    Options = CudaOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable()

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        why = unavailable()
        if why is not None:
            raise BackendUnavailable(why)
        self.cp = import_cupy()
        self.cfg = ctx.config
        opts: CudaOptions = ctx.options if ctx.options is not None else CudaOptions()
        self.opts = opts
        # the options, read once: the launch and post paths take them from these attributes
        self.mode = str(opts.copy).strip().lower()
        self.exec_on = str(opts.exec_on).strip().lower()
        self.spin_wait = max(0.0, float(opts.spin_us)) / 1e6
        self.kernel = opts.kernel
        self.chunk_shift = opts.chunk_shift
        self.chunk_shift_min = opts.chunk_shift_min
        self.strided_group = opts.strided_group
        self.ce_min_block = opts.ce_min_block
        self.auto_plan = opts.auto_plan
        self.split_fraction = opts.split_fraction
        self.pipe_pairs = opts.pipe_pairs
        self.index_zerocopy = opts.index_zerocopy
        self.native_post = opts.native_post
        self.native_staging = opts.native_staging
        self.route_on = opts.route
        self.i32_max = _I32_MAX if opts.index_i32 else 0
        if self.mode not in COPY_PATHS or self.exec_on not in EXEC_POLICIES:
            raise UsageError(f"CudaOptions: copy must be one of {', '.join(COPY_PATHS)} and exec_on one of "
                             f"{', '.join(EXEC_POLICIES)}, not {opts.copy!r} and {opts.exec_on!r}")
        self.drv = _driver()
        if self.mode == "ce" and not self.drv.has_batch:
            raise BackendUnavailable("CudaOptions.copy (KVX_CUDA_COPY) = ce needs cuMemcpyBatchAsync (CUDA >= 12.8 "
                                     "driver)")
        self.max_msg = int(_config_get("KVX_MAX_MESSAGE"))
        self._lock = threading.RLock()
        self._closed = False
        self._devs: dict[int, _Device] = {}
        ndev = int(self.cp.cuda.runtime.getDeviceCount())
        self._bus = [str(self.cp.cuda.Device(i).pci_bus_id).lower() for i in range(ndev)]
        self._home: int | None = None  # device that imports peers' GPU memory
        # control table
        self._ctrl_fd = os.memfd_create("kvx-cuda-ctrl", os.MFD_CLOEXEC)
        os.ftruncate(self._ctrl_fd, _CTRL_BYTES)
        self._ctrl = _native.map_fd(self._ctrl_fd, _CTRL_BYTES, 0, True)
        self._table = _u64view(self._ctrl, MAX_SLOTS * 4).reshape(MAX_SLOTS, 4)
        self._slots: dict[int, dict[str, Any]] = {}
        self._reaper = _Reaper(ctx.agent_name, opts.reaper_poll, opts.reaper_lazy, opts.reaper_deep_after)
        self._addr = f"\0kvx-cuda-{ctx.agent_id}"
        self._lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._lsock.bind(self._addr)
        self._lsock.listen(64)
        self._accepted: list[Channel] = []
        self._dead_infl: list[int] = []
        self._peers: dict[str, _Peer] = {}
        self._acceptor = threading.Thread(target=self._accept_loop, name=f"kvx-cuda-{ctx.agent_name}", daemon=True)
        self._acceptor.start()

    # ---- capability ------------------------------------------------------------------------
    def serves(self, local: MemoryKind, remote: MemoryKind, loopback: bool) -> bool:
        if MemoryKind.CUDA not in (local, remote):
            return False  # host <-> host is the host backend's
        return super().serves(local, remote, loopback)

    def _device(self, dev: int) -> _Device:
        d = self._devs.get(dev)
        if d is None:
            with self._lock:
                d = self._devs.get(dev)
                if d is None:
                    d = self._devs[dev] = _Device(self.cp, dev, self.opts)
        return d

    def _home_dev(self) -> int:
        if self._home is None:
            self._home = int(self.cp.cuda.runtime.getDevice())
        return self._home

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if not isinstance(region, Region) or region.kind not in (MemoryKind.HOST, MemoryKind.CUDA):
            raise RegistrationError("cuda backend registers HOST and CUDA memory only")
        info: dict[str, Any] = {"region": region, "gen": gen, "flags": 0}
        if region.kind == MemoryKind.CUDA:
            cp = self.cp
            if not 0 <= region.dev < len(self._bus):
                raise RegistrationError(f"CUDA device {region.dev} does not exist here")
            with cp.cuda.Device(region.dev):
                try:
                    attrs = cp.cuda.runtime.pointerGetAttributes(region.addr)
                except cp.cuda.runtime.CUDARuntimeError as exc:
                    raise ERRORS(exc, (RegistrationError, f"0x{region.addr:x} is not CUDA memory")) from exc
                if int(attrs.type) not in (2, 3) or (int(attrs.type) == 2 and int(attrs.device) != region.dev):
                    raise RegistrationError(f"0x{region.addr:x} is not device memory of GPU {region.dev}")
                base, size = self.drv.address_range(region.addr)
                if region.addr + region.nbytes > base + size:
                    raise RegistrationError("CUDA region extends past its allocation")
                info.update(base=base, bsize=size)
                if self.drv.is_vmm(region.addr) or self.drv.legacy_ipc_capable(region.addr) is False:
                    info["noipc"] = ("allocated with the VMM API (e.g. PyTorch expandable segments), which "
                                     "legacy CUDA IPC cannot export; set PYTORCH_CUDA_ALLOC_CONF="
                                     "expandable_segments:False")
                else:
                    try:
                        info["handle"] = bytes(cp.cuda.runtime.ipcGetMemHandle(base))
                        info["flags"] |= _F_IPC
                    except cp.cuda.runtime.CUDARuntimeError as exc:
                        info["noipc"] = f"cudaIpcGetMemHandle failed: {exc}"
                if "noipc" in info:
                    log.warning("GPU memory at 0x%x cannot be reached from other processes: %s", region.addr,
                                info["noipc"])
            if self._home is None:
                self._home = region.dev
        else:
            if region.shm is not None:
                info["flags"] |= _F_SHM
            dp = host_device_pointer(region.addr, region.nbytes)
            if dp is not None:
                info["flags"] |= _F_PINNED
                info["devptr"] = dp
        with self._lock:
            e = self._table[slot]
            e[1] = region.addr
            e[2] = region.nbytes
            e[3] = int(region.kind) | (int(region.dev) << 8) | (info["flags"] << 40)
            _native.store64(self._ctrl + slot * _ENTRY, (gen << 1) | 1)
            self._slots[slot] = info
        return gen

    def deregister(self, region: Any, handle: Any) -> None:
        gen = int(handle)
        with self._lock:
            slot = next((s for s, i in self._slots.items() if i["region"] is region and i["gen"] == gen), None)
            if slot is None:
                return
            del self._slots[slot]
            _native.store64(self._ctrl + slot * _ENTRY, gen << 1)  # not live: no new transfers start
            chans = [c for c in self._accepted if c.alive and "infl" in c.extra]
            counters = [int(c.extra["infl"]) + _CNT * slot for c in chans]
        if counters and not _native.drain(np.array(counters, dtype=np.uint64), float(self.cfg.peer_timeout)):
            for c in chans:
                if _native.load32(int(c.extra["infl"]) + _CNT * slot):
                    log.error("peer %s did not finish a GPU transfer on a released region within %.1f s; "
                              "disconnecting it", c.peer_name, self.cfg.peer_timeout)
                    c.close()
        for c in chans:
            try:
                c.send(wire.pack("revoke", slot=slot, gen=gen))
            except PeerDisconnected:
                pass

    # ---- peers: listener side --------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return {"uds": self._addr[1:], "pid": os.getpid(), "uid": os.getuid(), "devs": list(self._bus)}

    def _on_close(self, chan: Channel) -> None:
        with self._lock:
            if chan in self._accepted:
                self._accepted.remove(chan)
                infl = chan.extra.pop("infl", None)
                if infl is not None:
                    self._dead_infl.append(int(infl))  # unmapped at close: a drain may still read it
        p = chan.extra.get("peer")
        if p is not None and not self._closed:
            threading.Thread(target=self._cleanup_peer, args=(p,), daemon=True).start()

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
                self._unmap(p, msg["slot"], msg["gen"])
        elif t == "cuget":
            self._serve_get(chan, msg)
        else:
            rid = msg.get("rid")
            if isinstance(rid, int):
                chan.reply_error(rid, f"unknown request {t!r}")

    def _serve_get(self, chan: Channel, msg: dict[str, Any]) -> None:
        wire.check(msg, "cuget", {"rid": int, "slot": int, "gen": int})
        with self._lock:
            info = self._slots.get(msg["slot"])
        if info is None or info["gen"] != msg["gen"]:
            chan.reply_error(msg["rid"], "region is not registered (released?)")
            return
        region: Region = info["region"]
        if region.kind == MemoryKind.CUDA:
            if "handle" not in info:
                chan.reply_error(msg["rid"], f"GPU memory cannot be exported with CUDA IPC: {info.get('noipc')}")
                return
            chan.reply(msg["rid"], "cumem", kind=int(MemoryKind.CUDA), handle=info["handle"], base=info["base"],
                       bsize=info["bsize"], dev=region.dev)
        else:
            if region.shm is None:
                chan.reply_error(msg["rid"], "host memory is not shareable (use kvx.alloc_host(n, pinned=True))")
                return
            fd, off, size = region.shm
            chan.reply(msg["rid"], "cumem", kind=int(MemoryKind.HOST), off=off, size=size, fds=[fd])

    # ---- peers: initiator side -------------------------------------------------------------
    def connect(self, peer: PeerInfo) -> bool:
        sec = peer.sections.get(self.name)
        if not isinstance(sec, dict) or peer.sections.get("_boot") != BOOT_ID:
            return False
        try:
            wire.check(dict(sec, t="cuda"), "cuda", {"uds": str, "pid": int, "uid": int, "devs": list})
        except ProtocolError:
            raise ProtocolError(f"malformed cuda section in {peer.name!r} metadata") from None
        if not all(isinstance(b, str) for b in sec["devs"]):
            raise ProtocolError(f"malformed device list in {peer.name!r} metadata")
        devmap = [self._bus.index(b.lower()) if b.lower() in self._bus else -1 for b in sec["devs"]]
        chan, ctrl, infl = self._dial(peer, sec["uds"])
        p = _Peer(peer.name, chan, sec["pid"], ctrl, infl, devmap)
        self._adopt(peer.name, p, chan)
        return True

    def refresh_regions(self, peer_name: str) -> list[tuple[int, int, int, int, int, int]] | None:
        p = self._peers.get(peer_name)
        if p is None:
            return None
        with p.clock:
            return p.table() if p.ctrl else None

    def disconnect(self, peer_name: str) -> None:
        with self._lock:
            p = self._peers.pop(peer_name, None)
        if p is not None:
            self._drop(p)

    def _drop(self, p: _Peer) -> None:
        p.dropped = True
        p.chan.close()
        self._cleanup_peer(p)

    def _cleanup_peer(self, p: _Peer) -> None:
        """Wait (bounded) for the peer's transfers still on the GPU, then close its mappings."""
        deadline = time.monotonic() + float(self.cfg.peer_timeout)
        for r in self._reaper.pending_for(p):
            try:
                r.wait(max(0.0, deadline - time.monotonic()))
            except KVXError:
                pass
        with p.lock:
            keys = list(p.maps)
        for k in keys:
            self._unmap(p, k[0], k[1])
        with p.clock:
            if p.ctrl:
                for addr, size in ((p.ctrl, _CTRL_BYTES), (p.infl, _INFL_BYTES)):
                    try:
                        _native.unmap(addr, size)
                    except OSError:
                        pass
                p.ctrl = p.infl = 0

    # ---- preparation -----------------------------------------------------------------------
    def takes_strided(self, plist: PreparedList) -> bool:
        """A strided list of one count and one piece length goes to the strided kernel; another
        moves as its expansion."""
        d = plist.descs
        c, n = d.count, d.nbytes
        return bool(len(c)) and bool((c == c[0]).all()) and bool((n == n[0]).all())

    def prepare(self, plist: PreparedList) -> _Prep:
        prep = self._prepare(plist)
        d = plist.descs
        if d.is_strided:
            prep.count = int(d.count[0])
            prep.stride = np.ascontiguousarray(d.stride, dtype=np.uint64)
        return prep

    def _prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        addr = np.ascontiguousarray(d.addr, dtype=np.uint64)
        nb = np.ascontiguousarray(d.nbytes, dtype=np.uint64)
        ulen = int(nb[0]) if len(nb) and bool((nb == nb[0]).all()) else 0
        if plist.peer is None:
            return self._prepare_local(plist, addr, nb, ulen)
        p = self._peers.get(plist.peer)
        if p is None or not p.alive:
            raise PeerDisconnected(f"not connected to {plist.peer!r}")
        guards = [(p.ctrl + s * _ENTRY, (plist.gens[s] << 1) | 1, p.infl + _CNT * s) for s in plist.used.tolist()]
        prep = _Prep(plist.kind, -1, addr, nb, ulen, peer=p, guards=guards, plist=plist)
        if plist.kind == MemoryKind.HOST:
            prep.pending_host = True  # mapped (and pinned here) at the first GPU transfer only
            return prep
        self._translate_remote(prep)
        return prep

    def _remote_ready(self, rp: _Prep) -> _Peer | None:
        """The peer of a remote list, checked live (None for a local list); its pinned host
        regions translated on first use."""
        peer: _Peer | None = rp.peer
        if peer is not None:
            if self._peers.get(peer.name) is not peer or not peer.alive:
                raise PeerDisconnected(f"peer {peer.name!r} is not connected (or reconnected: prepare again)")
            if rp.pending_host:
                with rp.lock:
                    if rp.pending_host:
                        self._translate_remote(rp)
        return peer

    def _post_strided(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any, notify: bytes | None) -> Request:
        """A transfer between strided lists (one count, one piece length each): one launch of the
        strided kernel, one index pair per descriptor pair uploaded."""
        if lp.count != rp.count or lp.ulen != rp.ulen or not lp.ulen:
            raise ValueError(f"paired descriptors differ ({lp.count} x {lp.ulen} vs {rp.count} x {rp.ulen} bytes)")
        li, ri = _index(lidx, len(lp.addr)), _index(ridx, len(rp.addr))
        n = int(li.shape[0])
        if n != int(ri.shape[0]):
            raise ValueError("index lists differ in length")
        peer = self._remote_ready(rp)
        if n == 0:
            return DoneRequest(0)
        total = n * lp.count * lp.ulen
        d, _gpu2gpu = self._exec_device(op, lp, rp)
        src, sidx, dst, didx = (lp, li, rp, ri) if op is Op.WRITE else (rp, ri, lp, li)
        return self._launched(d, lp, rp, peer, total, notify,
                              lambda: (self._launch_strided(d, dst, didx, src, sidx, n, lp.ulen, lp.count), None))

    def _launched(self, d: _Device, lp: _Prep, rp: _Prep, peer: _Peer | None, total: int, notify: bytes | None,
                  launch: Callable[[], tuple[Any, Any]]) -> Request:
        """Run ``launch`` (-> completion event, what to keep alive until it fires) on GPU ``d``
        under its lock, after the local GPU's default stream when that is another GPU, with the
        peer's in-flight counters raised (released again if the launch fails); the transfer as a
        request the reaper retires."""
        counters = self._acquire(peer, rp.guards) if peer is not None else []
        try:
            with d.lock:
                if lp.kind == MemoryKind.CUDA and lp.dev != d.dev:
                    self._order_after_default(lp.dev, d)
                ev, keep = launch()
        except self.cp.cuda.runtime.CUDARuntimeError as exc:
            self._release_counters(peer, counters)
            raise ERRORS(exc, "CUDA launch failed") from exc
        except BaseException:
            self._release_counters(peer, counters)
            raise
        req = _CudaRequest(self, ev, total, peer, counters, notify, keep)
        self._reaper.add(req)
        return req

    def _prepare_local(self, plist: PreparedList, addr: np.ndarray, nb: np.ndarray, ulen: int) -> _Prep:
        with self._lock:
            infos = {s: self._slots.get(s) for s in plist.used.tolist()}
        if any(i is None for i in infos.values()):
            raise BackendUnavailable("a region of this list is not registered with the cuda backend")
        if plist.kind == MemoryKind.CUDA:
            devs = np.unique(plist.descs.dev)
            if len(devs) != 1:
                raise BackendUnavailable("a prepared list of GPU memory must lie on one GPU for the cuda backend")
            return _Prep(MemoryKind.CUDA, int(devs[0]), addr, nb, ulen, plist=plist, owner=int(devs[0]))
        delta = np.zeros(MAX_SLOTS, dtype=np.uint64)
        for s, i in infos.items():
            assert i is not None
            if not i["flags"] & _F_PINNED:
                raise BackendUnavailable("host memory is not pinned: use kvx.alloc_host(n, pinned=True) or a "
                                         "pinned tensor for GPU transfers")
            delta[s] = np.uint64((i["devptr"] - i["region"].addr) % (1 << 64))
        if delta.any():
            addr = addr + delta[plist.slots]
        return _Prep(MemoryKind.HOST, -1, addr, nb, ulen, plist=plist)

    # ---- transfers -------------------------------------------------------------------------
    def _acquire(self, p: _Peer, guards: list[tuple[int, int, int]]) -> list[int]:
        """Raise the in-flight counters of the target slots, then check they are still live."""
        cnts = [g[2] for g in guards]
        with p.clock:
            if not p.alive or not p.ctrl:
                raise PeerDisconnected(f"peer {p.name!r} is not connected")
            for c in cnts:
                _native.store64(c, _native.load64(c) + 1)  # seq-cst store: a full fence before the checks
            if all(_native.load64(st) == want for st, want, _c in guards):
                return cnts
            for c in cnts:
                _native.store64(c, _native.load64(c) - 1)
        raise RemoteError(f"peer {p.name!r}: the target released (or re-registered) the memory")

    def _release_counters(self, p: _Peer | None, cnts: list[int]) -> None:
        if p is None or not cnts:
            return
        with p.clock:
            if not p.infl:
                return
            for c in cnts:
                _native.store64(c, _native.load64(c) - 1)

    def _send_notif(self, p: _Peer | None, message: bytes) -> None:
        if p is None:
            self.ctx.deliver(self.ctx.agent_name, message)
            return
        try:
            p.chan.send(wire.pack("notif", msg=message))
        except PeerDisconnected:
            log.debug("notification to %s lost: peer gone", p.name)

    def _post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
              notify: bytes | None) -> Request:
        """The general path of a transfer (:class:`CudaRoute` calls it): indices as
        :func:`base.indices` leaves them (or checked arrays); raises TypeError/ValueError/IndexError
        for bad ones before anything moves (the route turns them into UsageError)."""
        lp: _Prep = local.bdata["cuda"]
        rp: _Prep = remote.bdata["cuda"]
        if self._closed:
            raise UsageError("cuda backend is closed")
        li: Any
        ri: Any
        if lp.count or rp.count:
            return self._post_strided(op, lp, lidx, rp, ridx, notify)
        if lp.ulen and rp.ulen:
            if lp.ulen != rp.ulen:
                raise ValueError("paired descriptors differ in length")
            ulen = lp.ulen
            # index sources as given when the kernel path can check them while staging them
            li = _stageable(lidx) if self.native_staging else None
            ri = _stageable(ridx) if li is not None else None
            if li is None or ri is None:
                li, ri = _index(lidx, len(lp.addr)), _index(ridx, len(rp.addr))
                checked = True
            else:
                checked = False
            n = _count(li)
            if n != _count(ri):
                raise ValueError("index lists differ in length")
            total = ulen * n
        else:
            li = _index(lidx, len(lp.addr))
            ri = _index(ridx, len(rp.addr))
            checked = True
            n = int(li.shape[0])
            if n != int(ri.shape[0]):
                raise ValueError("index lists differ in length")
            ln = lp.nbytes[li]
            if not np.array_equal(ln, rp.nbytes[ri]):
                raise ValueError("paired descriptors differ in length")
            total = int(ln.sum())
            ulen = int(ln[0]) if n and bool((ln == ln[0]).all()) else 0
        peer = self._remote_ready(rp)
        if n == 0:
            return DoneRequest(0)
        d, gpu2gpu = self._exec_device(op, lp, rp)
        path, frac = self.mode, self.split_fraction
        if path == "auto":
            path, frac = self._plan(total, n, gpu2gpu)
        if not checked and (path != "kernel" or 0 < self.pipe_pairs < n):
            li, ri = _index(li, len(lp.addr)), _index(ri, len(rp.addr))
        src, sidx, dst, didx = (lp, li, rp, ri) if op is Op.WRITE else (rp, ri, lp, li)

        def launch() -> tuple[Any, Any]:
            if path == "ce":
                return self._launch_ce(d, dst, didx, src, sidx)
            if path == "split" and self.drv.has_batch:
                return self._launch_split(d, dst, didx, src, sidx, n, ulen, frac)
            return self._launch_kernel(d, dst, didx, src, sidx, n, ulen)

        return self._launched(d, lp, rp, peer, total, notify, launch)

    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> CudaRoute:
        """The pair's :class:`CudaRoute` (made once per pair by the agent)."""
        return CudaRoute(self, op, local, remote)

    def notify(self, peer_name: str, message: bytes) -> None:
        p = self._peers.get(peer_name)
        if p is None or not p.alive:
            raise PeerDisconnected(f"peer {peer_name!r} is not connected")
        p.chan.send(wire.pack("notif", msg=message))

    def close(self) -> None:
        if not self._close_link():
            return
        self._reaper.close(float(self.cfg.peer_timeout))
        for s in list(self._slots):
            _native.store64(self._ctrl + s * _ENTRY, 0)
        with self._lock:
            dead, self._dead_infl = self._dead_infl, []
        for a in dead:
            try:
                _native.unmap(a, _INFL_BYTES)
            except OSError:
                pass
        for d in self._devs.values():
            try:
                d.stream.synchronize()
            except Exception:
                log.debug("synchronizing GPU %d at close", d.dev, exc_info=True)
        os.close(self._ctrl_fd)
