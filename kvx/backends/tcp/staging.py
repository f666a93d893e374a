"""The tcp backend's staging: blocks of CUDA memory go through pinned host slots.

A *slot* is one pinned host buffer of ``size`` bytes (a frame's payload, contiguous) plus a small
table area the copy kernel reads its descriptor arrays from (zero-copy, mapped host memory). A
*copier* gathers a chunk's blocks into a slot or scatters a slot into the blocks, asynchronously:

- :class:`CudaCopier`: the batched gather/scatter kernel of ``native/cuda/kvx_copy.cu`` (the one
  the cuda backend compiles; one launch per chunk and device on a blocking stream of that device,
  so work queued on the legacy default stream before a post is ordered before the copy; a
  non-blocking one with ``KVX_CUDA_ORDER=caller``), and a
  CUDA event per launch; slots come from ``cudaHostAlloc`` (portable, mapped).
- :class:`HostCopier`: the native batched memcpy on a thread of its own, asynchronous like a
  stream; slots are numpy buffers. Host memory takes this path only when
  ``TcpOptions.stage_host`` forces it (tests of the pipeline on machines without a GPU).

Each TCP connection owns a :class:`SlotRing` of a few slots (allocated at its first staged frame,
freed when the connection ends, after the copies on them finished), so connections never wait
for each other's slots and the pipeline cannot deadlock across peers.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from ...errors import TransferError, TransferTimeout

log = logging.getLogger(__name__)

#: Most descriptors one staged frame may carry (bounds a slot's table area).
MAX_STAGED_DESCS = 8192
_U64 = np.uint64
#: Each work item of the copy kernel moves at most 2**_SHIFT bytes of one block.
_SHIFT = 12
_THREADS = 256
_CTAS_PER_SM = 8
_HOST_ALLOC_FLAGS = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
#: a slot's table area: per device of a frame, dst, src, lens (u64 each), first (k+1 u64), 2k int32 indices
_TABLE = MAX_STAGED_DESCS * 40 + 8 * 64


class Ticket:
    """Copies in flight (one per device touched); ``wait`` raises TransferError/TransferTimeout."""

    __slots__ = ("events",)

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def done(self) -> bool:
        return all(ev.done for ev in self.events)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for ev in self.events:
            _wait_event(ev, deadline)
        self.events = []


_DONE = Ticket([])


def _wait_event(ev: Any, deadline: float) -> None:
    if isinstance(ev, _HostEvent):
        ev.sync(deadline - time.monotonic())
        return
    spin = _spin_fn()
    while True:
        if spin is not None:
            rc = spin[0](spin[1], int(ev.ptr), 2_000_000)  # native poll without the GIL, 2 ms
            if rc == 0:
                return
            if rc != _NOT_READY:
                raise TransferError(f"a staging copy failed with CUDA error {rc}")
        elif ev.done:
            return
        if time.monotonic() > deadline:
            raise TransferTimeout("a staging copy on the GPU did not finish in time")
        if spin is None:
            time.sleep(1e-4)


_SPIN: list[Any] = []


def _spin_fn() -> tuple[Any, int] | None:
    if not _SPIN:
        try:
            from ... import _native

            lib = ctypes.CDLL("libcuda.so.1")
            _SPIN.append((_native.cuda_event_spin, int(ctypes.cast(lib.cuEventQuery, ctypes.c_void_p).value or 0)))
        except (OSError, ImportError, AttributeError):
            _SPIN.append(None)
    return _SPIN[0]  # type: ignore[no-any-return]


class Slot:
    """One pinned staging buffer: ``addr`` (host), ``dptr`` (the same memory as the GPU sees it),
    ``size`` payload bytes, then the kernel's table area; ``ticket``: the last copy on it."""

    __slots__ = ("_keep", "addr", "dptr", "size", "table", "ticket")

    def __init__(self, addr: int, dptr: int, size: int, keep: Any) -> None:
        self.addr = addr
        self.dptr = dptr
        self.size = size
        self.table = addr + size
        self.ticket = _DONE
        self._keep = keep


