"""Block checksums of the tiers: CRC-32 with zlib's polynomial, from the fastest implementation
that is importable.

``zlib-ng`` (``pip install kvx[tiers]``) and ``isal`` compute exactly the values of
:func:`zlib.crc32` with SIMD (tens of GB/s per core against about 2 for zlib), so journals and
indexes written with one are read with any other.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

__all__ = ["crc32", "IMPL", "FAST"]


def _pick() -> tuple[Callable[[Any], int], str]:
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32, "zlib-ng"
    except ImportError:
        pass
    try:
        from isal import isal_zlib

        return isal_zlib.crc32, "isal"
    except ImportError:
        pass
    return zlib.crc32, "zlib"


crc32, IMPL = _pick()
#: a SIMD implementation is in use (a CRC pass costs far less than a copy)
FAST = IMPL != "zlib"
