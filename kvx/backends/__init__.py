"""South-bound backends. See :mod:`kvx.backends.base` for the contract."""

from . import registry
from .base import Backend, BackendContext, Op, PeerInfo, Request
from .registry import register_backend

__all__ = ["Backend", "BackendContext", "Op", "PeerInfo", "Request", "register_backend", "registry"]
