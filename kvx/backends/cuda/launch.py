"""Launching a transfer: which GPU runs it (and peer access), which path (kernel, copy engines or
both), the kernel launch with its index staging, the copy-engine batch, and building a route's
native launcher once per list pair."""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from ... import _native
from ...errors import BackendUnavailable
from ...memory import MemoryKind
from ..base import Op
from .device import _Device
from .driver import _ERR_PEER_ALREADY, _Driver
from .indices import _chunk_shift, _group_shift, _stageable
from .ipc import _Peer
from .prep import _Prep
from .route import _FastPost
from .staging import _BUSY, _Slot

log = logging.getLogger(__name__)


def _release_failed(d: _Device, st: Any, slots: list[_Slot]) -> None:
    """After a failed launch: the staging slots still marked busy are free again once what the
    stream may already run of them has finished."""
    for slot in slots:
        if slot.guard is _BUSY:
            try:
                st.synchronize()
            except Exception:
                log.debug("synchronizing GPU %d after a failed launch", d.dev, exc_info=True)
            slot.guard = None


class _Launcher:
    """Launch-side part of :class:`CudaBackend` (its settings are the backend's options, read once)."""

    cp: Any
    drv: _Driver
    mode: str
    exec_on: str
    kernel: str
    chunk_shift: int
    chunk_shift_min: int
    strided_group: int
    ce_min_block: int
    auto_plan: tuple[tuple[int, str, float], ...]
    pipe_pairs: int
    index_zerocopy: bool
    native_post: bool
    native_staging: bool
    i32_max: int
    _closed: bool
    _peers: dict[str, _Peer]
    _home_dev: Callable[[], int]
    _device: Callable[[int], _Device]
    _import_on: Callable[[_Prep, int], None]

    def _exec_device(self, op: Op, lp: _Prep, rp: _Prep) -> tuple[_Device, bool]:
        """The GPU that runs a transfer between ``lp`` and ``rp`` (peer access enabled), and whether
        both sides are GPU memory."""
        peer: _Peer | None = rp.peer
        dev = lp.dev if lp.kind == MemoryKind.CUDA else rp.dev
        gpu2gpu = lp.kind == MemoryKind.CUDA and rp.kind == MemoryKind.CUDA
        ipc = peer is not None and not peer.same_process
        if ipc and rp.kind == MemoryKind.CUDA and rp.dev >= 0 and rp.dev != lp.dev:
            dev = rp.dev  # IPC memory is reachable only from the GPU it was imported on (_map_ipc)
        if self.exec_on == "pull" and gpu2gpu:
            rhome = rp.owner if rp.owner >= 0 else rp.dev
            want = rhome if op is Op.WRITE else lp.dev
            if want >= 0 and want != dev:
                if ipc and want != rp.dev and want not in rp.alt:
                    with rp.lock:
                        if want not in rp.alt:
                            self._import_on(rp, want)
                dev = want
        if dev < 0:
            dev = self._home_dev()
        d = self._device(dev)
        if gpu2gpu:
            self._ensure_peer_access(d, lp.dev)
            self._ensure_peer_access(d, rp.owner if rp.owner >= 0 else rp.dev)
        return d, gpu2gpu

    def _ensure_peer_access(self, d: _Device, other: int) -> None:
        if other < 0 or other == d.dev or other in d.peers:
            return
        cp = self.cp
        with cp.cuda.Device(d.dev):
            if not cp.cuda.runtime.deviceCanAccessPeer(d.dev, other):
                raise BackendUnavailable(f"GPU {d.dev} cannot access GPU {other} (no peer access)")
            try:
                cp.cuda.runtime.deviceEnablePeerAccess(other)
            except cp.cuda.runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) != _ERR_PEER_ALREADY:
                    raise
        d.peers.add(other)

    def _route(self, r: _FastPost) -> None:
        """Build the native part of route ``r`` (``r.nat``), or leave it None where it does not apply
        (then :meth:`_post` runs): lists of unequal block lengths, a plan other than the kernel's,
        settings the route does not implement (pieces, index upload, the Python post
        path), a copy ordered after another GPU's default stream, or driver entry points missing.
        Strided lists (head slices) of equal counts whose pieces the group kernel takes run natively
        too, with that kernel; others take the general path's strided launch."""
        lp: _Prep = r.local.bdata["cuda"]
        rp: _Prep = r.remote.bdata["cuda"]
        op = r.op
        if (not (self.native_post and self.native_staging and self.index_zerocopy) or self.pipe_pairs
                or not lp.ulen or lp.ulen != rp.ulen or rp.pending_host or self._closed):
            return
        count = int(lp.count or 0)
        if (lp.count or rp.count) and (lp.count != rp.count
                                       or _group_shift(1, count, lp.ulen, self.strided_group, 1) < 0):
            return
        peer: _Peer | None = rp.peer
        if peer is not None and (self._peers.get(peer.name) is not peer or not peer.alive):
            return
        d, gpu2gpu = self._exec_device(op, lp, rp)
        if lp.kind == MemoryKind.CUDA and lp.dev != d.dev:
            return  # _order_after_default per post
        path = self.mode
        if path == "auto" and not count:
            path = self._plan(lp.ulen, 1, gpu2gpu)[0]
        fns = d.route_fns()
        if (path != "kernel" and not count) or fns is None:
            return  # (strided lists always run the kernel, as _launch_strided does)
        cp = self.cp
        src, dst = (lp, rp) if op is Op.WRITE else (rp, lp)
        i32 = len(dst.addr) <= self.i32_max and len(src.addr) <= self.i32_max
        host_side = dst.kind == MemoryKind.HOST or src.kind == MemoryKind.HOST
        _kern, func, threads, cap = d.config(cp, "strided_g" if count else self.kernel, host_side, i32)
        if not func:
            return
        dap = dst.device_ptrs(cp, d.dev)[0]
        sap, slp = src.device_ptrs(cp, d.dev)
        dsp = 0
        if count:  # the group kernel reads the two lists' strides where the others read lengths
            slp, dsp = src.stride_ptr(cp, d.dev), dst.stride_ptr(cp, d.dev)
        guards = np.array([x for g in rp.guards for x in g] if peer is not None else [], dtype=np.uint64)
        nat = _native.CudaRoute(fns[0], fns[1], fns[2], fns[3], d.ctx, int(d.stream.ptr), func, threads, cap,
                                self.chunk_shift, dap, sap, slp, lp.ulen, len(dst.addr), len(src.addr), not i32,
                                guards, min(self.chunk_shift, self.chunk_shift_min), count, dsp,
                                self.strided_group if count else 0)
        r.d, r.peer, r.ulen, r.isz = d, peer, lp.ulen * max(1, count), 4 if i32 else 8
        r.cnts = [g[2] for g in rp.guards] if peer is not None else []
        r.nat = nat  # last: a post on another thread sees the whole route or none

    def _order_after_default(self, src_dev: int, d: _Device) -> None:
        """Order ``d``'s copy stream after the work queued so far on ``src_dev``'s legacy default stream.

        (The copy runs on another GPU than the caller's memory: the blocking stream of ``d`` orders
        it only against ``d``'s own default stream.)
        """
        cp = self.cp
        with cp.cuda.Device(src_dev):
            ev = cp.cuda.Event(block=False, disable_timing=True)
            ev.record(cp.cuda.Stream.null)
        with cp.cuda.Device(d.dev):
            d.stream.wait_event(ev)

    def _plan(self, total: int, n: int, gpu2gpu: bool) -> tuple[str, float]:
        """``auto``: the copy path (and copy-engine fraction) for a transfer of ``n`` pairs."""
        if not self.drv.has_batch:
            return "kernel", 0.0
        if not gpu2gpu:
            return ("ce" if total >= self.ce_min_block * n else "kernel"), 0.0
        mean = total // max(1, n)
        path, frac = "kernel", 0.0
        for lo, pth, f in self.auto_plan:
            if mean >= lo:
                path, frac = pth, f
        return path, frac

    def _launch_kernel(self, d: _Device, dst: _Prep, didx: Any, src: _Prep, sidx: Any, n: int,
                       ulen: int, record: bool = True) -> tuple[Any, Any]:
        """Stage the indices in a slot of the GPU's ring (int32 when every list fits), upload them
        with one copy, launch one kernel, record one event (which also guards the slot).

        ``didx``/``sidx``: checked int arrays (from :func:`_index`), or, when ``ulen`` and one launch,
        unchecked index sources of a form :func:`_stageable` passed (checked while staged)."""
        cp = self.cp
        shift = self.chunk_shift
        i32 = len(dst.addr) <= self.i32_max and len(src.addr) <= self.i32_max
        itype = np.int32 if i32 else np.int64
        isz = 4 if i32 else 8
        host_side = dst.kind == MemoryKind.HOST or src.kind == MemoryKind.HOST
        cfg = d.config(cp, self.kernel, host_side, i32)
        threads, cap = cfg[2], cfg[3]
        if ulen:
            shift = _chunk_shift(n, ulen, cap * threads // 32, self.chunk_shift, self.chunk_shift_min)
        zc = self.index_zerocopy
        cpd = (ulen + (1 << shift) - 1) >> shift
        ev: Any = None
        taken: list[_Slot] = []
        with cp.cuda.Device(d.dev):
            dap = dst.device_ptrs(cp, d.dev)[0]
            sap, slp = src.device_ptrs(cp, d.dev)
            st = d.stream
            step = self.pipe_pairs if 0 < self.pipe_pairs < n else n
            try:
                for lo in range(0, n, step):
                    m = min(step, n - lo)
                    ib = 2 * m * isz  # a multiple of 8: the u64 prefix array (unequal lengths) follows
                    nb = ib if ulen else ib + 8 * (m + 1)
                    slot = d.staging.take(cp, nb)
                    taken.append(slot)
                    if (m == n and ulen and self.native_staging and _stageable(didx) is not None
                            and _stageable(sidx) is not None):
                        # check + int32/int64 conversion in C without the GIL, straight into the slot
                        try:
                            got = _native.stage_index(didx, len(dst.addr), sidx, len(src.addr), slot.hptr, slot.cap,
                                                      not i32)
                        except BaseException:
                            taken.pop()
                            slot.guard = None  # nothing was queued that reads it
                            raise
                        if got != m:
                            taken.pop()
                            slot.guard = None
                            raise ValueError("index lists changed length during the post")
                    else:
                        hi = slot.hview[:ib].view(itype)
                        di, si = (didx, sidx) if m == n else (didx[lo:lo + m], sidx[lo:lo + m])
                        np.copyto(hi[:m], di, casting="unsafe")  # bounds-checked in _index: fits
                        np.copyto(hi[m:], si, casting="unsafe")
                    if ulen:
                        items = m * cpd
                    else:
                        hf = slot.hview[ib:nb].view(np.uint64)
                        hf[0] = 0
                        np.cumsum((src.nbytes[si] + np.uint64((1 << shift) - 1)) >> np.uint64(shift), out=hf[1:])
                        items = int(hf[m])
                    ip = slot.hptr if zc else slot.dptr
                    up = 0 if zc else nb
                    grid = max(1, min(cap, (items * 32 + threads - 1) // threads))
                    a = (dap, sap, ip, slp, 0 if ulen else ip + ib, m, ulen, items)
                    # blocking sync: the reaper sleeps in cudaEventSynchronize on it (no polling)
                    g = cp.cuda.Event(block=True, disable_timing=True)
                    d.enqueue(cp, cfg, grid, st, slot.dptr, slot.hptr, up, a, shift, g)
                    slot.guard = g  # the slot is free again once this kernel has finished
                    if record and lo + m >= n:
                        ev = g
            except BaseException:
                _release_failed(d, st, taken)
                raise
        return ev, None

    def _launch_strided(self, d: _Device, dst: _Prep, didx: np.ndarray, src: _Prep, sidx: np.ndarray, n: int,
                        ulen: int, count: int) -> Any:
        """One launch of the strided kernel over ``n`` checked index pairs of strided lists (``count``
        pieces of ``ulen`` bytes each): the indices staged and uploaded (one pair per descriptor pair,
        not per piece), the strides uploaded once per list; returns the completion event."""
        cp = self.cp
        i32 = len(dst.addr) <= self.i32_max and len(src.addr) <= self.i32_max
        itype = np.int32 if i32 else np.int64
        isz = 4 if i32 else 8
        host_side = dst.kind == MemoryKind.HOST or src.kind == MemoryKind.HOST
        cfg = d.config(cp, "strided", host_side, i32)
        threads, cap = cfg[2], cfg[3]
        gs = _group_shift(n, count, ulen, self.strided_group, cap * threads // 32)
        if gs >= 0:
            cfg = d.config(cp, "strided_g", host_side, i32)  # the same threads and grid cap
        if gs < 0:  # a warp per chunk of a piece
            shift = _chunk_shift(n * count, ulen, cap * threads // 32, self.chunk_shift, self.chunk_shift_min)
            items = n * count * ((ulen + (1 << shift) - 1) >> shift)
            karg = ulen
        else:  # a warp per group of 2**gs pieces; the kernel takes the count in ulen's high half
            shift = gs
            items = n * ((count + (1 << gs) - 1) >> gs)
            karg = ulen | (count << 32)
        with cp.cuda.Device(d.dev):
            dap = dst.device_ptrs(cp, d.dev)[0]
            sap = src.device_ptrs(cp, d.dev)[0]
            dsp, ssp = dst.stride_ptr(cp, d.dev), src.stride_ptr(cp, d.dev)
            st = d.stream
            ib = 2 * n * isz
            slot = d.staging.take(cp, ib)
            try:
                hi = slot.hview[:ib].view(itype)
                np.copyto(hi[:n], didx, casting="unsafe")  # bounds-checked in _index: fits
                np.copyto(hi[n:], sidx, casting="unsafe")
                zc = self.index_zerocopy
                ip = slot.hptr if zc else slot.dptr
                grid = max(1, min(cap, (items * 32 + threads - 1) // threads))
                a = (dap, sap, ip, ssp, dsp, n, karg, items)
                g = cp.cuda.Event(block=True, disable_timing=True)
                d.enqueue(cp, cfg, grid, st, slot.dptr, slot.hptr, 0 if zc else ib, a, shift, g)
                slot.guard = g  # the slot is free again once this kernel has finished
            except BaseException:
                _release_failed(d, st, [slot])
                raise
        return g

    def _launch_ce(self, d: _Device, dst: _Prep, didx: np.ndarray, src: _Prep, sidx: np.ndarray,
                   stream: Any = None) -> tuple[Any, Any]:
        cp = self.cp
        dsts = np.ascontiguousarray(dst.addr_on(d.dev)[didx])
        srcs = np.ascontiguousarray(src.addr_on(d.dev)[sidx])
        sizes = np.ascontiguousarray(src.nbytes[sidx])
        with cp.cuda.Device(d.dev):
            st = d.stream if stream is None else stream
            self.drv.batch(dsts, srcs, sizes, st.ptr)
            ev = cp.cuda.Event(block=True, disable_timing=True)
            ev.record(st)
        return ev, None

    def _launch_split(self, d: _Device, dst: _Prep, didx: np.ndarray, src: _Prep, sidx: np.ndarray, n: int,
                      ulen: int, frac: float) -> tuple[Any, Any]:
        """The first ``frac`` of the bytes on the copy engines (side stream), the rest by the kernel
        (copy stream), at the same time; the returned event completes when both have."""
        if ulen:
            k = round(n * frac)
        else:
            cum = np.cumsum(src.nbytes[sidx])
            k = int(np.searchsorted(cum, frac * float(cum[-1]))) if n else 0
        if k <= 0:
            return self._launch_kernel(d, dst, didx, src, sidx, n, ulen)
        if k >= n:
            return self._launch_ce(d, dst, didx, src, sidx)
        cp = self.cp
        with cp.cuda.Device(d.dev):
            side = d.side_stream(cp)
            ev0 = cp.cuda.Event(block=False, disable_timing=True)
            ev0.record(d.stream)  # after what the copy stream is ordered after (default stream, other GPU)
            side.wait_event(ev0)
            ev1, _ = self._launch_ce(d, dst, didx[:k], src, sidx[:k], stream=side)
            _, keep = self._launch_kernel(d, dst, didx[k:], src, sidx[k:], n - k, ulen, record=False)
            d.stream.wait_event(ev1)
            ev = cp.cuda.Event(block=True, disable_timing=True)
            ev.record(d.stream)
        return ev, keep

