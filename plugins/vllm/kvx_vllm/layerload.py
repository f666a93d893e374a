"""Layer-wise offload loads: one step's loads, served to the forward pass layer by layer.

A request whose offloaded prefix loads layer-wise is scheduled in the step its load starts
(vLLM sees a synchronous load). ``start_load_kv`` hands the step's loads to a
:class:`LayerLoad`, which on a background thread

1. reads every request's blocks from its group's :class:`~kvx.tiers.TieredStore` into the
   layer-wise staging slots (one ``get`` per request: the store verifies whole blocks, so the
   tier read is not split by layer), then
2. posts, in layer order, one kvx transfer per group of layers (``offload_layer_group``) from
   the staging slots into the engine's KV cache: that group's pages of every block that arrived.

``wait_for_layer_load(layer)`` waits, within the step's bound (``load_timeout_s`` from the
start), for the transfer of that layer's group only, so the first layers compute while later
ones still move. Whatever did not arrive (a block the store no longer holds, a transfer that
failed or ran past the bound, a layer group the forward pass never waited for) ends as invalid
block ids after the forward pass: vLLM then drops that step's output of the affected requests
and recomputes them or fails them (``kv_load_failure_policy``), never serving wrong tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

import kvx

from .metadata import LoadSpec

if TYPE_CHECKING:
    from .worker import KVXWorker, _GroupStore

__all__ = ["LayerLoad"]

log = logging.getLogger(__name__)


class _Part:
    """One layer group's transfer: posted (or failed to post) once ``posted`` is set."""

    __slots__ = ("err", "posted", "waited", "xfer")

    def __init__(self) -> None:
        self.posted = threading.Event()
        self.xfer: kvx.Transfer | None = None
        self.err: BaseException | None = None
        self.waited = False


