"""The ``kvx`` PD transfer backend: SGLang prefill -> decode KV transfer over kvx agents.

It reuses SGLang's common machinery (``CommonKVManager``/``CommonKVSender``/
``CommonKVReceiver``/``CommonKVBootstrapServer``): the HTTP bootstrap server, the ZMQ control
sockets, room statuses, heartbeats (a dead prefill fails its rooms), aborts. What it adds is
the data path: each rank registers its KV buffers and metadata (aux) buffers with a
:class:`kvx.Agent`; a decode rank sends its agent metadata, buffer layout and attention-TP
place once, and per request the page indices it allocated; the prefill rank's worker then
writes the request's pages -- all layers, one kvx transfer -- and the aux row straight into the
decode rank's memory and reports the room's status on the control socket. Every remote
descriptor is validated by kvx against the decode agent's registrations.

Prefill and decode of different attention-TP sizes (:mod:`kvx_sglang.pdplan`): with MHA each
(prefill rank, decode rank) pair moves the heads both hold -- a run inside every token's row --
from per-token descriptor lists made once per peer; of prefill ranks holding the same replicated
heads for one decode rank only the first sends (the others complete the room). MLA keeps whole
pages (SGLang marks the extra prefill ranks ``is_dummy``; they send nothing and answer).
State pools (Mamba/SWA/DSA, ``KVArgs.state_types``) are refused when the manager is built.

Installed into SGLang through the ``sglang.srt.plugins`` entry point (:mod:`kvx_sglang.plugin`):
``--disaggregation-transfer-backend kvx``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import uuid
from typing import Any

import msgpack
import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

import kvx
from kvx import DescList, MemoryKind

from .pdplan import Mode, Pair, PlanError, page_rows, plan_pair, slice_descs

log = logging.getLogger(__name__)

__all__ = ["KVXKVBootstrapServer", "KVXKVManager", "KVXKVReceiver", "KVXKVSender"]

GUARD = b"KVX-SGL1"
_REG, _XFER = b"REG", b"XFER"
#: Bounds on what a peer may send (a registration message, a request's page list).
MAX_BUFFERS = 1 << 14
MAX_META = 1 << 24
MAX_PAGES = 1 << 24


def _timeout() -> float:
    """Bound on one request's transfer (seconds); SGLang's own waiting timeout caps it."""
    from sglang.srt.environ import envs

    return float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get())


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a rank's buffers are: ``(ptr, nbytes, item_bytes)`` per KV and aux buffer; and its
    place: attention-TP size and rank, total KV heads, tokens per page, MLA or not."""

    kv: tuple[tuple[int, int, int], ...]
    aux: tuple[tuple[int, int, int], ...]
    kind: int
    dev: int
    tp: int = 1
    rank: int = 0
    heads: int = 0
    page: int = 1
    mla: bool = False

    def pack(self) -> bytes:
        return msgpack.packb({"v": 2, "kv": self.kv, "aux": self.aux, "kind": self.kind, "dev": self.dev,
                              "tp": self.tp, "rank": self.rank, "heads": self.heads, "page": self.page,
                              "mla": self.mla})

    @classmethod
    def unpack(cls, b: bytes) -> "_Layout":
        try:
            d = msgpack.unpackb(b, raw=False, max_bin_len=0, max_str_len=16, max_array_len=MAX_BUFFERS,
                                max_map_len=16)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise kvx.ProtocolError(f"malformed kvx PD layout: {exc}") from exc

        def rows(x: Any) -> tuple[tuple[int, int, int], ...]:
            if not isinstance(x, list) or not all(
                    isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and 0 <= v < 1 << 63 for v in r)
                    for r in x):
                raise kvx.ProtocolError("kvx PD layout: buffers must be [ptr, nbytes, item_bytes] rows")
            if any(r[2] <= 0 or r[1] < r[2] for r in x):
                raise kvx.ProtocolError("kvx PD layout: empty buffer or item")
            return tuple(tuple(r) for r in x)  # type: ignore[misc]

        if not isinstance(d, dict) or d.get("v") != 2:
            raise kvx.ProtocolError("kvx PD layout: unknown version (prefill and decode run other kvx_sglang versions)")
        kind, dev = d.get("kind"), d.get("dev")
        if kind not in (int(MemoryKind.HOST), int(MemoryKind.CUDA)) or not isinstance(dev, int) or dev < 0:
            raise kvx.ProtocolError("kvx PD layout: bad memory kind or device")
        tp, rank, heads, page, mla = (d.get(k) for k in ("tp", "rank", "heads", "page", "mla"))
        ints = (tp, rank, heads, page)
        if (not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20 for v in ints)
                or not isinstance(mla, bool)):
            raise kvx.ProtocolError("kvx PD layout: bad attention-TP place, head count or page size")
        assert isinstance(tp, int) and isinstance(rank, int) and isinstance(heads, int) and isinstance(page, int)
        if tp < 1 or rank >= tp or page < 1:
            raise kvx.ProtocolError("kvx PD layout: bad attention-TP place, head count or page size")
        return cls(rows(d.get("kv")), rows(d.get("aux")), kind, dev, tp, rank, heads, page, mla)


