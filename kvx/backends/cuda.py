"""``cuda``: GPU memory and pinned host memory between processes of one machine (and within one).

What it moves: CUDA device memory (torch/cupy tensors, ``kvx.RawRegion(..., MemoryKind.CUDA)``)
to and from CUDA memory or pinned host memory (``kvx.alloc_host(n, pinned=True)``, torch pinned
tensors), in the same process or another process of the node, on the same GPU or a peer GPU.

How:

- **Reach.** A peer's GPU memory is imported with CUDA IPC: the target exports
  ``cudaIpcGetMemHandle`` of the *allocation base* (``cuMemGetAddressRange``: a tensor from a
  caching allocator is an offset inside a larger segment) on request over an AF_UNIX channel;
  the initiator opens it once (``cudaIpcOpenMemHandle``, cached and reference counted per
  handle) and closes it when the target revokes the region or the peer goes away. A peer's
  pinned host memory is its ``alloc_host`` memfd, passed with SCM_RIGHTS, mapped here and
  registered with CUDA here too (``cudaHostRegister``), so the local GPU reaches it directly.
- **Copies.** One launch per transfer, never a Python loop per block. Two paths
  (``KVX_CUDA_COPY``): ``kernel``, a batched gather/scatter kernel compiled at run time with
  NVRTC (``native/cuda/kvx_copy.cu``; the prepared lists' address arrays stay on the device,
  each transfer uploads only its index arrays), and ``ce``, ``cuMemcpyBatchAsync`` on the copy
  engines (CUDA >= 12.8). ``auto`` (the default) picks per transfer by mean block size; see
  ``docs/history.md`` for the measurements behind the threshold.
- **Completion.** A CUDA event recorded after the copy; ``Request.test`` queries it, and a
  reaper thread retires finished transfers (counters, notifications) even if nobody polls.
- **Safety.** Remote descriptors are validated by the agent's ``prepare``. Release is final:
  like the host backend, each agent publishes a control table (memfd) with
  ``state = generation << 1 | live`` per slot and gives each peer a page of in-flight counters;
  the initiator raises the counters of the slots a transfer touches, checks their states, and
  lowers them when the transfer's event has completed; ``release`` clears the live bit, waits
  for the counters to drain, then tells the peers to close their mappings. A peer whose channel
  dies fails its pending transfers with ``PeerDisconnected``.

cupy is imported lazily; without it (or without a GPU) :meth:`CudaBackend.unavailable_reason`
says what is missing and ``import kvx`` is unaffected.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _native, wire
from .._cuda import host_device_pointer, import_cupy, kernel_source_path, unavailable
from .._slots import BOOT_ID, MAX_SLOTS
from ..channel import Channel
from ..config import get as _config_get
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
from .base import Backend, BackendContext, DoneRequest, Op, PeerInfo, PreparedList, Request

__all__ = [
    "CudaBackend",
    "copy_mode",
]

log = logging.getLogger(__name__)

#: Environment variable choosing the copy path (kernel | ce | auto). To move into kvx.config.
COPY_ENV = "KVX_CUDA_COPY"
#: ``auto`` uses the copy engines when the mean block of a transfer is at least this large
#: (bytes); below it, the kernel. Chosen from the measurements in docs/history.md.
CE_MIN_BLOCK = 2 << 20
#: What ``auto`` does per mean block of a GPU<->GPU transfer: sorted (minimum mean block, path,
#: fraction of the bytes given to the copy engines when the path is ``split``). From the
#: measurements in docs/history.md: with waiters spinning natively the kernel wins up to 2 MiB (337-351
#: vs 308-336 GB/s), the copy engines from 8 MiB (351-371 vs 324-349). Transfers touching host memory
#: use :data:`CE_MIN_BLOCK` alone.
CE_MIN_BLOCK_PEER = 8 << 20
AUTO_PLAN: list[tuple[int, str, float]] = [(0, "kernel", 0.0), (CE_MIN_BLOCK_PEER, "ce", 0.0)]
#: ``split``: this fraction of a transfer's bytes goes to the copy engines (cuMemcpyBatchAsync on a
#: second stream) while the kernel copies the rest, both at once; one event waits for both.
SPLIT_FRACTION = 0.3
#: Kernel path: above this many pairs, upload the indices and launch the kernel in pieces of this
#: many pairs, so the GPU starts copying while the next piece is staged (0: one launch).
PIPE_PAIRS = 0
#: Index staging per GPU: a ring of at most this many slots, each a pinned host buffer and a device
#: buffer (reused across transfers, grown on demand). A slot is taken again once the event recorded
#: after the kernel that read it has completed; back-to-back posts take the next free slot.
STAGING_SLOTS = 8
#: Kernel path: the kernel reads the indices straight from the pinned staging slot (mapped host
#: memory, over PCIe; written before the launch, so stream order makes them visible) instead of one
#: upload before it. Default since measured +3-7% at 4 KiB, a tie at 32 KiB (docs/history.md; ``xtune2``
#: ``zc`` vs ``upload``).
INDEX_ZEROCOPY = True
#: Kernel path: the index upload, the launch and the completion event in one call of the native
#: extension (``_native.cuda_post``, driver functions taken from libcuda once) instead of three
#: Python-level CUDA calls.
NATIVE_POST = True
#: Kernel path with equal-length lists: the indices are checked and written into the pinned staging
#: slot by ``_native.stage_index`` (GIL released) instead of numpy (checks, then ``np.copyto``).
NATIVE_STAGING = True
#: The completion reaper: 0 = sleep on the oldest pending transfer's event (blocking-sync events, no
#: polling); > 0 = poll every that many seconds (the earlier behaviour, 5e-5).
REAPER_POLL = 0.0
#: Lazy reaper (with ``REAPER_POLL`` = 0): a post whose transfer carries no notification does not wake
#: the reaper while it is active; the reaper looks at such transfers every ``REAPER_LAZY`` seconds (and
#: sleeps on the event of the oldest one carrying a notification, so notifications leave as soon as the
#: data landed). After ``REAPER_DEEP_AFTER`` seconds with nothing pending it sleeps until a post wakes
#: it. Measured: waking it on every post cost 15-30 us of post time (GIL hand-offs, docs/history.md).
#: 0 = wake it on every post (the earlier behaviour).
REAPER_LAZY = 0.002
REAPER_DEEP_AFTER = 0.05
#: A waiter (``Transfer.wait``) first polls the transfer's CUDA event in native code without the GIL for
#: up to this many seconds, then sleeps between polls. Measured: the earlier Python loop (yield the GIL,
#: poll) saw a finished 256 MiB copy 30-50 us late (5-6% of its time); 0 = that loop.
#: ``KVX_CUDA_SPIN_US`` sets it at import (microseconds, default 2000).
SPIN_WAIT = max(0.0, float(_config_get("KVX_CUDA_SPIN_US"))) / 1e6
#: The agent's cached route of a list pair posts through :class:`_Route`: index check and staging,
#: the target's guards, the launch and the record of the staging slot's own completion event in one
#: native call (``_native.CudaRoute``). False: every post through :meth:`CudaBackend.post`.
ROUTE = True
#: When not None, every kernel launch appends its phases here (CPU stamps and timing events), for
#: ``python -m kvx.bench.cuda xtune2``.
PROFILE: list[dict[str, Any]] | None = None
#: When not None, post() appends (label, time.perf_counter_ns()) at each of its phases, for
#: ``python -m kvx.bench.cuda stamps`` (where the CPU time of one post goes).
STAMPS: list[tuple[str, int]] | None = None
#: One warp copies one chunk of 2**CHUNK_SHIFT bytes of a block (a work item of the kernel).
CHUNK_SHIFT = 14
#: Small transfers: while halving the chunks still leaves no more work items than the kernel has
#: warps, they are halved, down to 2**CHUNK_SHIFT_MIN bytes (equal-length blocks), so more warps
#: share the transfer: a warp moves 4 KiB per round of loads, one NVLink round trip on reads.
#: Transfers of 256 MiB keep 2**CHUNK_SHIFT from 4 KiB blocks up (docs/history.md).
CHUNK_SHIFT_MIN = 12
#: Threads per block of the copy kernel, and resident blocks per SM aimed for.
THREADS = 256
BLOCKS_PER_SM = 4
#: Resident blocks per SM when one side is host memory (PCIe saturates with fewer warps).
BLOCKS_PER_SM_HOST = 8
#: Copy kernel variant: ``warpx`` (8 loads in flight per lane; with equal-length blocks of several
#: work items, chunk-major items: warps side by side copy one chunk each of different blocks; measured
#: +1-4% at 256 KiB-2 MiB, even at 32 KiB and 64 MiB, docs/history.md), ``warp`` (the same, block-major:
#: a block's chunks go to neighbouring warps), ``warp16`` (16 in flight) or ``bulk`` (Hopper TMA bulk
#: copies through shared memory, one warp per CTA; warp copy on older GPUs).
KERNEL = "warpx"
#: CTAs (of one warp) per SM for the ``bulk`` kernel.
BLOCKS_PER_SM_BULK = 6
#: Which GPU runs GPU<->GPU copies with another process's memory when both GPUs are visible here:
#: ``initiator`` (default: the GPU of the initiator's own memory; a write pushes, a read pulls) or
#: ``owner`` (the GPU holding the peer's memory, where it is then imported: a write pulls, a read
#: pushes; measured +3-9% on writes and -0-10% on reads, docs/history.md). Read when a peer's region is
#: imported (prepare). A memory imported on one GPU cannot be touched from the other one (measured:
#: illegal address), hence ``pull`` imports it on a second GPU when needed (no gain measured either:
#: docs/history.md). ``KVX_CUDA_EXEC`` sets it at import (to move into kvx.config).
#: ``pull``: every GPU<->GPU copy runs on the GPU of its destination (a write on the owner's GPU,
#: a read on the initiator's); the peer's memory is then imported on both GPUs, once each.
EXEC_ON = str(_config_get("KVX_CUDA_EXEC") or "initiator").strip().lower()

_ENTRY = 32  # control-table entry: state, addr, nbytes, info
_CTRL_BYTES = MAX_SLOTS * _ENTRY
_CNT = 8  # bytes per in-flight counter (the low 32 bits are what drain() reads)
_INFL_BYTES = MAX_SLOTS * _CNT
_F_SHM = 1 << 0  # HOST region inside an alloc_host memfd
_F_PINNED = 1 << 1  # HOST region page-locked and registered with CUDA
_F_IPC = 1 << 2  # CUDA region exportable through cudaIpcGetMemHandle

_KERNEL_NAME = "kvx_gather_copy"
_KERNEL_NAMES = {"warp": _KERNEL_NAME, "warp16": "kvx_gather_copy_u16", "bulk": "kvx_bulk_copy",
                 "pf": "kvx_gather_copy_pf", "warpx": "kvx_gather_copy_x"}
_H2D = 1  # cudaMemcpyHostToDevice
_CUDA_NOT_READY = 600  # CUDA_ERROR_NOT_READY (cuEventQuery of a pending event)
_HOST_ALLOC_FLAGS = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped (staging slots)
_STAGING_MIN = 64 << 10
_I32_MAX = (1 << 31) - 1
_ERR_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ERR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_ERR_PEER_ALREADY = 704  # cudaErrorPeerAccessAlreadyEnabled


def copy_mode() -> str:
    """The copy path setting: ``kernel``, ``ce`` or ``auto`` (from ``KVX_CUDA_COPY``)."""
    from .. import config

    v = str(config.get(COPY_ENV) or "auto").strip().lower()
    if v not in ("kernel", "ce", "split", "auto"):
        raise UsageError(f"{COPY_ENV}={v!r}: expected kernel, ce, split or auto")
    return v


# ---------------------------------------------------------------------------------------------
# Driver entry points cupy does not wrap (ctypes on libcuda)


class _MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLoc), ("dstLocHint", _MemLoc),
                ("flags", ctypes.c_uint)]


class _Driver:
    """libcuda entry points: allocation ranges and batched copy-engine memcpy."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        f = self.lib.cuMemGetAddressRange_v2
        f.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        f.restype = ctypes.c_int
        self._range = f
        self.batch_v2 = True
        self._batch: Any = None
        for name, v2 in (("cuMemcpyBatchAsync_v2", True), ("cuMemcpyBatchAsync", False)):
            fn = getattr(self.lib, name, None)
            if fn is None:
                continue
            vp = ctypes.c_void_p
            if v2:  # CUDA 13: (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream)
                fn.argtypes = [vp, vp, vp, ctypes.c_size_t, vp, vp, ctypes.c_size_t, vp]
            else:  # CUDA 12.8: (..., numAttrs, failIdx, stream)
                fn.argtypes = [vp, vp, vp, ctypes.c_size_t, vp, vp, ctypes.c_size_t, vp, vp]
            fn.restype = ctypes.c_int
            self._batch, self.batch_v2 = fn, v2
            break
        g = getattr(self.lib, "cuPointerGetAttribute", None)
        if g is not None:
            g.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            g.restype = ctypes.c_int
        self._getattr = g
        # cuEventQuery's address, for the native event polls (_native.cuda_event_spin)
        self.event_query = int(ctypes.cast(self.lib.cuEventQuery, ctypes.c_void_p).value or 0)
        self._attrs = _MemcpyAttrs(1, _MemLoc(0, 0), _MemLoc(0, 0), 0)  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise RegistrationError(f"cuMemGetAddressRange(0x{ptr:x}) failed with CUDA error {rc}")
        return int(base.value), int(size.value)

    def is_vmm(self, ptr: int) -> bool:
        """True if ``ptr`` lies in memory mapped with the VMM API (cuMemCreate/cuMemMap, e.g. PyTorch's
        expandable segments), which legacy CUDA IPC cannot export correctly."""
        f = getattr(self.lib, "cuMemRetainAllocationHandle", None)
        if f is None:
            return False
        h = ctypes.c_uint64(0)
        if f(ctypes.byref(h), ctypes.c_void_p(ptr)) != 0:
            return False
        self.lib.cuMemRelease(h)
        return True

    def legacy_ipc_capable(self, ptr: int) -> bool | None:
        """CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE of ``ptr`` (False for VMM memory such as
        PyTorch's expandable segments), or None if the driver cannot tell."""
        if self._getattr is None:
            return None
        v = ctypes.c_int(0)
        if self._getattr(ctypes.byref(v), 18, ctypes.c_uint64(ptr)) != 0:
            return None
        return bool(v.value)

    def batch(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(dsts.shape[0])
        args: list[Any] = [dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.addressof(self._attrs),
                           ctypes.addressof(self._attr_idx), 1]
        if not self.batch_v2:
            args.append(ctypes.addressof(self._fail))
        args.append(stream)
        rc = self._batch(*args)
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync of {n} copies failed with CUDA error {rc}")


_DRIVER: list[_Driver] = []


def _driver() -> _Driver:
    if not _DRIVER:
        try:
            _DRIVER.append(_Driver())
        except OSError as exc:
            raise BackendUnavailable(f"libcuda.so.1 not loadable: {exc}") from exc
    return _DRIVER[0]


# ---------------------------------------------------------------------------------------------
# Per-device state: stream, kernel, limits


class _Device:
    def __init__(self, cp: Any, dev: int) -> None:
        self.dev = dev
        with cp.cuda.Device(dev):
            # a blocking stream: work the caller queued on the legacy default stream (cupy's and
            # torch's default) before a post is ordered before the copy, and vice versa
            self.stream = cp.cuda.Stream(non_blocking=False)
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
        self.staging = _Staging()
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
        key = (variant, host_side, i32, THREADS, BLOCKS_PER_SM, BLOCKS_PER_SM_HOST, BLOCKS_PER_SM_BULK)
        got = self._cfg.get(key)
        if got is None:
            kname = variant if variant in self.kernels else "warp"
            kern = (self.kernels32 if i32 else self.kernels)[kname]
            threads = THREADS
            per_sm = BLOCKS_PER_SM_HOST if host_side else BLOCKS_PER_SM
            if kname == "bulk":
                threads, per_sm = 32, BLOCKS_PER_SM_BULK
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
                raise TransferError(f"cuLaunchKernel failed with CUDA error {rc}")
        with stream:  # no current context for the driver call: cupy's launch sets it up
            kern((grid,), (threads,), tuple(np.uint64(x) for x in a) + (np.uint32(shift),))

    def enqueue(self, cp: Any, cfg: tuple[Any, int, int, int], grid: int, stream: Any, dptr: int, hptr: int,
                nbytes: int, a: tuple[int, ...] | None, shift: int, event: Any) -> None:
        """Upload ``nbytes`` from ``hptr`` to ``dptr`` (none if 0), launch the kernel with arguments ``a`` (none
        if None), record ``event`` (none if None), in this order on ``stream``: one native call without the
        GIL where the driver's functions are at hand, else through cupy and ctypes."""
        fns = self.cufns
        if fns is not None and cfg[1] and NATIVE_POST:
            z = (0, 0, 0, 0, 0, 0, 0, 0) if a is None else a
            step, rc = _native.cuda_post(fns[0], fns[1], fns[2], dptr, hptr, nbytes, stream.ptr,
                                         0 if a is None else cfg[1], grid, cfg[2], z[0], z[1], z[2], z[3], z[4], z[5],
                                         z[6], z[7], shift, 0 if event is None else int(event.ptr))
            if step == 3:
                return
            if rc != _ERR_INVALID_CONTEXT:
                what = ("index upload", "kernel launch", "event record")[step]
                raise TransferError(f"CUDA {what} failed with CUDA error {rc}")
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


class _Busy:
    """Guard of a staging slot being filled (never done)."""

    done = False


_BUSY = _Busy()


class _Slot:
    """One staging slot: a pinned host buffer (mapped, portable) and a device buffer of the same size."""

    __slots__ = ("cap", "dmem", "dptr", "ev", "guard", "hmem", "hptr", "hview", "req")

    def __init__(self) -> None:
        self.ev: Any = None  # the slot's own completion event (the route records it with the launch)
        self.cap = 0
        self.hmem: Any = None
        self.hptr = 0
        self.hview = np.empty(0, dtype=np.uint8)
        self.dmem: Any = None
        self.dptr = 0
        self.guard: Any = None  # event after the last kernel that read this slot (None: free)
        self.req: Any = None  # the request of that kernel, if known: once retired, no need to query the event

    def reserve(self, cp: Any, nbytes: int) -> None:
        """At least ``nbytes`` in both buffers (the slot is free: its last kernel has finished)."""
        if nbytes <= self.cap:
            return
        cap = max(_STAGING_MIN, 1 << (nbytes - 1).bit_length())
        self.hmem = self.dmem = None
        self.cap = 0
        pm = getattr(cp.cuda, "PinnedMemory", None) or cp.cuda.pinned_memory.PinnedMemory
        self.hmem = pm(cap, _HOST_ALLOC_FLAGS)
        self.hptr = int(self.hmem.ptr)
        self.hview = np.ctypeslib.as_array((ctypes.c_uint8 * cap).from_address(self.hptr))
        self.dmem = cp.cuda.alloc(cap)
        self.dptr = int(self.dmem.ptr)
        self.cap = cap


class _Staging:
    """A small ring of staging slots of one GPU (used under the device's lock)."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.next = 0

    def take(self, cp: Any, nbytes: int) -> _Slot:
        slots = self.slots
        k = len(slots)
        i = -1
        for j in range(k):
            c = (self.next + j) % k
            g = slots[c].guard
            r = slots[c].req
            if g is None or (r is not None and r._done) or g.done:
                i = c
                break
        if i < 0:
            if k < max(1, STAGING_SLOTS):
                slots.append(_Slot())
                i = k
            else:  # every slot in flight: wait for the oldest
                i = self.next
                g = slots[i].guard
                if g is not _BUSY:
                    g.synchronize()
        s = slots[i]
        self.next = (i + 1) % len(slots)
        r = s.req
        if r is not None and not r._done and r.event is s.ev:
            r._retire(None)  # its event (found complete above) is about to be recorded again
        s.guard = _BUSY
        s.req = None
        try:
            s.reserve(cp, nbytes)
        except BaseException:
            s.guard = None
            raise
        return s


# ---------------------------------------------------------------------------------------------
# Prepared lists and requests


@dataclass(slots=True)
class _Prep:
    kind: MemoryKind
    dev: int  # device that runs transfers touching this list (-1: any, pinned host)
    addr: np.ndarray  # addresses valid in this process (translated for remote lists)
    nbytes: np.ndarray
    ulen: int  # common length, 0 if lengths differ
    peer: Any = None  # _Peer for remote lists
    guards: list[tuple[int, int, int]] = field(default_factory=list)  # (state addr, want, counter addr)
    pending_host: bool = False  # remote pinned host: map at first use
    plist: Any = None
    on_dev: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # dev -> (addr, nbytes) device arrays
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: int = -1  # GPU (here) that holds the memory, -1: host memory or not visible
    alt: dict[int, np.ndarray] = field(default_factory=dict)  # dev -> addresses of a second IPC import
    ptrs: dict[int, tuple[int, int]] = field(default_factory=dict)  # dev -> device pointers of on_dev[dev]

    def addr_on(self, dev: int) -> np.ndarray:
        """Addresses valid for copies run on GPU ``dev`` (a remote list may be imported on two GPUs)."""
        return self.alt.get(dev, self.addr)

    def device_arrays(self, cp: Any, dev: int) -> tuple[Any, Any]:
        got = self.on_dev.get(dev)
        if got is None:
            with self.lock:
                got = self.on_dev.get(dev)
                if got is None:
                    with cp.cuda.Device(dev):
                        got = (cp.asarray(self.addr_on(dev)), cp.asarray(self.nbytes))
                        cp.cuda.Stream.null.synchronize()
                    self.on_dev[dev] = got
        return got

    def device_ptrs(self, cp: Any, dev: int) -> tuple[int, int]:
        """Device pointers of :meth:`device_arrays` (address array, length array); cached."""
        got = self.ptrs.get(dev)
        if got is None:
            a, n = self.device_arrays(cp, dev)
            got = self.ptrs[dev] = (int(a.data.ptr), int(n.data.ptr))
        return got


class _CudaRequest(Request):
    """A launched transfer: done when its CUDA event has completed."""

    __slots__ = ("_done", "_err", "_lock", "backend", "counters", "event", "keep", "nbytes", "notify", "peer")

    def __init__(self, backend: "CudaBackend", event: Any, nbytes: int, peer: Any, counters: list[int],
                 notify: bytes | None, keep: Any) -> None:
        self.nbytes = nbytes
        self.event = event
        self.backend = backend
        self.peer = peer
        self.counters = counters
        self.notify = notify
        self.keep = keep
        self._done = False
        self._err: BaseException | None = None
        self._lock = threading.Lock()

    def _poll(self) -> bool:
        """Query the event; retire the transfer once (counters, notification). True when finished."""
        if self._done:
            return True
        # one cuEventQuery, natively (cupy's Event.done costs ~1 us more)
        rc = _native.cuda_event_spin(self.backend.drv.event_query, int(self.event.ptr), 0)
        if rc == _CUDA_NOT_READY:
            return False
        # rc != 0: a CUDA error (faulting kernel, lost device)
        self._retire(TransferError(f"CUDA copy failed with CUDA error {rc}") if rc else None)
        return True

    def _retire(self, err: BaseException | None) -> None:
        """The event has completed (or failed with ``err``): lower the counters, send the
        notification; once."""
        with self._lock:
            if self._done:
                return
            peer = self.peer
            if err is None and peer is not None and not peer.alive:
                err = PeerDisconnected(f"peer {peer.name!r} disconnected during the transfer")
            self.backend._release_counters(peer, self.counters)
            self.counters = []
            self._err = err
            self.keep = None
            self._done = True
        if err is None and self.notify is not None:
            self.backend._send_notif(peer, self.notify)

    def test(self) -> bool:
        if not self._poll():
            return False
        if self._err is not None:
            raise self._err
        return True

    def wait(self, timeout: float) -> bool:
        t0 = time.monotonic()
        deadline = t0 + timeout
        if not self._done and SPIN_WAIT > 0 and timeout > 0:
            # poll natively without the GIL first; an error or the bound: read again by _poll below
            q = self.backend.drv.event_query
            if _native.cuda_event_spin(q, int(self.event.ptr), int(min(SPIN_WAIT, timeout) * 1e9)) == 0:
                self._retire(None)  # completed (another query would cost 1-2 us more)
        while not self._poll():
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - t0 < 2e-3:
                time.sleep(0)  # yield the GIL, stay responsive for short transfers
            else:
                time.sleep(min(2e-4 if now - t0 < 0.05 else 1e-3, deadline - now))
        return self.test()


def _route_knobs(be: "CudaBackend") -> tuple[Any, ...]:
    """The settings a :class:`_Route` is built under (it is rebuilt when one changes)."""
    return (ROUTE, be.mode, KERNEL, CHUNK_SHIFT, CHUNK_SHIFT_MIN, THREADS, BLOCKS_PER_SM, BLOCKS_PER_SM_HOST,
            BLOCKS_PER_SM_BULK, PIPE_PAIRS, INDEX_ZEROCOPY, NATIVE_POST, NATIVE_STAGING, _I32_MAX, PROFILE is None,
            EXEC_ON, CE_MIN_BLOCK, id(AUTO_PLAN), len(AUTO_PLAN))


class _Route:
    """The agent's cached route of one (op, list pair) (:meth:`CudaBackend.fast_path`). On the kernel
    path with equal block lengths (:meth:`CudaBackend._route` builds the native part) a post is only
    the peer check, a staging slot, one native call (indices checked and staged, guards raised and
    checked, context, launch, and the record of the slot's own completion event, made once per
    slot) and the request; elsewhere it calls :meth:`CudaBackend.post`. Nothing is launched, and
    nothing stays raised, when the call raises (bad indices) or the target released its memory.
    Rebuilt when a setting it depends on changes (:func:`_route_knobs`)."""

    __slots__ = ("be", "cnts", "d", "isz", "key", "local", "nat", "op", "peer", "remote", "ulen", "write")

    def __init__(self, be: "CudaBackend", op: Op, local: PreparedList, remote: PreparedList) -> None:
        self.be = be
        self.op = op
        self.local = local
        self.remote = remote
        self.write = op is Op.WRITE
        self.key: Any = None
        self.nat: Any = None
        self.d: Any = None
        self.peer: _Peer | None = None
        self.cnts: list[int] = []
        self.ulen = 0
        self.isz = 4

    def __call__(self, lidx: Any, ridx: Any) -> Request:
        be = self.be
        k = _route_knobs(be)
        if k != self.key:
            self.nat = None
            if ROUTE:
                be._route(self)
            self.key = k
        nat = self.nat
        if nat is None:
            return be.post(self.op, self.local, lidx, self.remote, ridx, None)
        if STAMPS is not None:
            STAMPS.append(("route", time.perf_counter_ns()))
        d, peer = self.d, self.peer
        if be._closed:
            raise UsageError("cuda backend is closed")
        if peer is not None and be._peers.get(peer.name) is not peer:
            raise PeerDisconnected(f"peer {peer.name!r} is not connected (or reconnected: prepare again)")
        didx, sidx = (ridx, lidx) if self.write else (lidx, ridx)
        need = 2 * self.isz * max(1, _count(didx))
        cp = be.cp
        with d.lock:
            slot = d.staging.take(cp, need)
            if STAMPS is not None:
                STAMPS.append(("take", time.perf_counter_ns()))
            try:
                ev = slot.ev
                if ev is None:  # made once per slot; recorded by the native call right after the launch
                    with cp.cuda.Device(d.dev):
                        ev = slot.ev = cp.cuda.Event(block=True, disable_timing=True)
                if peer is not None:
                    with peer.clock:
                        if not peer.ctrl or not peer.alive:
                            raise PeerDisconnected(f"peer {peer.name!r} is not connected")
                        n, step, rc = nat.post(didx, sidx, slot.hptr, slot.cap, ev.ptr)
                else:
                    n, step, rc = nat.post(didx, sidx, slot.hptr, slot.cap, ev.ptr)
            except BaseException:
                slot.guard = None  # nothing was queued that reads it
                raise
            if STAMPS is not None:
                STAMPS.append(("launched", time.perf_counter_ns()))
            if step < 3:
                self._undo(slot, step)
                if step == -1:
                    name = peer.name if peer is not None else "?"
                    raise RemoteError(f"peer {name!r}: the target released (or re-registered) the memory")
                what = ("context switch", "kernel launch", "event record")[step]
                raise TransferError(f"CUDA {what} failed with CUDA error {rc}")
            slot.guard = ev
            req = _CudaRequest(be, ev, n * self.ulen, peer, self.cnts, None, None)
            slot.req = req
        if rc:
            log.warning("cuda: restoring the caller's CUDA context after a launch failed with error %d", rc)
        be._reaper.add(req)
        if STAMPS is not None:
            STAMPS.append(("request", time.perf_counter_ns()))
        return req

    def _undo(self, slot: _Slot, step: int) -> None:
        """After a post that did not launch (step -1: the target released its memory, nothing raised;
        0/1: the context switch or the launch failed) or launched without its event (2): once nothing
        reads the memory any more, lower the counters and free the slot."""
        if step == 2:
            try:
                self.d.stream.synchronize()
            except Exception:
                log.debug("synchronizing GPU %d after a failed event record", self.d.dev, exc_info=True)
        slot.guard = None
        if step >= 0:
            self.be._release_counters(self.peer, self.cnts)


class _Reaper:
    """Retires finished transfers (counters down, notifications out) even if nobody polls.

    Event-driven for notifications: it sleeps in ``cudaEventSynchronize`` (blocking-sync events: no GIL
    while the GPU works) on the oldest pending transfer that carries a notification, then retires every
    finished one. Lazy for the rest (``REAPER_LAZY``): a post without a notification does not wake an
    active reaper (a waiter usually retires its transfer itself); the reaper checks pending transfers
    every ``REAPER_LAZY`` seconds, so the in-flight counters of an unpolled transfer come down at most
    that long after it finished. Idle for ``REAPER_DEEP_AFTER`` seconds, it sleeps until the next post.
    (``REAPER_LAZY`` = 0: woken by every post, sleeping on the oldest transfer's event; ``REAPER_POLL``
    > 0: polling at that interval, both for comparison.)
    """

    def __init__(self, name: str) -> None:
        self._cv = threading.Condition()
        self._pending: list[_CudaRequest] = []
        self._closed = False
        self._deep = True  # sleeping until a post wakes it
        self._thread = threading.Thread(target=self._run, name=f"kvx-cuda-reaper-{name}", daemon=True)
        self._thread.start()

    def add(self, req: _CudaRequest) -> None:
        with self._cv:
            self._pending.append(req)
            if self._deep or req.notify is not None or REAPER_LAZY <= 0 or REAPER_POLL > 0:
                self._cv.notify()

    def pending_for(self, peer: Any) -> list[_CudaRequest]:
        with self._cv:
            return [r for r in self._pending if r.peer is peer]

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            lazy = REAPER_LAZY if REAPER_POLL <= 0 else 0.0
            with self._cv:
                if not self._pending and not self._closed:
                    now = time.monotonic()
                    if lazy <= 0 or now - idle_since >= REAPER_DEEP_AFTER:
                        self._deep = True
                        while not self._pending and not self._closed:
                            self._cv.wait()
                        self._deep = False
                    else:
                        self._cv.wait(min(lazy, REAPER_DEEP_AFTER - (now - idle_since)))
                        continue
                if self._closed and not self._pending:
                    return
                snap = list(self._pending)
            if REAPER_POLL <= 0:
                # sleep on the oldest transfer owing a notification (every transfer when not lazy)
                head = next((r for r in snap if not r._done and (r.notify is not None or lazy <= 0 or self._closed)),
                            None)
                if head is not None:
                    try:
                        head.event.synchronize()  # no GIL held while the GPU works
                    except Exception:  # a failed copy: _poll reports it
                        pass
            done = [r for r in snap if r._poll()]
            with self._cv:
                if done:
                    ids = {id(r) for r in done}
                    self._pending = [r for r in self._pending if id(r) not in ids]
                if not self._pending:
                    idle_since = time.monotonic()
                elif len(done) < len(snap) and lazy > 0 and not self._closed:
                    # transfers still running, none owing a notification: look again later unless a
                    # post that owes one wakes us first
                    if not any(r.notify is not None and not r._done for r in self._pending):
                        self._cv.wait(lazy)
            if REAPER_POLL > 0:
                time.sleep(REAPER_POLL)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))


# ---------------------------------------------------------------------------------------------
# Peers


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


_STAGE_DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint64), np.dtype(np.uint32))


def _stageable(idx: Any) -> Any:
    """``idx`` itself if ``_native.stage_index`` takes it as it is (an int, a list or tuple, a contiguous
    1-D array of 32/64-bit integers), else None."""
    t = type(idx)
    if t is int or t is list or t is tuple:
        return idx
    if t is np.ndarray and idx.ndim == 1 and idx.dtype in _STAGE_DTYPES and idx.flags.c_contiguous:
        return idx
    return None


def _chunk_shift(n: int, ulen: int, warps: int) -> int:
    """log2 of the work item for ``n`` pairs of ``ulen`` bytes on a grid of ``warps`` warps
    (:data:`CHUNK_SHIFT`, halved while the items still fit the warps; as ``CudaRoute.post``)."""
    sh = CHUNK_SHIFT
    while sh > CHUNK_SHIFT_MIN and n * ((ulen + (1 << (sh - 1)) - 1) >> (sh - 1)) <= warps:
        sh -= 1
    return sh


def _count(idx: Any) -> int:
    """Number of indices of a checked array or a :func:`_stageable` source."""
    if type(idx) is int:
        return 1
    if type(idx) is np.ndarray:
        return int(idx.shape[0])
    return len(idx)


def _index(idx: Any, n: int) -> np.ndarray:
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and (idx.dtype == np.int64 or (
            idx.dtype == np.int32 and n <= _I32_MAX)):
        a = idx
        if a.size and int(a.view(np.uint64 if a.itemsize == 8 else np.uint32).max()) >= n:
            raise IndexError(f"descriptor index out of range for a list of {n}")
        return a  # one pass: a negative index is a huge unsigned one
    if type(idx) is int:
        a = np.array([idx], dtype=np.int64)
    else:
        a = np.atleast_1d(np.asarray(idx))
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, not {a.dtype}")
        a = a.astype(np.int64).reshape(-1)
    if a.size and int(a.view(np.uint64).max()) >= n:  # one pass: a negative index is a huge uint64
        raise IndexError(f"descriptor index out of range for a list of {n}")
    return a


# ---------------------------------------------------------------------------------------------
# The backend


class CudaBackend(SameNodeLink, Backend):
    """GPU and pinned host memory on one machine: CUDA IPC, a batched copy kernel or the copy
    engines, events for completion. See the module docstring."""

    name = "cuda"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.CUDA})
    _CTRL_BYTES = _CTRL_BYTES
    _INFL_BYTES = _INFL_BYTES
    _INFL_NAME = "kvx-cuda-inflight"
    _LINK_WHAT = "same-node GPU"
    remote = True
    local = True
    notifications = True

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
        self.mode = copy_mode()
        self.drv = _driver()
        if self.mode == "ce" and not self.drv.has_batch:
            raise BackendUnavailable(f"{COPY_ENV}=ce needs cuMemcpyBatchAsync (CUDA >= 12.8 driver)")
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
        self._reaper = _Reaper(ctx.agent_name)
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
                    d = self._devs[dev] = _Device(self.cp, dev)
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
                    raise RegistrationError(f"0x{region.addr:x} is not CUDA memory: {exc}") from exc
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
        """Import the peer's region (slot, gen) (GPU memory: on GPU ``want``, else by :data:`EXEC_ON`);
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
                raise BackendUnavailable(f"cannot pin {p.name!r}'s host memory here: {exc}") from exc
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
        elif EXEC_ON == "owner" and owner >= 0:
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
                    raise BackendUnavailable(f"cannot open {p.name!r}'s GPU memory with CUDA IPC on GPU {dev}: "
                                             f"{exc}") from exc
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

    # ---- preparation -----------------------------------------------------------------------
    def prepare(self, plist: PreparedList) -> _Prep:
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

    def post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
             notify: bytes | None) -> Request:
        lp: _Prep = local.bdata["cuda"]
        rp: _Prep = remote.bdata["cuda"]
        if STAMPS is not None:
            STAMPS.append(("post", time.perf_counter_ns()))
        if self._closed:
            raise UsageError("cuda backend is closed")
        li: Any
        ri: Any
        if lp.ulen and rp.ulen:
            if lp.ulen != rp.ulen:
                raise ValueError("paired descriptors differ in length")
            ulen = lp.ulen
            # index sources as given when the kernel path can check them while staging them
            li = _stageable(lidx) if NATIVE_STAGING else None
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
        peer: _Peer | None = rp.peer
        if STAMPS is not None:
            STAMPS.append(("index", time.perf_counter_ns()))
        if peer is not None:
            if self._peers.get(peer.name) is not peer or not peer.alive:
                raise PeerDisconnected(f"peer {peer.name!r} is not connected (or reconnected: prepare again)")
            if rp.pending_host:
                with rp.lock:
                    if rp.pending_host:
                        self._translate_remote(rp)
        if n == 0:
            return DoneRequest(0)
        d, gpu2gpu = self._exec_device(op, lp, rp)
        dev = d.dev
        if STAMPS is not None:
            STAMPS.append(("device", time.perf_counter_ns()))
        src, sidx, dst, didx = (lp, li, rp, ri) if op is Op.WRITE else (rp, ri, lp, li)
        path, frac = self.mode, SPLIT_FRACTION
        if path == "auto":
            path, frac = self._plan(total, n, gpu2gpu)
        if not checked and (path != "kernel" or 0 < PIPE_PAIRS < n):
            li, ri = _index(li, len(lp.addr)), _index(ri, len(rp.addr))
        counters = self._acquire(peer, rp.guards) if peer is not None else []
        if STAMPS is not None:
            STAMPS.append(("acquire", time.perf_counter_ns()))
        try:
            with d.lock:
                if lp.kind == MemoryKind.CUDA and lp.dev != dev:
                    self._order_after_default(lp.dev, d)
                if path == "ce":
                    ev, keep = self._launch_ce(d, dst, didx, src, sidx)
                elif path == "split" and self.drv.has_batch:
                    ev, keep = self._launch_split(d, dst, didx, src, sidx, n, ulen, frac)
                else:
                    ev, keep = self._launch_kernel(d, dst, didx, src, sidx, n, ulen)
        except self.cp.cuda.runtime.CUDARuntimeError as exc:
            self._release_counters(peer, counters)
            raise TransferError(f"CUDA launch failed: {exc}") from exc
        except BaseException:
            self._release_counters(peer, counters)
            raise
        req = _CudaRequest(self, ev, total, peer, counters, notify, keep)
        if STAMPS is not None:
            STAMPS.append(("request", time.perf_counter_ns()))
        self._reaper.add(req)
        if STAMPS is not None:
            STAMPS.append(("reaper", time.perf_counter_ns()))
        return req

    def _exec_device(self, op: Op, lp: _Prep, rp: _Prep) -> tuple[_Device, bool]:
        """The GPU that runs a transfer between ``lp`` and ``rp`` (peer access enabled), and whether
        both sides are GPU memory."""
        peer: _Peer | None = rp.peer
        dev = lp.dev if lp.kind == MemoryKind.CUDA else rp.dev
        gpu2gpu = lp.kind == MemoryKind.CUDA and rp.kind == MemoryKind.CUDA
        ipc = peer is not None and not peer.same_process
        if ipc and rp.kind == MemoryKind.CUDA and rp.dev >= 0 and rp.dev != lp.dev:
            dev = rp.dev  # IPC memory is reachable only from the GPU it was imported on (_map_ipc)
        if EXEC_ON == "pull" and gpu2gpu:
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

    def fast_path(self, op: Op, local: PreparedList, remote: PreparedList) -> Any:
        """The agent's per-(op, list pair) shortcut (no notification): a :class:`_Route`, which
        launches the kernel in one native call where the pair qualifies and calls :meth:`post`
        otherwise. Either takes the index sources as given (checked while staged, or by
        :func:`_index`) and raises TypeError/ValueError/IndexError before anything moves for one it
        cannot take; the agent then takes its general path, which converts, checks and raises
        ``UsageError``."""
        return _Route(self, op, local, remote)

    def make_plan(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
                  notify: bytes | None) -> Any:
        """A transfer posted again and again: indices checked once here, each post through the
        pair's route (:meth:`fast_path`) when there is no notification."""
        lp: _Prep = local.bdata["cuda"]
        rp: _Prep = remote.bdata["cuda"]
        li, ri = _index(lidx, len(lp.addr)), _index(ridx, len(rp.addr))
        if li.shape[0] != ri.shape[0]:
            raise ValueError("index lists differ in length")
        if notify is not None or not li.shape[0]:
            return lambda: self.post(op, local, li, remote, ri, notify)
        fast = self.fast_path(op, local, remote)
        return lambda: fast(li, ri)

    def _route(self, r: _Route) -> None:
        """Build the native part of route ``r`` (``r.nat``), or leave it None where it does not apply
        (then :meth:`post` runs): lists of unequal block lengths, a plan other than the kernel's,
        settings the route does not implement (profiling, pieces, index upload, the Python post
        path), a copy ordered after another GPU's default stream, or driver entry points missing."""
        lp: _Prep = r.local.bdata["cuda"]
        rp: _Prep = r.remote.bdata["cuda"]
        op = r.op
        if (PROFILE is not None or not (NATIVE_POST and NATIVE_STAGING and INDEX_ZEROCOPY) or PIPE_PAIRS
                or not lp.ulen or lp.ulen != rp.ulen or rp.pending_host or self._closed):
            return
        peer: _Peer | None = rp.peer
        if peer is not None and (self._peers.get(peer.name) is not peer or not peer.alive):
            return
        d, gpu2gpu = self._exec_device(op, lp, rp)
        if lp.kind == MemoryKind.CUDA and lp.dev != d.dev:
            return  # _order_after_default per post
        path = self.mode
        if path == "auto":
            path = self._plan(lp.ulen, 1, gpu2gpu)[0]
        fns = d.route_fns()
        if path != "kernel" or fns is None:
            return
        cp = self.cp
        src, dst = (lp, rp) if op is Op.WRITE else (rp, lp)
        i32 = len(dst.addr) <= _I32_MAX and len(src.addr) <= _I32_MAX
        host_side = dst.kind == MemoryKind.HOST or src.kind == MemoryKind.HOST
        _kern, func, threads, cap = d.config(cp, KERNEL, host_side, i32)
        if not func:
            return
        dap = dst.device_ptrs(cp, d.dev)[0]
        sap, slp = src.device_ptrs(cp, d.dev)
        guards = np.array([x for g in rp.guards for x in g] if peer is not None else [], dtype=np.uint64)
        nat = _native.CudaRoute(fns[0], fns[1], fns[2], fns[3], d.ctx, int(d.stream.ptr), func, threads, cap,
                                CHUNK_SHIFT, dap, sap, slp, lp.ulen, len(dst.addr), len(src.addr), not i32, guards,
                                min(CHUNK_SHIFT, CHUNK_SHIFT_MIN))
        r.d, r.peer, r.ulen, r.isz = d, peer, lp.ulen, 4 if i32 else 8
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
            return ("ce" if total >= CE_MIN_BLOCK * n else "kernel"), 0.0
        mean = total // max(1, n)
        path, frac = "kernel", 0.0
        for lo, pth, f in AUTO_PLAN:
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
        shift = CHUNK_SHIFT
        prof = PROFILE
        t0 = time.perf_counter() if prof is not None else 0.0
        t_s = t_stage = 0.0
        i32 = len(dst.addr) <= _I32_MAX and len(src.addr) <= _I32_MAX
        itype = np.int32 if i32 else np.int64
        isz = 4 if i32 else 8
        host_side = dst.kind == MemoryKind.HOST or src.kind == MemoryKind.HOST
        cfg = d.config(cp, KERNEL, host_side, i32)
        threads, cap = cfg[2], cfg[3]
        if ulen:
            shift = _chunk_shift(n, ulen, cap * threads // 32)
        zc = INDEX_ZEROCOPY
        cpd = (ulen + (1 << shift) - 1) >> shift
        ev: Any = None
        evs = []
        taken: list[_Slot] = []
        with cp.cuda.Device(d.dev):
            dap = dst.device_ptrs(cp, d.dev)[0]
            sap, slp = src.device_ptrs(cp, d.dev)
            if STAMPS is not None:
                STAMPS.append(("ctx+arrays", time.perf_counter_ns()))
            st = d.stream
            step = PIPE_PAIRS if 0 < PIPE_PAIRS < n else n
            try:
                for lo in range(0, n, step):
                    m = min(step, n - lo)
                    ib = 2 * m * isz  # a multiple of 8: the u64 prefix array (unequal lengths) follows
                    nb = ib if ulen else ib + 8 * (m + 1)
                    slot = d.staging.take(cp, nb)
                    taken.append(slot)
                    if STAMPS is not None:
                        STAMPS.append(("take", time.perf_counter_ns()))
                    if prof is not None:
                        t_s = time.perf_counter()
                    if (m == n and ulen and NATIVE_STAGING and _stageable(didx) is not None
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
                    if prof is not None:
                        t_stage += time.perf_counter() - t_s
                    if STAMPS is not None:
                        STAMPS.append(("staged", time.perf_counter_ns()))
                    ip = slot.hptr if zc else slot.dptr
                    up = 0 if zc else nb
                    grid = max(1, min(cap, (items * 32 + threads - 1) // threads))
                    a = (dap, sap, ip, slp, 0 if ulen else ip + ib, m, ulen, items)
                    # blocking sync: the reaper sleeps in cudaEventSynchronize on it (no polling)
                    g = cp.cuda.Event(block=True, disable_timing=True)
                    if STAMPS is not None:
                        STAMPS.append(("event", time.perf_counter_ns()))
                    if prof is None:
                        d.enqueue(cp, cfg, grid, st, slot.dptr, slot.hptr, up, a, shift, g)
                    else:  # timing events around the upload and the kernel
                        e0, e1, e2 = cp.cuda.Event(), cp.cuda.Event(), cp.cuda.Event()
                        e0.record(st)
                        d.enqueue(cp, cfg, grid, st, slot.dptr, slot.hptr, up, None, shift, e1)
                        d.enqueue(cp, cfg, grid, st, 0, 0, 0, a, shift, e2)
                        g.record(st)
                        evs.append((e0, e1, e2))
                    slot.guard = g  # the slot is free again once this kernel has finished
                    if STAMPS is not None:
                        STAMPS.append(("enqueued", time.perf_counter_ns()))
                    if record and lo + m >= n:
                        ev = g
            except BaseException:
                for slot in taken:
                    if slot.guard is _BUSY:
                        try:
                            st.synchronize()
                        except Exception:
                            log.debug("synchronizing GPU %d after a failed launch", d.dev, exc_info=True)
                        slot.guard = None
                raise
        if prof is not None:
            prof.append({"cpu_launch_us": (time.perf_counter() - t0) * 1e6, "cpu_stage_us": t_stage * 1e6,
                         "events": evs})
        if STAMPS is not None:
            STAMPS.append(("ctx-exit", time.perf_counter_ns()))
        return ev, None

    def _launch_ce(self, d: _Device, dst: _Prep, didx: np.ndarray, src: _Prep, sidx: np.ndarray,
                   stream: Any = None) -> tuple[Any, Any]:
        cp = self.cp
        dsts = np.ascontiguousarray(dst.addr_on(d.dev)[didx])
        srcs = np.ascontiguousarray(src.addr_on(d.dev)[sidx])
        sizes = np.ascontiguousarray(src.nbytes[sidx])
        with cp.cuda.Device(d.dev):
            st = d.stream if stream is None else stream
            if STAMPS is not None:
                STAMPS.append(("ce-arrays", time.perf_counter_ns()))
            self.drv.batch(dsts, srcs, sizes, st.ptr)
            if STAMPS is not None:
                STAMPS.append(("ce-batched", time.perf_counter_ns()))
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
