"""The s3 backend's options, and the settings and boto3 clients made from them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ... import config as _config
from ...errors import (
    UsageError,
)

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class S3Options:
    """Options of the ``s3`` backend (``AgentConfig(options={"s3": S3Options(...)})``).

    Parameters
    ----------
    endpoint
        Endpoint URL (``KVX_S3_ENDPOINT``, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``);
        None for AWS's own endpoints.
    region
        Signing region (``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else ``us-east-1``).
    threads
        Concurrent requests (``KVX_S3_THREADS``).
    access_key_id, secret_access_key, session_token
        Credentials; None (the default) uses boto's own chain (``AWS_ACCESS_KEY_ID`` ...,
        profiles, instance roles).
    """

    endpoint: str | None = field(
        default_factory=lambda: _config.get("KVX_S3_ENDPOINT")
        or _config.aws("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
        metadata={"env": "KVX_S3_ENDPOINT"})
    region: str = field(default_factory=lambda: _config.aws("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1")
    threads: int = _config.option("KVX_S3_THREADS")
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise UsageError("S3Options: give both access_key_id and secret_access_key, or neither")

    def __repr__(self) -> str:  # never print a secret
        return (f"S3Options(endpoint={self.endpoint!r}, region={self.region!r}, threads={self.threads}, "
                f"access_key_id={self.access_key_id!r}, secret_access_key={'***' if self.secret_access_key else None})")


@dataclass(frozen=True, slots=True)
class S3Settings:
    """Where and how the backend talks to the object store.

    Parameters
    ----------
    endpoint
        Endpoint URL (``http://127.0.0.1:8333``), or None for AWS's own endpoints.
    region
        Signing region.
    threads
        Worker threads (concurrent requests).
    connect_timeout, read_timeout
        Seconds per connection attempt and per socket read.
    max_attempts
        Attempts per request (botocore ``standard`` retry mode).
    credentials
        ``(access key id, secret, session token)`` given in the options, or None for boto's chain.
    """

    endpoint: str | None
    region: str
    threads: int
    connect_timeout: float
    read_timeout: float
    max_attempts: int = 3
    credentials: tuple[str, str, str | None] | None = field(default=None, repr=False)

    def session(self) -> Any:
        """A new ``boto3.session.Session`` with these credentials (boto's chain when None)."""
        import boto3

        if self.credentials is None:
            return boto3.session.Session()
        key, secret, token = self.credentials
        return boto3.session.Session(aws_access_key_id=key, aws_secret_access_key=secret, aws_session_token=token)


def settings_from_env(peer_timeout: float = 10.0, options: S3Options | None = None) -> S3Settings:
    """:class:`S3Settings` from the backend's options (by default, from ``KVX_S3_*`` and the
    standard AWS variables) and the agent's peer timeout."""
    o = options if options is not None else S3Options()
    creds = (o.access_key_id, o.secret_access_key, o.session_token) if o.access_key_id is not None else None
    return S3Settings(endpoint=o.endpoint, region=o.region, threads=int(o.threads),
                      connect_timeout=min(5.0, float(peer_timeout)), read_timeout=float(peer_timeout),
                      credentials=creds)  # type: ignore[arg-type]


def make_client(s: S3Settings, pool: int, session: Any = None) -> Any:
    """A boto3 S3 client for ``s`` with bounded timeouts, standard retries, ``pool`` connections.

    ``session`` (a ``boto3.session.Session``) lets several clients share one loaded service
    model and credential chain; sessions are not thread-safe, so callers serialize creation.
    """
    from botocore.config import Config

    cfg = Config(
        region_name=s.region,
        connect_timeout=s.connect_timeout,
        read_timeout=s.read_timeout,
        retries={"mode": "standard", "max_attempts": s.max_attempts},
        max_pool_connections=max(pool, 1),
        tcp_keepalive=True,
        # kvx moves opaque blocks: no per-request CRC over the body unless an API requires one,
        # and no SHA-256 of the payload in the signature (botocore does it over plain http).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path" if s.endpoint else "auto", "payload_signing_enabled": False},
    )
    return (session or s.session()).client("s3", endpoint_url=s.endpoint, config=cfg)
