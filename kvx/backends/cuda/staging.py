"""Index staging: per GPU, a small ring of slots, each a pinned (mapped) host buffer and a device
buffer, reused across transfers and grown on demand. A slot is free again once the event recorded
after the kernel that read it has completed."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

_HOST_ALLOC_FLAGS = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped (staging slots)
_STAGING_MIN = 64 << 10


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

    def __init__(self, max_slots: int) -> None:
        self.slots: list[_Slot] = []
        self.next = 0
        self.max_slots = max(1, max_slots)

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
            if k < self.max_slots:
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

