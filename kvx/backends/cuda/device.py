"""One GPU as the backend uses it: its copy stream, the compiled copy kernels and their launch
configurations, the launch itself (native, through the driver, or through cupy) and its ring of
index staging slots."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from ... import _native
from ..._cuda import import_cupy, kernel_source_path
from ...errors import BackendUnavailable
from .driver import _ERR_INVALID_CONTEXT, _H2D, _driver
from .errors import fail
from .options import CudaOptions
from .staging import _Staging

_KERNEL_NAME = "kvx_gather_copy"
_KERNEL_NAMES = {"warp": _KERNEL_NAME, "warp16": "kvx_gather_copy_u16", "bulk": "kvx_bulk_copy",
                 "pf": "kvx_gather_copy_pf", "warpx": "kvx_gather_copy_x", "strided": "kvx_strided_copy",
                 "strided_g": "kvx_strided_group"}


class _Device:
    def __init__(self, cp: Any, dev: int, opts: CudaOptions) -> None:
        self.dev = dev
        self.threads = opts.threads
        self.blocks_per_sm = opts.blocks_per_sm
        self.blocks_per_sm_host = opts.blocks_per_sm_host
        self.blocks_per_sm_bulk = opts.blocks_per_sm_bulk
        self.native_post = opts.native_post
        with cp.cuda.Device(dev):
            # order "legacy", a blocking stream: work the caller queued on the legacy default
            # stream (cupy's and torch's default) before a post is ordered before the copy, and
            # vice versa -- including work queued after the post but before the copy began, which
            # serialises a layer's copy behind the next layers' compute; order "caller", a
            # non-blocking stream: the caller posts only bytes that are ready (CudaOptions.order)
            self.stream = cp.cuda.Stream(non_blocking=opts.order == "caller")
            src = kernel_source_path()
            assert src is not None
            mod = cp.RawModule(code=src.read_text(), options=("--std=c++17",))
            self.kernels = {k: mod.get_function(v) for k, v in _KERNEL_NAMES.items()}
            self.kernels32 = {k: mod.get_function(v + "_i32") for k, v in _KERNEL_NAMES.items()}
            self.kernel = self.kernels["warp"]
            sms = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"])
        self.sms = sms
        self.peers: set[int] = set()
        self.lock = threading.Lock()
        self._side: Any = None
        self.staging = _Staging(opts.staging_slots)
        # (variant, host side, int32) -> (kernel, CUfunction or 0, threads, grid cap); built once
        self._cfg: dict[tuple[Any, ...], tuple[Any, int, int, int]] = {}
        # cuLaunchKernel through ctypes with a parameter block built once (used under self.lock)
        self._pv = (ctypes.c_uint64 * 8)()
        self._pshift = ctypes.c_uint32(0)
        base = ctypes.addressof(self._pv)
        self._params = (ctypes.c_void_p * 9)(*[base + 8 * i for i in range(8)], ctypes.addressof(self._pshift))
        self._params_addr = ctypes.addressof(self._params)
        self._culaunch: Any = None
        try:
            f = _driver().lib.cuLaunchKernel
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                          ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            f.restype = ctypes.c_int
            self._culaunch = f
        except (AttributeError, BackendUnavailable):
            self._culaunch = None
        # cuMemcpyHtoDAsync + cuLaunchKernel + cuEventRecord in one native call without the GIL
        # (_native.cuda_post): the driver functions' addresses, or None (then cupy/ctypes calls)
        self.cufns: tuple[int, int, int] | None = None
        if self._culaunch is not None and hasattr(_native, "cuda_post"):
            try:
                lib = _driver().lib
                fns = tuple(int(ctypes.cast(getattr(lib, x), ctypes.c_void_p).value or 0)
                            for x in ("cuMemcpyHtoDAsync_v2", "cuLaunchKernel", "cuEventRecord"))
                if all(fns):
                    self.cufns = (fns[0], fns[1], fns[2])
            except (AttributeError, BackendUnavailable):
                self.cufns = None
        self._route_fns: tuple[int, int, int, int] | None = None
        self.ctx = 0

    def route_fns(self) -> tuple[int, int, int, int] | None:
        """Addresses of cuLaunchKernel, cuEventRecord, cuCtxGetCurrent, cuCtxSetCurrent for
        :class:`_native.CudaRoute` (and this GPU's primary context in ``self.ctx``), or None."""
        if self._route_fns is None and self.cufns is not None:
            try:
                lib = _driver().lib
                g = lib.cuCtxGetCurrent
                g.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
                g.restype = ctypes.c_int
                with import_cupy().cuda.Device(self.dev):  # the runtime's (primary) context of this GPU
                    cur = ctypes.c_void_p()
                    rc = g(ctypes.byref(cur))
                fns = (self.cufns[1], self.cufns[2], int(ctypes.cast(g, ctypes.c_void_p).value or 0),
                       int(ctypes.cast(lib.cuCtxSetCurrent, ctypes.c_void_p).value or 0))
                if rc == 0 and cur.value and all(fns):
                    self.ctx = int(cur.value)
                    self._route_fns = fns
            except (AttributeError, BackendUnavailable):
                pass
        return self._route_fns

    def config(self, cp: Any, variant: str, host_side: bool, i32: bool) -> tuple[Any, int, int, int]:
        """(kernel, CUfunction handle or 0, threads per CTA, grid cap) for a launch; cached."""
        key = (variant, host_side, i32)
        got = self._cfg.get(key)
        if got is None:
            kname = variant if variant in self.kernels else "warp"
            kern = (self.kernels32 if i32 else self.kernels)[kname]
            threads = self.threads
            per_sm = self.blocks_per_sm_host if host_side else self.blocks_per_sm
            if kname == "bulk":
                threads, per_sm = 32, self.blocks_per_sm_bulk
            ptr: Any = 0
            if self._culaunch is not None:
                with cp.cuda.Device(self.dev):  # RawKernel.kernel: this device's Function (CUfunction in .ptr)
                    ptr = getattr(getattr(kern, "kernel", kern), "ptr", 0)
            got = (kern, int(ptr) if isinstance(ptr, int) else 0, threads, self.sms * per_sm)
            self._cfg[key] = got
        return got

    def launch(self, cfg: tuple[Any, int, int, int], grid: int, stream: Any, a: tuple[int, ...], shift: int) -> None:
        """One kernel launch on ``stream`` with the 8 u64 arguments ``a`` and ``shift``."""
        kern, fptr, threads, _cap = cfg
        if fptr:
            pv = self._pv
            pv[0], pv[1], pv[2], pv[3], pv[4], pv[5], pv[6], pv[7] = a
            self._pshift.value = shift
            rc = self._culaunch(fptr, grid, 1, 1, threads, 1, 1, 0, stream.ptr, self._params_addr, None)
            if rc == 0:
                return
            if rc != _ERR_INVALID_CONTEXT:
                raise fail(rc, "cuLaunchKernel")
        with stream:  # no current context for the driver call: cupy's launch sets it up
            kern((grid,), (threads,), tuple(np.uint64(x) for x in a) + (np.uint32(shift),))

    def enqueue(self, cp: Any, cfg: tuple[Any, int, int, int], grid: int, stream: Any, dptr: int, hptr: int,
                nbytes: int, a: tuple[int, ...] | None, shift: int, event: Any) -> None:
        """Upload ``nbytes`` from ``hptr`` to ``dptr`` (none if 0), launch the kernel with arguments ``a`` (none
        if None), record ``event`` (none if None), in this order on ``stream``: one native call without the
        GIL where the driver's functions are at hand, else through cupy and ctypes."""
        fns = self.cufns
        if fns is not None and cfg[1] and self.native_post:
            z = (0, 0, 0, 0, 0, 0, 0, 0) if a is None else a
            step, rc = _native.cuda_post(fns[0], fns[1], fns[2], dptr, hptr, nbytes, stream.ptr,
                                         0 if a is None else cfg[1], grid, cfg[2], z[0], z[1], z[2], z[3], z[4], z[5],
                                         z[6], z[7], shift, 0 if event is None else int(event.ptr))
            if step == 3:
                return
            if rc != _ERR_INVALID_CONTEXT:
                what = ("index upload", "kernel launch", "event record")[step]
                raise fail(rc, f"CUDA {what}")
            # no current context for the driver calls: the rest through cupy, which sets it up
            if step >= 1:
                nbytes = 0
            if step >= 2:
                a = None
        if nbytes:
            cp.cuda.runtime.memcpyAsync(dptr, hptr, nbytes, _H2D, stream.ptr)
        if a is not None:
            self.launch(cfg, grid, stream, a, shift)
        if event is not None:
            event.record(stream)

    def side_stream(self, cp: Any) -> Any:
        """A second (non-blocking) stream for the copy-engine part of a split transfer."""
        if self._side is None:
            with cp.cuda.Device(self.dev):
                self._side = cp.cuda.Stream(non_blocking=True)
        return self._side

