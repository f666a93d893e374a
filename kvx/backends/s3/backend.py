"""The s3 backend: registration of objects, posting transfers as units of work for its
thread pool (whole-object PUTs, multipart uploads, ranged GETs), release and shutdown."""

from __future__ import annotations

import http.client
import importlib.util
import logging
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import (
    AuthError,
    PeerDisconnected,
    RegistrationError,
    RemoteError,
    TransferError,
    UsageError,
)
from ...memory import MemoryKind, Region
from ..base import Backend, BackendContext, CallRoute, DoneRequest, Op, Request, Route

if TYPE_CHECKING:
    from ..base import PreparedList


from .errors import _AUTH_CODES, translate
from .lean import _READ_CHUNK, LeanPath, _LeanEndpoint, _MemReader, _view
from .settings import S3Options, make_client, settings_from_env

log = logging.getLogger(__name__)

#: Objects larger than this are written by multipart upload and read by parallel ranged GETs.
MULTIPART_THRESHOLD = 16 << 20
#: Part size of multipart uploads and of split reads (S3 needs parts >= 5 MiB but the last).
PART_BYTES = 8 << 20
#: ClientError codes that mean the credentials were refused.

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
_PUT, _MPU, _PART, _GET = 0, 1, 2, 3


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



class S3Backend(LeanPath, Backend):
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
    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        return CallRoute(self, op, local, remote)

    def _post(self, op: Op, local: "PreparedList", lidx: Any, remote: "PreparedList", ridx: Any,
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
