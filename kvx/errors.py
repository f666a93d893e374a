"""The one exception tree of kvx (DESIGN section 5).

Backends translate their native errors (OSError, CUDA, botocore, UCX) into these at their
boundary and keep the cause with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "KVXError",
    "UsageError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "IndexOutOfRange",
    "RegistrationError",
    "BackendUnavailable",
    "ProtocolError",
    "AuthError",
    "TransferError",
    "TransferTimeout",
    "PeerDisconnected",
    "RemoteError",
    "TierError",
    "BlockNotFound",
    "TierFull",
]


class KVXError(Exception):
    """Base class of every error kvx raises on purpose."""


class UsageError(KVXError, RuntimeError):
    """The caller misused the API (a released handle, a closed agent, bad arguments)."""


class ArgumentTypeError(UsageError, TypeError):
    """An argument of a public call has the wrong type.

    Raised before the call allocates, registers or sends anything; the message names the
    argument and what it takes. Also a ``TypeError``, as Python's own calls raise.
    """


class ArgumentValueError(UsageError, ValueError):
    """An argument of a public call has the right type but a value it cannot take (a size out of
    range, NaN, an empty name, arrays of different lengths).

    Raised before the call allocates, registers or sends anything; the message names the
    argument and its range. Also a ``ValueError``, as Python's own calls raise.
    """


class IndexOutOfRange(UsageError, IndexError):
    """An index lies outside the list it indexes (``DescList[i]``). Also an ``IndexError``."""


class RegistrationError(KVXError):
    """Memory cannot be registered, or a descriptor lies outside registered memory."""


class BackendUnavailable(KVXError):
    """No backend serves this memory pair, or a backend's optional dependency is missing."""


class ProtocolError(KVXError):
    """Malformed, oversized or incompatible metadata or message."""


class AuthError(KVXError):
    """A peer failed authentication."""


class TransferError(KVXError):
    """A transfer failed."""


class TransferTimeout(TransferError):
    """A transfer, handshake or notification did not finish within its bound."""


class PeerDisconnected(TransferError):
    """The peer died, closed, or was cut off."""


class RemoteError(TransferError):
    """The target refused the request (for example an out-of-bounds descriptor)."""


class TierError(KVXError):
    """A tiered-store operation failed."""


class BlockNotFound(TierError, KeyError):
    """The requested block is in no tier (or failed its checksum)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return Exception.__str__(self)


class TierFull(TierError):
    """A tier has no room and nothing can be evicted (everything is pinned)."""
