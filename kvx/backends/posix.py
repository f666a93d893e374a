"""``posix``: host memory <-> files with positional vectored I/O on a native thread pool.

A :class:`kvx.FileRegion` registration opens (creating it if absent, mode 0600) and preallocates
the file once, and keeps its descriptor for the life of the registration. Descriptors of a FILE
list carry the byte offset as ``addr`` and the registration slot as ``dev``; preparing a list
turns the slots into a per-descriptor fd array (``fd_table[slots]``, vectorized).

A transfer is one native job: the pairs are sorted by file offset (numpy, vectorized) so that
blocks that are adjacent in the file -- whatever their order in the request -- coalesce into
``pwritev``/``preadv`` calls of up to ``IOV_MAX`` iovecs, and the sorted list is cut into one
byte-balanced range per thread of a pthread pool that runs with the GIL released. Transfers of
at most ``KVX_INLINE_BYTES`` run inline in the posting thread (lowest latency).

Buffered writes (memory -> file) go through a shared mapping of the file (``KVX_POSIX_MMAP``,
default on; ``configure(mmap=...)``): each file is mapped ``MAP_SHARED`` read-write at
registration and a write is the native copy into ``map + offset`` (``OP_MMWRITE``), each run of
adjacent blocks first faulted in writable with ``madvise(MADV_POPULATE_WRITE)``. ``pwritev``
into one file serializes on the inode lock (about 5-6 GB/s here whatever the thread count);
page faults on a shared mapping do not, and dirty pages already mapped writable cost nothing.
One exception: a run with a page that is not in the page cache (``mincore``) where the file has
data on disk (``lseek(SEEK_DATA)``) goes through ``pwritev``, since a write fault would read that
page from the disk first and ``pwrite`` of whole pages does not (2x slower otherwise; never
written preallocated pages fault in as zeros, without I/O, and take the mapping). A file that
cannot be mapped stays on ``pwritev``. Reads stay on ``preadv``. A page the file no longer
backs (truncated or punched under the registration, disk full) fails the populate with EFAULT,
or raises SIGBUS in the copy, which the native guard catches: the transfer turns FAILED with a
TransferError that says which (see :meth:`PosixBackend._translate`).

``O_DIRECT`` (``KVX_POSIX_DIRECT=1`` or ``backend.configure(direct=True)`` before registering):
each file is opened a second time with ``O_DIRECT``. Per descriptor:

- file offset, length and memory address all 4096-aligned: straight ``pwritev``/``preadv`` on
  the direct descriptor from the caller's memory (zero copy);
- file range aligned, memory not: through page-aligned (mmap'd) bounce buffers -- the native
  memcpy gathers into the bounce and the pool writes it with ``O_DIRECT`` (reads the reverse),
  double-buffered so that copying one chunk overlaps the I/O of the previous one;
- file range not 4096-aligned: through the ordinary (buffered) descriptor.
  O_DIRECT jobs are split over at least 4 pool threads (they wait on the device, not the CPU). Linux keeps the two
  coherent (direct I/O writes back and invalidates the page cache over its range), but those
  blocks do go through the page cache.

Durability (``KVX_POSIX_SYNC`` or ``configure(sync=...)``) -- what a DONE write guarantees:

- ``none``: the bytes are in the kernel (page cache, or handed to the device under O_DIRECT):
  every reader of the file on this machine sees them and they survive the process dying, but
  not a kernel crash or power loss.
- ``data``: after all writes of the transfer succeeded, ``fdatasync`` ran on every file it
  touched: data and the metadata needed to read it back (size, allocated extents) are on stable
  storage, as far as the device honours cache flushes.
- ``full``: the same with ``fsync`` (inode metadata such as mtime too).

In ``data``/``full`` mode a registration that creates a file also fsyncs it and its directory.
A FAILED write guarantees nothing about the blocks it covered (some may hold new bytes).

Release is final: every job carries a guard per registration slot it touches (the slot's
``generation << 1 | live`` word and an in-flight counter, checked natively before any byte
moves); ``deregister`` clears the word and waits for the counters to drain before it unmaps the
file and closes the descriptor, so neither is reused under a running transfer.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import _native
from .. import config as _config
from .._slots import MAX_SLOTS
from ..errors import BackendUnavailable, KVXError, RegistrationError, TransferError, UsageError
from ..memory import MemoryKind, Region
from .base import Backend, BackendContext, ErrorMap, JobRequest, Op, PreparedList, Request, ThreadRequest

__all__ = ["PosixBackend", "ALIGN", "SYNC_MODES", "open_preallocated", "translate_oserror"]

log = logging.getLogger(__name__)

#: Alignment O_DIRECT needs of file offsets, lengths and memory addresses (safe for 4Kn drives).
ALIGN = 4096
#: Fewest pool threads (requests in flight) an O_DIRECT job is split over.
_DIRECT_THREADS = 4
#: Largest piece one bounce chunk carries (bounce buffers are twice this).
_PIECE = 8 << 20
#: ``KVX_POSIX_SYNC`` values -> the native ``sync`` argument.
SYNC_MODES = {"none": 0, "data": 1, "full": 2}
_NOSUPPORT = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
_U64 = np.uint64


def _sync_code(mode: str) -> int:
    try:
        return SYNC_MODES[str(mode).strip().lower()]
    except KeyError:
        raise UsageError(f"KVX_POSIX_SYNC must be one of none, data, full, not {mode!r}") from None


def _fsync_dir(path: str) -> None:
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def open_preallocated(path: str, nbytes: int, *, direct: bool = False, sync: int = 0) -> tuple[int, int, bool]:
    """Open (creating, mode 0600) and preallocate ``path`` to at least ``nbytes``.

    Parameters
    ----------
    path
        File to open; created if absent. An existing larger file is not shrunk.
    nbytes
        Bytes to preallocate (``posix_fallocate``; ``ftruncate`` where the filesystem cannot).
    direct
        Also open an ``O_DIRECT`` descriptor.
    sync
        0, 1 or 2: with 1 or 2 a newly created file and its directory are fsynced.

    Returns
    -------
    tuple
        ``(fd, direct_fd or -1, created)``.

    Raises
    ------
    RegistrationError
        If the file cannot be opened or preallocated (``"disk full"`` on ENOSPC/EDQUOT). A file
        this call created is removed again; an existing file gets its old size back.
    """
    flags = os.O_RDWR | os.O_CLOEXEC
    created = True
    try:
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            created = False
            fd = os.open(path, flags)
    except OSError as exc:
        raise RegistrationError(f"cannot open {path}: {exc.strerror}") from exc
    old = 0
    dfd = -1
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegistrationError(f"{path} is not a regular file")
        old = st.st_size
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in _NOSUPPORT:
                raise
            log.debug("posix_fallocate unsupported on %s (%s); using ftruncate", path, exc)
            if old < nbytes:
                os.ftruncate(fd, nbytes)
        if direct:
            try:
                dfd = os.open(path, flags | os.O_DIRECT)
            except OSError as exc:
                raise RegistrationError(
                    f"cannot open {path} with O_DIRECT ({exc.strerror}); the filesystem may not support "
                    "direct I/O: unset KVX_POSIX_DIRECT") from exc
        if sync and created:
            os.fsync(fd)
            _fsync_dir(path)
    except BaseException as exc:
        if dfd >= 0:
            os.close(dfd)
        try:
            if created:
                os.unlink(path)
            elif os.fstat(fd).st_size != old:
                os.ftruncate(fd, old)
        except OSError:
            log.warning("cannot undo the preallocation of %s", path, exc_info=True)
        os.close(fd)
        if isinstance(exc, OSError):
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise RegistrationError(f"disk full: cannot preallocate {nbytes} bytes for {path} "
                                        f"({exc.strerror})") from exc
            raise RegistrationError(f"cannot preallocate {nbytes} bytes for {path}: {exc.strerror}") from exc
        raise
    return fd, dfd, created


def _files(paths: list[str] | None) -> str:
    if not paths:
        return "file"
    return ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")


def _full(e: OSError, paths: list[str]) -> TransferError:
    what = "disk full" if e.errno == errno.ENOSPC else "disk quota exceeded"
    return TransferError(f"{what} writing {_files(paths)}; the blocks of this transfer have undefined content")


#: The posix backend's error map: a file job's errno (``where`` is the list of files it touched).
ERRORS = ErrorMap(
    (OSError, frozenset({errno.ENOSPC, errno.EDQUOT}), _full),
    (OSError, frozenset({errno.ESTALE}),
     lambda e, p: TransferError("a registration under this transfer was released while it was posted")),
    (OSError, frozenset({errno.ECANCELED}), lambda e, p: TransferError("transfer cancelled")),
    (OSError, frozenset({errno.ENODATA}), lambda e, p: TransferError(
        f"read past the end of {_files(p)}: the file was truncated under its registration")),
    (OSError, frozenset({errno.EBADF}),
     lambda e, p: TransferError(f"the descriptor of {_files(p)} was closed under its registration")),
    (OSError, frozenset({errno.EINVAL}), lambda e, p: TransferError(
        f"{_files(p)}: the kernel refused the request (O_DIRECT alignment?): {os.strerror(e.errno)}")),
    (OSError, frozenset({errno.EIO}),
     lambda e, p: TransferError(f"I/O error on {_files(p)} (device or filesystem failure)")),
    default=lambda e, p: TransferError(f"{_files(p)}: {os.strerror(getattr(e, 'errno', None) or errno.EIO)}"),
)
#: The name the other modules knew it by (``translate_oserror(exc, paths)``).
translate_oserror = ERRORS


@dataclass(slots=True)
class _File:
    """Handle of one registered file."""

    path: str
    nbytes: int
    slot: int
    fd: int
    dfd: int  # O_DIRECT descriptor, or -1
    base: int = 0  # address of the shared read-write mapping of [0, nbytes), or 0


@dataclass(frozen=True, slots=True)
class _Mem:
    """Handle of registered host memory (only its guard slot)."""

    slot: int


@dataclass(slots=True)
class _Prep:
    """A prepared list as this backend uses it."""

    kind: MemoryKind
    addr: np.ndarray  # uint64: memory address or file offset
    nbytes: np.ndarray  # uint64
    slots: np.ndarray  # int64 region slot per descriptor
    single: bool  # one slot only
    guards: np.ndarray  # uint64 (state_ptr, expected, inflight_ptr) per used slot
    pins: dict[int, int]  # slot -> expected state word
    fds: np.ndarray | None = None  # int64 buffered fd per descriptor (FILE)
    dfds: np.ndarray | None = None  # int64 O_DIRECT fd per descriptor (FILE, direct mode)
    maddr: np.ndarray | None = None  # uint64 mapped address per descriptor (FILE, every file mapped)
    faligned: np.ndarray | None = None  # FILE: offset and length 4096-aligned
    maligned: np.ndarray | None = None  # HOST: address 4096-aligned
    unit: int = 0  # FILE: every block has this length and starts at a multiple of it (else 0)
    paths: list[str] = field(default_factory=list)


class _FailedRequest(Request):
    """A transfer that failed while it was posted (inline I/O): FAILED at the first poll."""

    __slots__ = ("err", "nbytes")

    def __init__(self, nbytes: int, err: TransferError) -> None:
        self.nbytes = nbytes
        self.err = err

    def test(self) -> bool:
        raise self.err

    def wait(self, timeout: float) -> bool:
        raise self.err


def _failed(nbytes: int, exc: OSError, paths: list[str]) -> _FailedRequest:
    err = translate_oserror(exc, paths)
    err.__cause__ = exc
    return _FailedRequest(nbytes, err)


class _DirectRequest(ThreadRequest):
    """An O_DIRECT transfer driven by a worker thread (bounce buffers, mixed paths)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__(nbytes)
        self.jobs: list[Any] = []
        self.after: Any = None

    def finish(self, err: BaseException | None = None) -> None:
        self._err = err
        self._ev.set()
        if err is None and self.after is not None:
            self.after()

    def cancel(self) -> bool:
        self.cancelled = True
        for j in list(self.jobs):
            j.cancel()
        return not self._ev.is_set()


