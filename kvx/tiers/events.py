"""KV events in vLLM's format, published over ZMQ and to Python callbacks.

A batch is msgpack ``[ts, [event, ...]]`` where an event is ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium]`` or ``["BlockRemoved",
block_hashes, medium]`` (vLLM's ``KVEventBatch``: msgspec tagged array-like structs). The PUB
socket sends ``[topic, seq (8 bytes, big endian), payload]``; a ROUTER replay socket answers a
DEALER that sends a start sequence number with every buffered batch from there, then an empty
payload with sequence -1 -- the protocol of vLLM's ``ZmqEventPublisher``, so KV-aware routers
(vLLM's, Dynamo's) can subscribe to a kvx store as to an engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..errors import BackendUnavailable

__all__ = ["BlockStored", "BlockRemoved", "EventBus", "ZmqEventPublisher", "encode_batch", "decode_batch"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[Hashable]
    parent_block_hash: Hashable | None
    medium: str
    block_size: int = 0
    token_ids: list[int] = field(default_factory=list)
    lora_id: int | None = None

    def encode(self) -> list[Any]:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[Hashable]
    medium: str

    def encode(self) -> list[Any]:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


Event = BlockStored | BlockRemoved


def encode_batch(events: list[Event], ts: float | None = None) -> bytes:
    """One vLLM ``KVEventBatch`` as msgpack bytes."""
    return msgpack.packb([time.time() if ts is None else ts, [e.encode() for e in events]], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[Event]]:
    """Inverse of :func:`encode_batch` (for tests and subscribers without msgspec)."""
    ts, evs = msgpack.unpackb(payload, raw=False)[:2]
    out: list[Event] = []
    for e in evs:
        if e[0] == "BlockStored":
            out.append(BlockStored(e[1], e[2], e[6], e[4], e[3], e[5]))
        elif e[0] == "BlockRemoved":
            out.append(BlockRemoved(e[1], e[2]))
    return ts, out


class EventBus:
    """Collects events and hands them to subscribers in batches (one per store operation)."""

    def __init__(self) -> None:
        self._subs: list[Callable[[list[Event]], None]] = []
        self._lock = threading.Lock()

    def subscribe(self, fn: Callable[[list[Event]], None]) -> Callable[[], None]:
        """Call ``fn(events)`` for every batch; returns an unsubscribe function."""
        with self._lock:
            self._subs.append(fn)

        def off() -> None:
            with self._lock:
                if fn in self._subs:
                    self._subs.remove(fn)

        return off

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def emit(self, events: list[Event]) -> None:
        if not events or not self._subs:
            return
        for fn in list(self._subs):
            try:
                fn(events)
            except Exception:
                log.exception("KV event subscriber failed")


class ZmqEventPublisher:
    """Publish event batches on a ZMQ PUB socket with a replay ROUTER socket (vLLM protocol).

    Parameters
    ----------
    endpoint
        PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
    replay_endpoint
        ROUTER endpoint for replays, or None.
    topic
        Topic frame (vLLM's default is empty).
    buffer
        Recent batches kept for replay.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer: int = 10000) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise BackendUnavailable("ZMQ KV events need pyzmq: pip install pyzmq") from exc
        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = 0
        self._buf: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._router = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self._router.bind(replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve_replay, name="kvx-events-replay", daemon=True)
            self._thread.start()

    def __call__(self, events: list[Event]) -> None:
        self.publish(events)

    def publish(self, events: list[Event]) -> int:
        """Send one batch; returns its sequence number."""
        payload = encode_batch(events)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buf.append((seq, payload))
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    def _serve_replay(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        assert self._router is not None
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 2 or len(frames[-1]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[-1], "big")
            with self._lock:
                items = [(s, p) for s, p in self._buf if s >= start]
            for s, p in items:
                self._router.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
            self._router.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        if self._router is not None:
            self._thread.join(2)
            self._router.close(0)
        self._pub.close(0)
