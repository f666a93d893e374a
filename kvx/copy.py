"""Blocking gather/scatter helpers over the native copy engine (for staging buffers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._native import submit

__all__ = ["copy_blocking", "staging_offsets"]


def copy_blocking(dst_addr: np.ndarray, dst_len: np.ndarray, dst_idx: Any, src_addr: np.ndarray,
                  src_len: np.ndarray, src_idx: Any, threads: int = 1, timeout: float = 600.0) -> None:
    """Copy ``src[src_idx] -> dst[dst_idx]`` (descriptor arrays of addresses and lengths) and wait.

    Uses ``threads`` native threads for large copies, the calling thread for small ones; the
    GIL is released while bytes move. Raises OSError, IndexError or ValueError like
    ``_native.submit``.
    """
    job = submit(0, 0, dst_addr, dst_len, dst_idx, src_addr, src_len, src_idx, None, None, threads,
                         1 << 20 if threads > 1 else 1 << 62, 0)
    if not isinstance(job, int) and not job.wait(timeout):
        job.cancel()
        raise TimeoutError("native copy did not finish in time")


def staging_offsets(lengths: np.ndarray, base: int) -> np.ndarray:
    """Addresses of consecutive pieces of ``lengths`` bytes packed from ``base``."""
    offs = np.zeros(len(lengths), dtype=np.uint64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=offs[1:])
    return offs + np.uint64(base)
