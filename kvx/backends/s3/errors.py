"""The s3 backend's error map: S3 error codes, HTTP statuses, botocore's and the socket's errors."""

from __future__ import annotations

import functools
import http.client
import logging
import socket
from typing import TYPE_CHECKING, Any

from ...errors import (
    KVXError,
    PeerDisconnected,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from ..base import ErrorMap

if TYPE_CHECKING:
    pass


log = logging.getLogger(__name__)

_AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                         "ExpiredToken", "AuthorizationHeaderMalformed", "InvalidSecurity", "403", "Forbidden"})
_MISSING_KEY = frozenset({"NoSuchKey", "404", "NotFound"})




class _StatusError(Exception):
    """An S3 error response of the lean HTTP path: HTTP status, S3 error code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.reusable = False  # body read to its end on a kept-alive connection


class _ConnectFailed(ConnectionError):
    """The lean path could not open a connection (refused, unreachable, connect timeout)."""


def _from_code(code: str, status: int | None, msg: str, what: str, where: str) -> KVXError:
    """Map an S3 error code / HTTP status of an operation on ``what`` to the kvx error tree."""
    if code in _MISSING_KEY:
        return RemoteError(f"{what}: no such object (never written, or deleted)")
    if code == "NoSuchBucket":
        return RemoteError(f"{what}: no such bucket")
    if code in _AUTH_CODES or status == 403:
        return RemoteError(f"{what}: {where} refused the credentials ({code or status}): check "
                           "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    if code == "InvalidRange" or status == 416:
        return RemoteError(f"{what}: byte range outside the stored object (shorter than registered?)")
    if status is not None and status >= 500:
        return TransferError(f"{what}: {where} failed with {code or status} after retries: {msg}")
    return RemoteError(f"{what}: {where} refused the request: {code or status}: {msg}")


def _client_error(exc: Any, w: tuple[str, str]) -> KVXError:
    err = exc.response.get("Error", {}) or {}
    status = (exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode")
    return _from_code(str(err.get("Code", "")), status, err.get("Message", "") or "", *w)


def _unreachable(exc: BaseException, w: tuple[str, str]) -> KVXError:
    return PeerDisconnected(f"{w[0]}: object store at {w[1]} unreachable or dropped the connection: "
                            f"{exc.__cause__ or exc if isinstance(exc, _ConnectFailed) else exc}")


@functools.lru_cache(maxsize=1)
def errors() -> ErrorMap:
    """The s3 backend's error map (``where``: (what, endpoint)): S3 error codes and HTTP statuses of
    both request paths, botocore's and the socket's errors. Built on first use (botocore's types)."""
    from botocore import exceptions as bx

    return ErrorMap(
        (_StatusError, None, lambda e, w: _from_code(e.code or str(e.status), e.status, e.message, *w)),
        (_ConnectFailed, None, _unreachable),
        (bx.ClientError, None, _client_error),
        ((bx.ReadTimeoutError, socket.timeout, TimeoutError), None,
         lambda e, w: TransferTimeout(f"{w[0]}: no answer from {w[1]} in time ({e})")),
        (bx.NoCredentialsError, None, lambda e, w: RemoteError(
            f"{w[0]}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")),
        ((bx.EndpointConnectionError, bx.ConnectionClosedError, bx.ConnectTimeoutError, bx.ResponseStreamingError,
          bx.HTTPClientError, http.client.HTTPException, ConnectionError, OSError), None, _unreachable),
        default=lambda e, w: TransferError(f"{w[0]}: {type(e).__name__}: {e}"),
    )


def translate(exc: BaseException, what: str, endpoint: str | None) -> KVXError:
    """Map a botocore / lean-path / socket error of an operation on ``what`` to the kvx error tree."""
    return errors()(exc, (what, endpoint or "AWS S3"))  # type: ignore[no-any-return]
