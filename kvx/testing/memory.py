"""Memory factories for the conformance suites: one spec string per kind of memory a backend serves.

A spec names the memory a test allocates, in this process or in a peer process
(``kvx.testing.peer``'s ``register {mem: SPEC}``):

``alloc``        ``kvx.alloc_host`` (memfd-backed host memory other processes can map)
``numpy``        a plain numpy array (host memory the agent did not allocate)
``pinned``       ``kvx.alloc_host(pinned=True)`` (page-locked, reachable by GPUs)
``vram[:D]``     a cupy array on GPU ``D`` (default 0)
``torch[:D]``    a slice at an offset inside a PyTorch caching-allocator block on GPU ``D``

Each :class:`Memory` makes the object to register and a flat ``uint8`` view of it, fills a view
from host bytes and reads it back to host bytes, so one test body checks every kind of memory, as
zarr-python's store tests are generic over buffer prototypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import kvx

__all__ = ["Memory", "memory", "pattern"]

_HOST = ("alloc", "numpy", "pinned")
_GPU = ("vram", "torch")


def pattern(n: int, seed: int) -> np.ndarray:
    """``n`` reproducible random bytes."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class Memory:
    """One kind of memory: ``seg`` (alloc, numpy, pinned, vram, torch) on device ``dev``."""

    seg: str
    dev: int = 0

    @property
    def spec(self) -> str:
        return f"{self.seg}:{self.dev}" if self.seg in _GPU else self.seg

    @property
    def kind(self) -> kvx.MemoryKind:
        return kvx.MemoryKind.CUDA if self.seg in _GPU else kvx.MemoryKind.HOST

    def unavailable(self) -> str | None:
        """Why this memory cannot be made here (None if it can)."""
        if self.seg in ("alloc", "numpy"):
            return None
        try:
            import cupy

            n = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as exc:  # no cupy, no driver, no GPU
            return f"no CUDA here ({type(exc).__name__}: {exc})"
        if self.dev >= n:
            return f"needs GPU {self.dev}, this machine has {n}"
        if self.seg == "torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                return "torch is not installed"
        return None

    def alloc(self, nbytes: int) -> tuple[Any, Any]:
        """``(object to register, flat uint8 view)`` of ``nbytes`` zeroed bytes."""
        if self.seg == "alloc":
            buf = kvx.alloc_host(nbytes)
            return buf, buf
        if self.seg == "numpy":
            buf = np.zeros(nbytes, dtype=np.uint8)
            return buf, buf
        if self.seg == "pinned":
            buf = kvx.alloc_host(nbytes, pinned=True)
            return buf, buf
        import cupy

        if self.seg == "vram":
            with cupy.cuda.Device(self.dev):
                buf = cupy.zeros(nbytes, dtype=cupy.uint8)
            return buf, buf
        import torch

        big = torch.zeros(nbytes + 8192 + 16, dtype=torch.uint8, device=f"cuda:{self.dev}")
        t = big[4096 + 16: 4096 + 16 + nbytes]
        with cupy.cuda.Device(self.dev):  # from another device, cupy.asarray would copy
            return t, cupy.asarray(t)

    def fill(self, view: Any, data: Any, off: int = 0) -> None:
        """Write host bytes (or a scalar) into ``view[off:]`` and wait until they are there."""
        if isinstance(view, np.ndarray):
            if np.isscalar(data):
                view[off:] = data
            else:
                view[off: off + len(data)] = data
            return
        import cupy

        with cupy.cuda.Device(self.dev):
            if np.isscalar(data):
                view[off:] = data
            else:
                view[off: off + len(data)] = cupy.asarray(np.ascontiguousarray(data, dtype=np.uint8))
            cupy.cuda.runtime.deviceSynchronize()

    def read(self, view: Any, off: int = 0, n: int | None = None) -> np.ndarray:
        """A host copy of ``view[off:off+n]`` (all of it by default)."""
        part = view[off:] if n is None else view[off: off + n]
        if isinstance(part, np.ndarray):
            return part.copy()
        import cupy

        with cupy.cuda.Device(self.dev):
            return cupy.asnumpy(part)


def memory(spec: str) -> Memory:
    """Parse a memory spec (see the module docstring); ``ValueError`` for an unknown one."""
    seg, _, dev = spec.partition(":")
    if seg not in _HOST + _GPU or (dev and (seg in _HOST or not dev.isdigit())):
        raise ValueError(f"unknown memory spec {spec!r} (alloc, numpy, pinned, vram[:D], torch[:D])")
    return Memory(seg, int(dev) if dev else 0)
