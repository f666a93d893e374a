"""Runtime settings: the only module that reads ``KVX_*`` environment variables.

Every variable is listed in :data:`SETTINGS` (name, type, default, meaning) and documented in
``docs/settings.md``; a test checks that the two agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import UsageError

__all__ = ["AgentConfig", "SETTINGS", "Setting", "get"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``KVX_*`` variable."""

    name: str
    kind: Callable[[str], Any]
    default: Any
    help: str


def _bool(s: str) -> bool:
    v = s.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {s!r}")


def _list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _cpu_threads() -> int:
    n = os.cpu_count() or 1
    return max(1, min(8, n))


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("KVX_BACKENDS", _list, (), "Backend preference order, comma separated "
                "(default: every available backend in the built-in order)."),
        Setting("KVX_TRANSFER_TIMEOUT", float, 30.0,
                "Seconds a transfer may stay pending before it turns FAILED with TransferTimeout."),
        Setting("KVX_PEER_TIMEOUT", float, 10.0,
                "Seconds after which a silent or dead peer is declared gone (PeerDisconnected)."),
        Setting("KVX_HANDSHAKE_TIMEOUT", float, 5.0,
                "Seconds allowed for connecting to a peer and exchanging metadata."),
        Setting("KVX_HOST_PATH", str, "auto",
                "Same-node host path: auto, shm (shared mappings), cma (process_vm_*), uds (AF_UNIX)."),
        Setting("KVX_COPY_THREADS", int, None,
                "Native copy threads for large transfers (default: min(8, CPUs))."),
        Setting("KVX_INLINE_BYTES", int, 262144,
                "Transfers up to this many bytes run inline in the posting thread (lowest latency)."),
        Setting("KVX_AUTH_TOKEN", str, None,
                "Shared secret; when set, side channels and data connections require HMAC proof."),
        Setting("KVX_MAX_MESSAGE", int, 256 << 20,
                "Largest wire message (metadata, descriptor list, control frame) accepted, in bytes."),
        Setting("KVX_CUDA_COPY", str, "auto",
                "GPU copy path: kernel (batched NVRTC gather kernel), ce (cuMemcpyBatchAsync on the copy "
                "engines), auto (ce when the mean block is >= 8 MiB GPU<->GPU or >= 2 MiB with host memory, else "
                "kernel)."),
        Setting("KVX_GDS_COMPAT", _bool, False,
                "Let the gds backend run where GPUDirect Storage is not usable, in kvikio's compat mode (POSIX "
                "through kvikio's bounce buffers). Off by default: measured 2-8x slower than staging through "
                "pinned host memory with the cuda and posix backends (docs/benchmarks.md)."),
        Setting("KVX_CUDA_SPIN_US", float, 2000.0,
                "Microseconds a waiter on a GPU transfer polls its CUDA event natively (no GIL, one busy "
                "core) before sleeping between polls; 0 or less: no native spin (a Python poll loop, which "
                "notices a finished copy tens of microseconds later)."),
        Setting("KVX_CUDA_EXEC", str, "initiator",
                "Which GPU runs a GPU<->GPU copy: initiator (the caller's), owner (the target memory's GPU), "
                "pull (the destination's GPU)."),
        Setting("KVX_TCP_FAST_MAX", int, 65536,
                "Largest TCP transfer (bytes, at most 16 descriptors) sent on the low-latency path where the "
                "caller reads the reply itself; 0 turns the path off."),
        Setting("KVX_TCP_SPIN_US", float, 50.0,
                "Microseconds a waiter polls its socket (yielding) before sleeping in poll()."),
        Setting("KVX_TCP_SERVE_SPIN_US", float, 50.0,
                "Microseconds the serving thread polls for the next small request before sleeping."),
        Setting("KVX_TCP_RCVLOWAT", int, 512 << 10,
                "SO_RCVLOWAT for large TCP receives (bytes queued before the receiver wakes); 0 = off."),
        Setting("KVX_BENCH_GPU_NAME", str, None, "GPU name printed in the kvx bench header (set by gpu_check.sh)."),
        Setting("KVX_NIXL_LOG", str, "WARNING", "Log level of the NIXL comparison's child processes."),
        Setting("KVX_TCP_STREAMS", int, 2, "TCP connections per peer (a large transfer is striped over them)."),
        Setting("KVX_TCP_CHUNK", int, 16 << 20,
                "Bytes per TCP data frame (pipelining unit of large transfers; 16 MiB measured best on loopback)."),
        Setting("KVX_ETCD_ENDPOINTS", _list, (), "etcd endpoints (http://host:port,...) for discovery."),
        Setting("KVX_ETCD_NAMESPACE", str, "kvx", "Key prefix under which agents publish metadata in etcd."),
        Setting("KVX_S3_ENDPOINT", str, None, "S3 endpoint URL (overrides AWS_ENDPOINT_URL)."),
        Setting("KVX_S3_THREADS", int, 16, "Concurrent S3 requests per agent."),
        Setting("KVX_POSIX_DIRECT", _bool, False, "Use O_DIRECT for FILE registrations (aligned bounce buffers)."),
        Setting("KVX_POSIX_THREADS", int, None, "Threads of the posix backend's I/O pool (default: min(8, CPUs))."),
        Setting("KVX_POSIX_SYNC", str, "none",
                "Durability of file writes: none (page cache), data (fdatasync per transfer), full (fsync)."),
        Setting("KVX_POSIX_MMAP", _bool, True,
                "Buffered posix writes through a shared mapping of the file (MADV_POPULATE_WRITE + native copy) "
                "instead of pwritev, which serializes on the file's inode lock; 0 = pwritev."),
    ]
}


