"""Shared-secret authentication (HMAC-SHA256 challenge/response) for side channels and data
connections.

The listener sends a random nonce; the connecting side answers with
``HMAC(token, nonce || its agent id || listener id)``; the listener compares in constant time.
A peer without the token learns nothing but the nonce and gets :class:`~kvx.errors.AuthError`.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from .errors import AuthError

__all__ = ["new_nonce", "prove", "verify"]


def new_nonce() -> bytes:
    """32 random bytes."""
    return os.urandom(32)


def prove(token: str | None, nonce: bytes, client_id: str, server_id: str) -> bytes:
    """The answer to ``nonce`` (empty when no token is configured)."""
    if not token:
        return b""
    return hmac.new(token.encode(), nonce + client_id.encode() + b"|" + server_id.encode(), hashlib.sha256).digest()


def verify(token: str | None, nonce: bytes, client_id: str, server_id: str, mac: bytes) -> None:
    """Raise AuthError unless ``mac`` proves knowledge of ``token``."""
    if not token:
        return
    want = prove(token, nonce, client_id, server_id)
    if not isinstance(mac, bytes) or not hmac.compare_digest(want, mac):
        raise AuthError("peer failed authentication (wrong or missing KVX_AUTH_TOKEN)")
