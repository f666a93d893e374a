"""Runtime settings: the only module that reads ``KVX_*`` environment variables.

Every variable is listed in :data:`SETTINGS` (name, type, default, meaning) and documented in
``docs/settings.md``; a test checks that the two agree.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urlparse

from . import _args
from ._args import MAX_SECONDS
from .errors import ArgumentTypeError, ArgumentValueError, UsageError

__all__ = ["AgentConfig", "SETTINGS", "Setting", "check_env", "get"]


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


def _int(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in ``[lo, hi]``."""

    def parse(s: str) -> int:
        try:
            v = int(s.strip())
        except ValueError:
            raise ValueError(f"not an integer: {s!r}") from None
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo} and {hi}")
        return v

    return parse


def _number(lo: float, hi: float) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]``."""

    def parse(s: str) -> float:
        try:
            v = float(s.strip())
        except ValueError:
            raise ValueError(f"not a number: {s!r}") from None
        if not (math.isfinite(v) and lo <= v <= hi):
            raise ValueError(f"must be a finite number between {lo:g} and {hi:g}")
        return v

    return parse


def _seconds(s: str) -> float:
    try:
        v = float(s.strip())
    except ValueError:
        raise ValueError(f"not a number of seconds: {s!r}") from None
    if not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
        raise ValueError(f"must be a positive number of seconds, at most {MAX_SECONDS:g}")
    return v


def _choice(*values: str, upper: bool = False) -> Callable[[str], str]:
    """One of ``values`` (case-insensitive; returned lower case, or upper case with ``upper``)."""

    def parse(s: str) -> str:
        v = s.strip().upper() if upper else s.strip().lower()
        if v not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return v

    return parse


def _backends(s: str) -> tuple[str, ...]:
    names = _list(s)
    from .backends import registry  # at call time: the registry sits above config in the import graph

    known = registry.names()
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown backend {bad[0]!r} (known: {', '.join(known)})")
    return names


def _url(s: str, *, need_scheme: bool) -> str:
    v = s.strip()
    if need_scheme and "://" not in v:
        raise ValueError("expected a URL such as http://host:port")
    u = urlparse(v if "://" in v else f"http://{v}")
    try:
        u.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        raise ValueError(f"bad port in {v!r}: {exc}") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"expected an http(s) URL with a host, not {v!r}")
    return v


def _endpoint(s: str) -> str:
    return _url(s, need_scheme=True)


def _endpoints(s: str) -> tuple[str, ...]:
    return tuple(_url(x, need_scheme=False) for x in _list(s))


def _cpu_threads() -> int:
    n = os.cpu_count() or 1
    return max(1, min(8, n))


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("KVX_BACKENDS", _backends, (), "Backend preference order, comma separated "
                "(default: every available backend in the built-in order)."),
        Setting("KVX_TRANSFER_TIMEOUT", _seconds, 30.0,
                "Seconds a transfer may stay pending before it turns FAILED with TransferTimeout."),
        Setting("KVX_PEER_TIMEOUT", _seconds, 10.0,
                "Seconds after which a silent or dead peer is declared gone (PeerDisconnected)."),
        Setting("KVX_HANDSHAKE_TIMEOUT", _seconds, 5.0,
                "Seconds allowed for connecting to a peer and exchanging metadata."),
        Setting("KVX_HOST_PATH", _choice("auto", "shm", "cma", "uds"), "auto",
                "Same-node host path: auto, shm (shared mappings), cma (process_vm_*), uds (AF_UNIX)."),
        Setting("KVX_COPY_THREADS", _int(1, 1024), None,
                "Native copy threads for large transfers (default: min(8, CPUs))."),
        Setting("KVX_INLINE_BYTES", _int(0, 1 << 62), 262144,
                "Transfers up to this many bytes run inline in the posting thread (lowest latency)."),
        Setting("KVX_AUTH_TOKEN", str, None,
                "Shared secret; when set, side channels and data connections require HMAC proof."),
        Setting("KVX_MAX_MESSAGE", _int(64 << 10, 1 << 40), 256 << 20,
                "Largest wire message (metadata, descriptor list, control frame) accepted, in bytes."),
        Setting("KVX_CUDA_COPY", _choice("auto", "kernel", "ce", "split"), "auto",
                "GPU copy path: kernel (batched NVRTC gather kernel), ce (cuMemcpyBatchAsync on the copy "
                "engines), auto (ce when the mean block is >= 8 MiB GPU<->GPU or >= 2 MiB with host memory, else "
                "kernel)."),
        Setting("KVX_GDS_COMPAT", _bool, False,
                "Let the gds backend run where GPUDirect Storage is not usable, in kvikio's compat mode (POSIX "
                "through kvikio's bounce buffers). Off by default: measured 2-8x slower than staging through "
                "pinned host memory with the cuda and posix backends (docs/benchmarks.md)."),
        Setting("KVX_CUDA_SPIN_US", _number(-MAX_SECONDS * 1e6, MAX_SECONDS * 1e6), 2000.0,
                "Microseconds a waiter on a GPU transfer polls its CUDA event natively (no GIL, one busy "
                "core) before sleeping between polls; 0 or less: no native spin (a Python poll loop, which "
                "notices a finished copy tens of microseconds later)."),
        Setting("KVX_CUDA_ORDER", _choice("legacy", "caller"), "legacy",
                "How a copy of GPU memory (cuda backend, tcp staging) is ordered with the caller's GPU work: "
                "legacy (on a blocking stream: after everything queued on the legacy default stream before the "
                "post, and before what is queued after it) or caller (on a non-blocking stream: the caller "
                "makes sure the bytes are ready before it posts, e.g. waits for a CUDA event; later GPU work "
                "is never held behind the copy -- what lets layer-wise writes overlap the next layers)."),
        Setting("KVX_CUDA_EXEC", _choice("initiator", "owner", "pull"), "initiator",
                "Which GPU runs a GPU<->GPU copy: initiator (the caller's), owner (the target memory's GPU), "
                "pull (the destination's GPU)."),
        Setting("KVX_TCP_FAST_MAX", _int(0, 1 << 40), 65536,
                "Largest TCP transfer (bytes, at most 16 descriptors) sent on the low-latency path where the "
                "caller reads the reply itself; 0 turns the path off."),
        Setting("KVX_TCP_SPIN_US", _number(0.0, MAX_SECONDS * 1e6), 50.0,
                "Microseconds a waiter polls its socket (yielding) before sleeping in poll()."),
        Setting("KVX_TCP_SERVE_SPIN_US", _number(0.0, MAX_SECONDS * 1e6), 50.0,
                "Microseconds the serving thread polls for the next small request before sleeping."),
        Setting("KVX_TCP_RCVLOWAT", _int(0, (1 << 31) - 1), 512 << 10,
                "SO_RCVLOWAT for large TCP receives (bytes queued before the receiver wakes); 0 = off."),
        Setting("KVX_BENCH_GPU_NAME", str, None, "GPU name printed in the kvx bench header (set by gpu_check.sh)."),
        Setting("KVX_NIXL_LOG", _choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL", upper=True), "WARNING",
                "Log level of the NIXL comparison's child processes."),
        Setting("KVX_TCP_STAGE_BYTES", _int(64 << 10, 1 << 30), 8 << 20,
                "Bytes per pinned staging slot of the tcp backend: the largest frame of a transfer touching "
                "CUDA memory."),
        Setting("KVX_TCP_STAGE_SLOTS", _int(2, 64), 4,
                "Pinned staging slots per tcp connection (frames gathered, on the wire or scattering at once)."),
        Setting("KVX_TCP_STAGE_HOST", _bool, False,
                "Move host memory through the tcp backend's staging path too (tests of the GPU pipeline "
                "without a GPU; slower)."),
        Setting("KVX_UCX_STAGE", _choice("auto", "always", "never", "host"), "auto",
                "CUDA memory over ucx through pinned staging slots (batched gather/scatter kernel, one UCX "
                "operation per slot) instead of one UCX operation per block: auto = where UCX_TLS names no "
                "transport with device RMA (rc, dc, ib, cuda_ipc, gdr_copy), e.g. tcp,cuda_copy; host = host "
                "memory too (tests of the pipeline without a GPU)."),
        Setting("KVX_UCX_STAGE_BYTES", _int(64 << 10, 1 << 30), 4 << 20,
                "Bytes per pinned staging slot of the ucx backend (the unit of a staged transfer)."),
        Setting("KVX_UCX_STAGE_MIN", _int(0, 1 << 40), 256 << 10,
                "Smallest staged ucx transfer, bytes: smaller ones take one UCX operation per block (lower latency); "
                "0 = stage every transfer."),
        Setting("KVX_UCX_SAMENODE", _choice("host", "ucx"), "host",
                "Host memory between ucx agents on one host, while UCX_TLS allows shared memory: host = kvx's "
                "same-node engine (batched process_vm_* over copy threads, or shared mappings of alloc_host "
                "memory; the peer's pid verified by the kernel), ucx = UCX's one kernel copy per block."),
        Setting("KVX_UCX_STAGE_SLOTS", _int(2, 64), 4,
                "Pinned staging slots per ucx peer and direction (chunks gathered, moving or scattering at once)."),
        Setting("KVX_TCP_STREAMS", _int(1, 64), 2, "TCP connections per peer (a large transfer is striped over them)."),
        Setting("KVX_TCP_CHUNK", _int(4096, 1 << 30), 16 << 20,
                "Bytes per TCP data frame (pipelining unit of large transfers; 16 MiB measured best on loopback)."),
        Setting("KVX_ETCD_ENDPOINTS", _endpoints, (), "etcd endpoints (http://host:port,...) for discovery."),
        Setting("KVX_ETCD_NAMESPACE", str, "kvx", "Key prefix under which agents publish metadata in etcd."),
        Setting("KVX_S3_ENDPOINT", _endpoint, None, "S3 endpoint URL (overrides AWS_ENDPOINT_URL)."),
        Setting("KVX_S3_THREADS", _int(1, 1024), 16, "Concurrent S3 requests per agent."),
        Setting("KVX_POSIX_DIRECT", _bool, False, "Use O_DIRECT for FILE registrations (aligned bounce buffers)."),
        Setting("KVX_POSIX_THREADS", _int(1, 1024), None,
                "Threads of the posix backend's I/O pool (default: min(8, CPUs))."),
        Setting("KVX_POSIX_SYNC", _choice("none", "data", "full"), "none",
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
        raise UsageError(f"{name}={raw!r}: {exc}") from None


def check_env(environ: Mapping[str, str] | None = None) -> None:
    """Parse every ``KVX_*`` setting present in the environment now.

    Tools (``kvx bench``) call it before starting any work, so that a bad value is reported at
    once rather than by a child process later.

    Raises
    ------
    UsageError
        Naming the first variable whose value does not parse.
    """
    env = os.environ if environ is None else environ
    for name in SETTINGS:
        if env.get(name):
            get(name)


def _env(name: str) -> Callable[[], Any]:
    return lambda: get(name)


def option(env: str) -> Any:
    """A field of a backend's options dataclass whose default is the ``KVX_*`` setting ``env``.

    Backends declare their knobs as frozen dataclasses of such fields (``TcpOptions``,
    ``PosixOptions``, ...); the environment seeds each default when the options object is made,
    and code passes its own through ``AgentConfig(options={"posix": PosixOptions(threads=4)})``.
    """
    if env not in SETTINGS:
        raise UsageError(f"unknown kvx setting {env!r}")
    return field(default_factory=_env(env), metadata={"env": env})


def check_options(opts: Any) -> None:
    """Check every ``option()`` field of a backend's options object against its setting's rules.

    A value set in code passes the same parser as the environment variable would (ranges,
    choices), so ``PosixOptions(threads=0)`` is refused as ``KVX_POSIX_THREADS=0`` is.

    Raises
    ------
    UsageError
        Naming the options class, the field and the reason.
    """
    for f in fields(opts):
        env = f.metadata.get("env")
        v = getattr(opts, f.name)
        if env is None or v is None:
            continue
        if isinstance(v, bool) and SETTINGS[env].kind is not _bool:
            raise UsageError(f"{type(opts).__name__}.{f.name}: expected a value like {env}, not {v!r}")
        raw = ",".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)
        try:
            SETTINGS[env].kind(raw)
        except ValueError as exc:
            raise UsageError(f"{type(opts).__name__}.{f.name}={v!r}: {exc}") from None


def aws(*names: str) -> str | None:
    """The first set of the standard ``AWS_*`` variables ``names`` (boto's own), or None.

    The s3 backend's options take their defaults from these where kvx has no setting of its own,
    so that the one place reading the environment stays this module.
    """
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


def options_fields(cls: type) -> list[tuple[str, str]]:
    """``(field, KVX_* setting)`` of every ``option()`` field of an options dataclass."""
    return [(f.name, f.metadata["env"]) for f in fields(cls) if "env" in f.metadata]


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
    options
        Per backend name, that backend's options object (its ``Options`` class, e.g.
        ``{"posix": kvx.backends.posix.PosixOptions(sync="data")}``); a backend not named here
        takes its options' defaults, which come from the ``KVX_*`` variables.
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
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # each field as its KVX_* variable would take it (same ranges), checked before any agent uses it
        if not isinstance(self.options, Mapping) or not all(
                isinstance(k, str) and is_dataclass(v) and not isinstance(v, type) for k, v in self.options.items()):
            raise ArgumentTypeError("options maps backend names to their options objects (e.g. PosixOptions(...))")
        for v in self.options.values():
            check_options(v)
        if not isinstance(self.host_path, str):
            raise ArgumentTypeError(f"host_path must be a str (auto, shm, cma or uds), "
                                    f"not {type(self.host_path).__name__}")
        if self.host_path not in ("auto", "shm", "cma", "uds"):
            raise ArgumentValueError(f"host_path must be auto, shm, cma or uds, not {self.host_path!r}")
        for name in ("transfer_timeout", "peer_timeout", "handshake_timeout"):
            object.__setattr__(self, name, _args.seconds(getattr(self, name), name, positive=True))
        object.__setattr__(self, "copy_threads", _args.integer(self.copy_threads, "copy_threads", 1, 1024))
        object.__setattr__(self, "inline_bytes", _args.size(self.inline_bytes, "inline_bytes", lo=0))
        backends = _list(self.backends) if isinstance(self.backends, str) else self.backends
        if not isinstance(backends, (tuple, list)) or not all(isinstance(b, str) for b in backends):
            raise ArgumentTypeError(f"backends must be a tuple of backend names, not {self.backends!r:.80}")
        object.__setattr__(self, "backends", tuple(backends))
        if self.auth_token is not None and not isinstance(self.auth_token, str):
            raise ArgumentTypeError(f"auth_token must be a str or None, not {type(self.auth_token).__name__}")
        if self.listen is not None:
            if not isinstance(self.listen, (tuple, list)) or len(self.listen) != 2:
                raise ArgumentTypeError(f"listen must be a (host, port) tuple or None, not {self.listen!r:.80}")
            host = _args.name(self.listen[0], "listen host")
            port = _args.integer(self.listen[1], "listen port", 0, 65535)
            object.__setattr__(self, "listen", (host, port))