class Copier:
    """Gathers blocks into a slot and scatters a slot into blocks (asynchronously)."""

    def alloc(self, size: int) -> Slot:
        raise NotImplementedError

    def free(self, slot: Slot) -> None:
        raise NotImplementedError

    def gather(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        """Copy the blocks ``(addr, nb)`` (on devices ``dev``) back to back into ``slot``."""
        raise NotImplementedError

    def scatter(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        """Copy ``slot``'s bytes, back to back, into the blocks ``(addr, nb)``."""
        raise NotImplementedError


def _offsets(nb: np.ndarray, base: int) -> np.ndarray:
    offs = np.zeros(nb.shape[0], dtype=_U64)
    if nb.shape[0] > 1:
        np.cumsum(nb[:-1], out=offs[1:])
    return offs + _U64(base)


class _HostEvent:
    """Completion of one copy on a :class:`HostCopier`'s stream thread."""

    __slots__ = ("err", "ev")

    def __init__(self) -> None:
        self.ev = threading.Event()
        self.err: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.ev.is_set()

    def sync(self, timeout: float) -> None:
        if not self.ev.wait(max(0.0, timeout)):
            raise TransferTimeout("a host staging copy did not finish in time")
        if self.err is not None:
            raise TransferError(f"a host staging copy failed: {self.err}") from self.err


class HostCopier(Copier):
    """Host memory through the staging path (``TcpOptions.stage_host``): the native batched
    memcpy on one thread per copier, in order, completing asynchronously like a CUDA stream, so
    the pipeline's waits and overlaps are the GPU path's."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvx-tcp-hostcopy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from ... import _native  # type: ignore[attr-defined]

        while True:
            job = self._q.get()
            if job is None:
                return
            dst, src, nb, ev = job
            try:
                idx = np.arange(nb.shape[0], dtype=np.int64)
                res = _native.submit(0, 0, dst, nb, idx, src, nb, idx, None, None, 1, 1 << 62, 0)
                if not isinstance(res, int):  # pragma: no cover - inline copies finish in the call
                    res.wait(60.0)
            except Exception as exc:  # reported to the waiter
                ev.err = exc
            ev.ev.set()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(5.0)

    def alloc(self, size: int) -> Slot:
        buf = np.empty(size + _TABLE, dtype=np.uint8)
        a = int(buf.ctypes.data)
        return Slot(a, a, size, buf)

    def free(self, slot: Slot) -> None:
        slot._keep = None

    def _copy(self, slot: Slot, dst: np.ndarray, src: np.ndarray, nb: np.ndarray) -> Ticket:
        ev = _HostEvent()
        self._q.put((dst, src, nb, ev))
        tk = Ticket([ev])
        slot.ticket = tk
        return tk

    def gather(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        return self._copy(slot, _offsets(nb, slot.addr), addr, nb)

    def scatter(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        return self._copy(slot, addr, _offsets(nb, slot.addr), nb)


class _Gpu:
    """One device's stream and copy kernel."""

    def __init__(self, cp: Any, dev: int, order: str) -> None:
        from ..._cuda import copy_module

        self.dev = dev
        with cp.cuda.Device(dev):  # blocking unless the caller orders its copies (KVX_CUDA_ORDER)
            self.stream = cp.cuda.Stream(non_blocking=order == "caller")
            self.kernel = copy_module(cp).get_function("kvx_gather_copy_i32")
            self.cap = int(cp.cuda.Device(dev).attributes["MultiProcessorCount"]) * _CTAS_PER_SM
        self.lock = threading.Lock()


class CudaCopier(Copier):
    """CUDA memory: the batched copy kernel between device blocks and a pinned slot."""

    def __init__(self, order: str = "legacy") -> None:
        from ..._cuda import import_cupy, require_runtime

        require_runtime("tcp transfers of GPU memory")
        self.cp = import_cupy()
        self.order = order
        self._gpus: dict[int, _Gpu] = {}
        self._lock = threading.Lock()

    def _gpu(self, dev: int) -> _Gpu:
        g = self._gpus.get(dev)
        if g is None:
            with self._lock:
                g = self._gpus.get(dev)
                if g is None:
                    g = self._gpus[dev] = _Gpu(self.cp, dev, self.order)
        return g

    def alloc(self, size: int) -> Slot:
        rt = self.cp.cuda.runtime
        try:
            p = int(rt.hostAlloc(size + _TABLE, _HOST_ALLOC_FLAGS))
        except rt.CUDARuntimeError as exc:
            raise TransferError(f"cannot allocate {size} bytes of pinned staging memory: {exc}") from exc
        try:
            d = int(rt.pointerGetAttributes(p).devicePointer) or p
        except rt.CUDARuntimeError:
            d = p  # unified addressing: the same address
        return Slot(p, d, size, None)

    def free(self, slot: Slot) -> None:
        try:
            self.cp.cuda.runtime.freeHost(slot.addr)
        except Exception:  # CUDA may be torn down at exit
            log.debug("cudaFreeHost(0x%x) failed", slot.addr, exc_info=True)

    def _launch(self, slot: Slot, blocks: np.ndarray, nb: np.ndarray, dev: np.ndarray | None, gather: bool) -> Ticket:
        n = int(nb.shape[0])
        if n > MAX_STAGED_DESCS:
            raise TransferError(f"{n} descriptors in one staged frame (at most {MAX_STAGED_DESCS})")
        offs = _offsets(nb, slot.dptr)
        devs = [0] if dev is None else np.unique(dev).tolist()
        events = []
        t = slot.table
        for d in devs:
            sel = slice(None) if len(devs) == 1 else (dev == d)
            b, o, ln = blocks[sel], offs[sel], nb[sel]
            k = int(ln.shape[0])
            # table (pinned, mapped; read by the kernel over the bus): dst[k], src[k], lens[k], first[k+1], idx[2k]
            tab = np.frombuffer(memoryview((ctypes.c_char * (8 * (5 * k + 1))).from_address(t)).cast("B"),
                                dtype=np.uint8)
            u = tab[: 8 * (4 * k + 1)].view(_U64)
            dst, src, lens, first = u[:k], u[k: 2 * k], u[2 * k: 3 * k], u[3 * k: 4 * k + 1]
            dst[:] = o if gather else b
            src[:] = b if gather else o
            lens[:] = ln
            idx = tab[8 * (4 * k + 1): 8 * (4 * k + 1) + 8 * k].view(np.int32)
            idx[:k] = np.arange(k, dtype=np.int32)
            idx[k:] = idx[:k]
            uniform = bool(k and (ln == ln[0]).all())
            per = (ln + _U64((1 << _SHIFT) - 1)) >> _U64(_SHIFT)
            first[0] = 0
            np.cumsum(per, out=first[1:])
            items = int(first[k])
            ulen = int(ln[0]) if uniform else 0
            base = slot.dptr + (t - slot.addr)  # the table as the GPU addresses it
            if items == 0:
                continue
            g = self._gpu(int(d))
            grid = max(1, min(g.cap, (items * 32 + _THREADS - 1) // _THREADS))
            cp = self.cp
            with g.lock, cp.cuda.Device(g.dev), g.stream:  # the launch goes to the current stream
                ev = cp.cuda.Event(block=False, disable_timing=True)
                g.kernel((grid,), (_THREADS,),
                         (_U64(base), _U64(base + 8 * k), _U64(base + 8 * (4 * k + 1)), _U64(base + 16 * k),
                          _U64(base + 24 * k), _U64(k), _U64(ulen), _U64(items), np.uint32(_SHIFT)))
                ev.record(g.stream)
            events.append(ev)
            t += 8 * (5 * k + 1)  # the next device's table after this one's (k <= n, fits _TABLE)
        tk = Ticket(events)
        slot.ticket = tk
        return tk

    def gather(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        return self._launch(slot, addr, nb, dev, True)

    def scatter(self, slot: Slot, addr: np.ndarray, nb: np.ndarray, dev: np.ndarray | None) -> Ticket:
        return self._launch(slot, addr, nb, dev, False)


_CUDA: dict[str, CudaCopier] = {}
_CUDA_LOCK = threading.Lock()


def cuda_copier(order: str = "legacy") -> CudaCopier:
    """The process's CUDA copier of that stream order (made at first use; raises
    BackendUnavailable without CUDA)."""
    with _CUDA_LOCK:
        c = _CUDA.get(order)
        if c is None:
            c = _CUDA[order] = CudaCopier(order)
        return c


_live_lock = threading.Lock()
_live = 0


def live_slots() -> int:
    """Staging slots allocated by every :class:`SlotRing` of this process and not freed yet (a
    slot stays counted when its ring closes with a copy still running on it: it is leaked)."""
    return _live


def _count(k: int) -> None:
    global _live
    with _live_lock:
        _live += k


class SlotRing:
    """A connection's staging slots: at most ``count`` of ``size`` bytes, allocated on demand."""

    def __init__(self, copier: Copier, size: int, count: int) -> None:
        self.copier = copier
        self.size = size
        self.count = count
        self._free: list[Slot] = []
        self._all: list[Slot] = []
        self._cv = threading.Condition()
        self._closed = False

    def take(self, timeout: float) -> Slot:
        """A free slot (waits up to ``timeout`` for one to be given back)."""
        with self._cv:
            deadline = time.monotonic() + timeout
            while True:
                if self._closed:
                    raise TransferError("the connection's staging was closed")
                if self._free:
                    return self._free.pop()
                if len(self._all) < self.count:
                    s = self.copier.alloc(self.size)
                    _count(1)
                    self._all.append(s)
                    return s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no staging slot came free within {timeout:.1f} s")
                self._cv.wait(left)

    def give(self, slot: Slot) -> None:
        with self._cv:
            if slot in self._all and slot not in self._free:
                self._free.append(slot)
                self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Free every slot once the copies on it finished (a slot whose copy does not finish
        within ``timeout`` is leaked rather than freed under a running copy)."""
        with self._cv:
            self._closed = True
            slots, self._all, self._free = self._all, [], []
            self._cv.notify_all()
        for s in slots:
            try:
                s.ticket.wait(timeout)
            except TransferError:
                log.error("tcp: a staging copy did not finish; leaking its %d-byte slot", s.size)
                continue
            self.copier.free(s)
            _count(-1)

    @property
    def allocated(self) -> int:
        return len(self._all)
