"""What a prepared side, a file and a posted transfer of the posix backend hold, and how
transfers are cut into pieces for the I/O pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import TransferError
from ...memory import MemoryKind
from ..base import Request, ThreadRequest
from .files import _U64, translate_oserror

log = logging.getLogger(__name__)

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
    digests: np.ndarray | None = None  # HOST: kvx-nh64 of each block as last moved (keep_digests)
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
