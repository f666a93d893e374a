"""CUDA runtime access shared by memory registration and the GPU backends.

Nothing here runs at import time and nothing imports cupy until it is needed: whether CUDA works
here (:func:`unavailable`, cached), page-locking host memory for ``kvx.alloc_host(pinned=True)``,
and turning a ``__cuda_array_interface__`` object into a CUDA :class:`~kvx.memory.Region`.
``kvx.memory`` and the backends import this module; it imports no backend.
"""

from __future__ import annotations

import bisect
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BackendUnavailable, RegistrationError

__all__ = ["copy_module", "host_device_pointer", "import_cupy", "kernel_source_path", "pin_host", "region_from_cai",
           "require_runtime", "unavailable", "unpin_host"]

log = logging.getLogger(__name__)

KERNEL_FILE = "kvx_copy.cu"
_HOST_REGISTER_FLAGS = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


# ---------------------------------------------------------------------------------------------
# Runtime discovery (lazy: nothing here runs at import time)

_reason_lock = threading.Lock()
_reason: list[str | None] = []


def import_cupy() -> Any:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        raise BackendUnavailable(f"cupy not importable ({exc}): pip install kvx[cuda]") from exc
    return cupy


def kernel_source_path() -> Path | None:
    """Where the copy kernel's source is: the package's copy first, then the repository's."""
    here = Path(__file__).resolve()
    for p in (here.parent / "_kernels" / KERNEL_FILE, here.parents[1] / "native" / "cuda" / KERNEL_FILE):
        if p.is_file():
            return p
    return None


def copy_module(cp: Any) -> Any:
    """The batched copy kernels (``kvx_copy.cu``) compiled by NVRTC for the current device (a
    ``cupy.RawModule``; entry points ``kvx_gather_copy``, ``..._i32`` and the variants).

    Raises
    ------
    BackendUnavailable
        If the kernel source is missing.
    """
    src = kernel_source_path()
    if src is None:
        raise BackendUnavailable(f"copy kernel source {KERNEL_FILE} not found (native/cuda or kvx/_kernels)")
    return cp.RawModule(code=src.read_text(), options=("--std=c++17",))


def _probe() -> str | None:
    try:
        cp = import_cupy()
    except BackendUnavailable as exc:
        return str(exc)
    try:
        n = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return f"no CUDA device ({exc})"
    if n <= 0:
        return "no CUDA device"
    if kernel_source_path() is None:
        return f"copy kernel source {KERNEL_FILE} not found (native/cuda or kvx/_kernels)"
    return None


def unavailable() -> str | None:
    """Why the CUDA runtime cannot be used here (cached), or None."""
    with _reason_lock:
        if not _reason:
            _reason.append(_probe())
        return _reason[0]


def require_runtime(feature: str) -> None:
    """Raise BackendUnavailable naming ``feature`` and what is missing, unless CUDA works here."""
    why = unavailable()
    if why is not None:
        raise BackendUnavailable(f"{feature} needs CUDA: {why}")


# ---------------------------------------------------------------------------------------------
# Pinned host memory (called by kvx.alloc_host(pinned=True))

_PIN_LOCK = threading.Lock()
_PINNED: dict[int, int] = {}
_PIN_STARTS: list[int] = []


def pin_host(addr: int, nbytes: int) -> None:
    """Page-lock ``[addr, addr+nbytes)`` and register it with CUDA (portable, mapped).

    Raises
    ------
    RegistrationError
        If CUDA refuses (not enough lockable memory, already registered elsewhere).
    """
    require_runtime("pinning host memory")
    cp = import_cupy()
    try:
        cp.cuda.runtime.hostRegister(int(addr), int(nbytes), _HOST_REGISTER_FLAGS)
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise RegistrationError(f"cudaHostRegister of {nbytes} bytes failed: {exc}") from exc
    with _PIN_LOCK:
        _PINNED[int(addr)] = int(nbytes)
        bisect.insort(_PIN_STARTS, int(addr))


