"""``gds``: CUDA memory <-> files with GPUDirect Storage through kvikio (cuFile).

Available where kvikio imports and a CUDA driver with a device is present. Where GPUDirect
Storage itself is not usable (no ``nvidia-fs``, a file system cuFile cannot drive), kvikio runs in
*compat mode*: POSIX I/O through its own pinned bounce buffers -- the posix fallback for GPU
memory. It is slow (on an H100 without GDS, 0.12-0.47x of staging through pinned host memory
with the cuda and posix backends), so by default the backend is unavailable there;
``KVX_GDS_COMPAT=1`` allows it. ``GdsBackend.mode()`` says which (``"gds"`` or ``"compat"``) and
``kvx info`` shows it.

A FILE registration is opened once with ``kvikio.CuFile(path, "r+")`` after the posix helper
created and preallocated it (kvikio keeps a buffered and an ``O_DIRECT`` descriptor). A
transfer sorts its pairs by file offset, merges runs that are adjacent both in the file and in
device memory (vectorized), and issues one ``CuFile.pread``/``pwrite`` per run; those return
futures that kvikio's thread pool completes. kvikio has no batched Python API, so the runs are
posted in a Python loop: transfers of many small, scattered blocks are better staged through
pinned host memory and the posix backend.

Durability follows ``KVX_POSIX_SYNC`` (``fdatasync``/``fsync`` on kvikio's descriptor once every
write of a transfer completed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import config as _config
from ..errors import BackendUnavailable, RegistrationError, TransferError, UsageError
from ..memory import MemoryKind, Region
from .base import Backend, BackendContext, CallRoute, Op, PreparedList, Request, Route, index_vector
from .posix import _sync_code, open_preallocated, translate_oserror

__all__ = ["GdsBackend"]

log = logging.getLogger(__name__)

_INSTALL = "pip install kvx[gds]"


def _cuda_devices() -> str | None:
    """None if the CUDA driver answers with at least one device, else why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 not found)"
    if cuda.cuInit(0) != 0:
        return "no CUDA driver (cuInit failed)"
    n = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return "no CUDA device"
    return None


