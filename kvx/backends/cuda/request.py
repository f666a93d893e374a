"""A launched transfer: a CUDA event recorded after the copy; polled natively, waited on with a
native spin first, retired once (in-flight counters down, notification out)."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ... import _native
from ...errors import PeerDisconnected
from ..base import Request
from .driver import _CUDA_NOT_READY
from .errors import fail

if TYPE_CHECKING:
    from .backend import CudaBackend


class _CudaRequest(Request):
    """A launched transfer: done when its CUDA event has completed."""

    __slots__ = ("_done", "_err", "_lock", "backend", "counters", "event", "keep", "nbytes", "notify", "peer")

    def __init__(self, backend: "CudaBackend", event: Any, nbytes: int, peer: Any, counters: list[int],
                 notify: bytes | None, keep: Any) -> None:
        self.nbytes = nbytes
        self.event = event
        self.backend = backend
        self.peer = peer
        self.counters = counters
        self.notify = notify
        self.keep = keep
        self._done = False
        self._err: BaseException | None = None
        self._lock = threading.Lock()

    def _poll(self) -> bool:
        """Query the event; retire the transfer once (counters, notification). True when finished."""
        if self._done:
            return True
        # one cuEventQuery, natively (cupy's Event.done costs ~1 us more)
        rc = _native.cuda_event_spin(self.backend.drv.event_query, int(self.event.ptr), 0)
        if rc == _CUDA_NOT_READY:
            return False
        # rc != 0: a CUDA error (faulting kernel, lost device)
        self._retire(fail(rc, "CUDA copy") if rc else None)
        return True

    def _retire(self, err: BaseException | None) -> None:
        """The event has completed (or failed with ``err``): lower the counters, send the
        notification; once."""
        with self._lock:
            if self._done:
                return
            peer = self.peer
            if err is None and peer is not None and not peer.alive:
                err = PeerDisconnected(f"peer {peer.name!r} disconnected during the transfer")
            self.backend._release_counters(peer, self.counters)
            self.counters = []
            self._err = err
            self.keep = None
            self._done = True
        if err is None and self.notify is not None:
            self.backend._send_notif(peer, self.notify)

    def test(self) -> bool:
        if not self._poll():
            return False
        if self._err is not None:
            raise self._err
        return True

    def wait(self, timeout: float) -> bool:
        t0 = time.monotonic()
        deadline = t0 + timeout
        spin = self.backend.spin_wait
        if not self._done and spin > 0 and timeout > 0:
            # poll natively without the GIL first; an error or the bound: read again by _poll below
            q = self.backend.drv.event_query
            if _native.cuda_event_spin(q, int(self.event.ptr), int(min(spin, timeout) * 1e9)) == 0:
                self._retire(None)  # completed (another query would cost 1-2 us more)
        while not self._poll():
            now = time.monotonic()
            if now >= deadline:
                return False
            if now - t0 < 2e-3:
                time.sleep(0)  # yield the GIL, stay responsive for short transfers
            else:
                time.sleep(min(2e-4 if now - t0 < 0.05 else 1e-3, deadline - now))
        return self.test()

