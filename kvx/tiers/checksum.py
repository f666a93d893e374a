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
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _native
from ..errors import BackendUnavailable

if TYPE_CHECKING:
    from ..agent import Agent, PreparedList

__all__ = ["block_sum", "keep_digests", "IMPL", "TAG"]

#: checksum of one block (a bytes-like object) -> unsigned 64-bit int
block_sum: Callable[[Any], int] = _native.nh64
IMPL = "kvx-nh64"
#: what ``tier.meta`` of a journaled tier names, so a tier of another checksum is not read
TAG = "nh64"


def keep_digests(agent: Agent, plist: PreparedList) -> np.ndarray:
    """Have ``agent``'s posix backend checksum every block it moves to or from the HOST list
    ``plist``, in the same pass as the copy.

    The public route to :meth:`kvx.backends.posix.PosixBackend.keep_digests` (which says how
    the array fills): after this call, each buffered transfer between ``plist`` and a file
    leaves the kvx-nh64 (:data:`block_sum`) of every block it moved at that block's row of the
    returned array (one uint64 per descriptor of ``plist``), once the transfer is seen finished.

    Raises
    ------
    BackendUnavailable
        If no posix backend runs in ``agent``.
    UsageError
        If ``plist`` is not a HOST list prepared by ``agent``.
    """
    from ..backends.posix import PosixBackend

    posix = agent.backend("posix")
    if not isinstance(posix, PosixBackend):
        raise BackendUnavailable(f"the backend running as 'posix' in agent {agent.name!r} takes no checksums")
    return posix.keep_digests(plist)
