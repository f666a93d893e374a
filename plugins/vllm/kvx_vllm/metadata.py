"""What the scheduler-side and worker-side halves of the connector tell each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - the worker driven without vLLM (bench_tp_gpu.py)

    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in base when vLLM is not installed."""

        def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
            raise NotImplementedError

__all__ = [
    "KVXConnectorMetadata",
    "KVXHandshakeMetadata",
    "KVXWorkerMetadata",
    "LayerLayout",
    "RecvSpec",
    "LoadSpec",
    "PushSpec",
    "SaveSpec",
    "SendSpec",
]

#: Version of the kv_transfer_params this connector writes; a decode instance refuses others.
PARAMS_VERSION = 2


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Where one layer's blocks sit: block ``b`` is ``page`` bytes at ``base + b * stride``."""

    name: str
    base: int
    stride: int
    page: int
    num_blocks: int
    group: int

    def to_list(self) -> list[Any]:
        return [self.name, self.base, self.stride, self.page, self.num_blocks, self.group]

    @classmethod
    def from_list(cls, v: list[Any]) -> "LayerLayout":
        if not isinstance(v, (list, tuple)) or len(v) != 6:
            raise ValueError(f"malformed layer layout {v!r}")
        name, base, stride, page, nb, group = v
        for x in (base, stride, page, nb, group):
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise ValueError(f"malformed layer layout {v!r}")
        return cls(str(name), base, stride, page, nb, group)


@dataclass
class KVXHandshakeMetadata(KVConnectorHandshakeMetadata):
    """One worker's kvx endpoint, sent to its scheduler once the KV caches are registered.

    ``layout`` lists the layers' :class:`kvx_vllm.plan.LayerGeom`; ``compat`` holds the memory
    kind and device, and ``gen``: ``[address, count]`` of the blocks' generation words.
    """

    agent_name: str
    host: str
    port: int
    tp_rank: int
    layout: list[list[Any]]
    compat: dict[str, Any]


@dataclass(slots=True)
class RecvSpec:
    """Decode side: pull ``remote_block_ids`` of a prefill instance into ``local_block_ids``.

    Block id lists are per KV cache group: ``local_block_ids[g]`` are the blocks to fill, at
    block positions ``local_pos[g]`` of the request; ``remote_block_ids[g]`` are all the prefill
    instance's blocks of the request, in order (its block size may differ). Empty local lists only
    notify the prefill instance (its blocks are not needed: a full local prefix hit, or the
    request was aborted).
    """

    req_id: str
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]
    params: dict[str, Any]
    local_pos: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class LoadSpec:
    """Offload: copy stored blocks (store keys per group) into ``block_ids`` (per group);
    ``layerwise``: in this step's forward pass, layer by layer (a synchronous load for vLLM)."""

    req_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    layerwise: bool = False


@dataclass(slots=True)
class SaveSpec:
    """Offload: store ``block_ids`` (per group) under ``keys`` (per group, chained)."""

    req_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]


@dataclass(slots=True)
class SendSpec:
    """Prefill side: keep a finished request's blocks for a decode instance until ``lease_s``.

    ``lease`` is the request's lease id (increasing per engine, even); ``block_ids`` its blocks
    (all groups). A block whose last lease ends gets the largest lease id it was held under
    written to its generation word, which decode instances read after their pull.
    """

    req_id: str
    lease_s: float
    lease: int = 0
    block_ids: list[int] = field(default_factory=list)
    #: push mode: the request's push id and its blocks per KV cache group (written whole to the
    #: decode instance once it registers, unless they were pushed during the forward pass)
    push: str = ""
    groups: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class PushSpec:
    """Prefill side, push mode: request ``req_id`` (push id ``push``) completes its prefill in
    this step; ``block_ids`` (per group) hold its KV. Pushed during the forward pass when its
    decode instance has registered already."""

    req_id: str
    push: str
    block_ids: list[list[int]]


@dataclass
class KVXConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers.

    ``heartbeat`` lists queued remote-prefill requests (decode side) whose prefill workers
    should extend their leases. ``announce`` asks the workers to report every block their offload stores hold (the
    scheduler's first step, and the first after ``reset_cache``): a disk tier recovered at
    start-up becomes known to the scheduler that way.
    """

    recv: list[RecvSpec] = field(default_factory=list)
    load: list[LoadSpec] = field(default_factory=list)
    save: list[SaveSpec] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    announce: bool = False
    #: decode side: kv_transfer_params of queued requests whose prefill leases need a heartbeat
    heartbeat: list[dict[str, Any]] = field(default_factory=list)
    #: prefill side, push mode: requests completing their prefill in this step
    push: list[PushSpec] = field(default_factory=list)
    #: push mode: nothing is computed in this step and push messages are awaited; the workers
    #: wait up to this long for one (an idle engine then sleeps instead of spinning)
    idle_wait_s: float = 0.0


@dataclass
class KVXWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler: the offload stores' events, per tensor-parallel rank, and (push mode,
    prefill side) the push ids whose decode registrations each rank has received.

    Each event is ``("stored" | "removed", keys, parent_key, medium)``.
    """

    events: dict[int, list[tuple[str, list[bytes], bytes | None, str]]] = field(default_factory=dict)
    registered: dict[int, list[str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merge another worker's events into these."""
        assert isinstance(other, KVXWorkerMetadata)
        out = KVXWorkerMetadata({k: list(v) for k, v in self.events.items()},
                                {k: list(v) for k, v in self.registered.items()})
        for rank, evs in other.events.items():
            out.events.setdefault(rank, []).extend(evs)
        for rank, ids in other.registered.items():
            out.registered.setdefault(rank, []).extend(ids)
        return out
