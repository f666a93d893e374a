"""The south-bound contract: one small abstract class every backend implements.

Modelled on NIXL's backend engine. The agent owns registrations, peers and validation of
descriptor lists; a backend moves bytes between *prepared* lists it has accepted.

Life of a transfer::

    first post of a list pair -> backend.route(op, local, remote) -> Route (cached on the local list)
    agent.read/write          -> route.post(lidx, ridx, notify) -> Request
    agent.make_transfer       -> route.plan(lidx, ridx, notify) -> a poster built on route.post
    Transfer.status           -> Request.test()   (True when finished; raises TransferError on failure)
    Transfer.cancel           -> Request.cancel()

``Route.post`` is the only way a transfer starts; what a backend resolves once per list pair
(address arrays, native handles, the peer's connection) lives in its Route.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Protocol, Sequence

import numpy as np

from .._slots import MAX_SLOTS
from ..errors import KVXError, ProtocolError, UsageError
from ..memory import DescList, MemoryKind, Region

if TYPE_CHECKING:
    from ..config import AgentConfig

__all__ = ["BAD_INDEX", "Backend", "BackendContext", "CallRoute", "DoneRequest", "ErrorMap", "FlatRoute", "JobRequest",
           "Op", "PeerInfo", "PreparedList", "Request", "Route", "ThreadRequest", "index_array", "index_vector",
           "indices", "native_form", "piece_index", "region_rows", "validate"]

_U64 = np.uint64
_I64 = np.dtype(np.int64)

log = logging.getLogger(__name__)


class Op(enum.Enum):
    """Direction of a transfer, seen from the initiator's local list."""

    READ = "read"  # remote -> local
    WRITE = "write"  # local -> remote


