"""kvx: move the KV cache of LLM inference engines between GPUs, host memory, files and objects.

See ``docs/architecture.md``; the public names are listed in ``__all__``.
"""

from __future__ import annotations

from .agent import Agent, PreparedList, Registration
from .config import AgentConfig
from .errors import (
    ArgumentTypeError,
    ArgumentValueError,
    AuthError,
    BackendUnavailable,
    BlockNotFound,
    IndexOutOfRange,
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    RemoteError,
    TierError,
    TierFull,
    TransferError,
    TransferTimeout,
    UsageError,
)
from .memory import DescList, FileRegion, MemoryKind, ObjectRegion, RawRegion, alloc_host
from .transfer import Status, Transfer

__version__ = "0.1.0"

__all__ = [
    "Agent",
    "AgentConfig",
    "ArgumentTypeError",
    "ArgumentValueError",
    "AuthError",
    "BackendUnavailable",
    "BlockNotFound",
    "DescList",
    "FileRegion",
    "IndexOutOfRange",
    "KVXError",
    "MemoryKind",
    "ObjectRegion",
    "PeerDisconnected",
    "PreparedList",
    "ProtocolError",
    "RawRegion",
    "Registration",
    "RegistrationError",
    "RemoteError",
    "Status",
    "TierError",
    "TierFull",
    "Transfer",
    "TransferError",
    "TransferTimeout",
    "UsageError",
    "alloc_host",
    "__version__",
]
