"""The route of one (op, local list, remote list) (:class:`CudaRoute`, the post contract of
``kvx.backends.base``), and its fast poster (:class:`_FastPost`): on the kernel path with equal
block lengths a post is one native call (``_native.CudaRoute``: indices checked and staged, the
target's guards raised and checked, context, launch, event record); elsewhere the backend's
general post."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from ...errors import PeerDisconnected, RemoteError, UsageError
from ..base import BAD_INDEX, Op, PreparedList, Request, Route, indices, native_form
from .errors import fail
from .indices import _count, _index
from .ipc import _Peer
from .request import _CudaRequest
from .staging import _Slot

if TYPE_CHECKING:
    from .backend import CudaBackend

log = logging.getLogger(__name__)


class _FastPost:
    """The fast poster of one (op, list pair), without notification (:class:`CudaRoute`). On the kernel
    path with equal block lengths (:meth:`CudaBackend._route` builds the native part) a post is only
    the peer check, a staging slot, one native call (indices checked and staged, guards raised and
    checked, context, launch, and the record of the slot's own completion event, made once per
    slot) and the request; elsewhere it calls :meth:`CudaBackend._post`. Nothing is launched, and
    nothing stays raised, when the call raises (bad indices) or the target released its memory.
    The native part is built once, at the first post (the backend's options are fixed)."""

    __slots__ = ("be", "built", "cnts", "d", "isz", "local", "nat", "op", "peer", "remote", "ulen", "write")

    def __init__(self, be: "CudaBackend", op: Op, local: PreparedList, remote: PreparedList) -> None:
        self.be = be
        self.op = op
        self.local = local
        self.remote = remote
        self.write = op is Op.WRITE
        self.built = False
        self.nat: Any = None
        self.d: Any = None
        self.peer: _Peer | None = None
        self.cnts: list[int] = []
        self.ulen = 0
        self.isz = 4

    def __call__(self, lidx: Any, ridx: Any) -> Request:
        be = self.be
        if not self.built:
            if be.route_on:
                be._route(self)
            self.built = True
        nat = self.nat
        if nat is None:
            return be._post(self.op, self.local, lidx, self.remote, ridx, None)
        d, peer = self.d, self.peer
        if be._closed:
            raise UsageError("cuda backend is closed")
        if peer is not None and be._peers.get(peer.name) is not peer:
            raise PeerDisconnected(f"peer {peer.name!r} is not connected (or reconnected: prepare again)")
        didx, sidx = (ridx, lidx) if self.write else (lidx, ridx)
        need = 2 * self.isz * max(1, _count(didx))
        cp = be.cp
        with d.lock:
            slot = d.staging.take(cp, need)
            try:
                ev = slot.ev
                if ev is None:  # made once per slot; recorded by the native call right after the launch
                    with cp.cuda.Device(d.dev):
                        ev = slot.ev = cp.cuda.Event(block=True, disable_timing=True)
                if peer is not None:
                    with peer.clock:
                        if not peer.ctrl or not peer.alive:
                            raise PeerDisconnected(f"peer {peer.name!r} is not connected")
                        n, step, rc = nat.post(didx, sidx, slot.hptr, slot.cap, ev.ptr)
                else:
                    n, step, rc = nat.post(didx, sidx, slot.hptr, slot.cap, ev.ptr)
            except BaseException:
                slot.guard = None  # nothing was queued that reads it
                raise
            if step < 3:
                self._undo(slot, step)
                if step == -1:
                    name = peer.name if peer is not None else "?"
                    raise RemoteError(f"peer {name!r}: the target released (or re-registered) the memory")
                what = ("context switch", "kernel launch", "event record")[step]
                raise fail(rc, f"CUDA {what}")
            slot.guard = ev
            req = _CudaRequest(be, ev, n * self.ulen, peer, self.cnts, None, None)
            slot.req = req
        if rc:
            log.warning("cuda: restoring the caller's CUDA context after a launch failed with error %d", rc)
        be._reaper.add(req)
        return req

    def _undo(self, slot: _Slot, step: int) -> None:
        """After a post that did not launch (step -1: the target released its memory, nothing raised;
        0/1: the context switch or the launch failed) or launched without its event (2): once nothing
        reads the memory any more, lower the counters and free the slot."""
        if step == 2:
            try:
                self.d.stream.synchronize()
            except Exception:
                log.debug("synchronizing GPU %d after a failed event record", self.d.dev, exc_info=True)
        slot.guard = None
        if step >= 0:
            self.be._release_counters(self.peer, self.cnts)



class CudaRoute(Route):
    """The cuda backend's route of a list pair: the only way its transfers start.

    :meth:`post` goes through the backend's general path (:meth:`CudaBackend._post`) for the
    pair's first post and for every post with a notification; once a post without one went
    through, later ones take the pair's :class:`_FastPost`, which takes the index sources as given
    (checked while staged natively) and raises TypeError/ValueError/IndexError before anything
    moves for one it cannot take: a bad value of a form it takes as it is is ``UsageError`` at
    once; any other form goes through the general path, which converts it (``base.indices``)
    and raises ``UsageError`` for what is still wrong. :meth:`plan` checks the indices
    once and posts each time through a fast poster of its own (the general path with a
    notification)."""

    __slots__ = ("_fast",)

    def __init__(self, backend: "CudaBackend", op: Op, local: PreparedList, remote: PreparedList) -> None:
        super().__init__(backend, op, local, remote)
        self._fast: _FastPost | None = None

    def post(self, lidx: Any, ridx: Any, notify: bytes | None) -> Request:
        be: Any = self.backend
        fast = self._fast
        if fast is not None and notify is None:
            try:
                return fast(lidx, ridx)
            except BAD_INDEX as exc:
                # nothing moved. A form the native stage takes as it is (int, list, contiguous int64
                # vector) has a bad value: that is the caller's error. Another form (an int32 or
                # strided array, a tuple, a numpy scalar) goes once through the general path, which
                # converts it (base.indices) and raises UsageError for what is still wrong.
                if native_form(lidx) and native_form(ridx):
                    raise UsageError(f"bad transfer request: {exc}") from None
        try:
            req: Request = be._post(self.op, self.local, indices(lidx), self.remote, indices(ridx), notify)
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from exc
        if fast is None and notify is None:
            self._fast = _FastPost(be, self.op, self.local, self.remote)
        return req

    def plan(self, lidx: Any, ridx: Any, notify: bytes | None) -> Callable[[], Request]:
        be: Any = self.backend
        op, local, remote = self.op, self.local, self.remote
        try:
            li = _index(indices(lidx), len(local.bdata["cuda"].addr))
            ri = _index(indices(ridx), len(remote.bdata["cuda"].addr))
            if li.shape[0] != ri.shape[0]:
                raise ValueError("index lists differ in length")
        except BAD_INDEX as exc:
            raise UsageError(f"bad transfer request: {exc}") from exc
        if notify is not None or not li.shape[0]:
            def general() -> Request:
                try:
                    return be._post(op, local, li, remote, ri, notify)  # type: ignore[no-any-return]
                except BAD_INDEX as exc:
                    raise UsageError(f"bad transfer request: {exc}") from exc
            return general
        fast = _FastPost(be, op, local, remote)

        def fast_post() -> Request:
            try:
                return fast(li, ri)
            except BAD_INDEX as exc:
                raise UsageError(f"bad transfer request: {exc}") from exc
        return fast_post
