"""Block checksums of the tiers: kvx-nh64 (``kvx._native.nh64``, specified in
``native/kvx_hash.c``), a 64-bit checksum that the posix backend can take in the same pass as a
copy (``PosixBackend.keep_digests``).

A ``get`` from the disk tier into host memory therefore checks every block without a second
pass over it: the read computes the checksum of exactly the bytes that landed. Elsewhere
(``put`` into the host tier, write-back, promotion through host slots) :func:`block_sum` runs
over the bytes in memory, at tens of GB/s per core (AVX2; a portable version computes the same
values), with no optional dependency.

Tiers written with CRC-32 (before kvx-nh64; their ``tier.meta`` carries no ``nh64`` tag and
their journal records the ``KJ`` magic) are not read: their index is discarded on open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import _native

__all__ = ["block_sum", "IMPL", "TAG"]

#: checksum of one block (a bytes-like object) -> unsigned 64-bit int
block_sum: Callable[[Any], int] = _native.nh64
IMPL = "kvx-nh64"
#: what ``tier.meta`` of a journaled tier names, so a tier of another checksum is not read
TAG = "nh64"