def unpin_host(addr: int) -> None:
    """Undo :func:`pin_host` (safe to call at interpreter exit; errors are logged)."""
    with _PIN_LOCK:
        if _PINNED.pop(int(addr), None) is None:
            return
        try:
            _PIN_STARTS.remove(int(addr))
        except ValueError:
            pass
    try:
        import_cupy().cuda.runtime.hostUnregister(int(addr))
    except Exception:  # CUDA may already be torn down at exit
        log.debug("cudaHostUnregister(0x%x) failed", addr, exc_info=True)


def _pinned_by_us(addr: int, nbytes: int) -> bool:
    with _PIN_LOCK:
        i = bisect.bisect_right(_PIN_STARTS, addr) - 1
        if i < 0:
            return False
        s = _PIN_STARTS[i]
        return addr + nbytes <= s + _PINNED[s]


def host_device_pointer(addr: int, nbytes: int) -> int | None:
    """The device address of pinned host memory, or None if it is not pinned/registered."""
    cp = import_cupy()
    if not _pinned_by_us(addr, nbytes):
        try:
            a = cp.cuda.runtime.pointerGetAttributes(addr)
            b = cp.cuda.runtime.pointerGetAttributes(addr + nbytes - 1)
        except cp.cuda.runtime.CUDARuntimeError:
            return None
        if int(a.type) != 1 or int(b.type) != 1:  # cudaMemoryTypeHost: registered or cudaHostAlloc'd
            return None
        dp = int(a.devicePointer)
        return dp if dp else addr
    try:
        dp = int(cp.cuda.runtime.pointerGetAttributes(addr).devicePointer)
    except cp.cuda.runtime.CUDARuntimeError:
        dp = 0
    return dp if dp else addr


# ---------------------------------------------------------------------------------------------
# __cuda_array_interface__ objects (cupy arrays, numba, ...)


def region_from_cai(cai: dict[str, Any]) -> tuple[int, int, int]:
    """``(address, nbytes, device)`` of the GPU memory behind a ``__cuda_array_interface__``.

    Raises
    ------
    RegistrationError
        If the array is empty, read-only or not C-contiguous.
    BackendUnavailable
        If the CUDA runtime cannot be used here.
    """
    try:
        ptr, readonly = cai["data"]
        shape = tuple(int(x) for x in cai["shape"])
        itemsize = np.dtype(cai["typestr"]).itemsize
    except (KeyError, TypeError, ValueError) as exc:
        raise RegistrationError(f"malformed __cuda_array_interface__: {exc}") from exc
    if readonly:
        raise RegistrationError("cannot register read-only GPU memory (peers may write to it)")
    count = int(np.prod(shape)) if shape else 1
    nbytes = count * itemsize
    if nbytes == 0 or not ptr:
        raise RegistrationError("cannot register an empty GPU array")
    strides = cai.get("strides")
    if strides is not None:
        want, acc = [], itemsize
        for d in reversed(shape):
            want.append(acc)
            acc *= d
        if tuple(int(s) for s, d in zip(strides, shape) if d > 1) != tuple(
                w for w, d in zip(reversed(want), shape) if d > 1):
            raise RegistrationError("cannot register a non-contiguous GPU array")
    require_runtime("registering GPU memory")
    cp = import_cupy()
    try:
        attrs = cp.cuda.runtime.pointerGetAttributes(int(ptr))
    except cp.cuda.runtime.CUDARuntimeError as exc:
        raise RegistrationError(f"not a CUDA pointer: 0x{int(ptr):x} ({exc})") from exc
    if int(attrs.type) != 2:  # cudaMemoryTypeDevice
        raise RegistrationError(f"0x{int(ptr):x} is not CUDA device memory (type {int(attrs.type)})")
    return int(ptr), nbytes, int(attrs.device)
