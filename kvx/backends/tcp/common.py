"""The tcp backend's shared pieces: defaults, socket tuning, descriptor coalescing, frames, the error map."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import struct
from typing import Any

import numpy as np

from ... import wire
from ...errors import (
    PeerDisconnected,
    TransferError,
)
from ..base import ErrorMap

log = logging.getLogger(__name__)

#: Default streams (TCP connections) per peer (``KVX_TCP_STREAMS``).
STREAMS = 2
#: Default target bytes per chunk, one request frame (``KVX_TCP_CHUNK``); larger descriptors are split.
CHUNK = 16 << 20
#: Most descriptors per chunk (bounds the request frame).
MAX_DESCS = 1 << 16
#: Transfers up to this many bytes (one chunk) take the fast path: a dedicated stream per peer,
#: request and payload sent by the posting thread, the reply read by the thread that tests or
#: waits (no sender/reader thread hop), target-side validation without numpy.
FAST_MAX = 64 << 10
#: Most descriptors a request may carry to be validated on the target's scalar (numpy-free) path.
SMALL_DESCS = 16

_K_MSG = 1
_U64 = np.uint64

try:
    from ... import _net  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - build problem
    _net = None  # type: ignore[assignment]


# ---- sockets (frames and handshakes: kvx.net) ------------------------------------------------
def tune_socket(sock: socket.socket, peer_timeout: float) -> None:
    """TCP_NODELAY, keepalive with short intervals and TCP_USER_TIMEOUT from ``peer_timeout``."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        idle = max(1, int(peer_timeout / 3))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(peer_timeout) - idle))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1000, int(peer_timeout * 1000)))
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        log.debug("cannot tune a tcp socket", exc_info=True)


def _coalesce(addr: np.ndarray, nb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge runs of contiguous descriptors (fewer iovecs); vectorized."""
    n = addr.shape[0]
    if n <= 1:
        return addr, nb
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    np.not_equal(addr[1:], addr[:-1] + nb[:-1], out=brk[1:])
    if brk.all():
        return addr, nb
    starts = np.flatnonzero(brk)
    return addr[starts], np.add.reduceat(nb, starts).astype(_U64)


def _split_large(laddr: np.ndarray, raddr: np.ndarray, nb: np.ndarray, piece: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut descriptors longer than ``piece`` into pieces (same positions on both sides)."""
    cut = _split_rep(nb, piece)
    if cut is None:
        return laddr, raddr, nb
    rep, off = cut
    ln = np.minimum(_U64(piece), nb[rep] - off)
    return laddr[rep] + off, raddr[rep] + off, ln


def _split_rep(nb: np.ndarray, piece: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For :func:`_split_large`: the descriptor of each piece and its offset in it (None: no cut)."""
    big = nb > piece
    if not big.any():
        return None
    cnt = ((nb + _U64(piece - 1)) // _U64(piece)).astype(np.int64)
    rep = np.repeat(np.arange(nb.shape[0]), cnt)
    first = np.cumsum(cnt) - cnt
    k = (np.arange(rep.shape[0]) - np.repeat(first, cnt)).astype(_U64)
    return rep, k * _U64(piece)



_BIG_ENDIAN = struct.pack("=H", 1) != struct.pack("<H", 1)


def _native_u64(b: bytes) -> bytes:  # pragma: no cover - big-endian hosts only
    k = len(b) // 8
    return struct.pack(f"={k}Q", *struct.unpack(f"<{k}Q", b))


def _frame(body: bytes) -> bytes:
    return wire.frame_header(_K_MSG, len(body)) + body


#: The tcp backend's error map: what a failure on the connection to a peer (``where``: its name)
#: means for the transfers on it. A transfer error passes; anything else cut the link.
ERRORS = ErrorMap(
    (OSError, None, lambda e, name: PeerDisconnected(f"peer {name!r}: {_why(e)}")),
    default=lambda e, name: PeerDisconnected(f"peer {name!r}: {e}"),
    keep=TransferError,
)


def _why(exc: OSError) -> str:
    if exc.errno == errno.ETIMEDOUT:
        return "no progress within the peer timeout (dead or cut off)"
    return os.strerror(exc.errno) if exc.errno else str(exc)


def _hostname_ok(host: str) -> bool:
    """Whether ``host`` can be an IP address or a DNS name (at most 253 ASCII characters, labels
    of 1..63): what a peer's metadata may ask us to dial."""
    if not 0 < len(host) <= 253 or not host.isascii():
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(0 < len(label) <= 63 and all(c.isalnum() or c in "-_" for c in label)
               for label in host.rstrip(".").split("."))


def _i64(x: Any) -> np.ndarray:
    a = np.atleast_1d(np.asarray(x))
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, not {a.dtype}")
    return a.astype(np.int64).reshape(-1)

