"""Push mode and layer-wise streaming: the prefill worker WRITES a request's KV into blocks the
decode instance allocated up front, layer by layer while later layers compute (issue 29).

Two halves, engine-independent (kvx agents, prepared lists and index arrays in; no vLLM import),
so that the connector's workers, the GPU harness and the tests drive the same code:

- :class:`LayerPusher` (prefill worker): :meth:`~LayerPusher.add` a request with its destination
  (the decode worker's peer, both prepared lists and, per layer, the descriptor indices on both
  sides, e.g. from :func:`split_by_layer`); :meth:`~LayerPusher.on_layer` from ``save_kv_layer``
  posts the writes of every active request for the layers computed since the last post (``group``
  layers per kvx transfer, the last layer always closing a group), nonblocking;
  :meth:`~LayerPusher.wait` from ``wait_for_save`` waits only for what is still in flight. Every
  write carries a notification ``push_note(rid, part, parts)``; the decode side has the request
  once it has all ``parts``. On a GPU the layer's KV is only *queued* when ``save_kv_layer`` runs:
  pass a CUDA event recorded after the layer (``on_layer(name, event)``), and the writes are
  posted by a poster thread once it has executed, never before.
- :class:`PushLanding` (decode worker): :meth:`~PushLanding.expect` a request's parts with a
  deadline; :meth:`~PushLanding.poll` feeds notifications and returns the requests landed, failed
  (deadline passed: the prefill died, or its writes failed) and *quiesced* (failed requests whose
  blocks may now be reused).

Failure semantics. A request that fails on the decode side (deadline, abort) is not freed at
once: a write of a prefill that is still alive could land in reused blocks. The decode side
tells the prefill worker (:func:`abort_note`), and the blocks are released when the prefill
acknowledges that nothing of that request is in flight any more (:func:`aborted_note`, sent by
:meth:`LayerPusher.abort` after cancelling and draining its transfers) or, if no answer comes
(the prefill is gone), after ``quiesce_s`` (bounded by the prefill's kvx transfer timeout, after
which no write of it can still be pending). On the prefill side, a write that fails (decode died,
disconnected) fails that request only: its blocks are released and the other requests go on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

import kvx

__all__ = ["Hello", "LayerPusher", "PushDest", "PushLanding", "Registration", "abort_note", "aborted_note",
           "hello_note", "is_push_message", "parse_hello", "parse_push_note", "parse_registration", "push_dest",
           "push_note", "registration_note", "split_by_layer"]

log = logging.getLogger(__name__)

_MAGIC = b"kvx-push\x00"
#: bound on a request id's length in a push notification
MAX_RID = 512
#: bound on the parts of one request (layers, or layer groups)
MAX_PARTS = 1 << 16


def _pack(kind: int, rid: str, a: int = 0, b: int = 0) -> bytes:
    return _MAGIC + msgpack.packb([1, kind, rid, a, b], use_bin_type=True)


def push_note(rid: str, part: int, parts: int) -> bytes:
    """The notification carried by write ``part`` of ``parts`` of request ``rid``."""
    return _pack(0, rid, part, parts)


def abort_note(rid: str) -> bytes:
    """Decode -> prefill: stop pushing ``rid`` (decode gave up on it)."""
    return _pack(1, rid)


def aborted_note(rid: str) -> bytes:
    """Prefill -> decode: nothing of ``rid`` is in flight any more; its blocks may be reused."""
    return _pack(2, rid)


def parse_push_note(m: bytes) -> tuple[str, str, int, int] | None:
    """``(kind, rid, a, b)`` with kind ``"part"`` (a: part, b: parts), ``"abort"`` or ``"aborted"``;
    None for a message that is not a push notification. A malformed push notification raises
    :class:`kvx.ProtocolError`."""
    if not m.startswith(_MAGIC):
        return None
    try:
        v = msgpack.unpackb(m[len(_MAGIC):], raw=False, max_bin_len=0, max_str_len=MAX_RID,
                            max_array_len=5, max_map_len=0)
    except Exception as e:
        raise kvx.ProtocolError(f"malformed push notification: {e}") from None
    if (not isinstance(v, list) or len(v) != 5 or v[0] != 1 or v[1] not in (0, 1, 2)
            or not isinstance(v[2], str) or not v[2] or not all(type(x) is int for x in v[3:])):
        raise kvx.ProtocolError("malformed push notification")
    kind = ("part", "abort", "aborted")[v[1]]
    if kind == "part" and not (0 < v[4] <= MAX_PARTS and 0 <= v[3] < v[4]):
        raise kvx.ProtocolError(f"push notification part {v[3]} of {v[4]} out of range")
    return kind, v[2], v[3], v[4]


def split_by_layer(tables: Any, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the indices into ``(tables.local_descs, tables.remote_descs)`` of a request.

    ``tables`` is a :class:`kvx_vllm.plan.PeerTables` as the READING side builds it for a pull
    (local: the decode rank's layers, remote: the prefill rank's) and ``groups`` as for
    ``PeerTables.indices`` (the decode's new block ids, their positions, the prefill's block ids
    per KV cache group): the same arithmetic as ``PeerTables.indices``, kept per layer instead of
    concatenated. For push the prefill rank builds the same tables from the decode rank's
    geometry, prepares ``tables.remote_descs`` (its own memory) as the local list and
    ``tables.local_descs`` on the decode peer as the remote one, and writes ``(writer, reader) =
    (second, first)`` of each layer's pair.
    """
    from .plan import pair_blocks

    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    pairs: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
    for lg, rg, tp, lo, ro in zip(tables.layers, tables.remote, tables.templates, tables.loffs, tables.roffs):
        if lg.group >= len(groups) or not len(groups[lg.group][0]):
            continue
        lids, lpos, rids = groups[lg.group]
        key = (lg.group, lg.block_size, rg.block_size)
        if key not in pairs:
            pairs[key] = pair_blocks(lids, lpos, rids, lg.block_size, rg.block_size)
        lblock, rblock = pairs[key]
        if lblock.size and (lblock.max() >= lg.num_blocks or rblock.max() >= rg.num_blocks or rblock.min() < -1):
            raise kvx.ProtocolError(f"layer {lg.name}: block id out of range")
        p = np.arange(len(tp), dtype=np.int64)[None, :]
        lb, rb = lblock[:, tp.lsub], rblock[:, tp.rsub]
        ok = (lb >= 0) & (rb >= 0)
        out[lg.name] = ((lo + lb * len(tp) + p)[ok], (ro + rb * len(tp) + p)[ok])
    return out


