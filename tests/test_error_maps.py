"""Each backend maps native, OS and library errors to the kvx tree through one table at its
boundary (``kvx.backends.base.ErrorMap``), and transfers keep the specific class (issue 15.4)."""

from __future__ import annotations

import errno
from typing import Any

import pytest

import kvx
from kvx.backends import host, posix, s3, tcp
from kvx.backends.base import ErrorMap, Request
from kvx.errors import PeerDisconnected, ProtocolError, RemoteError, TransferError, TransferTimeout
from kvx.transfer import Transfer


def _os(code: int) -> OSError:
    return OSError(code, "x")


@pytest.mark.parametrize("table, exc, where, want, text", [
    (host.ERRORS, _os(errno.ESTALE), "t", RemoteError, "released"),
    (host.ERRORS, _os(errno.ESRCH), "t", PeerDisconnected, "process is gone"),
    (host.ERRORS, _os(errno.EFAULT), None, RemoteError, "local memory"),
    (host.ERRORS, _os(errno.EIO), "t", TransferError, "copy failed"),
    (posix.ERRORS, _os(errno.ENOSPC), ["/d/f"], TransferError, "disk full writing /d/f"),
    (posix.ERRORS, _os(errno.EDQUOT), ["/d/f"], TransferError, "quota"),
    (posix.ERRORS, _os(errno.ENODATA), ["/d/f"], TransferError, "truncated"),
    (posix.ERRORS, _os(errno.EPIPE), [], TransferError, "file"),
    (tcp.ERRORS, _os(errno.ETIMEDOUT), "p", PeerDisconnected, "no progress within the peer timeout"),
    (tcp.ERRORS, ProtocolError("garbage"), "p", PeerDisconnected, "garbage"),
    (tcp.ERRORS, TransferTimeout("slow"), "p", TransferTimeout, "slow"),
])
def test_backend_tables(table: ErrorMap, exc: BaseException, where: Any, want: type, text: str) -> None:
    err = table(exc, where)
    assert type(err) is want and text in str(err)


def test_s3_table() -> None:
    pytest.importorskip("botocore")
    from botocore import exceptions as bx

    assert type(s3.translate(s3._StatusError(403, "AccessDenied", "no"), "s3://b/k", None)) is RemoteError
    assert type(s3.translate(s3._StatusError(503, "SlowDown", "busy"), "s3://b/k", "http://e")) is TransferError
    assert type(s3.translate(TimeoutError("t"), "s3://b/k", None)) is TransferTimeout
    assert type(s3.translate(ConnectionRefusedError(), "s3://b/k", "http://e")) is PeerDisconnected
    ce = bx.ClientError({"Error": {"Code": "NoSuchKey", "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": 404}},
                        "GetObject")
    assert "no such object" in str(s3.translate(ce, "s3://b/k", None))
    assert type(s3.translate(ValueError("odd"), "s3://b/k", None)) is TransferError


def test_mapped_keeps_the_cause_and_passes_kvx_errors() -> None:
    cause = _os(errno.ESRCH)
    with pytest.raises(PeerDisconnected) as info:
        with host.ERRORS.mapped("t"):
            raise cause
    assert info.value.__cause__ is cause
    with pytest.raises(RemoteError) as info2:
        with host.ERRORS.mapped("t"):
            raise RemoteError("as is")
    assert info2.value.__cause__ is None


class _Failing(Request):
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def test(self) -> bool:
        raise self.exc

    def wait(self, timeout: float) -> bool:
        raise self.exc


def test_transfer_keeps_the_subclass_and_the_cause() -> None:
    x = Transfer(_Failing(PeerDisconnected("gone")), 1, "test", 5.0)
    with pytest.raises(PeerDisconnected):
        x.wait(1.0)
    y = Transfer(_Failing(ProtocolError("bad frame")), 1, "test", 5.0)
    assert y.status is kvx.Status.FAILED
    assert isinstance(y.error, TransferError) and "ProtocolError" in str(y.error)
    assert isinstance(y.error.__cause__, ProtocolError)
