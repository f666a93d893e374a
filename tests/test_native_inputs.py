"""kvx._native's entry points refuse inconsistent arguments instead of reading past them.

Run under ``make test-asan``, a read past a buffer here is a sanitizer report; in the normal build
the checks are what these tests see.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvx import _native

U = np.uint64


def _arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    src = np.arange(n * 16, dtype=np.uint8)
    dst = np.zeros(n * 16, dtype=np.uint8)
    sa = np.array([src.ctypes.data + 16 * i for i in range(n)], U)
    da = np.array([dst.ctypes.data + 16 * i for i in range(n)], U)
    ln = np.full(n, 16, U)
    return src, dst, sa, da, ln


def test_length_arrays_must_match_address_arrays() -> None:
    src, dst, sa, da, ln = _arrays(4)
    idx = np.arange(4, dtype=np.int64)
    for fn in (_native.submit, _native.plan):
        with pytest.raises(ValueError, match="dst_len must be as long as dst_addr"):
            fn(_native.OP_MEMCPY, 0, da, ln[:1], idx, sa, ln, idx, None, None, 1, 1 << 20, 0)
        with pytest.raises(ValueError, match="src_len must be as long as src_addr"):
            fn(_native.OP_MEMCPY, 0, da, ln, idx, sa, ln[:2], idx, None, None, 1, 1 << 20, 0)
        with pytest.raises(ValueError, match="fds must be as long as"):
            fn(_native.OP_PWRITE, 0, da, ln, idx, sa, ln, idx, np.zeros(1, np.int64), None, 1, 1 << 20, 0)
    assert (dst == 0).all()
    assert _native.submit(_native.OP_MEMCPY, 0, da, ln, idx, sa, ln, idx, None, None, 1, 1 << 20, 0) == 64
    assert (dst == src).all()


def test_an_index_list_that_shrinks_while_read_is_refused() -> None:
    """An index whose ``__index__`` empties the list being read: no read of the freed item array."""
    src, dst, sa, da, ln = _arrays(8)
    lst: list[object] = []

    class Shrinks:
        def __index__(self) -> int:
            lst.clear()
            return 0

    lst.extend([Shrinks()] + list(range(1, 8)))
    with pytest.raises((IndexError, ValueError, TypeError), match="changed"):
        _native.submit(_native.OP_MEMCPY, 0, da, ln, lst, sa, ln, list(range(8)), None, None, 1, 1 << 20, 0)
    assert (dst == 0).all()


def test_stage_index_with_a_shrinking_list_is_refused() -> None:
    """The cuda backend's index staging (CPU code) reads lists the same careful way."""
    lst: list[object] = []

    class Shrinks:
        def __index__(self) -> int:
            lst.clear()
            return 0

    lst.extend([Shrinks()] + list(range(1, 8)))
    staging = np.zeros(64, np.int64)
    with pytest.raises(ValueError, match="changed size"):
        _native.stage_index(lst, 8, list(range(8)), 8, staging.ctypes.data, staging.nbytes, 1)
    assert _native.stage_index(list(range(8)), 8, np.arange(8), 8, staging.ctypes.data, staging.nbytes, 1) == 8
    assert staging[:16].tolist() == list(range(8)) * 2
