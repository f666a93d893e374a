"""The ``kvx`` PD transfer backend: SGLang prefill -> decode KV transfer over kvx agents.

It reuses SGLang's common machinery (``CommonKVManager``/``CommonKVSender``/
``CommonKVReceiver``/``CommonKVBootstrapServer``): the HTTP bootstrap server, the ZMQ control
sockets, room statuses, heartbeats (a dead prefill fails its rooms), aborts. What it adds is
the data path: each rank registers its KV buffers (one block per page of every layer buffer)
and metadata (aux) buffers with a :class:`kvx.Agent`; a decode rank sends its agent metadata
and buffer layout once, and per request the page indices it allocated; the prefill rank's
worker then writes the request's pages -- all layers, one kvx transfer -- and the aux row
straight into the decode rank's memory and reports the room's status on the control socket.
Every remote descriptor is validated by kvx against the decode agent's registrations.

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
    """Where a rank's buffers are: ``(ptr, nbytes, item_bytes)`` per KV and aux buffer."""

    kv: tuple[tuple[int, int, int], ...]
    aux: tuple[tuple[int, int, int], ...]
    kind: int
    dev: int

    def pack(self) -> bytes:
        return msgpack.packb({"v": 1, "kv": self.kv, "aux": self.aux, "kind": self.kind, "dev": self.dev})

    @classmethod
    def unpack(cls, b: bytes) -> "_Layout":
        try:
            d = msgpack.unpackb(b, raw=False, max_bin_len=0, max_str_len=16, max_array_len=MAX_BUFFERS,
                                max_map_len=8)
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

        if not isinstance(d, dict) or d.get("v") != 1:
            raise kvx.ProtocolError("kvx PD layout: unknown version")
        kind, dev = d.get("kind"), d.get("dev")
        if kind not in (int(MemoryKind.HOST), int(MemoryKind.CUDA)) or not isinstance(dev, int) or dev < 0:
            raise kvx.ProtocolError("kvx PD layout: bad memory kind or device")
        return cls(rows(d.get("kv")), rows(d.get("aux")), kind, dev)


def _blocks(rows: tuple[tuple[int, int, int], ...], kind: MemoryKind, dev: int) -> tuple[DescList, np.ndarray]:
    """One descriptor per item of every buffer, buffer-major; and each buffer's first row."""
    counts = np.array([n // item for _, n, item in rows], dtype=np.int64)
    base = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    addr = np.concatenate([p + np.arange(c, dtype=np.int64) * item for (p, _, item), c in zip(rows, counts)])
    sizes = np.concatenate([np.full(c, item, dtype=np.int64) for (_, _, item), c in zip(rows, counts)])
    return DescList.from_arrays(kind=kind, addr=addr, nbytes=sizes, dev=dev), base


@dataclasses.dataclass
class _Peer:
    """A decode rank as the prefill rank sees it."""

    name: str
    kv: kvx.PreparedList
    kv_base: np.ndarray
    kv_count: np.ndarray
    aux: kvx.PreparedList | None
    aux_base: np.ndarray
    aux_count: np.ndarray
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
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        on_gpu = str(getattr(server_args, "device", "cuda")) not in ("cpu", "")
        self.mem_kind = MemoryKind.CUDA if on_gpu else MemoryKind.HOST
        self.dev = int(args.gpu_id) if on_gpu else 0
        mode = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.agent = kvx.Agent(f"sglang-{mode}-{args.engine_rank}-{uuid.uuid4().hex[:12]}")
        self.session_id = self.agent.name
        self.layout = _Layout(
            kv=tuple((int(p), int(n), int(i)) for p, n, i in zip(args.kv_data_ptrs, args.kv_data_lens,
                                                                    args.kv_item_lens)),
            aux=tuple((int(p), int(n), int(i)) for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens,
                                                                     args.aux_item_lens)),
            kind=int(self.mem_kind), dev=self.dev)
        self._regs: list[kvx.Registration] = []
        self.kv_local, self.kv_base = self._register(self.layout.kv, self.mem_kind, self.dev)
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
            threading.Thread(target=self._prefill_control, name="kvx-pd-control", daemon=True).start()
        else:
            threading.Thread(target=self._decode_control, name="kvx-pd-control", daemon=True).start()
            self._start_heartbeat_checker_thread()

    def _register(self, rows: tuple[tuple[int, int, int], ...], kind: MemoryKind,
                  dev: int) -> tuple[kvx.PreparedList, np.ndarray]:
        reg = self.agent.register([kvx.RawRegion(p, n, kind, dev) for p, n, _ in rows])
        self._regs.append(reg)
        descs, base = _blocks(rows, kind, dev)
        return self.agent.prepare(descs), base

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

    def _decode_control(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.server_socket.recv_multipart()
            except Exception:  # the socket was closed at teardown
                if self._stop.is_set():
                    return
                log.exception("kvx PD: decode control socket failed")
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
        while not self._stop.is_set():
            try:
                msg = self.server_socket.recv_multipart()
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("kvx PD: prefill control socket failed")
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
        if len(layout.kv) != len(self.layout.kv) or any(a[2] != b[2] for a, b in zip(layout.kv, self.layout.kv)):
            err = (f"decode {session} has {len(layout.kv)} KV buffers of other page sizes than this prefill "
                   f"({len(self.layout.kv)}): different model, TP layout or page size")
        kv_descs, kv_base = _blocks(layout.kv, MemoryKind(layout.kind), layout.dev)
        kv = self.agent.prepare(kv_descs, peer=peer)
        aux = None
        aux_base = np.zeros(0, np.int64)
        aux_count = np.zeros(0, np.int64)
        if layout.aux:
            self.check_peer_aux_buffer_count(session, len(layout.aux))
            aux_descs, aux_base = _blocks(layout.aux, MemoryKind.HOST, 0)
            aux = self.agent.prepare(aux_descs, peer=peer)
            aux_count = np.array([n // i for _, n, i in layout.aux], dtype=np.int64)
        kv_count = np.array([n // i for _, n, i in layout.kv], dtype=np.int64)
        with self._peers_lock:
            self._peers[session] = _Peer(peer, kv, kv_base, kv_count, aux, aux_base, aux_count, err)
        log.debug("kvx PD: registered decode %s", session)

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
        nbuf = len(self.layout.kv)
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
            if src_pages.size:
                if int(dst_pages.min()) < 0 or np.any(dst_pages >= peer.kv_count.min()):
                    raise kvx.UsageError("destination page index outside the decode KV pool")
                src = (self.kv_base[:nbuf, None] + src_pages[None, :]).ravel()
                dst = (peer.kv_base[:nbuf, None] + dst_pages[None, :]).ravel()
                xfers.append(self.agent.write(self.kv_local, src, peer.kv, dst))
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
        try:
            self.server_socket.close(linger=0)
        except Exception:
            pass


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