def get(name: str) -> Any:
    """Return the typed value of ``name`` from the environment, or its default.

    Raises
    ------
    UsageError
        If the variable is unknown to kvx or its value does not parse.
    """
    try:
        s = SETTINGS[name]
    except KeyError:
        raise UsageError(f"unknown kvx setting {name!r}") from None
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if name in ("KVX_COPY_THREADS", "KVX_POSIX_THREADS"):
            return _cpu_threads()
        return s.default
    try:
        return s.kind(raw)
    except ValueError as exc:
        raise UsageError(f"{name}={raw!r}: {exc}") from exc


def _env(name: str) -> Callable[[], Any]:
    return lambda: get(name)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Typed configuration of an :class:`kvx.Agent`.

    Every field defaults to its ``KVX_*`` environment variable (see ``docs/settings.md``).

    Parameters
    ----------
    backends
        Backend names in preference order; empty means every available backend.
    transfer_timeout
        Seconds before a pending transfer fails with ``TransferTimeout``.
    peer_timeout
        Bound on detecting a dead or silent peer.
    handshake_timeout
        Bound on connecting to a peer.
    host_path
        Same-node host path: ``auto``, ``shm``, ``cma`` or ``uds``.
    copy_threads
        Native threads used for large copies.
    inline_bytes
        Transfers at most this large run in the posting thread.
    auth_token
        Shared secret for HMAC authentication of peers, or ``None``.
    listen
        ``(host, port)`` for the TCP side channel and data listener, or ``None`` for none.
    """

    backends: tuple[str, ...] = field(default_factory=_env("KVX_BACKENDS"))
    transfer_timeout: float = field(default_factory=_env("KVX_TRANSFER_TIMEOUT"))
    peer_timeout: float = field(default_factory=_env("KVX_PEER_TIMEOUT"))
    handshake_timeout: float = field(default_factory=_env("KVX_HANDSHAKE_TIMEOUT"))
    host_path: str = field(default_factory=_env("KVX_HOST_PATH"))
    copy_threads: int = field(default_factory=_env("KVX_COPY_THREADS"))
    inline_bytes: int = field(default_factory=_env("KVX_INLINE_BYTES"))
    auth_token: str | None = field(default_factory=_env("KVX_AUTH_TOKEN"))
    listen: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.host_path not in ("auto", "shm", "cma", "uds"):
            raise UsageError(f"host_path must be auto, shm, cma or uds, not {self.host_path!r}")
        for name in ("transfer_timeout", "peer_timeout", "handshake_timeout"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise UsageError(f"{name} must be a positive number of seconds, not {v!r}")
        if self.copy_threads < 1:
            raise UsageError(f"copy_threads must be >= 1, not {self.copy_threads}")
        if isinstance(self.backends, str):
            object.__setattr__(self, "backends", _list(self.backends))
