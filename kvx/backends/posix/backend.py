"""The posix backend: options, registration (mapped, buffered or O_DIRECT), preparation,
posting transfers on the native pool, shutdown."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ... import _native
from ... import config as _config
from ..._slots import MAX_SLOTS
from ...errors import BackendUnavailable, KVXError, RegistrationError, TransferError, UsageError
from ...memory import MemoryKind, Region
from ..base import (
    BAD_INDEX,
    Backend,
    BackendContext,
    CallRoute,
    DoneRequest,
    JobRequest,
    Op,
    PreparedList,
    Request,
    Route,
    index_vector,
    indices,
)
from .direct import DirectPath
from .files import _U64, ALIGN, _sync_code, open_preallocated, translate_oserror
from .jobs import _FailedRequest, _File, _Mem, _Prep

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class PosixOptions:
    """Options of the ``posix`` backend (``AgentConfig(options={"posix": PosixOptions(...)})``).

    Parameters
    ----------
    direct
        O_DIRECT for FILE registrations, through aligned bounce buffers (``KVX_POSIX_DIRECT``).
    threads
        Threads of the I/O pool (``KVX_POSIX_THREADS``; default min(8, CPUs)).
    sync
        Durability of file writes: ``none`` (page cache), ``data`` (fdatasync per transfer),
        ``full`` (fsync) (``KVX_POSIX_SYNC``).
    mmap
        Buffered writes through a shared mapping of the file instead of pwritev (``KVX_POSIX_MMAP``).
    """

    direct: bool = _config.option("KVX_POSIX_DIRECT")
    threads: int = _config.option("KVX_POSIX_THREADS")
    sync: str = _config.option("KVX_POSIX_SYNC")
    mmap: bool = _config.option("KVX_POSIX_MMAP")




class PosixBackend(DirectPath, Backend):
    """Host memory <-> files through ``preadv``/``pwritev`` on a native thread pool.

    See the module docstring for O_DIRECT, durability and release semantics.
    """

    name = "posix"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.FILE})
    remote = False
    local = True
    notifications = False
    Options = PosixOptions

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.cfg = ctx.config
        opts: PosixOptions = ctx.options if ctx.options is not None else PosixOptions()
        self.opts = opts
        self.direct = bool(opts.direct)
        self.threads = max(1, int(opts.threads))
        self.sync = _sync_code(opts.sync)
        self.mmap = bool(opts.mmap)
        self.inline = int(self.cfg.inline_bytes)
        self._map_warned = False
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        # guard words and in-flight counters, one per slot, at stable addresses
        self._state = np.zeros(MAX_SLOTS, dtype=np.uint64)
        self._infl = np.zeros(MAX_SLOTS, dtype=np.uint32)
        self._state_at = int(self._state.ctypes.data)
        self._infl_at = int(self._infl.ctypes.data)
        self._pins = np.zeros(MAX_SLOTS, dtype=np.int64)  # python-side holders (direct worker threads)
        self._fd = np.full(MAX_SLOTS, -1, dtype=np.int64)
        self._dfd = np.full(MAX_SLOTS, -1, dtype=np.int64)
        self._base = np.zeros(MAX_SLOTS, dtype=_U64)  # mapping address per slot (0: not mapped)
        self._files: dict[int, _File] = {}
        self._bounce: list[mmap.mmap] = []

    def serves(self, local: MemoryKind, remote: MemoryKind, loopback: bool) -> bool:
        """Only host memory <-> file, within one agent."""
        return loopback and {local, remote} == {MemoryKind.HOST, MemoryKind.FILE}

    # ---- memory ------------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if self._closed:
            raise UsageError("posix backend is closed")
        if isinstance(region, Region):
            if region.kind is not MemoryKind.HOST:
                raise RegistrationError(f"posix serves HOST memory and files, not {region.kind.name}")
            handle: Any = _Mem(slot)
        elif getattr(region, "kind", None) is MemoryKind.FILE:
            fd, dfd, _created = open_preallocated(region.path, region.nbytes, direct=self.direct, sync=self.sync)
            handle = _File(region.path, region.nbytes, slot, fd, dfd)
            if self.mmap and dfd < 0 and region.nbytes > 0:
                handle.base = self._map(handle)
            with self._lock:
                self._files[slot] = handle
                self._fd[slot] = fd
                self._dfd[slot] = dfd
                self._base[slot] = handle.base
        else:
            raise RegistrationError(f"posix cannot register {region!r}")
        _native.store64(self._state_at + 8 * slot, (gen << 1) | 1)
        return handle

    def deregister(self, region: Any, handle: Any) -> None:
        if not isinstance(handle, (_File, _Mem)):
            return
        slot = handle.slot
        _native.store64(self._state_at + 8 * slot, 0)
        bound = float(self.cfg.transfer_timeout)
        drained = bool(_native.drain(np.array([self._infl_at + 4 * slot], dtype=np.uint64), bound))
        with self._cv:
            drained = self._cv.wait_for(lambda: self._pins[slot] == 0, bound) and drained
            if isinstance(handle, _File):
                self._files.pop(slot, None)
                self._fd[slot] = -1
                self._dfd[slot] = -1
                self._base[slot] = 0
        if not isinstance(handle, _File):
            return
        if not drained:
            # a transfer is stuck in the kernel; closing (or unmapping) would let the fd number (or
            # the address range) be reused under it
            log.error("transfers on %s did not finish within %.1f s; leaving its descriptor open and mapped",
                      handle.path, bound)
            return
        self._unmap(handle)
        for fd in (handle.fd, handle.dfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    log.debug("closing %s", handle.path, exc_info=True)

    def _map(self, f: _File) -> int:
        """Map ``f`` shared read-write for the mmap write path; 0 (``pwritev``) if the kernel refuses."""
        try:
            return int(_native.map_fd(f.fd, f.nbytes, 0, True))
        except OSError as exc:
            level = logging.DEBUG if self._map_warned else logging.WARNING
            self._map_warned = True
            log.log(level, "cannot map %s (%d bytes: %s); its writes use pwritev", f.path, f.nbytes, exc.strerror)
            return 0

    @staticmethod
    def _unmap(f: _File) -> None:
        if f.base:
            try:
                _native.unmap(f.base, f.nbytes)
            except OSError:  # pragma: no cover - munmap of our own mapping does not fail
                log.warning("cannot unmap %s", f.path, exc_info=True)
            f.base = 0

    def _translate(self, exc: OSError, paths: list[str]) -> TransferError:
        """:func:`translate_oserror`, plus what EFAULT of a copy through a mapping means."""
        if exc.errno != errno.EFAULT:
            return translate_oserror(exc, paths)
        return TransferError(self._mapped_write_fault(paths))

    def _mapped_write_fault(self, paths: list[str]) -> str:
        """Say why a copy through a file mapping faulted (EFAULT/SIGBUS), checking the files."""
        undefined = "; the blocks of this transfer have undefined content"
        with self._lock:
            files = [f for f in self._files.values() if f.path in paths]
        full = []
        for f in files:
            try:
                size = os.fstat(f.fd).st_size
                if size < f.nbytes:
                    return (f"the file {f.path} was truncated under its registration ({size} of {f.nbytes} bytes "
                            f"left): a copy through its mapping failed{undefined}")
                vfs = os.fstatvfs(f.fd)
                if vfs.f_bavail == 0 or vfs.f_bfree == 0:
                    full.append(f.path)
            except OSError:
                continue
        if full:
            return (f"disk full writing {', '.join(full[:3])}: a hole punched in the preallocated file could not be "
                    f"filled{undefined}")
        where = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "") if paths else "file"
        return (f"a copy through the mapping of {where} failed (EFAULT/SIGBUS): the file was truncated, punched or the "
                f"disk is full under the registration{undefined}")

    # ---- preparation -------------------------------------------------------------------------
    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        addr = np.ascontiguousarray(d.addr, dtype=_U64)
        nb = np.ascontiguousarray(d.nbytes, dtype=_U64)
        slots = np.ascontiguousarray(plist.slots, dtype=np.int64)
        used = plist.used
        pins = {int(s): (int(plist.gens[int(s)]) << 1) | 1 for s in used.tolist()}
        guards = np.empty((len(used), 3), dtype=_U64)
        for i, (s, want) in enumerate(pins.items()):
            guards[i] = (self._state_at + 8 * s, want, self._infl_at + 4 * s)
        p = _Prep(plist.kind, addr, nb, slots, len(used) == 1, guards.reshape(-1), pins)
        if plist.kind is MemoryKind.FILE:
            with self._lock:
                p.fds = np.ascontiguousarray(self._fd[slots])
                dfds = self._dfd[slots]
                base = self._base[slots]
                p.paths = [self._files[s].path for s in pins if s in self._files]
            if len(base) and bool((base != 0).all()):
                p.maddr = base + addr  # each file's mapping covers [0, nbytes): prepare checked the bounds
            if len(nb) and bool((nb == nb[0]).all()) and int(nb[0]) and bool((addr % nb[0] == 0).all()):
                p.unit = int(nb[0])
            if (p.fds < 0).any():
                raise BackendUnavailable("a file of this list is not registered with the posix backend")
            if (dfds >= 0).all():
                p.dfds = np.ascontiguousarray(dfds)
                p.faligned = ((addr % _U64(ALIGN)) == 0) & ((nb % _U64(ALIGN)) == 0)
        elif plist.kind is MemoryKind.HOST:
            p.maligned = (addr % _U64(ALIGN)) == 0
        else:
            raise BackendUnavailable(f"posix does not serve {plist.kind.name}")
        return p

    def keep_digests(self, plist: PreparedList) -> np.ndarray:
        """Checksum every block this backend moves to or from the HOST list ``plist``.

        From now on each buffered transfer between ``plist`` and a file takes the kvx-nh64
        checksum (``kvx._native.nh64``) of every block in the same pass as the copy -- of the
        bytes written to the file, or of the bytes that landed in memory -- and, once the
        transfer is seen finished (``wait``/``done`` returned True), stores it at the block's row
        of the returned array (one uint64 per descriptor of ``plist``). Transfers running at the
        same time must not move the same rows. O_DIRECT files refuse such transfers
        (``BackendUnavailable``).

        Raises
        ------
        UsageError
            If ``plist`` is not a HOST list prepared by this backend's agent.
        """
        p: _Prep | None = plist.bdata.get(self.name)
        if p is None or p.kind is not MemoryKind.HOST:
            raise UsageError("keep_digests needs a HOST list prepared by this agent")
        if p.digests is None:
            p.digests = np.zeros(len(p.addr), dtype=_U64)
        return p.digests

    # ---- transfers ---------------------------------------------------------------------------
    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        return _PosixRoute(self, op, local, remote)

    def _post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
              notify: bytes | None) -> Request:
        lp: _Prep | None = local.bdata.get(self.name)
        rp: _Prep | None = remote.bdata.get(self.name)
        if lp is None or rp is None or {lp.kind, rp.kind} != {MemoryKind.HOST, MemoryKind.FILE}:
            raise BackendUnavailable("posix moves host memory <-> file only")
        if self._closed:
            raise UsageError("posix backend is closed")
        to_file, fp, fi, mp, mi = self._sides(op, lp, lidx, rp, ridx)
        guards = np.concatenate((lp.guards, rp.guards))
        after = None
        if notify is not None:
            deliver, me = self.ctx.deliver, self.ctx.agent_name

            def after() -> None:
                deliver(me, notify)

        if fp.dfds is not None:
            if mp.digests is not None:
                raise BackendUnavailable("block checksums are taken in buffered file transfers only, not O_DIRECT")
            return self._post_direct(to_file, fp, fi, mp, mi, guards, after)
        code, args, off = self._job_args(to_file, fp, fi, mp, mi)
        try:
            job = _native.submit(code, 0, *args, fp.fds, guards, self.threads, self.inline,
                                 self.sync if to_file else 0, off, mp.digests)
        except OSError as exc:
            return self._failed(int(fp.nbytes[fi].sum()), exc, fp.paths)
        return self._wrap(job, fp, fi, after)

    def _job_args(self, to_file: bool, fp: _Prep, fi: np.ndarray, mp: _Prep, mi: np.ndarray
                  ) -> tuple[int, tuple[Any, Any, Any, Any, Any, Any], np.ndarray | None]:
        """The native op, its (dst, dst_len, dst_idx, src, src_len, src_idx) and the file offsets of
        the mapped side for a buffered transfer: through the mapping (runs not in the page cache
        ``pwritev``/``preadv``, given the file offsets), or ``pwritev``/``preadv``."""
        if not to_file:
            if fp.maddr is not None and self.mmap:
                return _native.OP_MMREAD, (mp.addr, mp.nbytes, mi, fp.maddr, fp.nbytes, fi), fp.addr
            return _native.OP_PREAD, (mp.addr, mp.nbytes, mi, fp.addr, fp.nbytes, fi), None
        if fp.maddr is not None and self.mmap:
            return _native.OP_MMWRITE, (fp.maddr, fp.nbytes, fi, mp.addr, mp.nbytes, mi), fp.addr
        return _native.OP_PWRITE, (fp.addr, fp.nbytes, fi, mp.addr, mp.nbytes, mi), None

    def _failed(self, nbytes: int, exc: OSError, paths: list[str]) -> _FailedRequest:
        err = self._translate(exc, paths)
        err.__cause__ = exc
        return _FailedRequest(nbytes, err)

    def _wrap(self, job: Any, fp: _Prep, fi: Any, after: Any) -> Request:
        """A native result as a Request (a DoneRequest when it ran inline)."""
        if job is None or isinstance(job, int):  # ran inline
            if after is not None:
                after()
            return DoneRequest(int(job) if job is not None else int(fp.nbytes[fi].sum()))
        req = JobRequest(job, fp.paths, self._translate, after)
        if after is not None:
            self._notify_when_done(req)
        return req

    def _plan(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any
              ) -> Callable[[], Request] | None:
        """Sort and build the native job once; each call posts it again (buffered files only)."""
        lp: _Prep | None = local.bdata.get(self.name)
        rp: _Prep | None = remote.bdata.get(self.name)
        if (lp is None or rp is None or lp.dfds is not None or rp.dfds is not None or lp.digests is not None
                or rp.digests is not None or not hasattr(_native, "plan")):
            return None
        to_file, fp, fi, mp, mi = self._sides(op, lp, lidx, rp, ridx)
        code, args, off = self._job_args(to_file, fp, fi, mp, mi)
        guards = np.concatenate((lp.guards, rp.guards))
        plan = _native.plan(code, 0, *args, fp.fds, guards, self.threads, self.inline, self.sync if to_file else 0,
                            off)
        nbytes = int(plan.nbytes)

        def post() -> Request:
            try:
                return self._wrap(plan.start(), fp, fi, None)
            except OSError as exc:
                return self._failed(nbytes, exc, fp.paths)

        return post

    def _sides(self, op: Op, lp: _Prep, lidx: Any, rp: _Prep, ridx: Any
               ) -> tuple[bool, _Prep, np.ndarray, _Prep, np.ndarray]:
        """(to_file, file prep, file indices, memory prep, memory indices), sorted by file offset."""
        if op is Op.WRITE:  # local -> remote
            dst, di, src, si = rp, ridx, lp, lidx
        else:
            dst, di, src, si = lp, lidx, rp, ridx
        to_file = dst.kind is MemoryKind.FILE
        fp, fi, mp, mi = (dst, di, src, si) if to_file else (src, si, dst, di)
        fi, mi = index_vector(fi), index_vector(mi)
        if fi.shape != mi.shape:
            raise ValueError(f"index lists differ in length ({len(mi)} vs {len(fi)})")
        if len(fi) > 1:
            fi, mi = self._sorted(fp, fi, mi)
        return to_file, fp, fi, mp, mi

    def _notify_when_done(self, req: Request) -> None:
        """Deliver a loopback notification once the data landed, even if nobody polls."""
        timeout = float(self.cfg.transfer_timeout)

        def waiter() -> None:
            try:
                req.wait(timeout)
            except KVXError:
                pass

        threading.Thread(target=waiter, name="kvx-posix-notify", daemon=True).start()

    @staticmethod
    def _sorted(fp: _Prep, fi: np.ndarray, mi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Order the pairs by (file, offset) so that neighbours in the file coalesce."""
        off = fp.addr[fi]
        if fp.single:
            if bool((off[1:] >= off[:-1]).all()):
                return fi, mi
            o = None
            if fp.unit:
                # equal blocks at multiples of their size: place by block number, O(n), no sort
                u = fp.unit
                ki = off.view(np.int64)  # offsets < 2**63 (file sizes)
                k = ki >> (u.bit_length() - 1) if u & (u - 1) == 0 else ki // u
                n = len(k)
                top = int(k.max()) + 1
                if top <= 4 * n + 4096:
                    pos = np.full(top, -1, dtype=np.int64)
                    pos[k] = np.arange(n, dtype=np.int64)
                    if top == n:  # a permutation of every block, or repeats
                        o = pos if int(pos.min()) >= 0 else None
                    else:
                        o = pos[pos >= 0]
                        if len(o) != n:  # repeated blocks: fall back to a sort
                            o = None
            if o is None:
                o = np.argsort(off, kind="stable")
        else:
            sl = fp.slots[fi]
            o = np.lexsort((off, sl))
        return np.ascontiguousarray(fi[o]), np.ascontiguousarray(mi[o])

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            files = list(self._files.values())
            self._files.clear()
            bounce, self._bounce = self._bounce, []
        for f in files:
            _native.store64(self._state_at + 8 * f.slot, 0)
        drained = True
        if files:
            drained = bool(_native.drain(np.array([self._infl_at + 4 * f.slot for f in files], dtype=np.uint64),
                                         float(self.cfg.transfer_timeout)))
        if not drained:
            log.error("transfers did not finish within %.1f s of close; leaving the files open and mapped",
                      float(self.cfg.transfer_timeout))
            files = []
        for f in files:
            self._unmap(f)
            for fd in (f.fd, f.dfd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        for m in bounce:
            m.close()


class _PosixRoute(CallRoute):
    """host memory <-> file; the descriptor work of a plan is done once (buffered files)."""

    __slots__ = ()

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        if notify is not None:
            return super().plan(lidx, ridx, notify)
        b: PosixBackend = self.backend  # type: ignore[assignment]
        try:
            p = b._plan(self.op, self.local, indices(lidx), self.remote, indices(ridx))
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None
        return p if p is not None else super().plan(lidx, ridx, notify)
