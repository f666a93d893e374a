"""``ucx``: host and GPU memory between agents on any nodes, through UCX (UCP).

UCX comes from the ``libucx-cu12``/``libucx-cu13`` wheels (``pip install kvx[ucx]``); the native
half is ``kvx._ucx`` (``native/kvx_ucx.c``). Transports are UCX's choice (``UCX_TLS``): RDMA
(rc/dc/ud, with GPUDirect where the NIC allows it), cuda_ipc/cuda_copy, tcp, shared memory.

Design (see ``docs/networking.md``):

- **One-sided data path.** Each registration is mapped with ``ucp_mem_map`` and its remote key
  packed once; the metadata section carries this worker's UCP address and the packed key of
  every live registration. A peer unpacks the keys it needs at ``prepare`` (after the agent
  validated the descriptors against the registrations this agent published) and posts a whole
  transfer's index list in one native call: a ``ucp_put_nbx``/``ucp_get_nbx`` per descriptor
  pair (``UCP_OP_ATTR_FLAG_MULTI_SEND``), then one ``ucp_ep_flush_nbx`` whose completion is
  the transfer's completion. :data:`UCX_DEFAULTS` (``RNDV_THRESH=inf``, as NIXL sets it) makes
  UCX put over ``tcp`` with the transport's own put instead of software emulation. A
  :class:`_UcxRoute` holds what one list pair needs (the agent keeps it per pair).
- **Batched active messages.** Where UCX has no one-sided transport (tcp, its shared-memory
  FIFOs) it would emulate each put/get with an active message; there HOST-to-HOST transfers
  go as a few large active messages instead (:attr:`UcxOptions.batch`), posted in the same one
  native call; the target checks every block against its registrations and the sender's
  cookie from the authenticated handshake, then lands or serves it (``docs/networking.md``).
- **Control channel.** UCX active messages carry a small msgpack protocol: ``hello`` /
  ``challenge`` / ``auth`` / ``welcome`` (the HMAC handshake of :mod:`kvx.auth`, so the target
  knows who its peers are and has an endpoint back to each), then *sealed* messages: each
  carries a sequence number and, with ``auth_token``, an HMAC under a per-session key (a peer
  without the token can neither forge nor replay notifications, revocations or acks).
- **Release.** ``deregister`` on the target sends ``revoke`` to every connected peer; a peer
  stops posting to that registration, flushes its endpoint (operations already posted
  complete), destroys the remote key and acknowledges; the target waits for the
  acknowledgements (bounded by ``peer_timeout``) and then unmaps the memory, which destroys the
  key (on RDMA the NIC refuses it from then on).
- **Failure bounds.** Endpoints use UCX's peer error handling: a dead or cut-off peer fails
  the endpoint and its pending transfers with :class:`~kvx.errors.PeerDisconnected`; an
  endpoint with pending work that completes nothing for ``peer_timeout`` seconds is failed the
  same way (this bound, not UCX's keepalive, is what fails a cut link's transfers in time).
- **Progress.** A native thread progresses the worker and sleeps on its event fd (no busy
  core when idle); a Python service thread handles control messages.
- **Same-node host memory.** Where the peer runs on this host and ``UCX_TLS`` allows shared
  memory, HOST-to-HOST transfers go through kvx's same-node engine (the ``host`` backend's, held
  inside this one: :attr:`UcxOptions.samenode`) instead of UCX's one kernel copy per block:
  batched ``process_vm_writev``/``readv`` over copy threads, or shared mappings of
  ``alloc_host`` memory; the peer's pid is the one the kernel names for its AF_UNIX listener
  and every copy is checked against the control table that process shares. UCX still carries
  CUDA memory, notifications and every peer on another host (or whose listener is out of
  reach, e.g. in another network namespace).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import auth, wire
from .. import config as _cfg
from .._slots import BOOT_ID, MAX_SLOTS
from ..errors import (
    AuthError,
    BackendUnavailable,
    KVXError,
    PeerDisconnected,
    ProtocolError,
    RegistrationError,
    RemoteError,
    TransferError,
    TransferTimeout,
    UsageError,
)
from ..memory import MemoryKind, Region
from .base import (
    BAD_INDEX,
    Backend,
    BackendContext,
    DoneRequest,
    Op,
    PeerInfo,
    PreparedList,
    Request,
    Route,
    index_vector,
    paired_nbytes,
    region_rows,
)
from .host import HostBackend

__all__ = ["UcxBackend", "UcxOptions", "INSTALL_HINT", "load"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install kvx[ucx] (the libucx-cu12 wheel; libucx-cu13 for CUDA 13), then reinstall kvx"
_U64 = np.uint64
#: Most unauthenticated handshakes a target keeps at once.
MAX_HANDSHAKES = 32
#: Sequence numbers a receiver remembers per session (replay window).
_WINDOW = 1 << 16

_mod: Any = None
_why: str | None = None


def load() -> Any:
    """Import ``kvx._ucx`` (loading the libucx wheel's libraries first); raise BackendUnavailable."""
    global _mod, _why
    if _mod is not None:
        return _mod
    if _why is not None:
        raise BackendUnavailable(_why)
    # UCX logs to stdout by default, which corrupts programs that speak a protocol on stdout:
    # unless the user chose a destination, its log goes to stderr (read once, when UCX loads)
    os.environ.setdefault("UCX_LOG_FILE", "stderr")
    try:
        import libucx  # type: ignore[import-not-found]

        libucx.load_library()
    except ImportError:
        pass  # a system UCX may still satisfy kvx._ucx's link
    except OSError as exc:  # pragma: no cover - broken wheel
        _why = f"the libucx wheel's libraries do not load ({exc}); {INSTALL_HINT}"
        raise BackendUnavailable(_why) from exc
    try:
        from .. import _ucx  # type: ignore[attr-defined]
    except ImportError as exc:
        import importlib.util

        if importlib.util.find_spec("libucx") is not None:
            _why = (f"kvx._ucx is not built ({exc}): reinstall kvx with the libucx wheel present "
                    "(pip install -e . after pip install libucx-cu12)")
        else:
            _why = f"UCX is not installed: {INSTALL_HINT}"
        raise BackendUnavailable(_why) from exc
    _mod = _ucx
    return _mod


#: UCX settings the backend changes from UCX's own defaults (``UCX_<NAME>`` in the environment or
#: :attr:`UcxOptions.ucx` override them). ``RNDV_THRESH=inf`` (NIXL's UCX backend sets the
#: same): with UCX's default threshold, puts where UCX emulates RMA over active messages (tcp)
#: ran several times slower (docs/history.md, "What limited writes").
#: ``MAX_RMA_RAILS=2`` (UCX: 1; its rendezvous already takes 2) with ``MIN_RMA_CHUNK_SIZE=256K``
#: (UCX: 8K): a put of 512 KiB or more is striped over two devices where two reach the peer (two
#: NICs; on one host, ``lo`` and ``eth0``), smaller ones stay whole: 2 MiB writes over tcp ~1.2x
#: faster on the test machine, 32-256 KiB unchanged (split into 16 KiB halves, 32 KiB writes
#: were ~0.75x).
UCX_DEFAULTS: tuple[tuple[str, str], ...] = (("RNDV_THRESH", "inf"), ("MAX_RMA_RAILS", "2"),
                                             ("MIN_RMA_CHUNK_SIZE", "256K"))
#: Over a kernel copy (cma/knem/xpmem), transfers of fewer blocks than this go one-sided even
#: where ``UcxOptions.batch`` would batch them (see ``_UcxRoute``).
FEW_BLOCKS = 8


@dataclass(frozen=True, slots=True)
class UcxOptions:
    """Settings of the ucx backend, passed as ``AgentConfig(options={"ucx": UcxOptions(...)})``.

    The fields named with a ``KVX_*`` variable take their defaults from it when the object is
    made. The peer timeout (seconds without progress after which a peer with pending work is
    declared gone; UCX's own keepalive stays as UCX sets it), the handshake timeout and the
    shared secret are the agent's (``AgentConfig.peer_timeout``, ``handshake_timeout``,
    ``auth_token``), as for every backend.

    Attributes
    ----------
    ucx
        Extra UCX settings as ``(name, value)`` pairs without the ``UCX_`` prefix (applied after
        the environment, e.g. ``(("TLS", "tcp"),)``); the environment's ``UCX_*`` apply too.
    batch
        How HOST-to-HOST transfers travel: as a few batched active messages (many blocks per
        message, validated and landed by the target) or as one UCX put/get per block.
        ``"auto"``: batched where the peer's endpoint has no RDMA or GPU transport (rc, dc,
        cuda_ipc, gdr_copy) and the list pair's largest block is at most
        :attr:`batch_max_block`; reads over transports without any one-sided operation (tcp,
        where UCX emulates each get with a software round trip) at every block size.
        ``"always"``/``"never"`` force one way. CUDA memory always goes one-sided.
    batch_bytes, batch_read_bytes
        The most bytes one batched write / one batched read answer carries (a larger block
        travels alone in a write; a read asks for it in pieces of at most
        ``batch_read_bytes``). Read answers stay within one zero-copy segment of UCX's tcp
        transport: a larger answer is sent in 8 KiB copied fragments.
    batch_max_block
        See :attr:`batch`: above it, writes go as UCX's zero-copy puts (over tcp they land
        straight from the socket, where a batch is copied once more at the target) and, over
        cma/knem/xpmem, reads and writes as the kernel's one-sided copies.
    stage
        CUDA memory through pinned staging slots (:mod:`kvx.backends.ucx_staged`): ``auto``
        where ``UCX_TLS`` names no transport with device RMA, ``always``, ``never``, or ``host``
        (host memory too: tests without a GPU) (``KVX_UCX_STAGE``).
    stage_bytes
        Bytes per staging slot (``KVX_UCX_STAGE_BYTES``).
    stage_slots
        Staging slots per peer and direction (``KVX_UCX_STAGE_SLOTS``).
    stage_min
        Transfers of fewer bytes take one UCX operation per block even where staging is chosen
        (a staged chunk costs a few thread hand-offs and two kernel launches; 0 = stage all)
        (``KVX_UCX_STAGE_MIN``).
    samenode
        HOST-to-HOST transfers with a peer on this host, while ``UCX_TLS`` allows shared memory:
        ``"host"`` through kvx's same-node engine (the module docstring), ``"ucx"`` through UCX
        like any other (one kernel copy per block over cma) (``KVX_UCX_SAMENODE``).
    """

    ucx: tuple[tuple[str, str], ...] = ()
    batch: str = "auto"
    batch_bytes: int = 1 << 20
    batch_read_bytes: int = (64 << 10) - 64
    batch_max_block: int = 16 << 10
    stage: str = _cfg.option("KVX_UCX_STAGE")
    stage_bytes: int = _cfg.option("KVX_UCX_STAGE_BYTES")
    stage_slots: int = _cfg.option("KVX_UCX_STAGE_SLOTS")
    stage_min: int = _cfg.option("KVX_UCX_STAGE_MIN")
    samenode: str = _cfg.option("KVX_UCX_SAMENODE")

    def __post_init__(self) -> None:
        if self.batch not in ("auto", "always", "never"):
            raise UsageError(f"UcxOptions.batch must be 'auto', 'always' or 'never', not {self.batch!r}")
        if not 0 < self.batch_bytes <= (64 << 20) or not 0 < self.batch_read_bytes <= (64 << 20):
            raise UsageError("UcxOptions.batch_bytes and batch_read_bytes must be 1 B to 64 MiB")
        _cfg.check_options(self)

    def worker_settings(self) -> list[tuple[str, str]]:
        """UCX settings for the worker: :data:`UCX_DEFAULTS` where neither the environment
        (``UCX_<NAME>``) nor :attr:`ucx` names them, then :attr:`ucx`."""
        named = {k.upper() for k, _ in self.ucx}
        base = [(k, v) for k, v in UCX_DEFAULTS if k not in named and f"UCX_{k}" not in os.environ]
        return base + list(self.ucx)


# ---- errors ---------------------------------------------------------------------------------
def _translate(exc: OSError, where: str) -> TransferError:
    """One table from UCS status codes to kvx errors."""
    m = _mod
    code = exc.errno if isinstance(exc.errno, int) else 0
    text = exc.strerror or str(exc)
    if m is not None and code == m.ERR_INVALID_ADDR:
        return RemoteError(f"{where}: the target refused a batch (outside its live registrations)")
    if m is not None and code == m.ERR_MESSAGE_TRUNCATED:
        return RemoteError(f"{where}: the target answered a batch with the wrong number of bytes")
    if m is not None and code == m.ERR_ENDPOINT_TIMEOUT:
        return PeerDisconnected(f"{where}: no progress within the peer timeout (dead or cut off)")
    if m is not None and code in (m.ERR_CANCELED, m.ERR_CONNECTION_RESET, m.ERR_UNREACHABLE,
                                  m.ERR_NOT_CONNECTED, m.ERR_REJECTED, m.ERR_IO_ERROR):
        return PeerDisconnected(f"{where}: {text}")
    if m is not None and code == m.ERR_TIMED_OUT:
        return TransferTimeout(f"{where}: {text}")
    return TransferError(f"{where}: {text}")


class _UcxRequest(Request):
    __slots__ = ("nbytes", "where", "x")

    def __init__(self, x: Any, where: str) -> None:
        self.x = x
        self.nbytes = int(x.nbytes)
        self.where = where

    def test(self) -> bool:
        try:
            return bool(self.x.test())
        except OSError as exc:
            raise _translate(exc, self.where) from exc

    def wait(self, timeout: float) -> bool:
        try:
            return bool(self.x.wait(timeout))
        except OSError as exc:
            raise _translate(exc, self.where) from exc


# ---- sessions -------------------------------------------------------------------------------
class _Session:
    """The sealed channel between this agent and one peer in one role."""

    def __init__(self, key: bytes | None) -> None:
        self.key = key
        self.send_seq = 0
        self.top = 0
        self.seen: set[int] = set()

    def seal(self, me: str, role: str, body: bytes) -> bytes:
        self.send_seq += 1
        seq = self.send_seq
        mac = b"" if self.key is None else _mac(self.key, me, role, seq, body)
        return wire.pack("s", **{"from": me, "r": role, "seq": seq, "body": body, "mac": mac})

    def open(self, msg: dict[str, Any]) -> bytes | None:
        """The body of a sealed message if it is authentic and fresh, else None."""
        seq, body = msg["seq"], msg["body"]
        if self.key is not None and not hmac.compare_digest(_mac(self.key, msg["from"], msg["r"], seq, body),
                                                            msg["mac"]):
            return None
        if seq <= self.top - _WINDOW or seq in self.seen or seq <= 0:
            return None
        self.seen.add(seq)
        if seq > self.top:
            self.top = seq
        if len(self.seen) > 2 * _WINDOW:
            floor = self.top - _WINDOW
            self.seen = {s for s in self.seen if s > floor}
        return body  # type: ignore[no-any-return]


def _mac(key: bytes, sender: str, role: str, seq: int, body: bytes) -> bytes:
    return hmac.new(key, f"{sender}|{role}|{seq}|".encode() + body, hashlib.sha256).digest()


def _session_key(token: str | None, nonce: bytes, client_id: str, server_id: str) -> bytes | None:
    if not token:
        return None
    return hmac.new(token.encode(), b"kvx-ucx-session|" + nonce + client_id.encode() + b"|" + server_id.encode(),
                    hashlib.sha256).digest()


class _Peer:
    """A target this agent reaches (initiator role)."""

    def __init__(self, name: str, agent_id: str, ep: int) -> None:
        self.name = name
        self.id = agent_id
        self.ep = ep
        self.session: _Session | None = None
        self.packed: dict[int, tuple[int, bytes]] = {}  # slot -> (gen, packed rkey)
        self.rkeys: dict[int, tuple[int, int]] = {}  # slot -> (gen, unpacked rkey handle)
        self.rgen = np.zeros(MAX_SLOTS, dtype=np.int64)  # gen of the live unpacked rkey per slot
        self.dead: str | None = None
        self.peer_errors = True  # the endpoint has UCX's peer failure handling
        self.cookie = 0  # the target's batch cookie for us (0: it takes no batched messages)
        self.rma = 2  # 0: no one-sided transport; 1: a kernel copy (cma/knem/xpmem); 2: RDMA/GPU


class _Client:
    """An initiator that reaches this agent (target role)."""

    def __init__(self, name: str, agent_id: str, ep: int, nonce: bytes, started: float) -> None:
        self.name = name
        self.id = agent_id
        self.ep = ep
        self.nonce = nonce
        self.started = started
        self.session: _Session | None = None  # set once authenticated
        self.cookie = 0  # the batch cookie given to it at welcome


@dataclass(slots=True)
class _Prep:
    addr: np.ndarray
    nbytes: np.ndarray
    handle: np.ndarray  # memh (local) or rkey (remote) per descriptor
    used: np.ndarray  # slots used
    gens: np.ndarray  # their generations
    slot: np.ndarray  # per descriptor: its registration's slot (uint64)
    gen: np.ndarray  # per descriptor: that registration's generation (uint64)
    host: bool  # HOST memory


class _UcxRoute(Route):
    """A list pair resolved once: both prepared sides (address, size and handle arrays, the
    slots and generations under them), the peer and the native post."""

    __slots__ = ("_am", "_bb", "_few", "_lp", "_ok", "_peer", "_rd", "_rp", "_split")

    def __init__(self, backend: "UcxBackend", op: Op, local: PreparedList, remote: PreparedList) -> None:
        super().__init__(backend, op, local, remote)
        self._lp: _Prep = local.bdata[backend.name]
        self._rp: _Prep = remote.bdata[backend.name]
        self._peer = backend._live_peer(remote.peer)
        self._rd = 1 if op is Op.READ else 0
        o = backend.opts
        big = int(self._lp.nbytes.max()) if self._lp.nbytes.size else 0
        tier = self._peer.rma
        auto = tier < 2 and (big <= o.batch_max_block or (tier == 0 and op is Op.READ))
        self._bb = o.batch_read_bytes if op is Op.READ else o.batch_bytes
        self._am = (self._lp.host and self._rp.host and self._peer.cookie != 0
                    and (o.batch == "always" or (o.batch == "auto" and auto)))
        # a batched read asks for blocks larger than one answer in pieces (see _pieces)
        self._split = self._am and op is Op.READ and big > self._bb
        self._ok = -1  # the backend's generation epoch at which this pair's registrations were last seen live
        # over a kernel copy (cma) a transfer of a few blocks goes one-sided all the same: each
        # is one process_vm_writev/readv in the posting call, where a batch waits for the
        # target's answer (a 4 KiB write: ~5 us instead of ~25 us)
        self._few = FEW_BLOCKS if self._am and tier == 1 and o.batch == "auto" else 0

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        b: UcxBackend = self.backend  # type: ignore[assignment]
        p, lp, rp = self._peer, self._lp, self._rp
        li, ri = b.post_args(p, lidx, ridx)
        if li.size == 0 and notify is None:
            return DoneRequest(0)
        with b._lock:
            if self._ok != b._epoch:  # a registration or remote key changed somewhere: look again
                if not np.array_equal(p.rgen[rp.used], rp.gens):
                    raise RemoteError(f"peer {p.name!r} released a registration under this prepared list")
                if not np.array_equal(b._lgen[lp.used], lp.gens):
                    raise UsageError("a registration under this prepared list was released; prepare again")
                self._ok = b._epoch
            note = None
            if notify is not None:
                assert p.session is not None
                note = p.session.seal(b.me, "i", wire.pack("notif", msg=notify))
            try:
                if li.size < self._few:
                    x = b.w.post(self._rd, p.ep, li, lp.addr, lp.nbytes, lp.handle, ri, rp.addr, rp.nbytes,
                                 rp.handle, note)
                elif self._split:
                    la, ln, ls, ra, rs, rg = self._pieces(li, ri)
                    ix = np.arange(la.shape[0], dtype=np.int64)
                    x = b.w.post_am(self._rd, p.ep, ix, la, ln, ls, ix, ra, ln, rs, rg, None, p.cookie, self._bb,
                                    note)
                elif self._am:
                    x = b.w.post_am(self._rd, p.ep, li, lp.addr, lp.nbytes, lp.slot, ri, rp.addr, rp.nbytes,
                                    rp.slot, rp.gen, None, p.cookie, self._bb, note)
                else:
                    x = b.w.post(self._rd, p.ep, li, lp.addr, lp.nbytes, lp.handle, ri, rp.addr, rp.nbytes,
                                 rp.handle, note)
            except OSError as exc:
                raise _translate(exc, f"peer {p.name!r}") from exc
            except BAD_INDEX as exc:  # the native bounds and length checks
                raise UsageError(f"bad transfer request: {exc}") from None
        return _UcxRequest(x, f"peer {p.name!r}")

    def _pieces(self, li: np.ndarray, ri: np.ndarray) -> tuple[np.ndarray, ...]:
        """The blocks of a batched read cut into pieces that each fill one answer: a block of
        ``n`` bytes becomes ``k = ceil(n / batch_read_bytes)`` pieces of about ``n / k`` bytes
        (rounded up to 4 KiB where that still fits). Returns local address, length, region slot;
        remote address, region slot, generation (one entry per piece, a block's pieces
        consecutive). The index lists are checked here as the native post checks them."""
        lp, rp, bb = self._lp, self._rp, self._bb
        n = paired_nbytes(li, ri, lp.nbytes, rp.nbytes).astype(np.int64)
        k = np.maximum(-(-n // bb), 1)
        q = np.maximum(-(-n // k), 1)
        q4 = -(-q // 4096) * 4096
        q = np.where(q4 <= bb, q4, q)
        k = np.maximum(-(-n // q), 1)
        first = np.cumsum(k) - k
        within = np.arange(int(k.sum()), dtype=np.int64) - np.repeat(first, k)
        off = within * np.repeat(q, k)
        ln = np.minimum(np.repeat(n, k) - off, np.repeat(q, k)).astype(np.uint64)
        off = off.astype(np.uint64)
        return (np.repeat(lp.addr[li], k) + off, ln, np.repeat(lp.slot[li], k),
                np.repeat(rp.addr[ri], k) + off, np.repeat(rp.slot[ri], k), np.repeat(rp.gen[ri], k))


class _SameNodeHost(HostBackend):
    """The ``host`` backend's engine, held by a ucx backend for its same-node peers' host memory
    (its own listener, control table and metadata, inside the ucx section)."""

    name = "ucx.host"


class _SameNodeRoute(Route):
    """A ucx route that the same-node engine's route carries (the transfer is ucx's to the agent)."""

    __slots__ = ("_inner",)

    def __init__(self, backend: "UcxBackend", op: Op, local: PreparedList, remote: PreparedList, inner: Route) -> None:
        super().__init__(backend, op, local, remote)
        self._inner = inner

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        return self._inner.post(lidx, ridx, notify)

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        return self._inner.plan(lidx, ridx, notify)


# ---- the backend ----------------------------------------------------------------------------
class UcxBackend(Backend):
    """HOST and CUDA memory to and from agents on any node through UCX; see the module docstring."""

    name = "ucx"
    kinds = frozenset({MemoryKind.HOST, MemoryKind.CUDA})
    remote = True
    local = False
    notifications = True
    Options = UcxOptions

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        m = load()
        self.opts: UcxOptions = ctx.options if ctx.options is not None else UcxOptions()
        self.peer_timeout = float(ctx.config.peer_timeout)
        self.handshake_timeout = float(ctx.config.handshake_timeout)
        self.auth_token: str | None = ctx.config.auth_token or None
        try:
            self.w = m.Worker(self.opts.worker_settings(), self.peer_timeout)
        except OSError as exc:
            raise BackendUnavailable(f"UCX cannot start here: {exc.strerror or exc}") from exc
        self.me = ctx.agent_id
        self._lock = threading.RLock()  # posts, peer tables, revocation marks
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._address: bytes = self.w.address()
        self._mem: dict[int, tuple[int, bytes, int, Any]] = {}  # slot -> (memh, packed rkey, gen, region)
        self._lgen = np.zeros(MAX_SLOTS, dtype=np.int64)
        # bumped (under _lock) whenever _lgen or any peer's rgen changes: a route whose check passed
        # at the current epoch needs no new look at the generation tables
        self._epoch = 0
        self._memh = np.zeros(MAX_SLOTS, dtype=_U64)
        self._peers: dict[str, _Peer] = {}
        self._peers_by_id: dict[str, _Peer] = {}
        self._clients: dict[str, _Client] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._acks: dict[int, set[str]] = {}
        self._rid = 0
        self._stager: Any = None
        from .ucx_staged import effective_tls

        # the UCX_TLS this worker was made with (UCX read it at its creation)
        self._tls: str | None = effective_tls(self.opts.ucx)
        # kvx's same-node engine for host memory (see the module docstring), where it may serve
        self._hb: _SameNodeHost | None = None
        if self.opts.samenode == "host" and _shm_allowed(self._tls):
            try:
                self._hb = _SameNodeHost(ctx)
            except OSError as exc:
                log.info("ucx: kvx's same-node path is unavailable (%s); UCX carries same-node host memory", exc)
        self._svc = threading.Thread(target=self._service, name=f"kvx-ucx-{ctx.agent_name}", daemon=True)
        self._svc.start()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            load()
        except BackendUnavailable as exc:
            return str(exc)
        return None

    # ---- memory ----------------------------------------------------------------------------
    def register(self, region: Any, slot: int, gen: int) -> Any:
        if not isinstance(region, Region) or region.kind not in self.kinds:
            raise RegistrationError("ucx backend registers HOST and CUDA memory only")
        try:
            memh, packed = self.w.mem_map(region.addr, region.nbytes, region.kind == MemoryKind.CUDA)
        except OSError as exc:
            raise RegistrationError(f"UCX cannot map {region.kind.name} memory at 0x{region.addr:x}: "
                                    f"{exc.strerror or exc}") from exc
        with self._lock:
            self._mem[slot] = (memh, packed, gen, region)
            self._memh[slot] = memh
            self._lgen[slot] = gen
            self._epoch += 1
        if region.kind == MemoryKind.HOST:  # batched messages may reach it (validated per block)
            self.w.region_add(slot, gen & 0xFFFFFFFF, region.addr, region.nbytes)
            if self._hb is not None:
                self._hb.register(region, slot, gen)
        return slot

    def deregister(self, region: Any, handle: Any) -> None:
        slot = int(handle)
        with self._lock:
            ent = self._mem.get(slot)
            if ent is None or ent[3] is not region:
                return
            memh, _packed, gen, _r = ent
            hb = self._hb if region.kind == MemoryKind.HOST else None
            self._lgen[slot] = 0  # our own posts from this memory stop here
            self._epoch += 1
            self._memh[slot] = 0
            del self._mem[slot]
            # no batched message lands in it or is served from it from here on (and none of our
            # pending reads lands in it: their answers are refused)
            self.w.region_del(slot)
            clients = [c for c in self._clients.values() if c.session is not None]
            peers = [p for p in self._peers.values() if p.dead is None]
        if hb is not None:  # same-node peers' copies drain and no new one reaches it
            hb.deregister(region, gen)
        # peers stop writing into it: revoke and wait for their acknowledgements (bounded)
        self._revoke(clients, slot, gen)
        if self._stager is not None:  # staged copies already checked against it finish first
            self._stager.wait_idle(slot, self.peer_timeout)
        # our own operations from this memory (initiator role) complete before it goes
        for p in peers:
            try:
                self.w.flush(p.ep).wait(self.peer_timeout)
            except OSError:
                pass
        try:
            self.w.mem_unmap(memh)
        except OSError as exc:  # pragma: no cover - UCX refused
            raise RegistrationError(f"UCX cannot unmap a region: {exc.strerror or exc}") from exc

    def _revoke(self, clients: list[_Client], slot: int, gen: int) -> None:
        if not clients:
            return
        with self._lock:
            self._rid += 1
            rid = self._rid
            self._acks[rid] = {c.id for c in clients}
        for c in clients:
            if not self._send(c, "t", wire.pack("revoke", slot=slot, gen=gen, rid=rid)):
                with self._lock:
                    self._acks[rid].discard(c.id)
        deadline = time.monotonic() + self.peer_timeout
        with self._cv:
            while self._acks[rid]:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # a client whose endpoint failed will not answer
                for cid in list(self._acks[rid]):
                    cl = self._clients.get(cid)
                    if cl is None or self.w.ep_status(cl.ep) != 0:
                        self._acks[rid].discard(cid)
                self._cv.wait(min(left, 0.1))
            late = self._acks.pop(rid)
        if late:
            log.warning("ucx: %d peer(s) did not acknowledge the release of a region within %.1f s; "
                        "unmapping it anyway", len(late), self.peer_timeout)

    # ---- peers -----------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        with self._lock:
            rk = [[s, g, p] for s, (_m, p, g, _r) in self._mem.items()]
        sec: dict[str, Any] = {"addr": self._address, "rkeys": rk}
        if self._hb is not None:
            sec["host"] = self._hb.metadata()
        return sec

    def connect(self, peer: PeerInfo) -> bool:
        sec = peer.sections.get(self.name)
        if sec is None:
            return False
        if (not isinstance(sec, dict) or not isinstance(sec.get("addr"), bytes)
                or not isinstance(sec.get("rkeys"), list)):
            raise ProtocolError(f"malformed ucx section in {peer.name!r} metadata")
        packed = _parse_rkeys(sec["rkeys"])
        if "host" in sec:  # the same-node engine's entry: checked whether this agent uses it or not
            HostBackend.check_metadata(sec["host"], peer.name)
        try:
            ep = self._ep_create(sec["addr"], peer_errors=not _shm_peer(peer, self._tls))
        except ValueError as exc:
            raise ProtocolError(f"malformed UCX address in {peer.name!r} metadata") from exc
        except OSError as exc:
            raise PeerDisconnected(f"cannot reach {peer.name!r} over UCX: {exc.strerror or exc}") from exc
        p = _Peer(peer.name, peer.agent_id, ep)
        p.packed = packed
        p.peer_errors = bool(self.w.ep_peer_errors(ep))
        p.rma = _rma_tier(self.w.ep_transports(ep))
        try:
            self._handshake(p)
        except BaseException:
            self.w.ep_close(ep, 0.2, True)
            raise
        with self._lock:
            if self._closed:
                self.w.ep_close(ep, 0.2, True)
                return False
            old = self._peers.pop(peer.name, None)
            self._peers[peer.name] = p
            self._peers_by_id[p.id] = p
        if old is not None and old is not p:
            self._drop_peer(old)
        try:
            self._connect_samenode(peer, sec)
        except ProtocolError:
            self.disconnect(peer.name)
            raise
        return True

    def _connect_samenode(self, peer: PeerInfo, sec: dict[str, Any]) -> None:
        """Reach a same-node peer's host engine too, where both sides run one; where that fails
        (another network namespace, CMA not permitted and no shared mappings...) UCX carries
        its host memory like any other."""
        hs = sec.get("host")
        if self._hb is None or hs is None or not _shm_peer(peer, self._tls):
            self._hb_drop(peer.name)  # (a link to an earlier incarnation of this name)
            return
        view = PeerInfo(peer.name, peer.agent_id, {_SameNodeHost.name: hs, "_boot": peer.sections.get("_boot"),
                                                   "_pid": peer.sections.get("_pid")})
        try:
            self._hb.connect(view)
        except ProtocolError:
            raise  # a malformed section: the peer's metadata is bad, as for any other backend
        except (KVXError, OSError) as exc:
            self._hb_drop(peer.name)
            log.info("ucx: %s's same-node host path is out of reach (%s); UCX carries its host memory",
                     peer.name, exc)

    def _hb_drop(self, name: str) -> None:
        if self._hb is not None:
            self._hb.disconnect(name)

    def _ep_create(self, addr: bytes, peer_errors: bool = True) -> int:
        """An endpoint with UCX's peer failure handling; where the transports cannot offer it
        (UCX's shared-memory transports alone), or for a same-host peer while shared memory is
        allowed (with peer failure handling UCX leaves its shared-memory transports out), one
        without: then a dead peer is noticed by the ``peer_timeout`` watchdog only."""
        if peer_errors:
            try:
                return int(self.w.ep_create(addr, True))
            except OSError as exc:
                if exc.errno != _mod.ERR_UNREACHABLE:
                    raise
        ep = int(self.w.ep_create(addr, False))
        log.info("ucx: the transports in use (UCX_TLS) have no peer failure handling; a dead peer is "
                 "detected by the %.1f s progress bound only", self.peer_timeout)
        return ep

    def _rpc(self, ep: int, msg: bytes, rid: int, timeout: float, what: str, sealed: _Peer | None = None
             ) -> dict[str, Any]:
        with self._lock:
            self._replies.pop(rid, None)
        try:
            if sealed is not None:
                assert sealed.session is not None
                msg = sealed.session.seal(self.me, "i", msg)
            self.w.am_send(ep, msg)
        except OSError as exc:
            raise PeerDisconnected(f"{what}: {exc.strerror or exc}") from exc
        rep = self._await_reply(ep, rid, timeout, what)
        if rep is None:
            raise PeerDisconnected(f"{what}: no answer within {timeout:.1f} s")
        return rep

    def _await_reply(self, ep: int, rid: int, timeout: float, what: str, peer: _Peer | None = None
                     ) -> dict[str, Any] | None:
        """The answer ``rid`` once the service thread delivered it, or None after ``timeout`` (or
        at close); PeerDisconnected as soon as the endpoint (or ``peer``) failed."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while rid not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                if (peer is not None and peer.dead is not None) or self.w.ep_status(ep) != 0:
                    raise PeerDisconnected(f"{what}: the peer's endpoint failed")
                self._cv.wait(min(left, 0.1))
            return self._replies.pop(rid, None)

    def _next_rid(self) -> int:
        with self._lock:
            self._rid += 1
            return self._rid

    def _handshake(self, p: _Peer) -> None:
        hto = self.handshake_timeout
        rid = self._next_rid()
        ch = self._rpc(p.ep, wire.pack("hello", **{"from": self.me, "to": p.id, "name": self.ctx.agent_name,
                                                    "addr": self._address, "rid": rid, "pe": p.peer_errors}),
                       rid, hto, f"handshake with {p.name!r}")
        if ch.get("t") != "challenge" or not isinstance(ch.get("nonce"), bytes):
            raise ProtocolError(f"{p.name!r} answered the ucx hello with something else")
        mac = auth.prove(self.auth_token, ch["nonce"], self.me, p.id)
        rid2 = self._next_rid()
        rep = self._rpc(p.ep, wire.pack("auth", **{"from": self.me, "mac": mac, "rid": rid2}), rid2, hto,
                        f"handshake with {p.name!r}")
        if rep.get("t") == "denied":
            raise AuthError(f"{p.name!r} refused us over ucx (wrong or missing KVX_AUTH_TOKEN)")
        if rep.get("t") != "welcome":
            raise ProtocolError(f"{p.name!r} answered the ucx handshake with something else")
        ck = rep.get("ck", 0)
        p.cookie = ck if isinstance(ck, int) and not isinstance(ck, bool) and 0 < ck < (1 << 64) else 0
        p.session = _Session(_session_key(self.auth_token, ch["nonce"], self.me, p.id))

    def refresh_regions(self, peer_name: str) -> list[tuple[int, int, int, int, int, int]] | None:
        p = self._peers.get(peer_name)
        if p is None or p.dead is not None:
            return None
        rid = self._next_rid()
        rep = self._rpc(p.ep, wire.pack("regions", rid=rid), rid, self.handshake_timeout,
                        f"region table of {peer_name!r}", sealed=p)
        rows, rk = rep.get("rows"), rep.get("rkeys")
        if not isinstance(rk, list):
            raise ProtocolError("malformed region table")
        out = region_rows(rows)
        packed = _parse_rkeys(rk)
        with self._lock:
            p.packed.update(packed)
        return out  # type: ignore[return-value]

    def disconnect(self, peer_name: str) -> None:
        with self._lock:
            p = self._peers.pop(peer_name, None)
            if p is not None and self._peers_by_id.get(p.id) is p:
                del self._peers_by_id[p.id]
        if p is not None:
            self._drop_peer(p)
        self._hb_drop(peer_name)

    def _drop_peer(self, p: _Peer) -> None:
        if p.dead is None and p.session is not None:
            try:
                self.w.am_send(p.ep, p.session.seal(self.me, "i", wire.pack("bye")))
            except OSError:
                pass
        p.dead = p.dead or "disconnected"
        with self._lock:
            keys = list(p.rkeys.values())
            p.rkeys.clear()
            p.rgen[:] = 0
            self._epoch += 1
        self.w.ep_close(p.ep, 0.0, True)  # pending transfers fail with PeerDisconnected
        if self._stager is not None:
            self._stager.drop(p.id)
        for _g, h in keys:
            self.w.rkey_destroy(h)

    def prepare(self, plist: PreparedList) -> _Prep:
        d = plist.descs
        slots = np.asarray(plist.slots, dtype=np.int64)
        used = np.fromiter(plist.gens.keys(), dtype=np.int64, count=len(plist.gens))
        gens = np.fromiter(plist.gens.values(), dtype=np.int64, count=len(plist.gens))
        addr = np.ascontiguousarray(d.addr, dtype=_U64)
        nb = np.ascontiguousarray(d.nbytes, dtype=_U64)
        gtab = np.zeros(MAX_SLOTS, dtype=_U64)
        gtab[used] = gens.astype(_U64) & _U64(0xFFFFFFFF)
        slot_u = slots.astype(_U64)
        gen_u = gtab[slots]
        host = d.kind == MemoryKind.HOST
        if plist.peer is None:
            with self._lock:
                if not np.array_equal(self._lgen[used], gens):
                    raise RegistrationError("a local registration of this list is not mapped for ucx")
                handle = self._memh[slots].copy()
            self._prepare_samenode(plist, host)
            return _Prep(addr, nb, handle, used, gens, slot_u, gen_u, host)
        p = self._peers.get(plist.peer)
        if p is None or p.dead is not None:
            raise PeerDisconnected(f"not connected to {plist.peer!r} over ucx")
        table = np.zeros(MAX_SLOTS, dtype=_U64)
        for s, g in zip(used.tolist(), gens.tolist()):
            table[s] = self._rkey(p, s, g)
        self._prepare_samenode(plist, host)
        return _Prep(addr, nb, table[slots], used, gens, slot_u, gen_u, host)

    def _prepare_samenode(self, plist: PreparedList, host: bool) -> None:
        """Prepare a HOST list for the same-node engine too, where it reaches the list's side; it
        keeps what it prepared under its own name in the list's ``bdata`` (its route reads it
        there). A remote list is checked against the control table the peer process shares: a
        descriptor outside it is a RegistrationError, as on the ``host`` backend."""
        hb = self._hb
        if hb is None or not host or (plist.peer is not None and plist.peer not in hb._peers):
            return
        try:
            plist.bdata[_SameNodeHost.name] = hb.prepare(plist)
        except RegistrationError:
            raise
        except KVXError:  # the link went meanwhile: UCX carries this list
            log.debug("ucx: same-node engine cannot prepare %r", plist, exc_info=True)

    def _rkey(self, p: _Peer, slot: int, gen: int) -> int:
        with self._lock:
            have = p.rkeys.get(slot)
            if have is not None and have[0] == gen:
                return have[1]
            pk = p.packed.get(slot)
        if pk is None or pk[0] != gen:
            self.refresh_regions(p.name)
            with self._lock:
                pk = p.packed.get(slot)
            if pk is None or pk[0] != gen:
                raise RegistrationError(f"peer {p.name!r} published no ucx remote key for its region {slot} "
                                        f"(generation {gen})")
        try:
            h = self.w.rkey_unpack(p.ep, pk[1])
        except ValueError as exc:
            raise ProtocolError(f"malformed ucx remote key from {p.name!r}") from exc
        except OSError as exc:
            raise _translate(exc, f"peer {p.name!r}") from exc
        with self._lock:
            old = p.rkeys.get(slot)
            if old is not None and old[0] == gen:  # another thread won
                self.w.rkey_destroy(h)
                return old[1]
            p.rkeys[slot] = (gen, h)
            p.rgen[slot] = gen
            self._epoch += 1
        if old is not None:
            self.w.rkey_destroy(old[1])
        return int(h)

    # ---- transfers -------------------------------------------------------------------------
    def route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        from . import ucx_staged

        if ucx_staged.wanted(self.opts.stage, self._tls, local.kind, remote.kind):
            return ucx_staged.StagedRoute(self, op, local, remote)
        hb, key = self._hb, _SameNodeHost.name
        if hb is not None and key in local.bdata and key in remote.bdata:
            return _SameNodeRoute(self, op, local, remote, hb.route(op, local, remote))
        return _UcxRoute(self, op, local, remote)

    def post_args(self, p: _Peer, lidx: Any, ridx: Any) -> tuple[np.ndarray, np.ndarray]:
        """A post's checks before any work: the peer still connected, the index lists as int64
        vectors of one length (else PeerDisconnected / UsageError)."""
        if p.dead is not None or self._peers.get(p.name) is not p:
            raise PeerDisconnected(f"peer {p.name!r} is not connected over ucx"
                                   + (f": {p.dead}" if p.dead is not None else ""))
        try:
            li, ri = index_vector(lidx), index_vector(ridx)
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from None
        if li.shape != ri.shape:
            raise UsageError(f"index lists differ in length ({li.shape[0]} local, {ri.shape[0]} remote)")
        return li, ri

    def direct_route(self, op: Op, local: PreparedList, remote: PreparedList) -> Route:
        """One UCX operation per block (the staged route's path for small transfers)."""
        return _UcxRoute(self, op, local, remote)

    def stager(self) -> Any:
        """The staged path's state (made at its first use)."""
        with self._lock:
            if self._stager is None:
                if self._closed:
                    raise PeerDisconnected("the ucx backend is closed")
                from .ucx_staged import Stager

                self._stager = Stager(self)
            return self._stager

    def _check_gens(self, p: _Peer, local: PreparedList, remote: PreparedList) -> None:
        lp: _Prep = local.bdata[self.name]
        rp: _Prep = remote.bdata[self.name]
        with self._lock:
            if not np.array_equal(p.rgen[rp.used], rp.gens):
                raise RemoteError(f"peer {p.name!r} released a registration under this prepared list")
            if not np.array_equal(self._lgen[lp.used], lp.gens):
                raise UsageError("a registration under this prepared list was released; prepare again")

    def _live_peer(self, peer_name: str | None) -> _Peer:
        p = self._peers.get(peer_name) if peer_name is not None else None
        if p is None or p.dead is not None:
            raise PeerDisconnected(f"peer {peer_name!r} is not connected over ucx"
                                   + (f": {p.dead}" if p is not None else ""))
        return p

    def notify(self, peer_name: str, message: bytes) -> None:
        p = self._live_peer(peer_name)
        if len(message) > (8 << 20):
            raise UsageError("a notification holds at most 8 MiB")
        with self._lock:
            assert p.session is not None
            body = p.session.seal(self.me, "i", wire.pack("notif", msg=message))
        try:
            self.w.am_send(p.ep, body)
        except OSError as exc:
            raise _translate(exc, f"peer {peer_name!r}") from exc

    # ---- control messages (service thread) -------------------------------------------------
    def _send(self, c: _Client, role: str, body: bytes) -> bool:
        try:
            with self._lock:
                assert c.session is not None
                msg = c.session.seal(self.me, role, body)
            self.w.am_send(c.ep, msg)
            return True
        except OSError:
            return False

    def _service(self) -> None:
        last_sweep = time.monotonic()
        while not self._closed:
            try:
                msgs = self.w.am_recv(0.25)
            except RuntimeError:  # the worker is closed
                return
            for raw in msgs:
                try:
                    self._handle(wire.unpack(raw, max_bytes=16 << 20))
                except KVXError as exc:
                    log.debug("ucx: dropped a control message: %s", exc)
                except Exception:  # pragma: no cover - a bug; keep serving
                    log.exception("ucx: error handling a control message")
            now = time.monotonic()
            if now - last_sweep > 0.25:
                last_sweep = now
                self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Drop clients whose endpoint failed or whose handshake expired; mark failed peers."""
        with self._lock:
            clients = list(self._clients.values())
            peers = list(self._peers.values())
        for c in clients:
            try:
                bad = self.w.ep_status(c.ep) != 0
            except (ValueError, RuntimeError):
                bad = True
            if bad or (c.session is None and now - c.started > self.handshake_timeout):
                self._drop_client(c)
        for p in peers:
            if p.dead is None:
                try:
                    st = self.w.ep_status(p.ep)
                except (ValueError, RuntimeError):
                    continue
                if st != 0:
                    p.dead = f"endpoint failed ({_mod.status_string(st)})"

    def _drop_client(self, c: _Client) -> None:
        with self._lock:
            if self._clients.get(c.id) is not c:
                return
            del self._clients[c.id]
            for s in self._acks.values():
                s.discard(c.id)
            self._cv.notify_all()
        if self._stager is not None:
            self._stager.drop(c.id)
        try:
            if c.cookie:
                self.w.cookie_del(c.cookie)
            self.w.ep_close(c.ep, 0.0, True)
        except (ValueError, RuntimeError):
            pass

    def _handle(self, msg: dict[str, Any]) -> None:
        t = msg["t"]
        if t == "s":
            wire.check(msg, "s", {"from": str, "r": str, "seq": int, "body": bytes, "mac": bytes})
            if msg["r"] == "i":  # from an initiator of ours
                c = self._clients.get(msg["from"])
                if c is None or c.session is None:
                    return
                body = c.session.open(msg)
                if body is not None:
                    self._from_client(c, wire.unpack(body))
            elif msg["r"] == "t":  # from a target we reach
                p = self._peers_by_id.get(msg["from"])
                if p is None or p.session is None:
                    return
                body = p.session.open(msg)
                if body is not None:
                    self._from_target(p, wire.unpack(body))
            return
        if t == "hello":
            wire.check(msg, "hello", {"from": str, "to": str, "name": str, "addr": bytes, "rid": int})
            self._on_hello(msg)
        elif t == "auth":
            wire.check(msg, "auth", {"from": str, "mac": bytes, "rid": int})
            self._on_auth(msg)
        elif t in ("challenge", "welcome", "denied"):
            wire.check(msg, t, {"rid": int})
            self._reply(msg)

    def _reply(self, msg: dict[str, Any]) -> None:
        with self._cv:
            self._replies[msg["rid"]] = msg
            if len(self._replies) > 4096:  # nobody waits for these any more
                self._replies.pop(next(iter(self._replies)))
            self._cv.notify_all()

    def _on_hello(self, msg: dict[str, Any]) -> None:
        if msg["to"] != self.me or not msg["name"] or len(msg["name"]) > 256:
            return
        with self._lock:
            pending = sum(1 for c in self._clients.values() if c.session is None)
            old = self._clients.get(msg["from"])
        if pending >= MAX_HANDSHAKES:
            log.warning("ucx: refused a handshake: too many peers in handshake")
            return
        if old is not None:
            self._drop_client(old)
        try:  # the same failure handling as the initiator's endpoint (UCX pairs the two)
            ep = self._ep_create(msg["addr"], peer_errors=msg.get("pe") is not False)
        except (ValueError, OSError) as exc:
            log.debug("ucx: cannot reach back a peer in handshake: %s", exc)
            return
        c = _Client(msg["name"], msg["from"], ep, auth.new_nonce(), time.monotonic())
        with self._lock:
            self._clients[c.id] = c
        try:
            self.w.am_send(ep, wire.pack("challenge", nonce=c.nonce, id=self.me, rid=msg["rid"]))
        except OSError:
            self._drop_client(c)

    def _on_auth(self, msg: dict[str, Any]) -> None:
        c = self._clients.get(msg["from"])
        if c is None or c.session is not None:
            return
        try:
            auth.verify(self.auth_token, c.nonce, c.id, self.me, msg["mac"])
        except AuthError:
            log.warning("ucx: peer %r failed authentication", c.name)
            try:
                self.w.am_send(c.ep, wire.pack("denied", rid=msg["rid"]))
            except OSError:
                pass
            self._drop_client(c)
            return
        c.session = _Session(_session_key(self.auth_token, c.nonce, c.id, self.me))
        # the cookie an authenticated peer puts in its batched messages (the target refuses others)
        c.cookie = int.from_bytes(os.urandom(8), "little") or 1
        self.w.cookie_add(c.cookie, c.ep)
        try:
            self.w.am_send(c.ep, wire.pack("welcome", rid=msg["rid"], ck=c.cookie))
        except OSError:
            self._drop_client(c)

    def _from_client(self, c: _Client, m: dict[str, Any]) -> None:
        t = m["t"]
        if t in ("so", "sw", "sr"):
            self.stager().on_message(c, m)
        elif t == "notif":
            wire.check(m, "notif", {"msg": bytes})
            self.ctx.deliver(c.name, m["msg"])
        elif t == "regions":
            wire.check(m, "regions", {"rid": int})
            with self._lock:
                rk = [[s, g, p] for s, (_m, p, g, _r) in self._mem.items()]
                rows = [[int(r.kind), r.addr, r.nbytes, r.dev, s, g] for s, (_m, _p, g, r) in self._mem.items()]
            self._send(c, "t", wire.pack("regions_rep", rid=m["rid"], rows=rows, rkeys=rk))
        elif t == "revoked":
            wire.check(m, "revoked", {"rid": int})
            with self._cv:
                s = self._acks.get(m["rid"])
                if s is not None:
                    s.discard(c.id)
                    self._cv.notify_all()
        elif t == "bye":
            self._drop_client(c)

    def _from_target(self, p: _Peer, m: dict[str, Any]) -> None:
        t = m["t"]
        if t == "revoke":
            wire.check(m, "revoke", {"slot": int, "gen": int, "rid": int})
            slot, gen = m["slot"], m["gen"]
            if not 0 < slot < MAX_SLOTS:
                return
            with self._lock:
                have = p.rkeys.get(slot)
                drop = have is not None and have[0] == gen
                if drop:
                    del p.rkeys[slot]
                    p.rgen[slot] = 0
                    self._epoch += 1
                pk = p.packed.get(slot)
                if pk is not None and pk[0] == gen:
                    del p.packed[slot]
            # operations already posted to it complete before we acknowledge
            try:
                self.w.flush(p.ep).wait(self.peer_timeout)
            except OSError:
                pass
            if drop:
                assert have is not None
                self.w.rkey_destroy(have[1])
            if p.dead is None and p.session is not None:
                try:
                    with self._lock:
                        body = p.session.seal(self.me, "i", wire.pack("revoked", rid=m["rid"]))
                    self.w.am_send(p.ep, body)
                except OSError:
                    pass
        elif t == "regions_rep":
            wire.check(m, "regions_rep", {"rid": int, "rows": list, "rkeys": list})
            self._reply(m)
        elif t in ("so_rep", "sw_rep", "sr_rep"):
            wire.check(m, t, {"rid": int})
            self._reply(m)

    # ---- shutdown --------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
            self._peers_by_id.clear()
            clients = list(self._clients.values())
            mem = list(self._mem.values())
            self._mem.clear()
            self._cv.notify_all()
        self.w.interrupt()
        if self._svc is not threading.current_thread():
            self._svc.join(timeout=5.0)
        for p in peers:
            self._drop_peer(p)
        if self._stager is not None:
            self._stager.close()
        if self._hb is not None:
            self._hb.close()
        for c in clients:
            try:
                self.w.ep_close(c.ep, 0.0, True)
            except (ValueError, RuntimeError):
                pass
        for memh, _p, _g, _r in mem:
            try:
                self.w.mem_unmap(memh)
            except OSError:
                pass
        self.w.close()


_SHM_TLS = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "all")
#: UCX transports whose puts/gets are one-sided in hardware (RDMA, GPU copies) and in the
#: kernel (cross-memory copies); every other one (tcp, the shared-memory FIFOs) has UCX emulate
#: puts and gets with active messages.
_RDMA_TLS = ("rc", "dc", "cuda_ipc", "gdr_copy")
_KERNEL_TLS = ("cma", "knem", "xpmem")


def _rma_tier(transports: list[tuple[str, str]]) -> int:
    """2 when an endpoint's lanes include an RDMA or GPU transport, 1 a kernel copy, else 0."""
    def has(names: tuple[str, ...]) -> bool:
        return any(t == n or t.startswith(n + "_") for t, _d in transports for n in names)

    return 2 if has(_RDMA_TLS) else 1 if has(_KERNEL_TLS) else 0


def _shm_allowed(tls: str | None) -> bool:
    """Whether UCX may use shared memory under the ``UCX_TLS`` value ``tls`` (None: unset)."""
    if tls is None or tls.startswith("^"):
        return True  # all transports, or an exclusion list: shared memory stays unless named, keep it simple
    return any(t.strip() in _SHM_TLS for t in tls.split(","))


def _shm_peer(peer: PeerInfo, tls: str | None) -> bool:
    """Whether ``peer`` runs on this host and UCX may use shared memory to reach it."""
    return peer.sections.get("_boot") == BOOT_ID and _shm_allowed(tls)


def _parse_rkeys(rk: list[Any]) -> dict[int, tuple[int, bytes]]:
    out: dict[int, tuple[int, bytes]] = {}
    for e in rk:
        if (not isinstance(e, list) or len(e) != 3 or not isinstance(e[0], int) or isinstance(e[0], bool)
                or not 0 < e[0] < MAX_SLOTS or not isinstance(e[1], int) or isinstance(e[1], bool)
                or not isinstance(e[2], bytes) or not 0 < len(e[2]) <= (1 << 16)):
            raise ProtocolError("malformed ucx remote key entry")
        out[e[0]] = (e[1], e[2])
    return out
