"""What the backend keeps per prepared list (``PreparedList.bdata["cuda"]``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...memory import MemoryKind


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
    count: int = 0  # a strided list's pieces per descriptor (one count for all), 0: a plain list
    stride: np.ndarray | None = None  # a strided list's strides (bytes, one per descriptor)
    sptr: dict[int, tuple[Any, int]] = field(default_factory=dict)  # dev -> (device strides, pointer)

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

    def stride_ptr(self, cp: Any, dev: int) -> int:
        """Device pointer of a strided list's strides on GPU ``dev`` (uploaded once)."""
        got = self.sptr.get(dev)
        if got is None:
            assert self.stride is not None
            with self.lock:
                got = self.sptr.get(dev)
                if got is None:
                    with cp.cuda.Device(dev):
                        arr = cp.asarray(self.stride)
                        cp.cuda.Stream.null.synchronize()
                    got = self.sptr[dev] = (arr, int(arr.data.ptr))
        return got[1]

    def device_ptrs(self, cp: Any, dev: int) -> tuple[int, int]:
        """Device pointers of :meth:`device_arrays` (address array, length array); cached."""
        got = self.ptrs.get(dev)
        if got is None:
            a, n = self.device_arrays(cp, dev)
            got = self.ptrs[dev] = (int(a.data.ptr), int(n.data.ptr))
        return got