def _i64(x: Any) -> np.ndarray:
    if type(x) is int:
        return np.array([x], dtype=np.int64)
    a = np.atleast_1d(np.asarray(x))
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, not {a.dtype}")
    return np.ascontiguousarray(a.astype(np.int64, copy=False).reshape(-1))


def _split(faddr: np.ndarray, maddr: np.ndarray, ln: np.ndarray, fds: np.ndarray, piece: int
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut descriptors longer than ``piece`` into pieces (vectorized; ``piece`` is aligned)."""
    cnt = ((ln + _U64(piece - 1)) // _U64(piece)).astype(np.int64)
    if not (cnt > 1).any():
        return faddr, maddr, ln, fds
    rep = np.repeat(np.arange(len(ln)), cnt)
    first = np.repeat(np.cumsum(cnt) - cnt, cnt)
    off = (np.arange(int(cnt.sum()), dtype=np.int64) - first).astype(_U64) * _U64(piece)
    nl = np.minimum(_U64(piece), ln[rep] - off)
    return faddr[rep] + off, maddr[rep] + off, nl, fds[rep]


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


class PosixBackend(Backend):
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

    # ---- options -----------------------------------------------------------------------------
    def configure(self, *, direct: bool | None = None, sync: str | None = None, threads: int | None = None,
                  inline_bytes: int | None = None, mmap: bool | None = None) -> None:
        """Change this backend's options (overriding ``KVX_POSIX_*``).

        Parameters
        ----------
        direct
            Open files registered from now on with ``O_DIRECT`` too.
        mmap
            Buffered writes through a shared mapping of the file (``KVX_POSIX_MMAP``). ``True``
            maps files registered from now on; ``False`` also sends writes posted from now on to
            files mapped before through ``pwritev``.
        sync
            ``none``, ``data`` or ``full``; applies to writes posted from now on.
        threads
            Native I/O threads per transfer.
        inline_bytes
            Transfers of at most this many bytes run in the posting thread.
        """
        if direct is not None:
            self.direct = bool(direct)
        if sync is not None:
            self.sync = _sync_code(sync)
        if threads is not None:
            if threads < 1:
                raise UsageError("threads must be >= 1")
            self.threads = int(threads)
        if inline_bytes is not None:
            self.inline = max(0, int(inline_bytes))
        if mmap is not None:
            self.mmap = bool(mmap)

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
        """:func:`translate_oserror`, plus what EFAULT of a write through a mapping means."""
        if exc.errno != errno.EFAULT:
            return translate_oserror(exc, paths)
        return TransferError(self._mapped_write_fault(paths))

    def _mapped_write_fault(self, paths: list[str]) -> str:
        """Say why a write through a file mapping faulted (EFAULT/SIGBUS), checking the files."""
        undefined = "; the blocks of this transfer have undefined content"
        with self._lock:
            files = [f for f in self._files.values() if f.path in paths]
        full = []
        for f in files:
            try:
                size = os.fstat(f.fd).st_size
                if size < f.nbytes:
                    return (f"the file {f.path} was truncated under its registration ({size} of {f.nbytes} bytes "
                            f"left): writing through its mapping failed{undefined}")
                vfs = os.fstatvfs(f.fd)
                if vfs.f_bavail == 0 or vfs.f_bfree == 0:
                    full.append(f.path)
            except OSError:
                continue
        if full:
            return (f"disk full writing {', '.join(full[:3])}: a hole punched in the preallocated file could not be "
                    f"filled{undefined}")
        where = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "") if paths else "file"
        return (f"writing {where} through its mapping failed (EFAULT/SIGBUS): the file was truncated, punched or the "
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

    # ---- transfers ---------------------------------------------------------------------------
    def post(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,  # type: ignore[override]
             notify: bytes | None) -> Request | int:
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
            return self._post_direct(to_file, fp, fi, mp, mi, guards, after)
        code, args, off = self._job_args(to_file, fp, fi, mp, mi)
        try:
            job = _native.submit(code, 0, *args, fp.fds, guards, self.threads, self.inline,
                                 self.sync if to_file else 0, off)
        except OSError as exc:
            return self._failed(int(fp.nbytes[fi].sum()), exc, fp.paths)
        return self._wrap(job, fp, fi, after)

    def _job_args(self, to_file: bool, fp: _Prep, fi: np.ndarray, mp: _Prep, mi: np.ndarray
                  ) -> tuple[int, tuple[Any, Any, Any, Any, Any, Any], np.ndarray | None]:
        """The native op, its (dst, dst_len, dst_idx, src, src_len, src_idx) and ``dst_off`` for a
        buffered transfer: reads ``preadv``; writes through the mapping (runs not in the page
        cache ``pwritev``, given the file offsets) or ``pwritev``."""
        if not to_file:
            return _native.OP_PREAD, (mp.addr, mp.nbytes, mi, fp.addr, fp.nbytes, fi), None
        if fp.maddr is not None and self.mmap:
            return _native.OP_MMWRITE, (fp.maddr, fp.nbytes, fi, mp.addr, mp.nbytes, mi), fp.addr
        return _native.OP_PWRITE, (fp.addr, fp.nbytes, fi, mp.addr, mp.nbytes, mi), None

    def _failed(self, nbytes: int, exc: OSError, paths: list[str]) -> _FailedRequest:
        err = self._translate(exc, paths)
        err.__cause__ = exc
        return _FailedRequest(nbytes, err)

    def _wrap(self, job: Any, fp: _Prep, fi: Any, after: Any) -> Request | int:
        """A native result as the agent wants it: an int (done inline) or a Request."""
        if job is None or isinstance(job, int):  # ran inline
            if after is not None:
                after()
            return int(job) if job is not None else int(fp.nbytes[fi].sum())
        req = JobRequest(job, fp.paths, self._translate, after)
        if after is not None:
            self._notify_when_done(req)
        return req

    def make_plan(self, op: Op, local: PreparedList, lidx: Any, remote: PreparedList, ridx: Any,
                  notify: bytes | None) -> Callable[[], Request | int]:
        """Sort and build the native job once; each call posts it again (buffered files only)."""
        lp: _Prep | None = local.bdata.get(self.name)
        rp: _Prep | None = remote.bdata.get(self.name)
        if (lp is None or rp is None or notify is not None or lp.dfds is not None or rp.dfds is not None
                or not hasattr(_native, "plan")):
            return super().make_plan(op, local, lidx, remote, ridx, notify)
        to_file, fp, fi, mp, mi = self._sides(op, lp, lidx, rp, ridx)
        code, args, off = self._job_args(to_file, fp, fi, mp, mi)
        guards = np.concatenate((lp.guards, rp.guards))
        plan = _native.plan(code, 0, *args, fp.fds, guards, self.threads, self.inline, self.sync if to_file else 0,
                            off)
        nbytes = int(plan.nbytes)

        def post() -> Request | int:
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
        fi, mi = _i64(fi), _i64(mi)
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

    # ---- O_DIRECT ----------------------------------------------------------------------------
    def _post_direct(self, to_file: bool, fp: _Prep, fi: np.ndarray, mp: _Prep, mi: np.ndarray,
                     guards: np.ndarray, after: Any) -> Request | int:
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
