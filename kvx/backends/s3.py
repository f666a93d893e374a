"""``s3``: OBJECT registrations on an S3-compatible object store (own SigV4 GET/PUT + boto3).

An :class:`~kvx.ObjectRegion` ``(bucket, key, nbytes)`` is one object. Transfers are loopback:
the local list is HOST memory of this agent, the other list is OBJECT descriptors (one per
object; ``addr`` is a byte offset inside the object, ``dev`` the registration slot).

- **Writes** (memory -> object) are whole-object only: each descriptor must cover its object
  exactly (offset 0, ``nbytes`` == registered size), checked vectorized at post. Objects up to
  :data:`MULTIPART_THRESHOLD` go as one ``PutObject`` (atomic); larger ones as a multipart
  upload of :data:`PART_BYTES` parts uploaded in parallel, made visible atomically by
  ``CompleteMultipartUpload`` and aborted on any failure or cancel. A reader therefore sees the
  old object, the new object, or no object -- never a torn one.
- **Reads** (object -> memory) are whole or ranged GETs that stream the body straight into the
  destination memory (``readinto`` on a ``ctypes`` view of the address; no intermediate
  ``bytes``). Reads larger than :data:`MULTIPART_THRESHOLD` are split into :data:`PART_BYTES`
  ranges fetched in parallel.
- **Lean path**: with a configured endpoint, single-object PUTs and all GETs skip botocore:
  kvx signs them itself (SigV4, :mod:`kvx.backends._sigv4`, ``UNSIGNED-PAYLOAD``, signing key
  cached per day) and sends them on one kept-alive ``http.client`` connection per worker,
  with the same retries, bounds and error mapping. boto3 still does bucket checks/creation,
  multipart uploads, credential resolution, and everything against AWS's own endpoints.
- **Concurrency**: a pool of ``KVX_S3_THREADS`` worker threads; every object operation (PUT,
  part, ranged GET) is one queued unit. ``post`` only queues and returns; the request completes
  when every unit of the transfer has finished. ``cancel`` drops queued units (in-flight ones
  run to their end; multipart uploads are aborted).
- **Bounds**: botocore ``standard`` retry mode, mirrored by the lean path (3 attempts,
  exponential backoff with jitter; throttling, 5xx, connection errors and timeouts retried),
  connect timeout ``min(5, peer_timeout)`` s, read timeout ``peer_timeout`` s per socket read.
  A dead endpoint fails a transfer in a few seconds; a silent one within the retry budget of
  read timeouts; the agent's ``transfer_timeout`` bounds everything.
- **Buckets** are checked (``HeadBucket``) at ``register`` and created when missing; objects are
  not created by ``register``: reading a never-written object fails the transfer with
  :class:`~kvx.errors.RemoteError` naming the key.

Endpoint and credentials: ``KVX_S3_ENDPOINT`` (overrides), else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``; credentials, profile and region from the standard AWS chain
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``; region defaults to ``us-east-1``).
"""

from __future__ import annotations

import ctypes
import functools
import http.client
import importlib.util
import io
import logging
import queue
import random
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from .. import config as _config
from ..errors import (
    AuthError,
    KVXError,
    PeerDisconnected,
    RegistrationError,
    RemoteError,
    TransferError,
    TransferTimeout,
    UsageError,
)
from ..memory import MemoryKind, Region
from ._sigv4 import Signer, canonical_path
from .base import Backend, BackendContext, DoneRequest, ErrorMap, Op, Request

if TYPE_CHECKING:
    from .base import PreparedList

__all__ = ["S3Backend", "S3Options", "S3Settings", "MULTIPART_THRESHOLD", "PART_BYTES", "settings_from_env"]

log = logging.getLogger(__name__)

#: Objects larger than this are written by multipart upload and read by parallel ranged GETs.
MULTIPART_THRESHOLD = 16 << 20
#: Part size of multipart uploads and of split reads (S3 needs parts >= 5 MiB but the last).
PART_BYTES = 8 << 20
#: Bytes per ``readinto`` call while streaming a body (release and cancel are checked between).
_READ_CHUNK = 4 << 20
#: Bytes handed to the socket per ``read`` of a request body (urllib3 asks for 16 KiB).
_SEND_CHUNK = 1 << 20
#: ClientError codes that mean the credentials were refused.
_AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                         "ExpiredToken", "AuthorizationHeaderMalformed", "InvalidSecurity", "403", "Forbidden"})
_MISSING_KEY = frozenset({"NoSuchKey", "404", "NotFound"})
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


