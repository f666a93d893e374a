"""The O_DIRECT write and read path of the posix backend: aligned blocks go zero-copy, others
through aligned bounce buffers, odd offsets buffered."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from typing import Any, Callable

import numpy as np

from ... import _native
from ...errors import TransferError, UsageError
from ..base import Request
from .files import _DIRECT_THREADS, _PIECE, _U64, translate_oserror
from .jobs import _DirectRequest, _failed, _Prep, _split

log = logging.getLogger(__name__)

class DirectPath:
    """Mixin of :class:`~kvx.backends.posix.PosixBackend`: transfers of files opened with O_DIRECT.

    The backend provides the attributes annotated here.
    """

    cfg: Any
    threads: int
    inline: int
    sync: int
    _lock: threading.Lock
    _cv: threading.Condition
    _closed: bool
    _state: np.ndarray
    _pins: np.ndarray
    _bounce: list[mmap.mmap]
    _wrap: Callable[..., Request]

    # ---- O_DIRECT ----------------------------------------------------------------------------
    def _post_direct(self, to_file: bool, fp: _Prep, fi: np.ndarray, mp: _Prep, mi: np.ndarray,
                     guards: np.ndarray, after: Any) -> Request:
        assert fp.faligned is not None and mp.maligned is not None and fp.dfds is not None
        if len(fi) and (int(fi.max()) >= len(fp.addr) or int(mi.max()) >= len(mp.addr)
                        or int(fi.min()) < -len(fp.addr) or int(mi.min()) < -len(mp.addr)):
            raise IndexError("descriptor index out of range")
        ln = fp.nbytes[fi]
        if not np.array_equal(ln, mp.nbytes[mi]):
            raise ValueError("paired descriptors differ in length")
        fal = fp.faligned[fi]
        mal = mp.maligned[mi]
        code = _native.OP_PWRITE if to_file else _native.OP_PREAD
        sync = self.sync if to_file else 0
        total = int(ln.sum())

        def args(sel: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
            f, m = fi[sel], mi[sel]
            if to_file:
                return (fp.addr, fp.nbytes, f, mp.addr, mp.nbytes, m)
            return (mp.addr, mp.nbytes, m, fp.addr, fp.nbytes, f)

        # O_DIRECT jobs wait on the device, not the CPU: keep at least _DIRECT_THREADS requests in flight
        nthr = max(self.threads, _DIRECT_THREADS)
        if bool(fal.all()) and bool(mal.all()):  # zero-copy O_DIRECT for everything
            try:
                job = _native.submit(code, 0, *args(slice(None)), fp.dfds, guards, nthr, self.inline, sync)
            except OSError as exc:
                return _failed(total, exc, fp.paths)
            return self._wrap(job, fp, fi, after)

        direct_sel = fal & mal
        bounce_sel = fal & ~mal
        buffered_sel = ~fal
        dreq = _DirectRequest(total)
        dreq.after = after
        pins = {**fp.pins, **mp.pins}
        with self._lock:
            for s, want in pins.items():
                if int(self._state[s]) != want:
                    raise UsageError("a registration under this transfer was released; prepare again")
            for s in pins:
                self._pins[s] += 1

        def run() -> None:
            err: BaseException | None = None
            try:
                jobs = []
                for sel, fds, nt in ((direct_sel, fp.dfds, nthr), (buffered_sel, fp.fds, self.threads)):
                    if sel.any():
                        j = _native.submit(code, 0, *args(sel), fds, guards, nt, 0, sync)
                        if isinstance(j, int):  # nothing left to wait for
                            continue
                        jobs.append(j)
                        dreq.jobs.append(j)
                if bounce_sel.any():
                    self._bounce_run(to_file, fp, fi[bounce_sel], mp, mi[bounce_sel], guards, dreq)
                deadline = time.monotonic() + float(self.cfg.transfer_timeout)
                for j in jobs:
                    while not j.wait(0.05):
                        if dreq.cancelled or time.monotonic() > deadline:
                            j.cancel()
                if sync and bounce_sel.any():
                    assert fp.dfds is not None
                    fsync = os.fdatasync if sync == 1 else os.fsync
                    for fd in np.unique(fp.dfds[fi[bounce_sel]]).tolist():
                        fsync(int(fd))
            except OSError as exc:
                err = translate_oserror(exc, fp.paths)
                err.__cause__ = exc
            except BaseException as exc:  # pragma: no cover - a bug, surfaced as a failure
                err = TransferError(f"direct transfer failed: {exc!r}")
                err.__cause__ = exc
            finally:
                with self._cv:
                    for s in pins:
                        self._pins[s] -= 1
                    self._cv.notify_all()
            dreq.finish(err)

        threading.Thread(target=run, name="kvx-posix-direct", daemon=True).start()
        return dreq

    def _take_bounce(self) -> mmap.mmap:
        with self._lock:
            if self._bounce:
                return self._bounce.pop()
        return mmap.mmap(-1, 2 * _PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def _give_bounce(self, m: mmap.mmap) -> None:
        with self._lock:
            if len(self._bounce) < 4 and not self._closed:
                self._bounce.append(m)
                return
        m.close()

    def _bounce_run(self, to_file: bool, fp: _Prep, fi: np.ndarray, mp: _Prep, mi: np.ndarray,
                    guards: np.ndarray, dreq: _DirectRequest) -> None:
        """Aligned file ranges, unaligned memory: copy through page-aligned bounce buffers."""
        assert fp.dfds is not None
        faddr, maddr, ln, fds = _split(fp.addr[fi], mp.addr[mi], fp.nbytes[fi], fp.dfds[fi], _PIECE)
        start = np.concatenate(([0], np.cumsum(ln)[:-1])).astype(np.int64) if len(ln) else np.zeros(0, np.int64)
        grp = start // _PIECE
        cuts = np.flatnonzero(np.diff(grp)) + 1
        bounds = np.concatenate(([0], cuts, [len(ln)])).astype(np.int64)
        bufs = [self._take_bounce(), self._take_bounce()]
        addrs = [np.frombuffer(b, dtype=np.uint8).ctypes.data for b in bufs]
        big = 1 << 62
        pending: Any = None  # the I/O job of the previous chunk
        pending_scatter: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

        def io(k: int, lo: int, hi: int) -> tuple[Any, np.ndarray]:
            b = _U64(addrs[k % 2]) + (start[lo:hi] - start[lo]).astype(_U64)
            ar = np.arange(hi - lo, dtype=np.int64)
            if to_file:
                j = _native.submit(_native.OP_PWRITE, 0, faddr[lo:hi], ln[lo:hi], ar, b, ln[lo:hi], ar,
                                   fds[lo:hi], guards, max(self.threads, _DIRECT_THREADS), 0, 0)
            else:
                j = _native.submit(_native.OP_PREAD, 0, b, ln[lo:hi], ar, faddr[lo:hi], ln[lo:hi], ar,
                                   fds[lo:hi], guards, max(self.threads, _DIRECT_THREADS), 0, 0)
            dreq.jobs.append(j)
            return j, b

        def finish(j: Any) -> None:
            while not j.wait(0.05):
                if dreq.cancelled:
                    j.cancel()
            dreq.jobs.remove(j)

        try:
            for k in range(len(bounds) - 1):
                if dreq.cancelled:
                    raise OSError(errno.ECANCELED, "cancelled")
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                ar = np.arange(hi - lo, dtype=np.int64)
                if to_file:
                    # gather chunk k into its bounce (inline, GIL released) while chunk k-1 is written
                    b = _U64(addrs[k % 2]) + (start[lo:hi] - start[lo]).astype(_U64)
                    _native.submit(_native.OP_MEMCPY, 0, b, ln[lo:hi], ar, maddr[lo:hi], ln[lo:hi], ar,
                                   None, guards, 1, big, 0)
                    if pending is not None:
                        finish(pending)
                    pending, _ = io(k, lo, hi)
                else:
                    j, b = io(k, lo, hi)
                    if pending_scatter is not None:  # scatter chunk k-1 while chunk k is read
                        pb, pm, pl = pending_scatter
                        par = np.arange(len(pl), dtype=np.int64)
                        _native.submit(_native.OP_MEMCPY, 0, pm, pl, par, pb, pl, par, None, guards, 1, big, 0)
                    finish(j)
                    pending_scatter = (b, maddr[lo:hi], ln[lo:hi])
            if pending is not None:
                finish(pending)
                pending = None
            if pending_scatter is not None:
                pb, pm, pl = pending_scatter
                par = np.arange(len(pl), dtype=np.int64)
                _native.submit(_native.OP_MEMCPY, 0, pm, pl, par, pb, pl, par, None, guards, 1, big, 0)
        finally:
            if pending is not None:  # an error: let the in-flight write end before reusing its bounce
                pending.cancel()
                try:
                    pending.wait(float(self.cfg.transfer_timeout))
                except OSError:
                    pass
            for m in bufs:
                self._give_bounce(m)
