"""The cached route of one (op, local list, remote list): on the kernel path with equal block
lengths a post is one native call (``_native.CudaRoute``: indices checked and staged, the target's
guards raised and checked, context, launch, event record); elsewhere the backend's general post."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...errors import PeerDisconnected, RemoteError, UsageError
from ..base import Op, PreparedList, Request
from .errors import fail
from .indices import _count
from .ipc import _Peer
from .request import _CudaRequest
from .staging import _Slot

if TYPE_CHECKING:
    from .backend import CudaBackend

log = logging.getLogger(__name__)


class _Route:
    """The agent's cached route of one (op, list pair) (:meth:`CudaBackend.fast_path`). On the kernel
    path with equal block lengths (:meth:`CudaBackend._route` builds the native part) a post is only
    the peer check, a staging slot, one native call (indices checked and staged, guards raised and
    checked, context, launch, and the record of the slot's own completion event, made once per
    slot) and the request; elsewhere it calls :meth:`CudaBackend.post`. Nothing is launched, and
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
            return be.post(self.op, self.local, lidx, self.remote, ridx, None)
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