# ---------------------------------------------------------------------------------------------
class _S3Request(Request):
    """A transfer: completes when its last unit finishes; the first error wins."""

    __slots__ = ("_err", "_ev", "_left", "_lock", "_on_done", "_user_cancel", "nbytes", "stop")

    def __init__(self, nbytes: int, units: int, on_done: Any) -> None:
        self.nbytes = nbytes
        self._left = units
        self._lock = threading.Lock()
        self._ev = threading.Event()
        self._err: BaseException | None = None
        self.stop = False  # queued units skip themselves (cancel, or an earlier unit failed)
        self._user_cancel = False
        self._on_done = on_done

    def unit_done(self, err: BaseException | None) -> None:
        with self._lock:
            if err is not None and self._err is None:
                self._err = err
                self.stop = True
            self._left -= 1
            last = self._left == 0
        if last:
            if self._err is None and not self._user_cancel and self._on_done is not None:
                try:
                    self._on_done()
                except Exception:  # pragma: no cover - delivery never raises in practice
                    log.exception("delivering a notification")
            self._ev.set()

    def test(self) -> bool:
        if not self._ev.is_set():
            return False
        if self._err is not None:
            raise self._err
        if self._user_cancel:
            raise TransferError("transfer was cancelled")
        return True

    def wait(self, timeout: float) -> bool:
        if not self._ev.wait(timeout):
            return False
        return self.test()

    def cancel(self) -> bool:
        self._user_cancel = True
        self.stop = True
        return not self._ev.is_set()


class _Multipart:
    """State of one multipart upload shared by its part units."""

    __slots__ = ("bucket", "err", "key", "left", "lock", "lslot", "parts", "rslot", "upload_id")

    def __init__(self, bucket: str, key: str, nparts: int, lslot: int, rslot: int) -> None:
        self.bucket = bucket
        self.key = key
        self.upload_id = ""
        self.parts: list[dict[str, Any] | None] = [None] * nparts
        self.left = nparts
        self.lock = threading.Lock()
        self.err: BaseException | None = None
        self.lslot = lslot
        self.rslot = rslot


@dataclass(slots=True)
class _ObjPrep:
    """Per prepared OBJECT list: which descriptors cover their whole object."""

    whole: np.ndarray


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
_PUT, _MPU, _PART, _GET = 0, 1, 2, 3


