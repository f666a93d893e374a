"""A decode worker's pull of one request, and the notifications that end a prefill's lease.

:class:`Pull` posts one kvx read per prefill rank it reads (descriptor lists from
:mod:`kvx_vllm.plan`), then, once all are done, reads those blocks' generation words from each
(carrying the notification that lets the prefill free them), then checks that no block was
released meanwhile. Polled by the worker like a Future.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

import kvx

from .metadata import RecvSpec
from .plan import LayerGeom, PeerTables

if TYPE_CHECKING:
    from .worker import KVXWorker

__all__ = ["MAX_HOLD", "Failed", "Peer", "Pull", "note", "parse_note"]

def note(rid: str, n: int) -> bytes:
    """The notification a decode worker sends a prefill worker: request id and how many decode
    workers will send it (the prefill worker frees the blocks once all have)."""
    return f"{rid}\n{n}".encode()


#: a lease extended by heartbeats ends at the latest this many leases after it started
MAX_HOLD = 10


def parse_note(m: bytes) -> tuple[str, int] | None:
    """``(request id, decode workers to wait for)``; 0 is a heartbeat."""
    try:
        text = m.decode()
    except UnicodeDecodeError:
        return None
    rid, sep, n = text.rpartition("\n")
    if not sep:
        return text, 1
    if not n.isdigit() or not 0 <= int(n) <= 4096:
        return None
    return rid, int(n)


class Peer:
    """A prefill worker this decode worker pulls from: its layers, generation words, and the
    descriptor lists of each head range read from it (built once)."""

    __slots__ = ("dev", "gen", "geoms", "kind", "name", "tables")

    def __init__(self, name: str, geoms: list[LayerGeom], kind: kvx.MemoryKind, dev: int,
                 gen: kvx.PreparedList | None) -> None:
        self.name, self.geoms, self.kind, self.dev, self.gen = name, geoms, kind, dev, gen
        self.tables: dict[tuple[int, int, int], tuple[PeerTables, kvx.PreparedList, kvx.PreparedList]] = {}


class Pull:
    """One request's pull: a kvx read per prefill rank it reads (posted at once), then, once all
    are done, a read of those blocks' generation words from each (carrying the notification that
    lets the prefill free them), then the check that no block was released meanwhile; prefill
    ranks it does not read are only notified. ``done``/``result`` poll it like a Future."""

    __slots__ = (
        "deadline",
        "error",
        "gens",
        "local",
        "notify_only",
        "payload",
        "phase",
        "reads",
        "slots",
        "spec",
        "t0",
        "worker",
    )

    def __init__(self, worker: "KVXWorker", spec: RecvSpec, reads: list[tuple[Peer, Any, np.ndarray]],
                 notify_only: list[str], payload: dict[str, bytes]) -> None:
        self.worker, self.spec, self.payload, self.notify_only = worker, spec, payload, notify_only
        self.local = [b for g in spec.local_block_ids for b in g]
        self.t0 = time.monotonic()
        self.deadline = self.t0 + worker.cfg.load_timeout_s
        self.error: BaseException | None = None
        self.gens: list[tuple[Any, np.ndarray, int, Peer]] = []  # (transfer, remote blocks, first slot, peer)
        self.slots = 0
        self.reads: list[tuple[Peer, Any, np.ndarray]] = reads
        self.phase = 0  # 0: data, 1: generations, 2: done

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for _p, x, _b in self.reads:
            if x is not None and not x.done():
                x.cancel()
        for x, _b, _s, _p in self.gens:
            if not x.done():
                x.cancel()
        self.phase = 2
        self.worker._notify_all([p.name for p, _x, _b in self.reads] + self.notify_only, self.payload)

    def done(self, block: bool = False) -> bool:
        w = self.worker
        while self.phase < 2:
            xs = [x for _p, x, _b in self.reads if x is not None] if self.phase == 0 else [g[0] for g in self.gens]
            if time.monotonic() > self.deadline:
                self._fail(kvx.TransferTimeout(f"pull not done within {w.cfg.load_timeout_s} s"))
                break
            if block:
                for x in xs:
                    try:
                        x.wait(max(0.001, self.deadline - time.monotonic()))
                    except kvx.KVXError:
                        pass  # its status says what happened (checked below)
            if not all(x.done() for x in xs):
                return False
            bad = next((x for x in xs if x.status is not kvx.Status.DONE), None)
            if bad is not None:
                self._fail(bad.error or kvx.TransferError("pull failed"))
                break
            if self.phase == 0:
                try:
                    self._post_gens()
                except Exception as exc:
                    self._fail(exc)
                    break
                self.phase = 1
            else:
                self._check_gens()
                self.phase = 2
        return True

    def _post_gens(self) -> None:
        w = self.worker
        lease = int(self.spec.params.get("kvx_lease", 0))
        for peer, _x, rblocks in self.reads:
            if peer.gen is None or not lease:
                raise kvx.ProtocolError(f"prefill worker {peer.name} publishes no block generations")
            if not rblocks.size:  # nothing was read from it: only tell it
                w._notify_all([peer.name], self.payload)
                continue
            first = w._slots(rblocks.size)
            self.gens.append((w.agent.read(w._gen_local, first + np.arange(rblocks.size), peer.gen, rblocks,
                                           notify=self.payload[peer.name]), rblocks, first, peer))
        w._notify_all(self.notify_only, self.payload)

    def _check_gens(self) -> None:
        lease = int(self.spec.params["kvx_lease"])
        for _x, rblocks, first, peer in self.gens:
            got = self.worker._gen_view[first:first + rblocks.size]
            if (got >= lease).any():
                n = int((got >= lease).sum())
                self.error = kvx.TransferError(
                    f"{n} of {rblocks.size} blocks were released by prefill worker {peer.name} before the "
                    f"pull finished (lease {self.spec.params.get('kvx_lease')} expired); their bytes may "
                    "belong to another request")
                return

    def result(self) -> list[int]:
        """The blocks that failed (none when the pull succeeded)."""
        if self.error is None:
            self.worker._count(pulls=1, pulled_blocks=len(self.local), pull_s=time.monotonic() - self.t0)
            return []
        self.worker._pull_failed(self.spec, self.error)
        return self.local


class Failed:
    """A pull that failed before anything was posted."""

    def __init__(self, local: list[int]) -> None:
        self.local = local

    def done(self) -> bool:
        return True

    def result(self) -> list[int]:
        return self.local


