"""The s3 backend's lean GET/PUT path: SigV4-signed requests over this thread's kept-alive
connection, streamed straight from and into registered memory, with retries."""

from __future__ import annotations

import ctypes
import http.client
import io
import logging
import random
import re
import threading
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...errors import (
    KVXError,
    RemoteError,
    TransferError,
    UsageError,
)
from .._sigv4 import Signer, canonical_path

if TYPE_CHECKING:
    pass


from .errors import _ConnectFailed, _StatusError
from .settings import S3Settings

if TYPE_CHECKING:
    from .backend import _S3Request

log = logging.getLogger(__name__)

#: Bytes per ``readinto`` call while streaming a body (release and cancel are checked between).
_READ_CHUNK = 4 << 20
#: Bytes handed to the socket per ``read`` of a request body (urllib3 asks for 16 KiB).
_SEND_CHUNK = 1 << 20
#: Bytes per ``sendall`` of a lean PUT body (release and cancel are checked between).
_PUT_CHUNK = 4 << 20
#: Lean path: HTTP statuses and S3 codes retried with backoff (as botocore's ``standard`` mode).
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
_RETRY_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
                          "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
                          "BandwidthLimitExceeded", "RequestThrottled", "RequestTimeout", "RequestTimeoutException",
                          "PriorRequestNotComplete", "InternalError", "ServiceUnavailable"})
#: Errors of a request on a kept-alive connection that the server may have closed meanwhile.
_STALE = (http.client.RemoteDisconnected, http.client.BadStatusLine, BrokenPipeError, ConnectionResetError,
          ConnectionAbortedError)
_CODE_RE = re.compile(rb"<Code>([^<]*)</Code>")
_MSG_RE = re.compile(rb"<Message>([^<]*)</Message>")