class S3Backend(Backend):
    """HOST memory <-> OBJECT registrations through boto3; see the module docstring."""

    name = "s3"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.OBJECT})
    remote = False
    local = True
    notifications = False
    Options = S3Options

    #: one boto3 client per worker thread (True) or one shared client with a pool (False).
    #: Measured on SeaweedFS (docs/storage-objects.md): per-thread clients were as fast or
    #: faster at every block size, so they are the default.
    per_thread_clients: bool = True
    #: GET and PUT of whole objects and ranges through kvx's own SigV4 signer and one kept-alive
    #: ``http.client`` connection per worker (True), or through boto3 (False). Only with a
    #: configured endpoint (path-style); AWS's own endpoints always go through boto3.
    #: Measured in docs/storage-objects.md: 3-8x less client CPU per request.
    lean: bool = True

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        self.settings = settings_from_env(float(ctx.config.peer_timeout), ctx.options)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._live: dict[int, int] = {}  # slot -> gen of every region registered with us
        self._objs: dict[int, tuple[str, str, int]] = {}  # slot -> (bucket, key, nbytes)
        self._busy: Counter[int] = Counter()  # slot -> units touching it right now
        self._buckets: set[str] = set()  # buckets known to exist
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._client: Any = None
        self._session: Any = None
        self._mk_lock = threading.Lock()
        self._tls = threading.local()
        self._closed = False
        self._creds: Any = None  # botocore credentials (refreshable or not) of the lean path
        self._lean = _LeanEndpoint(self.settings) if self.lean and self.settings.endpoint else None

    # ---- capability ------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("boto3") is None or importlib.util.find_spec("botocore") is None:
            return "boto3 not importable: pip install kvx[s3]"
        return None

    def serves(self, local: MemoryKind, remote: MemoryKind, loopback: bool) -> bool:
        return loopback and local == MemoryKind.HOST and remote == MemoryKind.OBJECT

    # ---- clients and workers ---------------------------------------------------------------
    def client(self) -> Any:
        """The boto3 client of the calling thread (created on first use)."""
        if self.per_thread_clients:
            c = getattr(self._tls, "client", None)
            if c is None:
                with self._mk_lock:  # boto3 session/client creation is not thread-safe
                    if self._session is None:
                        self._session = self.settings.session()
                    c = make_client(self.settings, 2, self._session)
                self._tls.client = c
            return c
        c = self._client
        if c is None:
            with self._mk_lock:
                if self._client is None:
                    try:
                        self._client = make_client(self.settings, self.settings.threads + 4)
                    except ImportError as exc:
                        raise RegistrationError("boto3 not importable: pip install kvx[s3]") from exc
                c = self._client
        return c

    def _start_workers(self) -> None:
        with self._lock:
            if self._workers or self._closed:
                return
            for i in range(self.settings.threads):
                t = threading.Thread(target=self._worker, name=f"kvx-s3-{self.ctx.agent_name}-{i}", daemon=True)
                t.start()
                self._workers.append(t)

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if isinstance(region, Region):
            if region.kind != MemoryKind.HOST:
                raise RegistrationError("s3 backend registers HOST memory and OBJECT regions only")
        elif getattr(region, "kind", None) == MemoryKind.OBJECT:
            self._ensure_bucket(region.bucket)
            with self._lock:
                self._objs[slot] = (region.bucket, region.key, int(region.nbytes))
        else:
            raise RegistrationError("s3 backend registers HOST memory and OBJECT regions only")
        with self._lock:
            self._live[slot] = gen
        return slot

    def _ensure_bucket(self, bucket: str) -> None:
        """HeadBucket, and CreateBucket when missing (once per bucket per backend)."""
        if bucket in self._buckets:
            return
        from botocore import exceptions as bx

        c = self.client()
        what = f"bucket {bucket!r}"
        try:
            try:
                c.head_bucket(Bucket=bucket)
            except bx.ClientError as exc:
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if code not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                log.info("creating bucket %s at %s", bucket, self.settings.endpoint or "AWS")
                kw: dict[str, Any] = {}
                if self.settings.region != "us-east-1" and not self.settings.endpoint:
                    kw["CreateBucketConfiguration"] = {"LocationConstraint": self.settings.region}
                try:
                    c.create_bucket(Bucket=bucket, **kw)
                except bx.ClientError as exc2:
                    if exc2.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":
                        raise
        except bx.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_CODES or status == 403:
                raise AuthError(f"{what}: {self.settings.endpoint or 'AWS S3'} refused the credentials "
                                f"({code or status}): check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY") from exc
            raise RegistrationError(f"{what}: cannot check or create it: {translate(exc, what, self.settings.endpoint)}"
                                    ) from exc
        except bx.NoCredentialsError as exc:
            raise AuthError(f"{what}: no S3 credentials found: set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY") from exc
        except (bx.BotoCoreError, OSError) as exc:
            raise RegistrationError(f"{what}: {translate(exc, what, self.settings.endpoint)}") from exc
        self._buckets.add(bucket)

    def deregister(self, region: Any, handle: Any) -> None:
        slot = int(handle)
        bound = self.settings.read_timeout * self.settings.max_attempts + 5.0
        with self._cv:
            self._live.pop(slot, None)
            self._objs.pop(slot, None)
            # units that touch this slot stop at their next chunk; wait for them to let go
            if not self._cv.wait_for(lambda: self._busy[slot] == 0, bound):
                log.error("s3: units still touching released slot %d after %.1f s", slot, bound)
            self._busy.pop(slot, None)

    def prepare(self, plist: "PreparedList") -> Any:
        if plist.kind != MemoryKind.OBJECT:
            return None
        slots = np.asarray(plist.slots, dtype=np.int64)
        with self._lock:
            sizes = np.array([self._objs.get(int(s), ("", "", -1))[2] for s in np.unique(slots)], dtype=np.int64)
            uniq = np.unique(slots)
        size = sizes[np.searchsorted(uniq, slots)]
        d = plist.descs
        whole = (d.addr == 0) & (d.nbytes.astype(np.int64) == size)
        return _ObjPrep(whole=whole)

    # ---- transfers -------------------------------------------------------------------------
    def post(self, op: Op, local: "PreparedList", lidx: Any, remote: "PreparedList", ridx: Any,
             notify: bytes | None) -> Request:
        if self._closed:
            raise UsageError("s3 backend is closed")
        li = _index(lidx, len(local))
        ri = _index(ridx, len(remote))
        if li.shape != ri.shape:
            raise ValueError(f"{li.shape[0]} local vs {ri.shape[0]} remote indices")
        ld, rd = local.descs, remote.descs
        n = ld.nbytes[li]
        if not np.array_equal(n, rd.nbytes[ri]):
            bad = int(np.argmax(n != rd.nbytes[ri]))
            raise ValueError(f"pair {bad}: local descriptor of {int(n[bad])} bytes vs object range of "
                             f"{int(rd.nbytes[ri][bad])} bytes")
        if op is Op.WRITE:
            prep = remote.bdata.get(self.name)
            whole = prep.whole[ri] if isinstance(prep, _ObjPrep) else np.zeros(len(ri), bool)
            if not whole.all():
                bad = int(np.argmin(whole))
                raise UsageError(f"object writes are whole-object: descriptor {int(ri[bad])} covers bytes "
                                 f"{int(rd.addr[ri[bad]])}+{int(rd.nbytes[ri[bad]])}, not the whole object")
        total = int(n.sum())
        if len(li) == 0:
            return DoneRequest(0)
        on_done = None
        if notify is not None:
            name = self.ctx.agent_name
            on_done = lambda: self.ctx.deliver(name, notify)  # noqa: E731
        addr = ld.addr[li].tolist()
        nb = n.tolist()
        off = rd.addr[ri].tolist()
        lslot = np.asarray(local.slots, dtype=np.int64)[li].tolist()
        rslot = np.asarray(remote.slots, dtype=np.int64)[ri].tolist()
        units: list[tuple[Any, ...]] = []
        big = MULTIPART_THRESHOLD
        for a, k, o, ls, rs in zip(addr, nb, off, lslot, rslot):
            if op is Op.WRITE:
                units.append((_MPU if k > big else _PUT, a, k, o, ls, rs))
            elif k > big:
                for p in range(0, k, PART_BYTES):
                    units.append((_GET, a + p, min(PART_BYTES, k - p), o + p, ls, rs))
            else:
                units.append((_GET, a, k, o, ls, rs))
        req = _S3Request(total, len(units), on_done)
        self._start_workers()
        put = self._q.put
        for u in units:
            put((req, u))
        return req

    # ---- workers ---------------------------------------------------------------------------
    def _worker(self) -> None:
        q = self._q
        while True:
            item = q.get()
            if item is None:
                self._drop_conn()
                return
            req, u = item
            if req.stop or self._closed:
                if u[0] == _PART:
                    self._part_done(req, u[6], u[7], TransferError("transfer cancelled"))
                else:
                    req.unit_done(TransferError("transfer cancelled") if not self._closed
                                  else TransferError("s3 backend closed"))
                continue
            kind = u[0]
            if kind == _PART:
                mp = u[6]
                err = self._guarded(req, u, mp.lslot, mp.rslot)
                self._part_done(req, mp, u[7], err)
            else:
                err = self._guarded(req, u, u[4], u[5])
                if kind != _MPU or err is not None:
                    req.unit_done(err)

    def _guarded(self, req: _S3Request, u: tuple[Any, ...], lslot: int, rslot: int) -> BaseException | None:
        """Run one unit with both slots pinned live; return its error (None when it worked)."""
        with self._lock:
            if lslot not in self._live or rslot not in self._live:
                return RemoteError("a registration of this transfer was released")
            bucket, key, _size = self._objs[rslot]
            self._busy[lslot] += 1
            self._busy[rslot] += 1
        what = f"s3://{bucket}/{key}"
        try:
            kind = u[0]
            if kind == _GET:
                get = self._lean_get if self._lean is not None else self._get
                get(req, bucket, key, u[1], u[2], u[3], u[2] != _size or u[3] != 0, (lslot, rslot))
            elif kind == _PUT:
                if self._lean is not None:
                    self._lean_put(req, bucket, key, u[1], u[2], (lslot, rslot))
                else:
                    self.client().put_object(Bucket=bucket, Key=key, Body=_MemReader(u[1], u[2]))
            elif kind == _MPU:
                self._start_multipart(req, bucket, key, u)
            else:  # _PART
                mp, pno = u[6], u[7]
                r = self.client().upload_part(Bucket=bucket, Key=key, UploadId=mp.upload_id, PartNumber=pno + 1,
                                              Body=_MemReader(u[1], u[2]))
                mp.parts[pno] = {"PartNumber": pno + 1, "ETag": r["ETag"]}
            return None
        except BaseException as exc:
            err = translate(exc, what, self.settings.endpoint)
            if err is not exc:
                err.__cause__ = exc
            log.debug("s3 unit on %s failed: %s", what, err)
            return err
        finally:
            with self._cv:
                self._busy[lslot] -= 1
                self._busy[rslot] -= 1
                self._cv.notify_all()

    def _get(self, req: _S3Request, bucket: str, key: str, addr: int, n: int, off: int, ranged: bool,
             slots: tuple[int, int]) -> None:
        kw: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if ranged:
            kw["Range"] = f"bytes={off}-{off + n - 1}"
        resp = self.client().get_object(**kw)
        body = resp["Body"]
        raw = getattr(body, "_raw_stream", None)
        fp = getattr(raw, "_fp", None)
        ok = False
        try:
            clen = int(resp.get("ContentLength", -1))
            if clen != n:
                raise RemoteError(f"s3://{bucket}/{key}: the store returned {clen} bytes where {n} were expected "
                                  "(object size differs from the registration)")
            mv = _view(addr, n)
            # stream straight into the destination: http.client's readinto fills our view
            readinto = fp.readinto if isinstance(fp, http.client.HTTPResponse) else body.readinto
            got = 0
            live = self._live
            while got < n:
                if req.stop or slots[0] not in live or slots[1] not in live:
                    raise TransferError("transfer cancelled or registration released while reading")
                k = readinto(mv[got:min(n, got + _READ_CHUNK)])
                if not k:
                    raise PeerDisconnected(f"s3://{bucket}/{key}: connection closed after {got} of {n} bytes")
                got += k
            ok = True
        finally:
            if ok and raw is not None and hasattr(raw, "release_conn"):
                raw.release_conn()  # body fully read: the connection goes back to the pool
            else:
                body.close()  # drop the connection: its stream is in an unknown state

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

    def _start_multipart(self, req: _S3Request, bucket: str, key: str, u: tuple[Any, ...]) -> None:
        _k, a, n, _o, ls, rs = u
        nparts = -(-n // PART_BYTES)
        mp = _Multipart(bucket, key, nparts, ls, rs)
        r = self.client().create_multipart_upload(Bucket=bucket, Key=key)
        mp.upload_id = r["UploadId"]
        for p in range(nparts):
            o = p * PART_BYTES
            self._q.put((req, (_PART, a + o, min(PART_BYTES, n - o), o, ls, rs, mp, p)))

    def _part_done(self, req: _S3Request, mp: _Multipart, pno: int, err: BaseException | None) -> None:
        with mp.lock:
            if err is not None and mp.err is None:
                mp.err = err
            mp.left -= 1
            last = mp.left == 0
        if err is not None:
            req.stop = True  # the remaining parts of a failing upload skip themselves
        if not last:
            return
        c = None
        try:
            c = self.client()
            if mp.err is None:
                c.complete_multipart_upload(Bucket=mp.bucket, Key=mp.key, UploadId=mp.upload_id,
                                            MultipartUpload={"Parts": mp.parts})
                req.unit_done(None)
                return
        except BaseException as exc:
            mp.err = translate(exc, f"s3://{mp.bucket}/{mp.key}", self.settings.endpoint)
            mp.err.__cause__ = exc
        try:
            if c is not None:
                c.abort_multipart_upload(Bucket=mp.bucket, Key=mp.key, UploadId=mp.upload_id)
        except Exception:  # the server may be gone; its lifecycle rules clean up the parts
            log.warning("s3: could not abort multipart upload of s3://%s/%s", mp.bucket, mp.key, exc_info=True)
        req.unit_done(mp.err)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers, self._workers = self._workers, []
        for _ in workers:
            self._q.put(None)
        for t in workers:
            t.join(self.settings.read_timeout + 5.0)
        # anything still queued (behind the sentinels) fails
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                req, u = item
                if u[0] == _PART:
                    self._part_done(req, u[6], u[7], TransferError("s3 backend closed"))
                else:
                    req.unit_done(TransferError("s3 backend closed"))


def _index(idx: Any, n: int) -> np.ndarray:
    """Indices as an int64 array, bounds-checked (no negative wrap-around)."""
    a = np.atleast_1d(np.asarray(idx))
    if a.size and a.dtype.kind not in "iu":
        raise TypeError(f"indices must be integers, not {a.dtype}")
    a = a.astype(np.int64, copy=False).reshape(-1)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
        raise IndexError(f"index out of range for a list of {n}")
    return a