def _blocks(rows: tuple[tuple[int, int, int], ...], kind: MemoryKind, dev: int) -> tuple[DescList, np.ndarray]:
    """One descriptor per item of every buffer, buffer-major; and each buffer's first row."""
    counts = np.array([n // item for _, n, item in rows], dtype=np.int64)
    base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    addr = np.concatenate([p + np.arange(c, dtype=np.int64) * item for (p, _, item), c in zip(rows, counts)])
    sizes = np.concatenate([np.full(c, item, dtype=np.int64) for (_, _, item), c in zip(rows, counts)])
    return DescList.from_arrays(kind=kind, addr=addr, nbytes=sizes, dev=dev), base


@dataclasses.dataclass
class _Peer:
    """A decode rank as the prefill rank sees it: where its pages are and how this rank fills them.

    ``PAGES``: ``kv`` has a descriptor per page of every buffer (``kv_base``: each buffer's first
    row), sent from the prefill's own per-page list. ``SLICE``: ``kv`` has a descriptor per token
    of every buffer (its head run), sent from ``src`` (the prefill's per-token list for this
    slice, ``src_base``). ``kv_pages``: pages in the smallest decode buffer.
    """

    name: str
    pair: Pair | None
    kv: kvx.PreparedList | None
    kv_base: np.ndarray
    kv_pages: int
    aux: kvx.PreparedList | None
    aux_base: np.ndarray
    aux_count: np.ndarray
    src: kvx.PreparedList | None = None
    src_base: np.ndarray | None = None
    error: str | None = None


@dataclasses.dataclass
class _TransferInfo:
    """One decode rank's part of a room (``endpoint``/``dst_port``/``is_dummy`` are read by
    SGLang's common code)."""

    room: int
    endpoint: str
    dst_port: int
    session: str
    kv_indices: np.ndarray
    aux_index: int | None
    required_dst_info_num: int
    is_dummy: bool
    decode_prefix_len: int


class KVXKVManager(CommonKVManager):
    """Per-rank transfer state: a kvx agent over this rank's KV and aux buffers."""

    kv_status_msg_tag = b"KVX_STATUS"
    kv_status_msg_carries_reason = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        states = [getattr(t, "value", t) for t in (getattr(args, "state_types", None) or [])]
        if states or any(getattr(args, "state_data_ptrs", None) or []):
            raise kvx.UsageError(
                f"the kvx PD transfer backend moves KV pages and metadata rows, not state pools; this model "
                f"has {', '.join(map(str, states)) or 'state buffers'} (Mamba/SWA/DSA state): use "
                "--disaggregation-transfer-backend mooncake or nixl for it")
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        on_gpu = str(getattr(server_args, "device", "cuda")) not in ("cpu", "")
        self.mem_kind = MemoryKind.CUDA if on_gpu else MemoryKind.HOST
        self.dev = int(args.gpu_id) if on_gpu else 0
        mode = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.agent = kvx.Agent(f"sglang-{mode}-{args.engine_rank}-{uuid.uuid4().hex[:12]}")
        self.session_id = self.agent.name
        heads = int(getattr(args, "total_kv_head_num", 0) or 0) or \
            int(getattr(args, "kv_head_num", 0) or 0) * int(self.attn_tp_size)
        self.layout = _Layout(
            kv=tuple((int(p), int(n), int(i)) for p, n, i in zip(args.kv_data_ptrs, args.kv_data_lens,
                                                                    args.kv_item_lens)),
            aux=tuple((int(p), int(n), int(i)) for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens,
                                                                     args.aux_item_lens)),
            kind=int(self.mem_kind), dev=self.dev, tp=int(self.attn_tp_size),
            rank=int(args.engine_rank) % int(self.attn_tp_size), heads=heads, page=int(args.page_size),
            mla=bool(is_mla_backend))
        self._regs: list[kvx.Registration] = []
        self.kv_local, self.kv_base = self._register(self.layout.kv, self.mem_kind, self.dev)
        self.kv_pages = min((n // i for _, n, i in self.layout.kv), default=0)
        self._slices: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[kvx.PreparedList, np.ndarray]] = {}
        self.pages_sent = 0  # (page, decode rank) pairs this prefill rank wrote KV bytes for
        self.aux_local: kvx.PreparedList | None = None
        self.aux_base: np.ndarray = np.zeros(0, np.int64)
        if self.layout.aux:
            self.aux_local, self.aux_base = self._register(self.layout.aux, MemoryKind.HOST, 0)
        self._peers: dict[str, _Peer] = {}
        self._peers_lock = threading.Lock()
        self._stop = threading.Event()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.transfer_infos: dict[int, dict[str, _TransferInfo]] = {}  # type: ignore[assignment]
            self._queue: queue.Queue[Any] = queue.Queue()
            threading.Thread(target=self._worker, name="kvx-pd-worker", daemon=True).start()
            self._control = threading.Thread(target=self._prefill_control, name="kvx-pd-control", daemon=True)
        else:
            self._control = threading.Thread(target=self._decode_control, name="kvx-pd-control", daemon=True)
            self._start_heartbeat_checker_thread()
        self._control.start()

    def _register(self, rows: tuple[tuple[int, int, int], ...], kind: MemoryKind,
                  dev: int) -> tuple[kvx.PreparedList, np.ndarray]:
        reg = self.agent.register([kvx.RawRegion(p, n, kind, dev) for p, n, _ in rows])
        self._regs.append(reg)
        descs, base = _blocks(rows, kind, dev)
        return self.agent.prepare(descs), base

    def _src_slice(self, pair: Pair) -> tuple[kvx.PreparedList, np.ndarray]:
        """This rank's strided list of one head run, a descriptor per page (made once per distinct
        run, shared by peers)."""
        key = (pair.src_off, pair.nbytes)
        got = self._slices.get(key)
        if got is None:
            kv = self.layout.kv
            descs, base = slice_descs([r[0] for r in kv], [r[1] for r in kv], [r[2] for r in kv],
                                      self.layout.page, pair.src_off, pair.nbytes, kind=self.mem_kind, dev=self.dev)
            got = (self.agent.prepare(descs), base)
            self._slices[key] = got
        return got

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """SGLang's KV checksum covers the prefill rank's pages; a decode rank of another TP size
        (MHA) holds other heads, so it cannot compare."""
        info = getattr(self, "prefill_info_table", {}).get(bootstrap_addr)
        return info is None or bool(self.is_mla_backend) or int(info.attn_tp_size) == int(self.attn_tp_size)

    # -- decode side: the messages a receiver sends --------------------------------------------
    def build_receiver_registration_message(self) -> list[bytes]:
        return [GUARD, _REG, self.session_id.encode(), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), self.agent.metadata(), self.layout.pack()]

    def build_receiver_metadata_message(self, *, bootstrap_room: int, required_dst_info_num: int,
                                        kv_indices: Any, aux_index: int | None, state_indices: Any,
                                        decode_prefix_len: int | None, is_dummy: bool,
                                        device_kv_indices: Any = None) -> list[bytes]:
        if state_indices and any(s is not None and len(s) for s in state_indices):
            raise NotImplementedError("the kvx PD backend moves KV pages and aux rows; not state pools "
                                      "(Mamba/SWA/DSA) yet")
        idx = b"" if is_dummy else np.asarray(kv_indices, dtype=np.int32).tobytes()
        return [GUARD, _XFER, str(bootstrap_room).encode("ascii"), self.local_ip.encode("ascii"),
                str(self.rank_port).encode("ascii"), self.session_id.encode(), idx,
                str(-1 if aux_index is None else int(aux_index)).encode("ascii"),
                str(required_dst_info_num).encode("ascii"), str(int(is_dummy)).encode("ascii"),
                str(int(decode_prefix_len or 0)).encode("ascii")]

    def _recv(self) -> list[bytes] | None:
        """The next control message; None when stopping. The control thread owns the socket (a
        ZMQ socket is not thread-safe): it polls, and closes it when the manager closes."""
        sock = self.server_socket
        while not self._stop.is_set():
            if sock.poll(200):
                return sock.recv_multipart()
        sock.close(linger=0)
        return None

    def _decode_control(self) -> None:
        while True:
            try:
                msg = self._recv()
            except Exception:
                log.exception("kvx PD: decode control socket failed")
                return
            if msg is None:
                return
            if self.handle_abort_ack_message(msg):
                continue
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                log.warning("kvx PD: unexpected control message dropped")
                continue
            room, status, rank, reason = parsed
            self.apply_prefill_status(bootstrap_room=room, status=status, prefill_rank=rank, failure_reason=reason)

    # -- prefill side ---------------------------------------------------------------------------
    def _prefill_control(self) -> None:
        while True:
            try:
                msg = self._recv()
            except Exception:
                log.exception("kvx PD: prefill control socket failed")
                return
            if msg is None:
                return
            try:
                if msg and msg[0] == ABORT_TAG:
                    self._on_abort(msg)
                elif self._handle_bootstrap_message(msg):
                    pass
                elif len(msg) >= 2 and msg[0] == GUARD and msg[1] == _REG:
                    self._on_register(msg)
                elif len(msg) >= 2 and msg[0] == GUARD and msg[1] == _XFER:
                    self._on_transfer_info(msg)
                else:
                    log.warning("kvx PD: foreign control message dropped")
            except (kvx.KVXError, ValueError, UnicodeDecodeError) as exc:
                log.warning("kvx PD: bad control message dropped: %s", exc)

    def _on_abort(self, msg: list[bytes]) -> None:
        note = AbortNotification.from_zmq(msg)
        if note is None:
            return
        room = note.room
        if room in self.request_status and self.check_status(room) != KVPoll.Success:
            self.record_failure(room, "Aborted by decode-side abort notification.")
            self.update_status(room, KVPoll.Failed)

    def _on_register(self, msg: list[bytes]) -> None:
        if len(msg) != 7 or len(msg[5]) > MAX_META or len(msg[6]) > MAX_META:
            raise kvx.ProtocolError("kvx PD: malformed registration")
        session = msg[2].decode()
        layout = _Layout.unpack(msg[6])
        peer = self.agent.add_peer(bytes(msg[5]))
        err = None
        pair: Pair | None = None
        me = self.layout
        try:
            if layout.page != me.page:
                raise PlanError(f"decode pages hold {layout.page} tokens, this prefill's {me.page}")
            if layout.mla != me.mla:
                raise PlanError("one side has an MLA KV pool, the other not")
            if not me.mla and layout.tp != me.tp and layout.heads != me.heads:
                raise PlanError(f"decode has {layout.heads} KV heads in all, this prefill {me.heads}")
            pair = plan_pair(mla=me.mla, src_tp=me.tp, src_rank=me.rank, dst_tp=layout.tp, dst_rank=layout.rank,
                             total_heads=me.heads, page_size=me.page, src_items=[r[2] for r in me.kv],
                             dst_items=[r[2] for r in layout.kv])
        except PlanError as exc:
            err = f"decode {session} (attention TP {layout.rank}/{layout.tp}) cannot take this prefill's KV: {exc}"
        kind = MemoryKind(layout.kind)
        kv: kvx.PreparedList | None = None
        src = src_base = None
        kv_base = np.zeros(0, np.int64)
        kv_pages = min((n // i for _, n, i in layout.kv), default=0)
        if pair is not None and pair.mode is Mode.PAGES:
            kv_descs, kv_base = _blocks(layout.kv, kind, layout.dev)
            kv = self.agent.prepare(kv_descs, peer=peer)
        elif pair is not None and pair.mode is Mode.SLICE:
            kv_descs, kv_base = slice_descs([r[0] for r in layout.kv], [r[1] for r in layout.kv],
                                            [r[2] for r in layout.kv], layout.page, pair.dst_off, pair.nbytes,
                                            kind=kind, dev=layout.dev)
            kv = self.agent.prepare(kv_descs, peer=peer)
            src, src_base = self._src_slice(pair)
        aux = None
        aux_base = np.zeros(0, np.int64)
        aux_count = np.zeros(0, np.int64)
        if layout.aux:
            self.check_peer_aux_buffer_count(session, len(layout.aux))
            aux_descs, aux_base = _blocks(layout.aux, MemoryKind.HOST, 0)
            aux = self.agent.prepare(aux_descs, peer=peer)
            aux_count = np.array([n // i for _, n, i in layout.aux], dtype=np.int64)
        with self._peers_lock:
            self._peers[session] = _Peer(peer, pair, kv, kv_base, kv_pages, aux, aux_base, aux_count, src, src_base,
                                         err)
        log.debug("kvx PD: registered decode %s (%s)", session, pair.mode.value if pair else err)

    def _on_transfer_info(self, msg: list[bytes]) -> None:
        if len(msg) != 11 or len(msg[6]) > 4 * MAX_PAGES or len(msg[6]) % 4:
            raise kvx.ProtocolError("kvx PD: malformed transfer request")
        room = int(msg[2])
        info = _TransferInfo(room=room, endpoint=msg[3].decode("ascii"), dst_port=int(msg[4]),
                             session=msg[5].decode(), kv_indices=np.frombuffer(msg[6], dtype=np.int32).copy(),
                             aux_index=None if int(msg[7]) < 0 else int(msg[7]),
                             required_dst_info_num=int(msg[8]), is_dummy=bool(int(msg[9])),
                             decode_prefix_len=int(msg[10]))
        infos = self.transfer_infos.setdefault(room, {})
        infos[info.session] = info
        if len(infos) == info.required_dst_info_num:
            self.req_to_decode_prefix_len[room] = info.decode_prefix_len
            self.update_status(room, KVPoll.WaitingForInput)

    def add_transfer_request(self, bootstrap_room: int, kv_indices: Any, index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: Any = None, **_: Any) -> None:
        """Queue one chunk of a room's pages (called by the sender on the scheduler thread)."""
        if state_indices and any(s is not None and len(s) for s in state_indices):
            self.conclude_failure(bootstrap_room=bootstrap_room,
                                  failure_reason="the kvx PD backend does not move state pools yet")
            return
        self.update_status(bootstrap_room, KVPoll.Transferring)
        self._queue.put((bootstrap_room, np.asarray(kv_indices, dtype=np.int64), index_slice, is_last_chunk,
                         aux_index))

    def _worker(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            room, src_pages, sl, last, aux_index = item
            if self.request_status.get(room) == KVPoll.Failed or room not in self.request_status:
                if room in self.request_status:
                    self.conclude_failure(bootstrap_room=room, failure_reason=self.failure_records.get(
                        room, "room failed before its transfer"))
                continue
            try:
                self._send(room, src_pages, sl, last, aux_index)
            except Exception as exc:  # every failure becomes the room's Failed status, with its reason
                log.warning("kvx PD: room %s failed: %s", room, exc)
                self.conclude_failure(bootstrap_room=room, failure_reason=f"kvx transfer failed: {exc}")
                continue
            if last:
                self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)

    def _send(self, room: int, src_pages: np.ndarray, sl: slice, last: bool, aux_index: int | None) -> None:
        infos = self.transfer_infos.get(room)
        if not infos:
            raise kvx.UsageError(f"room {room} has no decode destination")
        timeout = _timeout()
        xfers = []
        for info in list(infos.values()):
            if info.is_dummy:
                continue
            with self._peers_lock:
                peer = self._peers.get(info.session)
            if peer is None:
                raise kvx.UsageError(f"decode {info.session} never registered")
            if peer.error:
                raise kvx.UsageError(peer.error)
            dst_pages = info.kv_indices[sl].astype(np.int64)
            if dst_pages.shape != src_pages.shape:
                raise kvx.UsageError(f"{src_pages.size} source pages but {dst_pages.size} destination pages")
            assert peer.pair is not None
            if src_pages.size and peer.pair.mode is not Mode.SKIP:
                assert peer.kv is not None
                if int(dst_pages.min()) < 0 or int(dst_pages.max()) >= peer.kv_pages:
                    raise kvx.UsageError("destination page index outside the decode KV pool")
                if int(src_pages.min()) < 0 or int(src_pages.max()) >= self.kv_pages:
                    raise kvx.UsageError("source page index outside this prefill's KV pool")
                if peer.pair.mode is Mode.PAGES:
                    xfers.append(self.agent.write(self.kv_local, page_rows(self.kv_base, src_pages), peer.kv,
                                                  page_rows(peer.kv_base, dst_pages)))
                else:
                    assert peer.src is not None and peer.src_base is not None
                    xfers.append(self.agent.write(peer.src, page_rows(peer.src_base, src_pages), peer.kv,
                                                  page_rows(peer.kv_base, dst_pages)))
                self.pages_sent += int(src_pages.size)
            if last and aux_index is not None and info.aux_index is not None and peer.aux is not None \
                    and self.aux_local is not None:
                n = min(len(self.aux_base), len(peer.aux_base))
                if not 0 <= info.aux_index < int(peer.aux_count[:n].min()):
                    raise kvx.UsageError("destination aux index outside the decode metadata buffers")
                xfers.append(self.agent.write(self.aux_local, self.aux_base[:n] + aux_index, peer.aux,
                                              peer.aux_base[:n] + info.aux_index))
        for x in xfers:
            x.wait(timeout)

    # -- lifecycle ------------------------------------------------------------------------------
    def teardown(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker, release the buffers, close the agent."""
        if self._stop.is_set():
            return
        self._stop.set()
        if hasattr(self, "_queue"):
            self._queue.put(None)
        if hasattr(self, "_heartbeat_shutdown"):
            self._heartbeat_shutdown.set()
        for r in self._regs:
            try:
                r.release()
            except kvx.KVXError:
                pass
        self.agent.close()
        self._control.join(5.0)  # it closes the control socket (within one 200 ms poll)


class KVXKVSender(CommonKVSender):
    """Prefill side of one request (SGLang's common sender; the manager moves the bytes)."""

    def abort(self) -> None:
        """Fail the room here and tell its decode ranks at once (not at their timeout)."""
        targets = self.kv_mgr._room_notify_targets(self.bootstrap_room)
        super().abort()
        if targets:
            self.kv_mgr.send_kv_status_message(targets=targets, bootstrap_room=self.bootstrap_room,
                                               status=KVPoll.Failed, failure_reason="Aborted by the prefill side")


class KVXKVReceiver(CommonKVReceiver):
    """Decode side of one request (SGLang's common receiver; pages land by kvx writes)."""


class KVXKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's HTTP bootstrap server, unchanged."""