class _DevBuf:
    """A device range as an array kvikio accepts (``__cuda_array_interface__``, uint8)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


@dataclass(slots=True)
class _File:
    path: str
    slot: int
    fd: int  # our descriptor (kept for fsync; kvikio has its own)
    handle: Any  # kvikio.CuFile


@dataclass(slots=True)
class _Prep:
    kind: MemoryKind
    addr: np.ndarray
    nbytes: np.ndarray
    slots: np.ndarray
    files: dict[int, _File] | None = None


class _FutRequest(Request):
    """kvikio futures of one transfer; completion polled without blocking."""

    def __init__(self, futs: list[Any], nbytes: int, expect: list[int], paths: list[str], after: Any) -> None:
        self.futs = futs
        self.nbytes = nbytes
        self.expect = expect
        self.paths = paths
        self.after = after
        self._done = False
        self._lock = threading.Lock()

    def test(self) -> bool:
        if self._done:
            return True
        if not all(f.done() for f in self.futs):
            return False
        with self._lock:
            if self._done:
                return True
            for f, want in zip(self.futs, self.expect):
                try:
                    got = f.get()
                except OSError as exc:
                    raise translate_oserror(exc, self.paths) from exc
                except RuntimeError as exc:  # kvikio raises CUfileException (a RuntimeError)
                    raise TransferError(f"cuFile I/O on {', '.join(self.paths)} failed: {exc}") from exc
                if got != want:
                    raise TransferError(f"short cuFile I/O on {', '.join(self.paths)}: {got} of {want} bytes")
            if self.after is not None:
                self.after()
            self._done = True
        return True


@dataclass(frozen=True, slots=True)
class GdsOptions:
    """Options of the ``gds`` backend.

    Parameters
    ----------
    sync
        Durability of file writes, as for posix (``KVX_POSIX_SYNC``). Whether kvikio's compat mode
        may stand in for GPUDirect Storage is decided before the backend starts, from
        ``KVX_GDS_COMPAT``.
    """

    sync: str = _config.option("KVX_POSIX_SYNC")


class GdsBackend(Backend):
    """CUDA memory <-> files through kvikio/cuFile (GPUDirect Storage)."""

    name = "gds"
    kinds = frozenset({MemoryKind.CUDA, MemoryKind.FILE})
    remote = False
    local = True
    notifications = False
    Options = GdsOptions

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            import kvikio
            import kvikio.defaults
        except ImportError as exc:
            if "libcuda" in str(exc):
                return f"no CUDA driver ({exc})"
            return f"kvikio not importable ({exc}): {_INSTALL}"
        except OSError as exc:  # a shared library kvikio needs is missing
            return f"no CUDA driver ({exc})"
        why = _cuda_devices()
        if why is not None:
            return why
        try:
            compat = kvikio.defaults.is_compat_mode_preferred()
        except AttributeError:  # kvikio < 24.12
            compat = bool(kvikio.defaults.compat_mode())
        if compat and not _config.get("KVX_GDS_COMPAT"):
            return ("GPUDirect Storage (cuFile) is not usable here; kvikio's compat mode is off (KVX_GDS_COMPAT=1 "
                    "allows it): stage through pinned host memory with the cuda and posix backends")
        return None

    @staticmethod
    def mode() -> str:
        """``"gds"`` when cuFile drives the I/O, ``"compat"`` when kvikio bounces through host memory."""
        import kvikio.defaults

        try:
            compat = kvikio.defaults.is_compat_mode_preferred()
        except AttributeError:  # kvikio < 24.12
            compat = bool(kvikio.defaults.compat_mode())
        return "compat" if compat else "gds"

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        import kvikio

        self._kvikio = kvikio
        opts: GdsOptions = ctx.options if ctx.options is not None else GdsOptions()
        self.sync = _sync_code(opts.sync)
        self._files: dict[int, _File] = {}
        self._lock = threading.Lock()
        self._live: dict[int, weakref.WeakSet[_FutRequest]] = {}  # file slot -> requests on it

    def serves(self, local: MemoryKind, remote: MemoryKind, loopback: bool) -> bool:
        """Only CUDA memory <-> file, within one agent."""
        return loopback and {local, remote} == {MemoryKind.CUDA, MemoryKind.FILE}

    def register(self, region: Any, slot: int, gen: int) -> Any:
        if isinstance(region, Region):
            if region.kind is not MemoryKind.CUDA:
                raise RegistrationError(f"gds serves CUDA memory and files, not {region.kind.name}")
            return None  # cuFile buffer registration is optional; kvikio handles unregistered memory
        if getattr(region, "kind", None) is not MemoryKind.FILE:
            raise RegistrationError(f"gds cannot register {region!r}")
        fd, _dfd, _ = open_preallocated(region.path, region.nbytes, sync=self.sync)
        try:
            handle = self._kvikio.CuFile(region.path, "r+")
        except Exception as exc:
            os.close(fd)
            raise RegistrationError(f"cuFile cannot open {region.path}: {exc}") from exc
        f = _File(region.path, slot, fd, handle)
        with self._lock:
            self._files[slot] = f
        return f

    def deregister(self, region: Any, handle: Any) -> None:
        if not isinstance(handle, _File):
            return
        with self._lock:
            self._files.pop(handle.slot, None)
            live = list(self._live.pop(handle.slot, ()))
        # release is final: let the I/O already handed to kvikio end before the file closes
        deadline = time.monotonic() + float(self.ctx.config.transfer_timeout)
        for r in live:
            while not all(f.done() for f in r.futs):
                if time.monotonic() > deadline:
                    log.error("cuFile I/O on %s did not finish in time; leaving the file open", handle.path)
                    return
                time.sleep(0.001)
        handle.handle.close()
        os.close(handle.fd)

    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        p = _Prep(plist.kind, np.ascontiguousarray(d.addr, dtype=np.uint64),
                  np.ascontiguousarray(d.nbytes, dtype=np.uint64), np.ascontiguousarray(plist.slots))
        if plist.kind is MemoryKind.FILE:
            with self._lock:
                p.files = {int(s): self._files[int(s)] for s in plist.used.tolist() if int(s) in self._files}
            if len(p.files) != len(plist.used):
                raise BackendUnavailable("a file of this list is not registered with the gds backend")
        elif plist.kind is not MemoryKind.CUDA:
            raise BackendUnavailable(f"gds does not serve {plist.kind.name}")
        return p

    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        return CallRoute(self, op, local, remote)

    def _post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
             notify: bytes | None) -> Request:
        lp: _Prep | None = local.bdata.get(self.name)
        rp: _Prep | None = remote.bdata.get(self.name)
        if lp is None or rp is None or {lp.kind, rp.kind} != {MemoryKind.CUDA, MemoryKind.FILE}:
            raise BackendUnavailable("gds moves CUDA memory <-> file only")
        if op is Op.WRITE:
            dst, di, src, si = rp, ridx, lp, lidx
        else:
            dst, di, src, si = lp, lidx, rp, ridx
        to_file = dst.kind is MemoryKind.FILE
        fp, fi, mp, mi = (dst, di, src, si) if to_file else (src, si, dst, di)
        fi, mi = index_vector(fi), index_vector(mi)
        if fi.shape != mi.shape:
            raise ValueError("index lists differ in length")
        ln = fp.nbytes[fi]  # IndexError on a bad index
        if not np.array_equal(ln, mp.nbytes[mi]):
            raise ValueError("paired descriptors differ in length")
        fslot, foff, maddr = fp.slots[fi], fp.addr[fi], mp.addr[mi]
        o = np.lexsort((foff, fslot))
        fslot, foff, maddr, ln = fslot[o], foff[o], maddr[o], ln[o]
        # merge runs adjacent in the file and in device memory (vectorized)
        if len(ln) > 1:
            brk = np.ones(len(ln), dtype=bool)
            brk[1:] = ((fslot[1:] != fslot[:-1]) | (foff[1:] != foff[:-1] + ln[:-1])
                       | (maddr[1:] != maddr[:-1] + ln[:-1]))
            starts = np.flatnonzero(brk)
            run_len = np.add.reduceat(ln, starts)
            fslot, foff, maddr, ln = fslot[starts], foff[starts], maddr[starts], run_len
        assert fp.files is not None
        with self._lock:
            if any(self._files.get(s) is not f for s, f in fp.files.items()):
                raise UsageError("a file under this transfer was released; prepare again")
        futs, expect = [], []
        for s, off, addr, n in zip(fslot.tolist(), foff.tolist(), maddr.tolist(), ln.tolist()):
            f = fp.files[s].handle
            buf = _DevBuf(addr, n)
            futs.append(f.pwrite(buf, n, off) if to_file else f.pread(buf, n, off))
            expect.append(n)
        paths = [f.path for f in fp.files.values()]
        after = None
        if to_file and self.sync:
            fds = [fp.files[s].fd for s in np.unique(fslot).tolist()]
            sync = os.fdatasync if self.sync == 1 else os.fsync

            def after() -> None:
                for fd in fds:
                    try:
                        sync(fd)
                    except OSError as exc:
                        raise translate_oserror(exc, paths) from exc

        if notify is not None:
            prev, deliver, me = after, self.ctx.deliver, self.ctx.agent_name

            def after() -> None:
                if prev is not None:
                    prev()
                deliver(me, notify)

        req = _FutRequest(futs, int(ln.sum()), expect, paths, after)
        with self._lock:
            for s in fp.files:
                self._live.setdefault(s, weakref.WeakSet()).add(req)
        return req

    def close(self) -> None:
        with self._lock:
            files = list(self._files.values())
            self._files.clear()
        for f in files:
            try:
                f.handle.close()
            finally:
                os.close(f.fd)
