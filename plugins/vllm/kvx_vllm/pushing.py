"""Push mode inside the connector's workers: :mod:`kvx_vllm.push`'s halves wired to vLLM's steps.

Decode worker (:class:`DecodePush`): a push request's blocks are allocated as soon as it
arrives; the worker connects to each prefill worker it reads from (side channel, as for a pull:
one, or several when the prefill's TP is larger and each holds part of this rank's heads),
introduces itself once (:func:`~kvx_vllm.push.hello_note`: its agent metadata and layers), and
sends each a :func:`~kvx_vllm.push.registration_note` with the request's new block ids and their
positions. :class:`~kvx_vllm.push.PushLanding` counts the writes' notifications; the request is
reported loaded when every writer's have landed, and failed (its blocks invalid, recomputed or failed by
vLLM's policy) once it has passed ``push_timeout_s`` AND the prefill has confirmed that nothing of
it is in flight (or a second ``push_timeout_s`` has passed: the prefill is gone). A request
aborted while it waits keeps its blocks (delayed free) until the same confirmation.

Prefill worker (:class:`PrefillPush`): registrations arrive as notifications. A request that
completes its prefill in a step whose decode has registered already is written during the
forward pass by a :class:`~kvx_vllm.push.LayerPusher` (layer by layer, or whole after the last
layer); one whose registration comes later (or that needs several writers) is written whole
from its finished blocks, which the scheduler keeps (delayed free) for ``push_timeout_s``. The
blocks are freed as soon as the writes are done, failed, or the bound has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

import kvx

from .metadata import PushSpec, RecvSpec, SendSpec
from .plan import LayerGeom, PeerTables, read_plan
from .push import (
    LayerPusher,
    PushLanding,
    Registration,
    aborted_note,
    hello_note,
    is_push_message,
    parse_hello,
    parse_push_note,
    parse_registration,
    push_dest,
    push_note,
    registration_note,
)

if TYPE_CHECKING:
    from .worker import KVXWorker

__all__ = ["DecodePush", "PrefillPush", "split_notes"]

log = logging.getLogger(__name__)


#: registrations kept per decode peer whose introduction has not arrived yet, and their bytes
#: (a registration may be ~128 MiB: the count alone would not bound the memory a peer can pin)
MAX_HELD_PER_PEER = 256
MAX_HELD_BYTES_PER_PEER = 64 << 20


def split_notes(notes: dict[str, list[bytes]]) -> tuple[dict[str, list[bytes]], dict[str, list[bytes]]]:
    """``(push messages, other messages)``, both per peer."""
    push: dict[str, list[bytes]] = {}
    rest: dict[str, list[bytes]] = {}
    for peer, msgs in notes.items():
        for m in msgs:
            (push if is_push_message(m) else rest).setdefault(peer, []).append(m)
    return push, rest


def _heads(worker: "KVXWorker") -> int:
    return 1 if worker.compat.get("mla") else int(worker.compat["num_kv_heads"])


# ==============================================================================================
class DecodePush:
    """Decode-worker side of push mode (see the module docstring)."""

    def __init__(self, worker: "KVXWorker") -> None:
        self.w = worker
        cfg = worker.cfg
        self._lock = threading.Lock()
        self.landing = PushLanding(cfg.push_timeout_s, cfg.push_timeout_s, self._notify)
        self._hello: set[str] = set()  # prefill peers introduced to
        # push id -> (vLLM request id, local blocks)
        self._reqs: dict[str, tuple[str, list[int]]] = {}
        self._failed_early: list[str] = []  # push ids whose registration could not be sent
        self._aborted: set[str] = set()  # push ids aborted by vLLM (delayed free: report sending)
        self._gave_up: set[str] = set()  # push ids failed by deadline, waiting to quiesce
        self._send_now: list[str] = []  # aborted requests whose blocks are free to go

    def _notify(self, peer: str, msg: bytes) -> None:
        self.w.agent.notify(peer, msg)

    def start(self, spec: RecvSpec) -> None:
        """Register a request's blocks with its prefill worker (on a pool thread: connecting a
        new prefill worker takes a handshake)."""
        push_id = str(spec.params["kvx_push"])
        local = [b for g in spec.local_block_ids for b in g]
        with self._lock:
            if push_id in self._reqs:
                log.warning("kvx_vllm: push id %s used twice; the second request is computed locally", push_id)
                self.w._invalid.update(local)
                return
            self._reqs[push_id] = (spec.req_id, local)
        self.w._pull_pool.submit(self._register, spec, push_id)

    def _register(self, spec: RecvSpec, push_id: str) -> None:
        w = self.w
        try:
            reads, _notify, _payload = w._check_params(spec)
            # every prefill rank that holds heads of this rank writes them (prefill TP larger
            # than decode TP: several, each into its slice of the same blocks)
            peers: list[str] = []
            for entry, *_heads_of in reads:
                if entry[0] in peers:
                    continue
                peer = w._peer(entry)
                if peer.name not in self._hello:
                    w.agent.notify(peer.name, hello_note(w.agent.metadata(), [g.to_list() for g in w.geoms],
                                                         int(w.kind), w.dev))
                    self._hello.add(peer.name)
                peers.append(peer.name)
            pos = spec.local_pos or [list(range(len(g))) for g in spec.local_block_ids]
            groups = [(list(ids), list(p)) for ids, p in zip(spec.local_block_ids, pos)]
            with self._lock:
                self.landing.expect(push_id, peers)
            note = registration_note(push_id, groups, int(w.compat["tp_size"]), w.tp_rank)
            for name in peers:
                w.agent.notify(name, note)
        except Exception as exc:
            log.error("kvx_vllm: registering push %s with the prefill worker failed: %s", push_id, exc)
            w._count(pull_failures=1)
            with self._lock:
                if push_id in self.landing.pending():
                    # the registration may have left: wait for the prefill's confirmation/bound
                    self.landing.give_up(push_id)
                    self._gave_up.add(push_id)
                else:
                    self._failed_early.append(push_id)
            if isinstance(exc, kvx.PeerDisconnected):
                for e in (spec.params.get("remote_agents") or {}).values():
                    if isinstance(e, (list, tuple)) and e and isinstance(e[0], str):
                        w._forget_peer(e[0])
                        self._hello.discard(e[0])

    def abort(self, spec: RecvSpec) -> None:
        """vLLM finished (aborted) a request still waiting for its writes: tell the prefill,
        free the blocks once nothing of it can land any more."""
        push_id = str(spec.params.get("kvx_push"))
        with self._lock:
            if push_id not in self._reqs:  # landed or failed already: nothing can land any more
                self._send_now.append(spec.req_id)
                return
            self._aborted.add(push_id)
            if push_id in self.landing.pending() and push_id not in self._gave_up:
                self.landing.give_up(push_id)
                self._gave_up.add(push_id)

    def poll(self, notes: dict[str, list[bytes]]) -> tuple[set[str], set[str], set[str], list[int]]:
        """``(recving, failed, sending, bad blocks)`` of vLLM request ids."""
        recving: set[str] = set()
        failed: set[str] = set()
        sending: set[str] = set()
        bad: list[int] = []
        with self._lock:
            landed, late, quiesced, _rest = self.landing.poll(notes)
            if late:
                log.warning("kvx_vllm: %d push(es) not landed within %.0f s: %s", len(late),
                            self.w.cfg.push_timeout_s, sorted(late)[:3])
                self._gave_up |= late
            early, self._failed_early = self._failed_early, []
            sending.update(self._send_now)
            self._send_now = []
            for push_id in landed:
                rid, _blocks = self._reqs.pop(push_id)
                if push_id in self._aborted:
                    self._aborted.discard(push_id)
                    sending.add(rid)
                else:
                    recving.add(rid)
                    self.w._count(pulls=1, pulled_blocks=len(_blocks))
            for push_id in list(quiesced) + early:
                self._gave_up.discard(push_id)
                st = self._reqs.pop(push_id, None)
                if st is None:
                    continue
                rid, blocks = st
                if push_id in self._aborted:
                    self._aborted.discard(push_id)
                    sending.add(rid)
                else:
                    recving.add(rid)
                    failed.add(rid)
                    bad.extend(blocks)
        return recving, failed, sending, bad

    def pending(self) -> bool:
        with self._lock:
            return bool(self._reqs)


# ==============================================================================================
class _Decoder:
    """A decode worker this prefill worker writes to: its layers and the prepared lists of each
    head range (built once)."""

    __slots__ = ("dev", "geoms", "kind", "lists", "name")

    def __init__(self, name: str, geoms: list[LayerGeom], kind: kvx.MemoryKind, dev: int) -> None:
        self.name, self.geoms, self.kind, self.dev = name, geoms, kind, dev
        self.lists: dict[tuple[int, int, int], tuple[PeerTables, Any, Any]] = {}


class PrefillPush:
    """Prefill-worker side of push mode (see the module docstring)."""

    def __init__(self, worker: "KVXWorker") -> None:
        self.w = worker
        cfg = worker.cfg
        names = [g.name for g in worker.geoms]
        group = cfg.push_group if cfg.layerwise else len(names)
        self.pusher = LayerPusher(worker.agent, names, group=group, timeout=cfg.push_timeout_s,
                                  threaded=worker.kind == kvx.MemoryKind.CUDA)
        self._decoders: dict[str, _Decoder] = {}
        # push id -> decode peer -> (registration, time received)
        self._regs: dict[str, dict[str, tuple[Registration, float]]] = {}
        self._new: list[str] = []  # push ids registered since the last report to the scheduler
        self._in_pass: dict[str, str] = {}  # push id -> vLLM request id, pushed in this pass
        self._pushed: dict[str, tuple[bool, float]] = {}  # push id -> (ok, when) of in-pass pushes
        # finished requests waiting to be written: push id -> [req id, groups, deadline]
        self._finished: dict[str, list[Any]] = {}
        # late writes: push id -> decode peer -> transfer
        self._late: dict[str, dict[str, Any]] = {}
        self._expect: dict[int, int] = {}  # decode TP size -> decode ranks writing from this rank
        self._aborted: dict[str, float] = {}  # push ids a decode worker gave up on -> when
        # registrations from peers whose introduction has not come yet: peer -> [(message, when)]
        self._unintroduced: dict[str, list[tuple[bytes, float]]] = {}
        self._pass_started = False
        #: counters: requests pushed in the forward pass, written whole afterwards, failed
        self.stats = {"pushed_in_pass": 0, "pushed_late": 0, "push_failures": 0}

    # -- registrations ---------------------------------------------------------------------------
    def handle(self, notes: dict[str, list[bytes]]) -> None:
        """Act on push messages from decode workers."""
        now = time.monotonic()
        for peer, msgs in notes.items():
            todo = [(m, now) for m in msgs]
            while todo:
                m, t = todo.pop(0)
                try:
                    todo[:0] = self._one(peer, m, t)  # an introduction releases what overtook it
                except Exception as exc:  # a peer's bad message never stops the engine
                    log.warning("kvx_vllm: dropping a push message from %s: %s", peer, exc)

    def _one(self, peer: str, m: bytes, now: float) -> list[tuple[bytes, float]]:
        """Act on one message; returns the held registrations it releases (to act on next)."""
        hello = parse_hello(m)
        if hello is not None:
            name = self.w.agent.parse_metadata(hello.meta).name  # checked before connecting anywhere
            if name != peer:
                raise kvx.ProtocolError(f"peer {peer!r} introduced itself with the metadata of {name!r}")
            if len(hello.layout) != len(self.w.geoms):
                raise kvx.ProtocolError(f"decode worker {peer} has {len(hello.layout)} layers, this one "
                                        f"{len(self.w.geoms)}")
            geoms = [LayerGeom.from_list(v) for v in hello.layout]
            self.w.agent.add_peer(hello.meta)
            self._decoders[peer] = _Decoder(peer, geoms, kvx.MemoryKind(hello.kind), hello.dev)
            return self._unintroduced.pop(peer, [])  # registrations that overtook it
        reg = parse_registration(m)
        if reg is not None:
            if peer not in self._decoders:
                # its introduction may still be on the way (notifications to one peer can overtake
                # each other over several tcp streams): kept until it comes, within bounds
                held = self._unintroduced.setdefault(peer, [])
                if (len(held) >= MAX_HELD_PER_PEER
                        or sum(len(x) for x, _t in held) + len(m) > MAX_HELD_BYTES_PER_PEER):
                    raise kvx.ProtocolError(f"registration of {reg.rid} from {peer}, which has not introduced "
                                            f"itself ({len(held)} held already)")
                held.append((m, now))
                return []
            regs = self._regs.setdefault(reg.rid, {})
            if peer in regs:
                raise kvx.ProtocolError(f"{peer} registered {reg.rid} twice")
            regs[peer] = (reg, now)
            self._new.append(reg.rid)
            if reg.rid in self._finished:
                self._late_write(reg.rid, peer)
            return []
        parsed = parse_push_note(m)
        if parsed is not None and parsed[0] == "abort":
            self._abort(parsed[1], peer)
        return []

    def _abort(self, push_id: str, peer: str) -> None:
        if push_id in self._regs and peer not in self._regs[push_id] and push_id not in self._finished:
            return  # not this peer's request
        self._aborted[push_id] = time.monotonic()
        if self.pusher.abort(push_id, peer):
            return  # LayerPusher.abort acknowledged it
        x = self._late.get(push_id, {}).get(peer)
        if x is not None and not isinstance(x, BaseException):
            if not x.done():
                x.cancel()
            try:
                x.wait(1.0)
            except kvx.KVXError:
                pass
        regs = self._regs.get(push_id)
        if regs is not None:
            regs.pop(peer, None)
        try:  # nothing of it is (or will be) in flight to that peer any more
            self.w.agent.notify(peer, aborted_note(push_id))
        except kvx.KVXError as exc:
            log.info("kvx_vllm: abort acknowledgement for %s not delivered: %s", push_id, exc)

    def registered(self) -> list[str]:
        """Push ids registered since the last call (for the scheduler)."""
        out, self._new = self._new, []
        return out

    def _expected(self, decode_tp: int) -> int:
        """How many decode ranks of a TP ``decode_tp`` instance write... read from this rank."""
        n = self._expect.get(decode_tp)
        if n is None:
            heads, mine = _heads(self.w), self.w.tp_rank
            tp = int(self.w.compat["tp_size"])
            n = sum(1 for d in range(decode_tp) if any(r == mine for r, *_ in read_plan(heads, decode_tp, d, tp)[0]))
            self._expect[decode_tp] = n
        return n

    def _dest(self, push_id: str, peer: str, blocks: list[list[int]]) -> Any:
        reg = self._regs[push_id][peer][0]
        dec = self._decoders[peer]
        w = self.w
        mine = [x for x in read_plan(_heads(w), reg.tp_size, reg.tp_rank, int(w.compat["tp_size"]))[0]
                if x[0] == w.tp_rank]
        if len(mine) != 1:
            raise kvx.ProtocolError(f"decode rank {reg.tp_rank} of {reg.tp_size} reads no heads of this rank")
        _r, lh0, rh0, nh = mine[0]
        lists = dec.lists.get((lh0, rh0, nh))
        if lists is None:
            tabs = PeerTables(dec.geoms, w.geoms, lh0, rh0, nh, dec.kind, dec.dev, w.kind, w.dev)
            lists = (tabs, w.agent.prepare(tabs.remote_descs), w.agent.prepare(tabs.local_descs, peer=peer))
            dec.lists[(lh0, rh0, nh)] = lists
        tabs, local, remote = lists
        return push_dest(tabs, reg, blocks, peer, local, remote)

    # -- the forward pass ------------------------------------------------------------------------
    def on_layer(self, name: str, specs: list[PushSpec]) -> None:
        """``save_kv_layer``: at the pass's first layer, the requests of ``specs`` whose decode
        registered (one writer each) join the pass; then the layer's writes are posted."""
        if not self._pass_started:
            self._pass_started = True
            self.w._take_notes()  # registrations that came meanwhile
            for spec in specs:
                regs = self._regs.get(spec.push, {})
                if len(regs) != 1 or spec.push in self._aborted:
                    continue
                peer = next(iter(regs))
                reg = regs[peer][0]
                if self._expected(reg.tp_size) != 1:
                    continue
                try:
                    self.pusher.add(spec.push, self._dest(spec.push, peer, spec.block_ids))
                except Exception as exc:  # e.g. geometries that do not pair: that request only
                    log.warning("kvx_vllm: push %s not started: %s", spec.push, exc)
                    continue
                self._in_pass[spec.push] = spec.req_id
        if self._in_pass:
            self.pusher.on_layer(name, self._layer_event())

    def _layer_event(self) -> Any:
        """On a GPU, an event recorded on the current stream behind the layer's kernels: the
        poster thread posts the layer's writes once it has executed, so that the copies need not
        run on a blocking stream (``KVX_CUDA_ORDER=caller`` lets them overlap the next layers)."""
        if self.w.kind != kvx.MemoryKind.CUDA:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record()
        return ev

    def end_pass(self) -> None:
        """``wait_for_save``: wait for this pass's writes still in flight."""
        self._pass_started = False
        if not self._in_pass:
            return
        try:
            done, failed = self.pusher.wait()
        except kvx.KVXError as exc:
            log.error("kvx_vllm: push writes of this step failed: %s", exc)
            done, failed = set(), {p: exc for p in self._in_pass}
            for push_id in self._in_pass:  # cancel what is in flight; the decode is told
                self.pusher.abort(push_id)
        now = time.monotonic()
        for push_id in done:
            self._pushed[push_id] = (True, now)
            self.stats["pushed_in_pass"] += 1
        for push_id, err in failed.items():
            log.error("kvx_vllm: pushing %s failed: %s", push_id, err)
            self._pushed[push_id] = (False, now)
            self.stats["push_failures"] += 1
        for push_id in list(self._in_pass):
            if push_id in done or push_id in failed:
                del self._in_pass[push_id]
                self._regs.pop(push_id, None)

    # -- finished requests -----------------------------------------------------------------------
    def finished(self, send: SendSpec) -> bool:
        """A push request finished; True when its blocks can be freed at once (pushed in the pass
        already, or failed)."""
        st = self._pushed.pop(send.push, None)
        if st is not None or send.push in self._aborted:
            return True
        self._finished[send.push] = [send.req_id, send.groups, time.monotonic() + send.lease_s]
        for peer in list(self._regs.get(send.push, {})):
            self._late_write(send.push, peer)
        return False

    def _late_write(self, push_id: str, peer: str) -> None:
        _rid, groups, _deadline = self._finished[push_id]
        late = self._late.setdefault(push_id, {})
        if peer in late:
            return
        try:
            dest = self._dest(push_id, peer, groups)
            li = np.concatenate([v[0] for v in dest.layers.values()] or [np.empty(0, np.int64)])
            ri = np.concatenate([v[1] for v in dest.layers.values()] or [np.empty(0, np.int64)])
            note = push_note(push_id, 0, 1)
            if li.size:
                late[peer] = self.w.agent.write(dest.local, li, dest.remote, ri, notify=note)
            else:
                self.w.agent.notify(peer, note)
                late[peer] = None
        except Exception as exc:  # that request only
            log.error("kvx_vllm: writing %s to %s failed: %s", push_id, peer, exc)
            late[peer] = exc
        self.stats["pushed_late"] += 1

    def poll(self) -> list[str]:
        """vLLM request ids whose blocks can be freed now (written, failed, or past the bound)."""
        out: list[str] = []
        now = time.monotonic()
        for push_id, (rid, _groups, deadline) in list(self._finished.items()):
            late = self._late.get(push_id, {})
            regs = self._regs.get(push_id, {})
            want = self._expected(next(iter(regs.values()))[0].tp_size) if regs else 1
            if push_id in self._aborted and not regs:
                want = 0
            xs = list(late.values())
            busy = [x for x in xs if x is not None and not isinstance(x, BaseException) and not x.done()]
            if (len(xs) >= want and not busy) or now >= deadline:
                for x in busy:
                    x.cancel()
                bad = [x for x in xs if isinstance(x, BaseException)
                       or (x is not None and x.done() and x.status is not kvx.Status.DONE)]
                if bad or len(xs) < want:
                    self.stats["push_failures"] += 1
                    log.warning("kvx_vllm: push %s: %s; freeing its blocks", push_id,
                                "a write failed" if bad else "no decode registered in time")
                del self._finished[push_id]
                self._late.pop(push_id, None)
                self._regs.pop(push_id, None)
                out.append(rid)
        # registrations and results nobody asked for (the request was aborted here) expire
        for push_id, regs in list(self._regs.items()):
            if push_id not in self._finished and push_id not in self._in_pass and all(
                    now - t > 2 * self.w.cfg.push_timeout_s for _r, t in regs.values()):
                del self._regs[push_id]
        for push_id, (_ok, t) in list(self._pushed.items()):
            if now - t > 2 * self.w.cfg.push_timeout_s:
                del self._pushed[push_id]
        for push_id, t in list(self._aborted.items()):
            if now - t > 2 * self.w.cfg.push_timeout_s:
                del self._aborted[push_id]
        for peer, held in list(self._unintroduced.items()):
            kept = [(m, t) for m, t in held if now - t <= self.w.cfg.push_timeout_s]
            if len(kept) < len(held):
                log.warning("kvx_vllm: %d registration(s) from %s dropped: it never introduced itself",
                            len(held) - len(kept), peer)
            if kept:
                self._unintroduced[peer] = kept
            else:
                del self._unintroduced[peer]
        return out

    def pending(self) -> bool:
        return bool(self._finished)

    def close(self) -> None:
        self.pusher.close()
        for late in self._late.values():
            for x in late.values():
                if x is not None and not isinstance(x, BaseException) and not x.done():
                    x.cancel()
