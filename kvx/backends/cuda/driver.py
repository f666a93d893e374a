"""libcuda entry points cupy does not wrap (ctypes), and the CUDA codes and flags the backend uses."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from ...errors import BackendUnavailable, RegistrationError
from .errors import ERRORS, fail

_H2D = 1  # cudaMemcpyHostToDevice
_CUDA_NOT_READY = 600  # CUDA_ERROR_NOT_READY (cuEventQuery of a pending event)
_ERR_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT
_IPC_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_ERR_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_ERR_PEER_ALREADY = 704  # cudaErrorPeerAccessAlreadyEnabled



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
            raise fail(rc, (RegistrationError, f"cuMemGetAddressRange(0x{ptr:x})"))
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
            raise fail(rc, f"cuMemcpyBatchAsync of {n} copies")


_DRIVER: list[_Driver] = []


def _driver() -> _Driver:
    if not _DRIVER:
        try:
            _DRIVER.append(_Driver())
        except OSError as exc:
            raise ERRORS(exc, (BackendUnavailable, "libcuda.so.1 not loadable")) from exc
    return _DRIVER[0]