@dataclass
class PushDest:
    """Where one request's KV goes: the decode worker (``peer``), the writer's and the reader's
    prepared lists, and per layer name the indices into both."""

    peer: str
    local: Any
    remote: Any
    layers: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class _Push:
    rid: str
    dest: PushDest
    parts: int
    posted: int = 0
    armed: bool = False  # joined a forward pass at its first layer
    xfers: list[Any] = field(default_factory=list)
    failed: BaseException | None = None


class LayerPusher:
    """Prefill-worker half of push mode (see the module docstring).

    Parameters
    ----------
    agent
        The worker's kvx agent.
    layer_names
        The model's layers in forward order (the order ``save_kv_layer`` sees them).
    group
        Layers per kvx write (1: one write per layer; ``len(layer_names)``: one write per request
        after the last layer, i.e. push without layer-wise streaming).
    timeout
        Bound on the wait for a request's writes in :meth:`wait` (seconds).
    threaded
        Post from a poster thread that first waits for each layer's event (GPU); False posts in
        :meth:`on_layer` itself (CPU engines, where a layer has executed when it returns).
    """

    def __init__(self, agent: kvx.Agent, layer_names: list[str], group: int = 1, timeout: float = 30.0,
                 threaded: bool = False) -> None:
        if not layer_names or len(set(layer_names)) != len(layer_names):
            raise kvx.UsageError("layer_names must be a non-empty list of distinct names")
        if not isinstance(group, int) or group < 1:
            raise kvx.UsageError(f"group must be a positive int, not {group!r}")
        self.agent = agent
        self.names = list(layer_names)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.group = min(group, len(self.names))
        self.timeout = timeout
        self._lock = threading.Lock()
        self._active: dict[str, _Push] = {}
        self._next = 0  # first layer not yet posted in this forward pass
        self._q: queue.Queue[tuple[int, Any]] | None = None
        self._queued = 0  # layers handed to the poster thread and not yet processed
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._err: BaseException | None = None
        #: ``time.perf_counter()`` of each post of the current or last forward pass (measurements)
        self.post_times: list[float] = []
        if threaded:
            self._q = queue.Queue()
            self._thread = threading.Thread(target=self._poster, name="kvx-push-poster", daemon=True)
            self._thread.start()

    @property
    def parts(self) -> int:
        """Writes per request: one per group of layers."""
        return -(-len(self.names) // self.group)

    def add(self, rid: str, dest: PushDest) -> None:
        """Push ``rid`` in the next forward pass (call before the pass that computes its KV; a
        request added while a pass is under way waits for the next one). One pass per request:
        a prompt prefilled in several chunks goes by pull."""
        if not isinstance(rid, str) or not rid or len(rid.encode()) > MAX_RID:
            raise kvx.UsageError(f"bad request id {rid!r}")
        unknown = set(dest.layers) - set(self.index)
        if unknown:
            raise kvx.UsageError(f"destination names unknown layers: {sorted(unknown)[:3]}")
        with self._lock:
            if rid in self._active:
                raise kvx.UsageError(f"request {rid!r} is already being pushed")
            self._active[rid] = _Push(rid, dest, self.parts)

    def on_layer(self, name: str, event: Any = None) -> None:
        """``save_kv_layer``: layer ``name`` has been computed (or, with ``event``, queued: the
        poster thread waits for the event). Posts the group's writes when it is complete."""
        i = self.index.get(name)
        if i is None:
            return  # a layer this pusher does not move (another KV cache group)
        if i == 0:  # a new forward pass: the requests added before it take part in it
            with self._lock:
                for p in self._active.values():
                    p.armed = True
        if self._q is not None:
            with self._cv:
                self._queued += 1
            self._q.put((i, event))
        else:
            self._layer_done(i)

    def _poster(self) -> None:
        assert self._q is not None
        while True:
            i, ev = self._q.get()
            if i < 0:
                return
            try:
                if ev is not None:
                    ev.synchronize()
                self._layer_done(i)
            except BaseException as e:  # reported by wait()
                self._err = e
            finally:
                with self._cv:
                    self._queued -= 1
                    self._cv.notify_all()

    def _layer_done(self, i: int) -> None:
        last = i == len(self.names) - 1
        if i + 1 - self._next < self.group and not last:
            return
        lo, hi = self._next, i + 1
        self._next = 0 if last else hi
        if lo == 0:
            self.post_times = []
        self.post_times.append(time.perf_counter())
        with self._lock:
            pushes = [p for p in self._active.values() if p.armed and p.failed is None and p.posted < p.parts]
        for p in pushes:
            lidx = [p.dest.layers[n][0] for n in self.names[lo:hi] if n in p.dest.layers]
            ridx = [p.dest.layers[n][1] for n in self.names[lo:hi] if n in p.dest.layers]
            li = np.concatenate(lidx) if lidx else np.empty(0, np.int64)
            ri = np.concatenate(ridx) if ridx else np.empty(0, np.int64)
            note = push_note(p.rid, p.posted, p.parts)
            try:
                if len(li):
                    p.xfers.append(self.agent.write(p.dest.local, li, p.dest.remote, ri, notify=note))
                else:  # nothing of this request in these layers: the part still counts
                    self.agent.notify(p.dest.peer, note)
            except Exception as e:  # this request only
                p.failed = e
            p.posted += 1

    def wait(self) -> tuple[set[str], dict[str, BaseException]]:
        """``wait_for_save``: wait for the writes still in flight; returns the requests whose every
        part has landed (their prefill blocks can be freed now) and those that failed (also
        freed; the decode side fails them too, by deadline if not sooner)."""
        if self._q is not None:
            with self._cv:
                if not self._cv.wait_for(lambda: self._queued == 0, self.timeout):
                    raise kvx.TransferTimeout(f"layers not posted within {self.timeout} s")
            if self._err is not None:
                err, self._err = self._err, None
                raise err
        done: set[str] = set()
        failed: dict[str, BaseException] = {}
        with self._lock:
            pushes = list(self._active.values())
        deadline = time.monotonic() + self.timeout  # one bound for the whole wait
        for p in pushes:
            if p.failed is None:
                for x in p.xfers:
                    try:
                        x.wait(max(0.0, deadline - time.monotonic()))
                    except Exception as e:
                        p.failed = e
                        break
            if p.failed is not None:
                self._cancel(p)
                failed[p.rid] = p.failed
            elif p.posted == p.parts:
                done.add(p.rid)
        with self._lock:
            for rid in done | set(failed):
                self._active.pop(rid, None)
        return done, failed

    @staticmethod
    def _cancel(p: _Push) -> None:
        for x in p.xfers:
            if not x.done():
                x.cancel()
        for x in p.xfers:  # cancelled or finished: nothing of them is in flight any more
            try:
                x.wait(1.0)
            except Exception:
                pass

    def abort(self, rid: str, peer: str | None = None) -> bool:
        """Decode gave up on ``rid``: post nothing more, cancel what is in flight, and tell the
        decode side (:func:`aborted_note`) once nothing of it can land any more. False if the
        request was not being pushed (finished, failed or unknown) or, with ``peer``, is not
        pushed to that peer (one decode instance cannot abort another's requests)."""
        with self._lock:
            p = self._active.get(rid)
            if p is None or (peer is not None and p.dest.peer != peer):
                return False
            del self._active[rid]
        if p is None:
            return False
        self._cancel(p)
        try:
            self.agent.notify(p.dest.peer, aborted_note(rid))
        except Exception as e:
            log.info("push %s: abort acknowledgement not delivered: %s", rid, e)
        return True

    def handle_notes(self, notes: dict[str, list[bytes]]) -> list[bytes]:
        """Act on the decode side's abort notes; returns the messages that are not push notes."""
        rest = []
        for peer, msgs in notes.items():
            for m in msgs:
                try:
                    parsed = parse_push_note(m)
                except kvx.ProtocolError as e:
                    log.warning("dropping a malformed push notification: %s", e)
                    continue
                if parsed is None:
                    rest.append(m)
                elif parsed[0] == "abort":
                    self.abort(parsed[1], peer)
        return rest

    def active(self) -> set[str]:
        with self._lock:
            return set(self._active)

    def close(self) -> None:
        if self._q is not None and self._thread is not None:
            self._q.put((-1, None))
            self._thread.join(5.0)
        with self._lock:
            pushes = list(self._active.values())
            self._active.clear()
        for p in pushes:
            self._cancel(p)


@dataclass
class _Expect:
    """One writer's part of an expected request."""

    parts: int | None
    deadline: float
    got: set[int] = field(default_factory=set)
    peer: str | None = None
    gave_up: float | None = None
    done: bool = False  # all its parts landed
    acked: bool = False  # it acknowledged the abort


class PushLanding:
    """Decode-worker half of push mode (see the module docstring).

    A request may have several writers (a decode rank whose heads several prefill ranks hold:
    prefill TP larger than decode TP): it has landed when every writer's parts have, and a
    given-up request quiesces when every writer has acknowledged the abort (or ``quiesce_s``).

    Parameters
    ----------
    timeout
        Seconds from :meth:`expect` until a request whose parts have not all landed fails.
    quiesce_s
        Seconds after giving up until a failed request's blocks may be reused when the prefill
        worker never acknowledges the abort (it died): at least the prefill's kvx transfer
        timeout, after which none of its writes can still be pending.
    notify
        ``notify(peer, message)``: how abort notes reach the prefill worker (``agent.notify``).
    clock
        Monotonic clock (tests pass their own).
    """

    def __init__(self, timeout: float, quiesce_s: float, notify: Callable[[str, bytes], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.quiesce_s = quiesce_s
        self._notify = notify
        self._clock = clock
        self._expect: dict[str, dict[str | None, _Expect]] = {}
        self._quiescing: dict[str, dict[str | None, _Expect]] = {}

    def expect(self, rid: str, peer: str | Sequence[str] | None, parts: int | None = None) -> None:
        """``rid``'s blocks are allocated and its destination sent to ``peer`` (the prefill
        worker; a list: every prefill worker that writes a part of them; None: any one)."""
        if rid in self._expect or rid in self._quiescing:
            raise kvx.UsageError(f"request {rid!r} is already expected")
        peers: list[str | None] = [peer] if peer is None or isinstance(peer, str) else list(peer)
        if not peers or len(set(peers)) != len(peers):
            raise kvx.UsageError(f"request {rid!r}: the writers must be distinct and at least one")
        deadline = self._clock() + self.timeout
        self._expect[rid] = {p: _Expect(parts, deadline, peer=p) for p in peers}

    def give_up(self, rid: str) -> None:
        """Decode aborts ``rid`` (client gone, request cancelled): tell its prefill workers, keep
        the blocks until every one acknowledges or ``quiesce_s`` has passed."""
        es = self._expect.pop(rid, None)
        if es is None:
            return
        now = self._clock()
        self._quiescing[rid] = es
        for e in es.values():
            e.gave_up = now
            if e.peer is not None:
                try:
                    self._notify(e.peer, abort_note(rid))
                except Exception as exc:  # the prefill is gone: the quiesce bound covers it
                    log.info("push %s: abort not delivered to %s: %s", rid, e.peer, exc)

    @staticmethod
    def _writer(es: dict[str | None, _Expect] | None, peer: str) -> _Expect | None:
        if es is None:
            return None
        e = es.get(peer)
        return e if e is not None else es.get(None)

    def poll(self, notes: dict[str, list[bytes]]) -> tuple[set[str], set[str], set[str], list[bytes]]:
        """Feed drained notifications; returns ``(landed, failed, quiesced, other messages)``.

        ``landed``: every part of every writer arrived (the request can be scheduled).
        ``failed``: deadline passed (fail the request now; do NOT reuse its blocks yet).
        ``quiesced``: failed or given-up requests whose blocks may now be freed.
        """
        landed: set[str] = set()
        quiesced: set[str] = set()
        rest: list[bytes] = []
        for peer, msgs in notes.items():
            for m in msgs:
                try:
                    parsed = parse_push_note(m)
                except kvx.ProtocolError as exc:
                    log.warning("dropping a malformed push notification from %s: %s", peer, exc)
                    continue
                if parsed is None:
                    rest.append(m)
                    continue
                kind, rid, a, b = parsed
                if kind == "part":
                    es = self._expect.get(rid)
                    e = self._writer(es, peer)
                    if es is None or e is None or e.done:
                        continue  # late (given up), not ours, or a repeat: never counts
                    if e.parts is None:
                        e.parts = b
                    elif e.parts != b:
                        continue
                    e.got.add(a)
                    if len(e.got) == e.parts:
                        e.done = True
                        if all(x.done for x in es.values()):
                            landed.add(rid)
                            del self._expect[rid]
                elif kind == "aborted":
                    q = self._quiescing.get(rid)
                    e = self._writer(q, peer)
                    if q is not None and e is not None:
                        e.acked = True
                        if all(x.acked for x in q.values()):
                            quiesced.add(rid)
                            del self._quiescing[rid]
        now = self._clock()
        failed = {rid for rid, es in self._expect.items() if any(now >= e.deadline for e in es.values())}
        for rid in failed:
            self.give_up(rid)
        for rid, q in list(self._quiescing.items()):
            if any(e.gave_up is not None and now - e.gave_up >= self.quiesce_s for e in q.values()):
                quiesced.add(rid)
                del self._quiescing[rid]
        return landed, failed, quiesced, rest

    def pending(self) -> set[str]:
        return set(self._expect) | set(self._quiescing)


# ----------------------------------------------------------------------------------------------
# registration: decode -> prefill, "here are the blocks I allocated for this request"

_REG = b"kvx-push-reg\x00"
#: bound on the blocks of one request in one KV cache group, and on the groups
MAX_BLOCKS = 1 << 20
MAX_GROUPS = 16


@dataclass(frozen=True)
class Registration:
    """A decode worker's blocks for request ``rid``: per KV cache group, its new block ids and
    their positions in the request (blocks it already holds, e.g. prefix-cache hits, are absent),
    and the decode engine's tensor-parallel size and this worker's rank."""

    rid: str
    groups: tuple[tuple[np.ndarray, np.ndarray], ...]
    tp_size: int
    tp_rank: int


def registration_note(rid: str, groups: list[tuple[list[int], list[int]]], tp_size: int, tp_rank: int) -> bytes:
    """Encode a :class:`Registration` (sent with ``agent.notify`` over kvx's side channel)."""
    body = [1, rid, tp_size, tp_rank,
            [[np.asarray(ids, "<u4").tobytes(), np.asarray(pos, "<u4").tobytes()] for ids, pos in groups]]
    return _REG + msgpack.packb(body, use_bin_type=True)


def parse_registration(m: bytes) -> Registration | None:
    """Decode a registration; None for another message; :class:`kvx.ProtocolError` for a
    malformed one (sizes, types, duplicate blocks or positions, ids out of range)."""
    if not m.startswith(_REG):
        return None
    try:
        v = msgpack.unpackb(m[len(_REG):], raw=False, max_str_len=MAX_RID, max_bin_len=4 * MAX_BLOCKS,
                            max_array_len=max(5, MAX_GROUPS), max_map_len=0)
    except Exception as e:
        raise kvx.ProtocolError(f"malformed push registration: {e}") from None
    if (not isinstance(v, list) or len(v) != 5 or v[0] != 1 or not isinstance(v[1], str) or not v[1]
            or type(v[2]) is not int or type(v[3]) is not int or not 0 <= v[3] < v[2] <= 4096
            or not isinstance(v[4], list) or not 0 < len(v[4]) <= MAX_GROUPS):
        raise kvx.ProtocolError("malformed push registration")
    groups = []
    for g in v[4]:
        if (not isinstance(g, list) or len(g) != 2 or not all(isinstance(x, bytes) for x in g)
                or len(g[0]) != len(g[1]) or len(g[0]) % 4):
            raise kvx.ProtocolError("malformed push registration group")
        ids = np.frombuffer(g[0], "<u4").astype(np.int64)
        pos = np.frombuffer(g[1], "<u4").astype(np.int64)
        if ids.size and (ids.max() >= 1 << 31 or pos.max() >= MAX_BLOCKS
                         or np.unique(ids).size != ids.size or np.unique(pos).size != pos.size):
            raise kvx.ProtocolError("push registration: block ids or positions out of range or repeated")
        groups.append((ids, pos))
    return Registration(v[1], tuple(groups), v[2], v[3])


def push_dest(tables: Any, reg: Registration, prefill_blocks: list[list[int]], peer: str, local: Any,
              remote: Any) -> PushDest:
    """The :class:`PushDest` of a registered request on the prefill worker.

    ``tables``: the :class:`~kvx_vllm.plan.PeerTables` of this (decode rank, prefill rank) pair
    built as the decode rank would for a pull (local = the decode rank's layers); ``local``: this
    worker's ``prepare(tables.remote_descs)`` (its own memory); ``remote``:
    ``prepare(tables.local_descs, peer=peer)``; ``prefill_blocks``: the request's block ids here,
    per group. Block ids beyond the tables' ranges raise :class:`kvx.ProtocolError`.
    """
    if len(reg.groups) > len(prefill_blocks):
        raise kvx.ProtocolError(f"registration names {len(reg.groups)} KV cache groups, the request has "
                                f"{len(prefill_blocks)}")
    groups = [(ids, pos, np.asarray(prefill_blocks[g], np.int64)) for g, (ids, pos) in enumerate(reg.groups)]
    per = split_by_layer(tables, groups)
    return PushDest(peer, local, remote, {n: (w, r) for n, (r, w) in per.items()})


# ----------------------------------------------------------------------------------------------
# hello: decode -> prefill, once per pair of workers: "this is how to reach my memory"

_HELLO = b"kvx-push-hello\x00"
#: bound on a hello's agent metadata (bytes) and on its layers
MAX_META = 1 << 20
MAX_LAYERS = 1 << 12


@dataclass(frozen=True)
class Hello:
    """A decode worker's kvx agent metadata (the prefill worker adds it as a peer to write into
    its memory), its layers' geometry (:meth:`kvx_vllm.plan.LayerGeom.to_list`), and the memory
    kind and device of its KV cache."""

    meta: bytes
    layout: list[Any]
    kind: int
    dev: int


def hello_note(meta: bytes, layout: list[Any], kind: int, dev: int) -> bytes:
    """Encode a :class:`Hello`."""
    return _HELLO + msgpack.packb([1, bytes(meta), list(layout), int(kind), int(dev)], use_bin_type=True)


def parse_hello(m: bytes) -> Hello | None:
    """Decode a hello; None for another message; :class:`kvx.ProtocolError` for a malformed one
    (the metadata itself is checked by ``agent.add_peer``, the layers by ``LayerGeom.from_list``)."""
    if not m.startswith(_HELLO):
        return None
    try:
        v = msgpack.unpackb(m[len(_HELLO):], raw=False, max_str_len=4096, max_bin_len=MAX_META,
                            max_array_len=MAX_LAYERS, max_map_len=0)
    except Exception as e:
        raise kvx.ProtocolError(f"malformed push hello: {e}") from None
    if (not isinstance(v, list) or len(v) != 5 or v[0] != 1 or not isinstance(v[1], bytes)
            or not isinstance(v[2], list) or not v[2] or type(v[3]) is not int or type(v[4]) is not int
            or not 0 <= v[4] < 1 << 16):
        raise kvx.ProtocolError("malformed push hello")
    try:
        kvx.MemoryKind(v[3])
    except ValueError:
        raise kvx.ProtocolError(f"push hello: unknown memory kind {v[3]}") from None
    return Hello(v[1], v[2], v[3], v[4])


def is_push_message(m: bytes) -> bool:
    """Whether ``m`` belongs to push mode (a part, abort, registration or hello)."""
    return m.startswith(b"kvx-push")
