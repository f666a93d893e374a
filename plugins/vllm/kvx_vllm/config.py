"""Settings of the kvx connector, read from ``kv_connector_extra_config``.

Every key is optional::

    {"kv_connector": "KVXConnector", "kv_connector_module_path": "kvx_vllm",
     "kv_role": "kv_producer",
     "kv_connector_extra_config": {"side_channel_host": "10.0.0.5", "side_channel_port": 5600,
                                   "lease_s": 120, "offload_host_gb": 8}}

Push mode (prefill writes into blocks decode allocated up front; see :mod:`kvx_vllm.push`) is
``"transfer_mode": "push"`` on both instances, ``"layerwise": true`` adds layer-wise streaming
(each layer's KV is written while the next layers compute); the proxy runs with ``--mode push``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from .pool import KEYS as POOL_KEYS
from .pool import PoolSettings

__all__ = ["KVXConnectorConfig"]


def _bool(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


@dataclass(frozen=True, slots=True)
class KVXConnectorConfig:
    """Typed view of ``kv_connector_extra_config``.

    Parameters
    ----------
    side_channel_host
        Address the worker's kvx listener (side channel and tcp data path) binds to. ``0.0.0.0``
        listens everywhere; peers are then told ``advertise_host``.
    side_channel_port
        Base port; tensor-parallel rank ``r`` listens on ``side_channel_port + r``. 0 picks free
        ports (fine on one machine: the real address travels in the handshake metadata).
    advertise_host
        Host name or address decode instances dial to reach this prefill instance (default:
        ``side_channel_host``, or the machine's first non-loopback address for ``0.0.0.0``).
    lease_s
        Seconds a prefill instance keeps a finished request's blocks for its decode instance;
        unclaimed blocks are freed afterwards.
    load_timeout_s
        Bound on one request's pull (handshake plus transfer) on the decode side.
    handshake_timeout_s
        Bound on connecting to a peer worker (side channel, authentication, data connections),
        on both sides. Generous by default: engines that share cores with busy workers (TP > 1
        on a small machine) answer a handshake late, not never.
    backends
        kvx backend names in preference order (default: every available one).
    pd
        Whether prefill/decode transfer is on (default: on unless the role is ``kv_both`` with
        offloading configured).
    offload
        Whether blocks are offloaded to a kvx ``TieredStore`` (default: on when a size is given).
    offload_host_gb, offload_host_bytes
        Size of the host-memory tier (per worker).
    offload_disk_path, offload_disk_gb, offload_disk_bytes
        Optional disk tier below it.
    offload_policy
        Eviction policy name (``kvx.tiers.policies.POLICIES``); empty for the store's default.
    offload_layerwise
        Load offloaded blocks layer by layer inside the forward pass that uses them: the
        request is scheduled in the step its load starts (a synchronous load for vLLM), the
        tier read of its blocks and then one transfer per ``offload_layer_group`` layers into the
        engine's cache are posted in ``start_load_kv``, and each attention layer waits
        (``wait_for_layer_load``, bounded by ``load_timeout_s``) only for its own layers. Off:
        the whole load runs in the background and the request computes in a later step.
        Single KV cache group models only (others load whole); at most ``staging_blocks``
        blocks per step load layer-wise, the rest whole.
    offload_layer_group
        Layers per transfer in a layer-wise load.
    pool
        The cluster-wide KV pool below the offload tiers (:mod:`kvx_vllm.pool`: the ``pool_*``
        keys, on with ``pool_etcd``); None: no pool.
    check_model_name
        Also require equal model names (not only equal geometry) between prefill and decode.
    transfer_mode
        ``"pull"`` (default: decode reads what the prefill's kv_transfer_params name once the
        prefill has finished) or ``"push"`` (decode allocates a request's blocks as soon as it
        arrives, registers them with the prefill workers, and the prefill workers write the KV
        into them). Both instances must agree.
    layerwise
        Push only: write each layer's KV (``push_group`` layers per kvx write) while the next
        layers compute, instead of the whole request after its last layer.
    push_group
        Layers per kvx write in layer-wise push.
    push_timeout_s
        Push: bound from a decode worker's registration to the last write having landed (the
        request fails after it, its blocks are freed once the prefill confirms or this bound has
        passed again), and on how long a prefill instance keeps a finished request's blocks for a
        registration that has not come.
    push_wait_s
        Push, prefill side: how long a request may wait for its decode's registration before it
        is computed anyway (then written whole once the registration comes). Layer-wise streaming
        needs the registration before the forward pass.
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    advertise_host: str = ""
    lease_s: float = 120.0
    load_timeout_s: float = 60.0
    handshake_timeout_s: float = 30.0
    backends: tuple[str, ...] = ()
    pd: bool | None = None
    offload: bool | None = None
    offload_host_bytes: int = 0
    offload_disk_path: str = ""
    offload_disk_bytes: int = 0
    offload_policy: str = ""
    offload_layerwise: bool = False
    offload_layer_group: int = 1
    pool: PoolSettings | None = None
    check_model_name: bool = True
    staging_blocks: int = 64
    transfer_mode: str = "pull"
    layerwise: bool = False
    push_group: int = 1
    push_timeout_s: float = 30.0
    push_wait_s: float = 0.5

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "KVXConnectorConfig":
        """Parse ``kv_connector_extra_config``; unknown keys raise ``ValueError``."""
        extra = dict(extra or {})
        gb = 1 << 30
        kw: dict[str, Any] = {}
        if "pool" in extra:
            raise ValueError("unknown kv_connector_extra_config key for KVXConnector: 'pool' (the pool's "
                             f"keys: {', '.join(POOL_KEYS)})")
        kw["pool"] = PoolSettings.from_extra(extra)  # takes the pool_* keys out of extra
        if "offload_host_gb" in extra:
            kw["offload_host_bytes"] = int(float(extra.pop("offload_host_gb")) * gb)
        if "offload_disk_gb" in extra:
            kw["offload_disk_bytes"] = int(float(extra.pop("offload_disk_gb")) * gb)
        known = {f.name: f for f in fields(cls)}
        for k, v in extra.items():
            if k not in known:
                raise ValueError(f"unknown kv_connector_extra_config key for KVXConnector: {k!r} "
                                 f"(known: {', '.join(sorted(known))}, offload_host_gb, offload_disk_gb)")
            if k in ("side_channel_port", "offload_host_bytes", "offload_disk_bytes", "staging_blocks",
                     "push_group", "offload_layer_group"):
                kw[k] = int(v)
            elif k in ("lease_s", "load_timeout_s", "handshake_timeout_s", "push_timeout_s", "push_wait_s"):
                kw[k] = float(v)
            elif k in ("pd", "offload"):
                kw[k] = None if v is None else _bool(v)
            elif k in ("check_model_name", "layerwise", "offload_layerwise"):
                kw[k] = _bool(v)
            elif k == "backends":
                kw[k] = tuple(v.split(",")) if isinstance(v, str) else tuple(v)
            else:
                kw[k] = str(v)
        cfg = cls(**kw)
        if cfg.lease_s <= 0 or cfg.load_timeout_s <= 0 or cfg.handshake_timeout_s <= 0:
            raise ValueError("lease_s, load_timeout_s and handshake_timeout_s must be positive")
        if cfg.offload_disk_path and cfg.offload_disk_bytes <= 0:
            raise ValueError("offload_disk_path needs offload_disk_gb (or offload_disk_bytes)")
        if cfg.transfer_mode not in ("pull", "push"):
            raise ValueError(f"transfer_mode must be 'pull' or 'push', not {cfg.transfer_mode!r}")
        if cfg.layerwise and cfg.transfer_mode != "push":
            raise ValueError("layerwise needs transfer_mode 'push' (a pull reads the request after its prefill)")
        if cfg.offload_layerwise and not cfg.offload_enabled:
            raise ValueError("offload_layerwise needs offloading on (offload_host_gb or offload_host_bytes)")
        if cfg.offload_layer_group < 1:
            raise ValueError(f"offload_layer_group must be at least 1, not {cfg.offload_layer_group}")
        if cfg.push_group < 1 or cfg.push_timeout_s <= 0 or cfg.push_wait_s < 0:
            raise ValueError("push_group and push_timeout_s must be positive, push_wait_s not negative")
        return cfg

    @property
    def push(self) -> bool:
        """Push mode is on."""
        return self.transfer_mode == "push"

    @property
    def offload_enabled(self) -> bool:
        """Offloading is on (explicitly, or by giving the host tier a size)."""
        if self.offload is not None:
            return self.offload and self.offload_host_bytes > 0
        return self.offload_host_bytes > 0

    def pd_enabled(self, role: str | None) -> bool:
        """Prefill/decode transfer is on for this ``kv_role``."""
        if self.pd is not None:
            return self.pd
        return not (role == "kv_both" and self.offload_enabled)

    def advertised_host(self) -> str:
        """The host peers should dial."""
        if self.advertise_host:
            return self.advertise_host
        if self.side_channel_host not in ("0.0.0.0", "::", ""):
            return self.side_channel_host
        return os.environ.get("VLLM_HOST_IP", "") or _first_address()


def _first_address() -> str:
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