@dataclass(frozen=True, slots=True)
class BackendContext:
    """What the agent hands each backend it creates."""

    agent_name: str
    agent_id: str
    config: "AgentConfig"
    #: deliver(peer_name, message) queues a notification for the user.
    deliver: Callable[[str, bytes], None]
    #: lookup(addr_array, nbytes_array, kind) -> (region slot array, ok mask): validates local
    #: descriptors against the agent's live registrations (used by two-sided targets).
    validate_local: Callable[[MemoryKind, np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    #: current local registrations table (for one-sided publication).
    regions: Callable[[], dict[int, tuple[Region, int]]]
    #: this backend's options (an instance of its ``Options`` class), or None if it has none.
    options: Any = None


@dataclass(slots=True)
class PeerInfo:
    """A peer as the agent knows it: its name, id, and each backend's metadata section."""

    name: str
    agent_id: str
    sections: dict[str, Any]
    regions: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    # (kind, addr, nbytes, dev, slot, generation) per live registration region


class PreparedList(Protocol):
    """What a backend may read of a prepared list (``kvx.PreparedList`` is the agent's).

    ``descs`` are the descriptors, ``peer`` the peer's name (None: local), ``slots`` per
    descriptor the registration slot that contains it, ``gens`` each used slot's generation at
    prepare time, ``used`` the distinct slots. ``bdata[name]`` holds what backend ``name``
    returned from its :meth:`Backend.prepare` for this list.
    """

    descs: DescList
    peer: str | None
    slots: np.ndarray
    gens: dict[int, int]
    used: np.ndarray
    bdata: dict[str, Any]

    @property
    def kind(self) -> MemoryKind: ...

    def __len__(self) -> int: ...


def validate(
    kind: MemoryKind,
    addr: np.ndarray,
    nbytes: np.ndarray,
    dev: np.ndarray,
    table: Sequence[tuple[int, int, int, int, int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """Find, for each descriptor, the live region that contains it.

    ``table`` rows are ``(kind, addr, nbytes, dev, slot, gen)``. Returns ``(slots, ok)``:
    the containing region's slot per descriptor (-1 where none) and a boolean mask.
    Vectorized: per device one ``searchsorted`` over the region starts.
    """
    n = addr.shape[0]
    slots = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return slots, np.ones(0, dtype=bool)
    rows = [r for r in table if r[0] == int(kind)]
    if not rows:
        return slots, np.zeros(n, dtype=bool)
    end = addr + nbytes
    wrap = end < addr
    if kind in (MemoryKind.FILE, MemoryKind.OBJECT):
        # dev is the slot; regions start at offset 0
        size = np.zeros(MAX_SLOTS, dtype=_U64)
        for r in rows:
            size[r[4]] = r[2]
        inrange = dev < MAX_SLOTS
        d = np.where(inrange, dev, 0).astype(np.int64)
        ok = inrange & (size[d] > 0) & (end <= size[d]) & ~wrap
        slots[ok] = d[ok]
        return slots, ok
    ok = np.zeros(n, dtype=bool)
    bydev: dict[int, list[tuple[int, int, int, int, int, int]]] = defaultdict(list)
    for r in rows:
        bydev[r[3]].append(r)
    devs = list(bydev)
    for dv in devs:
        rs = sorted(bydev[dv], key=lambda r: r[1])
        starts = np.array([r[1] for r in rs], dtype=_U64)
        ends = np.array([r[1] + r[2] for r in rs], dtype=_U64)
        rslot = np.array([r[4] for r in rs], dtype=np.int64)
        sel = dev == dv if len(devs) > 1 or dv != 0 else slice(None)
        a = addr[sel]
        i = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
        good = (i >= 0)
        ic = np.where(good, i, 0)
        good &= (a >= starts[ic]) & (end[sel] <= ends[ic]) & ~wrap[sel]
        if isinstance(sel, slice):
            ok = good & (dev == dv)
            slots = np.where(ok, rslot[ic], -1)
        else:
            ok[sel] = good
            slots[sel] = np.where(good, rslot[ic], -1)
    return slots, ok


class ErrorMap:
    """A backend's one table from native, OS and library errors to the kvx tree, applied at its
    boundary (as httpx maps its transports' errors): ``errors(exc, where)`` gives the kvx error,
    ``with errors.mapped(where):`` raises it from ``exc`` (the cause is kept).

    Parameters
    ----------
    rules
        ``(exception types, errno codes or None, factory(exc, where) -> KVXError)``, tried in order:
        the first whose types match (and, for an OSError, whose errno is in the codes; None: any)
        makes the error. A KVXError passes through unchanged.
    default
        ``factory(exc, where)`` for an error no rule matches.
    keep
        kvx errors that pass through unchanged (default: every KVXError); others go through the rules.
    """

    __slots__ = ("default", "keep", "rules")

    def __init__(self, *rules: tuple[Any, frozenset[int] | None, Callable[[Any, Any], BaseException]],
                 default: Callable[[Any, Any], BaseException], keep: Any = KVXError) -> None:
        self.rules = rules
        self.default = default
        self.keep = keep

    def __call__(self, exc: BaseException, where: Any = None) -> Any:
        if isinstance(exc, self.keep):
            return exc
        code = getattr(exc, "errno", None)
        for types, codes, make in self.rules:
            if isinstance(exc, types) and (codes is None or code in codes):
                return make(exc, where)
        return self.default(exc, where)

    @contextlib.contextmanager
    def mapped(self, where: Any = None) -> Iterator[None]:
        """Raise what the table makes of any non-kvx exception inside the block."""
        try:
            yield
        except Exception as exc:
            err = self(exc, where)
            if err is exc:
                raise
            raise err from exc


def region_rows(rows: Any, what: str = "region table") -> list[tuple[int, int, int, int, int, int]]:
    """Check a peer's region rows (``(kind, addr, nbytes, dev, slot, gen)``, from its metadata or a
    refresh) and return them as tuples; ``ProtocolError`` for anything else."""
    if not isinstance(rows, list):
        raise ProtocolError(f"malformed {what}")
    out = []
    for r in rows:
        if (not isinstance(r, list) or len(r) != 6
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 64) for x in r)):
            raise ProtocolError(f"malformed region row in the {what}")
        if r[0] not in (0, 1, 2, 3) or not 0 < r[4] < MAX_SLOTS:
            raise ProtocolError(f"region row with unknown kind or slot in the {what}")
        out.append(tuple(r))
    return out  # type: ignore[return-value]


class Request(ABC):
    """A posted transfer inside a backend."""

    nbytes: int = 0

    @abstractmethod
    def test(self) -> bool:
        """Return True when finished; raise a TransferError subclass if it failed."""

    def cancel(self) -> bool:
        """Try to stop it; return True if it will not complete. Default: cannot."""
        return False

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when finished (raises on failure)."""
        deadline = time.monotonic() + timeout
        delay = 1e-5
        while not self.test():
            now = time.monotonic()
            if now >= deadline:
                return False
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 2e-3)
        return True


class DoneRequest(Request):
    """A request that completed while it was posted (small inline transfers)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def test(self) -> bool:
        return True

    def wait(self, timeout: float) -> bool:
        return True


class ThreadRequest(Request):
    """A request completed by another thread calling :meth:`finish`."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._ev = threading.Event()
        self._err: BaseException | None = None
        self.cancelled = False

    def finish(self, err: BaseException | None = None) -> None:
        if not self._ev.is_set():
            self._err = err
            self._ev.set()

    def test(self) -> bool:
        if not self._ev.is_set():
            return False
        if self._err is not None:
            raise self._err
        return True

    def cancel(self) -> bool:
        self.cancelled = True
        return not self._ev.is_set()

    def wait(self, timeout: float) -> bool:
        if not self._ev.wait(timeout):
            return False
        return self.test()


class JobRequest(Request):
    """A request over a native ``kvx._native.Job``.

    ``where`` names what the job touches (a peer, files) for error messages; ``translate(exc,
    where)`` maps the job's OSError to a TransferError; ``after`` runs once when the job is
    seen finished successfully (a notification, say).
    """

    __slots__ = ("_fired", "after", "job", "nbytes", "translate", "where")

    def __init__(self, job: Any, where: Any, translate: Callable[[OSError, Any], Exception],
                 after: Callable[[], None] | None = None) -> None:
        self.job = job
        self.nbytes = int(job.nbytes)
        self.where = where
        self.translate = translate
        self.after = after
        self._fired = False

    def _done(self) -> None:
        if not self._fired:
            self._fired = True
            if self.after is not None:
                self.after()

    def test(self) -> bool:
        try:
            ok = self.job.test()
        except OSError as exc:
            raise self.translate(exc, self.where) from exc
        if ok:
            self._done()
        return bool(ok)

    def wait(self, timeout: float) -> bool:
        try:
            ok = self.job.wait(timeout)
        except OSError as exc:
            raise self.translate(exc, self.where) from exc
        if ok:
            self._done()
        return bool(ok)

    def cancel(self) -> bool:
        self.job.cancel()
        return True


def indices(idx: Any) -> Any:
    """Normalise an index argument for the native layer: a list, tuple or int passes through,
    anything else becomes a contiguous int64 array. Raises UsageError for non-integer input."""
    t = type(idx)
    if t is list or t is int or t is tuple:
        return idx
    if t is np.ndarray and idx.dtype is _I64 and idx.ndim == 1 and idx.flags.c_contiguous:
        return idx
    if isinstance(idx, (list, tuple)):
        return idx
    if isinstance(idx, np.integer):
        return int(idx)
    a = np.asarray(idx)
    if a.dtype.kind not in "iu":
        raise UsageError(f"indices must be integers, not {a.dtype}")
    if a.dtype != np.int64:
        if a.size and a.dtype.kind == "u" and int(a.max()) >= (1 << 63):
            raise UsageError("index out of range")
        a = a.astype(np.int64)
    return np.ascontiguousarray(a.reshape(-1))


def native_form(idx: Any) -> bool:
    """Whether the native layers take ``idx`` as it is: an int, a list, or a C-contiguous array of
    64-bit integers. A native refusal of such a form is a bad value (the caller's error); another
    form is converted once (:func:`indices`) and posted again."""
    t = type(idx)
    if t is list or t is int:
        return True
    return t is np.ndarray and idx.dtype.itemsize == 8 and idx.dtype.kind in "iu" and idx.flags.c_contiguous


def index_vector(idx: Any) -> np.ndarray:
    """``idx`` (an int, a sequence or an integer array) as a contiguous 1-D int64 array; UsageError
    for non-integer input. Bounds are the caller's (or the native layer's) to check."""
    if type(idx) is int:
        return np.array([idx], dtype=np.int64)
    a = np.atleast_1d(np.asarray(idx))
    if a.size and a.dtype.kind not in "iu":
        raise UsageError(f"indices must be integers, not {a.dtype}")
    if a.dtype.kind == "u" and a.size and int(a.max()) >= (1 << 63):
        raise UsageError("index out of range")
    return np.ascontiguousarray(a.astype(np.int64, copy=False).reshape(-1))


def paired_nbytes(li: np.ndarray, ri: np.ndarray, lnb: np.ndarray, rnb: np.ndarray) -> np.ndarray:
    """The byte counts of a transfer's block pairs: ``lnb[li]``, after checking that the index
    lists have one length, that every index lies in its list (``lnb``/``rnb`` are the lists'
    sizes) and that each pair's blocks have one size (else UsageError). ``li``/``ri``: int64
    vectors (``index_vector``). The one check of a transfer's indices where no native post makes
    it (ucx's batches, the host backend's AF_UNIX path)."""
    if li.shape != ri.shape:
        raise UsageError(f"index lists differ in length ({li.shape[0]} local, {ri.shape[0]} remote)")
    if li.size and (int(li.min()) < 0 or int(li.max()) >= lnb.shape[0]
                    or int(ri.min()) < 0 or int(ri.max()) >= rnb.shape[0]):
        raise UsageError("bad transfer request: index out of range")
    n = lnb[li]
    if not np.array_equal(n, rnb[ri]):
        raise UsageError("bad transfer request: local and remote blocks differ in size")
    return n


def index_array(idx: Any, n: int, what: str = "index") -> np.ndarray:
    """``idx`` as a checked int64 array of positions in a list of ``n`` descriptors (UsageError if not)."""
    try:
        a = index_vector(idx)
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"bad {what}: {exc}") from None
    if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
        raise UsageError(f"{what} out of range for a list of {n} descriptors")
    return a


class Route(ABC):
    """A backend's resolved state for one ``(op, local list, remote list)``.

    :meth:`Backend.route` makes it once per list pair (the agent keeps it on the local list);
    :meth:`post` is the only way a transfer starts. ``lidx``/``ridx`` arrive as the user passed
    them; a route raises :class:`~kvx.errors.UsageError` for a bad index, a length mismatch or
    unequal descriptor sizes, and returns a :class:`Request` (a :class:`DoneRequest` when the
    work finished while posting). The agent has checked the registrations' liveness, the open
    agent and the peer's incarnation before each call.
    """

    __slots__ = ("backend", "local", "op", "remote")

    def __init__(self, backend: "Backend", op: Op, local: "PreparedList", remote: "PreparedList") -> None:
        self.backend = backend
        self.op = op
        self.local = local
        self.remote = remote

    @abstractmethod
    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> "Request":
        """Start moving ``local[lidx]`` <-> ``remote[ridx]``; must not block for long."""

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], "Request"]:
        """A zero-argument function that posts this transfer (each call posts once).

        The default checks the indices now and posts through :meth:`post`; a route may do the
        descriptor work once instead.
        """
        li = index_array(lidx, len(self.local), "local index")
        ri = index_array(ridx, len(self.remote), "remote index")
        if li.shape != ri.shape:
            raise UsageError(f"index lists differ in length ({li.shape[0]} local, {ri.shape[0]} remote)")
        post = self.post
        return lambda: post(li, ri, notify)


#: what index checks (numpy's and the native layer's) raise; OverflowError: an int past 64 bits
BAD_INDEX = (IndexError, ValueError, TypeError, OverflowError)


class CallRoute(Route):
    """The route of a backend with no per-pair state: each post calls the backend's
    ``_post(op, local, lidx, remote, ridx, notify) -> Request`` with normalised indices, and
    the index errors of its checks become UsageError here, at the boundary."""

    __slots__ = ()

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        try:
            return self.backend._post(self.op, self.local, indices(lidx), self.remote,  # type: ignore[attr-defined, no-any-return]
                                      indices(ridx), notify)
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None


def piece_index(idx: Any, first: np.ndarray, count: np.ndarray, what: str = "index") -> np.ndarray:
    """Positions, in a strided list's expansion (:meth:`kvx.DescList.flatten`), of the pieces of
    descriptors ``idx``, in order: descriptor ``i``'s pieces are ``first[i] .. first[i] +
    count[i] - 1``. ``first``/``count`` are int64 arrays; UsageError for a bad index."""
    a = index_array(idx, first.shape[0], what)
    c = count[a]
    n = int(c.sum())
    if n == a.size:  # one piece each
        return first[a]
    start = np.repeat(first[a] - (np.cumsum(c) - c), c)
    return start + np.arange(n, dtype=np.int64)


class FlatRoute(Route):
    """A route over strided lists through a backend that moves plain descriptors only: posts the
    inner route (made on the lists' expansions) with every index expanded into its pieces
    (:func:`piece_index`, vectorised). The agent makes it; correctness first, one descriptor per
    piece on the wire."""

    __slots__ = ("_inner", "_lmap", "_rmap")

    def __init__(self, inner: Route, local: "PreparedList", remote: "PreparedList",
                 lmap: tuple[np.ndarray, np.ndarray] | None, rmap: tuple[np.ndarray, np.ndarray] | None) -> None:
        super().__init__(inner.backend, inner.op, local, remote)
        self._inner, self._lmap, self._rmap = inner, lmap, rmap

    def _expand(self, lidx: Any, ridx: Any) -> tuple[Any, Any]:
        if self._lmap is not None:
            lidx = piece_index(lidx, *self._lmap, what="local index")
        if self._rmap is not None:
            ridx = piece_index(ridx, *self._rmap, what="remote index")
        return lidx, ridx

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        li, ri = self._expand(lidx, ridx)
        return self._inner.post(li, ri, notify)

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        li, ri = self._expand(lidx, ridx)
        return self._inner.plan(li, ri, notify)


class Backend(ABC):
    """A way of moving bytes. Subclasses set the class attributes and implement the methods.

    Attributes
    ----------
    name
        Registry name (``"host"``, ``"tcp"``, ...).
    kinds
        Memory kinds this backend can serve on either side.
    remote
        Whether it reaches other agents.
    local
        Whether it serves loopback transfers within one agent (storage backends).
    notifications
        Whether it carries notifications to peers.
    strided
        Whether :meth:`prepare` and :meth:`route` may be given strided lists (see
        :meth:`takes_strided`); a backend without it only ever sees their expansion.
    Options
        Its options: a frozen dataclass whose fields default to ``KVX_*`` settings
        (``kvx.config.option``), or None. The agent passes the user's instance (from
        ``AgentConfig.options[name]``) or a default one as ``ctx.options``; a backend reads its
        knobs there, not from the environment or module globals.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[frozenset[MemoryKind]] = frozenset()
    remote: ClassVar[bool] = False
    local: ClassVar[bool] = False
    notifications: ClassVar[bool] = False
    strided: ClassVar[bool] = False
    Options: ClassVar[type | None] = None

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx

    # ---- capability ------------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (a missing dependency, no device), or None."""
        return None

    def takes_strided(self, plist: "PreparedList") -> bool:
        """Whether this strided list goes to :meth:`prepare` as it is (True) or expanded into its
        pieces (False: the agent prepares the expansion instead, and posts through a
        :class:`FlatRoute`). Only asked where :attr:`strided` is set; by default every list."""
        return self.strided

    def serves(self, local: MemoryKind, remote: MemoryKind, loopback: bool) -> bool:
        """Whether a transfer between these kinds can go through this backend."""
        if loopback and not self.local:
            return False
        if not loopback and not self.remote:
            return False
        return local in self.kinds and remote in self.kinds

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        """Accept a region (published as ``slot`` at generation ``gen``); return a private handle.

        Raise RegistrationError if the backend cannot serve it.
        """
        return None

    def deregister(self, region: Any, handle: Any) -> None:
        """Forget a region; after return no peer reaches it through this backend."""

    # ---- peers -----------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any] | None:
        """This backend's section of the agent's metadata (msgpack-able), or None."""
        return None

    def connect(self, peer: PeerInfo) -> bool:
        """Make ``peer`` reachable; return False if this backend cannot reach it."""
        return False

    def disconnect(self, peer_name: str) -> None:
        """Drop a peer; pending transfers to it fail with PeerDisconnected."""

    def refresh_regions(self, peer_name: str) -> list[tuple[int, int, int, int, int, int]] | None:
        """The peer's current live regions ``(kind, addr, nbytes, dev, slot, gen)``, or None.

        Called by ``prepare`` when a descriptor is outside the regions the peer's metadata
        listed (the peer may have registered more since). Default: cannot refresh.
        """
        return None

    def prepare(self, plist: "PreparedList") -> Any:
        """Per-backend preparation of a validated list (e.g. address translation); may return None."""
        return None

    # ---- transfers -------------------------------------------------------------------------
    @abstractmethod
    def route(self, op: Op, local: "PreparedList", remote: "PreparedList") -> Route:
        """This backend's :class:`Route` for a list pair it serves (called once per pair).

        Raise a kvx error if the pair cannot be served (e.g. the peer is not connected).
        """

    def notify(self, peer_name: str, message: bytes) -> None:
        """Send a notification to a peer (backends with ``notifications = True``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything; pending requests fail."""