def _view(addr: int, n: int) -> memoryview:
    """A writable byte view of ``n`` bytes of process memory at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


class _MemReader(io.RawIOBase):
    """A seekable file over process memory whose ``read`` returns views, not copies.

    botocore takes request bodies as bytes or files; this lets the HTTP layer ``sendall``
    slices of the registered memory directly, and rewind it for a retry.
    """

    def __init__(self, addr: int, n: int) -> None:
        super().__init__()
        self._mv = _view(addr, n)
        self._n = n
        self._pos = 0

    def __len__(self) -> int:
        return self._n

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, off: int, whence: int = 0) -> int:
        base = (0, self._pos, self._n)[whence]
        self._pos = max(0, min(self._n, base + off))
        return self._pos

    def read(self, size: int | None = -1) -> memoryview:  # type: ignore[override]
        end = self._n if size is None or size < 0 else min(self._n, self._pos + max(size, _SEND_CHUNK))
        out = self._mv[self._pos:end]
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:  # pragma: no cover - the HTTP layer uses read()
        k = min(len(b), self._n - self._pos)
        b[:k] = self._mv[self._pos:self._pos + k]
        self._pos += k
        return k




class _LeanEndpoint:
    """Where the lean path connects: scheme, host, port, ``Host`` header, path prefix, signer."""

    __slots__ = ("host", "https", "netloc", "port", "prefix", "signer")

    def __init__(self, s: S3Settings) -> None:
        u = urlsplit(s.endpoint or "")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise UsageError(f"S3 endpoint {s.endpoint!r} is not an http(s)://host[:port] URL")
        self.https = u.scheme == "https"
        self.host = u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.netloc = u.netloc.rsplit("@", 1)[-1]
        self.prefix = u.path.rstrip("/")
        self.signer = Signer(s.region)


# unit kinds



class LeanPath:
    """Mixin of :class:`~kvx.backends.s3.S3Backend`: GET and PUT without boto3 on the hot path.

    The backend provides the attributes annotated here.
    """

    settings: S3Settings
    _lean: _LeanEndpoint | None
    _tls: threading.local
    _mk_lock: threading.Lock
    _session: Any
    _creds: Any
    _live: dict[int, int]

    # ---- lean GET/PUT path ---------------------------------------------------------------
    def _auth(self, method: str, path: str) -> dict[str, str]:
        """SigV4 headers for ``method path`` with the current credentials (UNSIGNED-PAYLOAD)."""
        c = self._creds
        if c is None:
            with self._mk_lock:
                if self._session is None:
                    self._session = self.settings.session()
                c = self._session.get_credentials()
            if c is None:
                raise RemoteError("no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            self._creds = c
        f = c.get_frozen_credentials()  # refreshes expiring (role, SSO) credentials when due
        ep = self._lean
        assert ep is not None
        return ep.signer.headers(method, ep.netloc, path, f.access_key, f.secret_key, f.token)

    def _conn(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the endpoint, opened when needed; (conn, reused)."""
        c: http.client.HTTPConnection | None = getattr(self._tls, "conn", None)
        if c is not None and c.sock is not None:
            return c, True
        ep = self._lean
        assert ep is not None
        s = self.settings
        c = (http.client.HTTPSConnection(ep.host, ep.port, timeout=s.connect_timeout) if ep.https
             else http.client.HTTPConnection(ep.host, ep.port, timeout=s.connect_timeout))
        try:
            c.connect()  # sets TCP_NODELAY
        except OSError as exc:
            c.close()
            raise _ConnectFailed(f"cannot connect to {ep.netloc}: {exc}") from exc
        assert c.sock is not None
        c.sock.settimeout(s.read_timeout)
        self._tls.conn = c
        return c, False

    def _drop_conn(self) -> None:
        c = getattr(self._tls, "conn", None)
        if c is not None:
            self._tls.conn = None
            try:
                c.close()
            except OSError:  # pragma: no cover
                pass

    def _retrying(self, req: _S3Request, attempt: Any) -> None:
        """Run ``attempt(conn)`` with bounded retries and exponential backoff with jitter.

        Throttling, 5xx, connection errors and timeouts are retried up to ``max_attempts`` in
        all; a kept-alive connection found closed by the server is replaced at once, once,
        without counting as an attempt. kvx errors (cancel, release, size mismatch) and other
        S3 errors are final. The connection is dropped whenever its state is unknown.
        """
        tries = 0
        free = 1
        while True:
            conn, reused = self._conn()
            try:
                attempt(conn)
                return
            except BaseException as exc:
                if not (isinstance(exc, _StatusError) and exc.reusable):
                    self._drop_conn()
                if isinstance(exc, KVXError) or req.stop:
                    raise
                if isinstance(exc, _StatusError):
                    if exc.status not in _RETRY_STATUS and exc.code not in _RETRY_CODES:
                        raise
                elif not isinstance(exc, (OSError, http.client.HTTPException)):
                    raise
                if reused and free and isinstance(exc, _STALE):
                    free -= 1
                    continue
                tries += 1
                if tries >= self.settings.max_attempts:
                    raise
                delay = random.random() * min(20.0, 2.0 ** (tries - 1))
                log.debug("s3: retrying in %.2f s after %r", delay, exc)
                time.sleep(delay)

    @staticmethod
    def _status_error(resp: http.client.HTTPResponse) -> "_StatusError":
        """The error of a non-2xx response; reads (at most 64 KiB of) its XML body."""
        body = b""
        try:
            body = resp.read(65536) if resp.length is None or resp.length <= 65536 else b""
        except (OSError, http.client.HTTPException):
            pass
        m = _CODE_RE.search(body)
        mm = _MSG_RE.search(body)
        err = _StatusError(resp.status, m.group(1).decode(errors="replace") if m else "",
                           mm.group(1).decode(errors="replace") if mm else resp.reason)
        err.reusable = resp.isclosed() and not resp.will_close
        return err

    def _lean_get(self, req: _S3Request, bucket: str, key: str, addr: int, n: int, off: int, ranged: bool,
                  slots: tuple[int, int]) -> None:
        """GET (a range of) an object straight into ``n`` bytes of memory at ``addr``."""
        ep = self._lean
        assert ep is not None
        path = ep.prefix + canonical_path(bucket, key)
        rng = f"bytes={off}-{off + n - 1}" if ranged else None
        live = self._live

        def attempt(conn: http.client.HTTPConnection) -> None:
            conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
            for h, v in self._auth("GET", path).items():
                conn.putheader(h, v)
            if rng is not None:
                conn.putheader("Range", rng)
            conn.endheaders()
            resp = conn.getresponse()
            st = resp.status
            if st != 200 and st != 206:
                raise self._status_error(resp)
            clen = resp.length
            if clen != n or (rng is not None and st == 200 and off != 0):
                raise RemoteError(f"s3://{bucket}/{key}: the store returned {clen} bytes where {n} were expected "
                                  "(object size differs from the registration)")
            mv = _view(addr, n)
            readinto = resp.readinto
            got = 0
            while got < n:
                if req.stop or slots[0] not in live or slots[1] not in live:
                    raise TransferError("transfer cancelled or registration released while reading")
                k = readinto(mv[got:min(n, got + _READ_CHUNK)])
                if not k:
                    raise http.client.IncompleteRead(b"", n - got)
                got += k

        self._retrying(req, attempt)

    def _lean_put(self, req: _S3Request, bucket: str, key: str, addr: int, n: int, slots: tuple[int, int]) -> None:
        """PUT ``n`` bytes of memory at ``addr`` as one whole object (atomic in S3)."""
        ep = self._lean
        assert ep is not None
        path = ep.prefix + canonical_path(bucket, key)
        live = self._live
        clen = str(n)

        def attempt(conn: http.client.HTTPConnection) -> None:
            conn.putrequest("PUT", path, skip_host=True, skip_accept_encoding=True)
            for h, v in self._auth("PUT", path).items():
                conn.putheader(h, v)
            conn.putheader("Content-Length", clen)
            conn.endheaders()
            sock = conn.sock
            assert sock is not None
            mv = _view(addr, n)
            try:
                for i in range(0, n, _PUT_CHUNK):
                    if req.stop or slots[0] not in live or slots[1] not in live:
                        raise TransferError("transfer cancelled or registration released while writing")
                    sock.sendall(mv[i:i + _PUT_CHUNK])
            except OSError as exc:
                # the store may have answered early (refused credentials, ...) and closed
                try:
                    early = conn.getresponse()
                except BaseException:
                    raise exc from None
                if early.status < 300:
                    raise
                raise self._status_error(early) from exc
            resp = conn.getresponse()
            if resp.status != 200:
                raise self._status_error(resp)
            resp.read()  # empty body; the connection stays usable

        self._retrying(req, attempt)
