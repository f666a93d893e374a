"""Index sources of a transfer: which forms the native staging takes as they are, checking and
converting the others, counting them, and the kernel's work-item size for a transfer."""

from __future__ import annotations

from typing import Any

import numpy as np

_I32_MAX = (1 << 31) - 1
_STAGE_DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint64), np.dtype(np.uint32))


def _stageable(idx: Any) -> Any:
    """``idx`` itself if ``_native.stage_index`` takes it as it is (an int, a list or tuple, a contiguous
    1-D array of 32/64-bit integers), else None."""
    t = type(idx)
    if t is int or t is list or t is tuple:
        return idx
    if t is np.ndarray and idx.ndim == 1 and idx.dtype in _STAGE_DTYPES and idx.flags.c_contiguous:
        return idx
    return None


def _chunk_shift(n: int, ulen: int, warps: int, shift: int, min_shift: int) -> int:
    """log2 of the work item for ``n`` pairs of ``ulen`` bytes on a grid of ``warps`` warps
    (``shift``, halved down to ``min_shift`` while the items still fit the warps; as
    ``CudaRoute.post``)."""
    sh = shift
    while sh > min_shift and n * ((ulen + (1 << (sh - 1)) - 1) >> (sh - 1)) <= warps:
        sh -= 1
    return sh


def _group_shift(n: int, count: int, ulen: int, group: int, warps: int) -> int:
    """log2 of the pieces one warp of the strided group kernel copies, for ``n`` pairs of ``count``
    pieces of ``ulen`` bytes: the largest group of at most ``group`` bytes and ``count`` pieces,
    halved while the groups would leave warps of the grid idle; -1: a warp per piece (pieces larger
    than half a group, a single piece, or sizes the kernel's 32-bit fields do not hold)."""
    if count < 2 or 2 * ulen > group or count >= 1 << 31 or ulen >= 1 << 31:
        return -1
    gs = 0
    while (2 << gs) * ulen <= group and (1 << gs) < count:
        gs += 1
    while gs > 0 and n * ((count + (1 << gs) - 1) >> gs) < warps:
        gs -= 1
    return gs


def _count(idx: Any) -> int:
    """Number of indices of a checked array or a :func:`_stageable` source."""
    if type(idx) is int:
        return 1
    if type(idx) is np.ndarray:
        return int(idx.shape[0])
    return len(idx)


def _index(idx: Any, n: int) -> np.ndarray:
    if isinstance(idx, np.ndarray) and idx.ndim == 1 and (idx.dtype == np.int64 or (
            idx.dtype == np.int32 and n <= _I32_MAX)):
        a = idx
        if a.size and int(a.view(np.uint64 if a.itemsize == 8 else np.uint32).max()) >= n:
            raise IndexError(f"descriptor index out of range for a list of {n}")
        return a  # one pass: a negative index is a huge unsigned one
    if type(idx) is int:
        a = np.array([idx], dtype=np.int64)
    else:
        a = np.atleast_1d(np.asarray(idx))
        if a.size and a.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, not {a.dtype}")
        a = a.astype(np.int64).reshape(-1)
    if a.size and int(a.view(np.uint64).max()) >= n:  # one pass: a negative index is a huge uint64
        raise IndexError(f"descriptor index out of range for a list of {n}")
    return a

