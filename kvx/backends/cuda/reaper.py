"""The completion reaper: a thread per backend that retires finished transfers (counters down,
notifications out) even if nobody polls them."""

from __future__ import annotations

import threading
import time
from typing import Any

from .request import _CudaRequest


class _Reaper:
    """Retires finished transfers (counters down, notifications out) even if nobody polls.

    Event-driven for notifications: it sleeps in ``cudaEventSynchronize`` (blocking-sync events: no GIL
    while the GPU works) on the oldest pending transfer that carries a notification, then retires every
    finished one. Lazy for the rest: a post without a notification does not wake an active reaper
    (a waiter usually retires its transfer itself); the reaper checks pending transfers every ``lazy``
    seconds, so the in-flight counters of an unpolled transfer come down at most that long after it
    finished. Idle for ``deep_after`` seconds, it sleeps until the next post. (``lazy`` = 0: woken
    by every post, sleeping on the oldest transfer's event; ``poll`` > 0: polling at that interval,
    both for comparison.) The three come from ``CudaOptions.reaper_*``.
    """

    def __init__(self, name: str, poll: float = 0.0, lazy: float = 0.002, deep_after: float = 0.05) -> None:
        self.poll = poll
        self.lazy = lazy
        self.deep_after = deep_after
        self._cv = threading.Condition()
        self._pending: list[_CudaRequest] = []
        self._closed = False
        self._deep = True  # sleeping until a post wakes it
        self._thread = threading.Thread(target=self._run, name=f"kvx-cuda-reaper-{name}", daemon=True)
        self._thread.start()

    def add(self, req: _CudaRequest) -> None:
        with self._cv:
            self._pending.append(req)
            if self._deep or req.notify is not None or self.lazy <= 0 or self.poll > 0:
                self._cv.notify()

    def pending_for(self, peer: Any) -> list[_CudaRequest]:
        with self._cv:
            return [r for r in self._pending if r.peer is peer]

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            lazy = self.lazy if self.poll <= 0 else 0.0
            with self._cv:
                if not self._pending and not self._closed:
                    now = time.monotonic()
                    if lazy <= 0 or now - idle_since >= self.deep_after:
                        self._deep = True
                        while not self._pending and not self._closed:
                            self._cv.wait()
                        self._deep = False
                    else:
                        self._cv.wait(min(lazy, self.deep_after - (now - idle_since)))
                        continue
                if self._closed and not self._pending:
                    return
                snap = list(self._pending)
            if self.poll <= 0:
                # sleep on the oldest transfer owing a notification (every transfer when not lazy)
                head = next((r for r in snap if not r._done and (r.notify is not None or lazy <= 0 or self._closed)),
                            None)
                if head is not None:
                    try:
                        head.event.synchronize()  # no GIL held while the GPU works
                    except Exception:  # a failed copy: _poll reports it
                        pass
            done = [r for r in snap if r._poll()]
            with self._cv:
                if done:
                    ids = {id(r) for r in done}
                    self._pending = [r for r in self._pending if id(r) not in ids]
                if not self._pending:
                    idle_since = time.monotonic()
                elif len(done) < len(snap) and lazy > 0 and not self._closed:
                    # transfers still running, none owing a notification: look again later unless a
                    # post that owes one wakes us first
                    if not any(r.notify is not None and not r._done for r in self._pending):
                        self._cv.wait(lazy)
            if self.poll > 0:
                time.sleep(self.poll)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(max(0.0, deadline - time.monotonic()))

