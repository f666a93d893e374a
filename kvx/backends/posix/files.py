"""Files for the posix backend: opening and preallocating, durability codes, the error map."""

from __future__ import annotations

import errno
import logging
import os
import stat

import numpy as np

from ...errors import RegistrationError, TransferError, UsageError
from ..base import ErrorMap

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