class LayerLoad:
    """The layer-wise loads of one step (see the module docstring).

    Parameters
    ----------
    worker
        The worker whose stores, KV block table and agent serve the loads.
    specs
        The step's layer-wise :class:`~kvx_vllm.metadata.LoadSpec` s.
    """

    def __init__(self, worker: "KVXWorker", specs: list[LoadSpec]) -> None:
        self.w = worker
        self.specs = specs
        self.t0 = time.monotonic()
        self.deadline = self.t0 + worker.cfg.load_timeout_s
        self.group = worker.cfg.offload_layer_group
        # per KV cache group: its store and the layer groups' parts
        self.parts: dict[int, list[_Part]] = {}
        for g, st in worker._stores.items():
            n = (len(st.layers) + self.group - 1) // self.group
            self.parts[g] = [_Part() for _ in range(n)]
        self.bad: list[int] = []  # blocks that did not arrive (known before the transfers)
        self.loaded: dict[int, list[int]] = {g: [] for g in self.parts}  # blocks being transferred
        self._lock = threading.Lock()
        self._closed = False  # set by finish: nothing is posted into the KV cache after it
        self._posting = False  # the thread is inside a post
        self.last_wait = self.t0  # when the latest wait_for_layer_load returned
        self.wait_s = 0.0  # time the forward pass spent blocked in wait_for_layer_load
        self._thread = threading.Thread(target=self._run, name="kvx-vllm-layerload", daemon=True)
        self._thread.start()

    # -- background: tier reads, then the transfers in layer order ----------------------------
    def _run(self) -> None:
        try:
            per: dict[int, tuple[list[int], list[int]]] = {g: ([], []) for g in self.parts}
            used: dict[int, int] = dict.fromkeys(self.parts, 0)
            for spec in self.specs:
                for g, keys, ids in zip(self.w.groups, spec.keys, spec.block_ids):
                    st = self.w._stores.get(g)
                    if st is None or not keys:
                        self.bad.extend(ids)
                        continue
                    got = self._read(st, spec.req_id, keys, ids, used[g])
                    per[g][0].extend(ids[:got])
                    per[g][1].extend(range(used[g], used[g] + got))
                    used[g] += len(keys)
                    self.bad.extend(ids[got:])
            for g, parts in self.parts.items():
                ids, slots = per[g]
                self.loaded[g] = ids
                st = self.w._stores[g]
                for j, part in enumerate(parts):
                    sel = np.arange(j * self.group, min((j + 1) * self.group, len(st.layers)), dtype=np.int64)
                    try:
                        if ids:
                            kv, pieces = st.layer_idx(ids, slots, sel)
                            assert self.w.table is not None
                            with self._lock:
                                if self._closed:
                                    raise kvx.TransferTimeout("layer-wise load: the step ended first")
                                self._posting = True
                            try:
                                part.xfer = self.w.agent.read(self.w.table, kv, st.lw_pieces, pieces)
                            finally:
                                with self._lock:
                                    self._posting = False
                    except BaseException as exc:
                        part.err = exc
                    part.posted.set()
        except BaseException as exc:  # nothing posted from here on: every part fails
            log.error("kvx_vllm: layer-wise offload load failed: %s", exc)
            for parts in self.parts.values():
                for part in parts:
                    if not part.posted.is_set():
                        part.err = exc
                        part.posted.set()

    def _read(self, st: "_GroupStore", rid: str, keys: list[bytes], ids: list[int], first: int) -> int:
        """Read one request's blocks into slots ``first..``; returns how many (a prefix) arrived."""
        if first + len(keys) > st.slots:
            log.error("kvx_vllm: request %s: a layer-wise load past the %d staging blocks (loaded whole "
                      "by recomputing)", rid, st.slots)
            return 0
        left = self.deadline - time.monotonic()
        if left <= 0:
            return 0
        try:
            return st.store.get(keys, st.lw_blocks, np.arange(first, first + len(keys)), timeout=left)
        except kvx.BlockNotFound as exc:
            log.warning("offload load of %s: %s", rid, exc.args[0] if exc.args else exc)
            return int(exc.args[1]) if len(exc.args) > 1 else 0
        except Exception as exc:
            log.error("kvx_vllm: offload load of request %s failed: %s", rid, exc)
            return 0

    # -- the forward pass ---------------------------------------------------------------------
    def part_of(self, g: int, j: int) -> _Part:
        return self.parts[g][j // self.group]

    def wait(self, g: int, j: int) -> bool:
        """Wait (bounded by the step's deadline) for layer ``j`` of KV cache group ``g``; returns
        whether its pages landed. A failure is remembered for :meth:`finish`."""
        part = self.part_of(g, j)
        t = time.monotonic()
        try:
            ok = self._wait(part)
        finally:
            part.waited = True
            self.last_wait = time.monotonic()
            self.wait_s += self.last_wait - t
        return ok

    def _wait(self, part: _Part, deadline: float | None = None) -> bool:
        deadline = self.deadline if deadline is None else deadline
        if not part.posted.wait(max(0.0, deadline - time.monotonic())):
            part.err = part.err or kvx.TransferTimeout("layer-wise load: the tier read ran past load_timeout_s")
            return False
        if part.err is not None:
            return False
        if part.xfer is None:
            return True
        try:
            if part.xfer.wait(max(0.0, deadline - time.monotonic())):
                return True
            part.err = kvx.TransferTimeout("layer-wise load: a layer's transfer ran past load_timeout_s")
        except kvx.KVXError as exc:
            part.err = exc
        part.xfer.cancel()
        return False

    def _settle(self, x: kvx.Transfer) -> bool:
        """Wait (bounded) for a transfer posted as the step ended; cancel it past the bound."""
        try:
            if x.wait(self.w.cfg.load_timeout_s):
                return True
        except kvx.KVXError:
            return False
        x.cancel()
        return False

    def finish(self) -> set[int]:
        """After the forward pass: wait (bounded) for what it did not wait for; returns the blocks
        that must not be trusted."""
        bad = set()
        failed = False
        for parts in self.parts.values():
            for part in parts:
                if not part.waited:
                    # the forward pass may have read these layers before they landed
                    if not part.posted.is_set() or part.xfer is not None or part.err is not None:
                        failed = True
                    self._wait(part)
                failed = failed or part.err is not None
        with self._lock:
            self._closed = True
            posting = self._posting
        if posting:  # a post under way is let finish (bounded) and its transfer waited for
            self._thread.join(self.w.cfg.load_timeout_s)
            for parts in self.parts.values():
                for part in parts:
                    if part.xfer is not None and not self._settle(part.xfer):
                        failed = True
        if posting and self._thread.is_alive():
            log.error("kvx_vllm: a layer-wise load's transfer could not be posted within twice load_timeout_s")
        if self._thread.is_alive() or failed:
            for ids in self.loaded.values():
                bad.update(ids)
            for parts in self.parts.values():
                for part in parts:
                    if part.err is not None:
                        log.error("kvx_vllm: layer-wise offload load failed: %s", part.err)
                        break
        bad.update(self.bad)
        if self._thread.is_alive():
            # still reading from the tiers: every block of the step is suspect
            for spec in self.specs:
                for ids in spec.block_ids:
                    bad.update(ids)
        return bad

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def loaded_blocks(self, bad: set[int]) -> int:
        return sum(len([b for b in ids if b not in bad]) for ids in self.loaded.values())
