"""What ``kvx bench`` checks before any long work starts.

:func:`check` raises :class:`kvx.UsageError` with a one-line message naming the cause: a bad
``KVX_*`` variable, an unknown or unavailable backend or comparison, block sizes that cannot be
carved from ``--total``, more memory or disk than the machine has, a ``--path`` where no file can
be created, a ``--json``/``--plot`` file that cannot be written, ``--plot`` without matplotlib, an
S3 endpoint that does not answer. What can only fail later (a disk filling up during the run, a
child process dying) surfaces as :class:`kvx.KVXError`, :class:`OSError` or
:class:`kvx.bench.BenchError`, which the CLI reports the same way.
"""

from __future__ import annotations

import os
import socket
import tempfile
from urllib.parse import urlparse

from ..errors import KVXError, UsageError
from . import BenchOptions, fmt_size

__all__ = ["BACKENDS", "COMPARES", "check", "check_output_file"]

#: Backends ``kvx bench`` has a runner for.
BACKENDS = ("host", "cuda", "tcp", "ucx", "posix", "gds", "s3")

#: Comparisons (``--compare``) and the backends each is wired for.
COMPARES: dict[str, tuple[str, ...]] = {"nixl": ("host", "tcp", "ucx", "posix", "cuda", "s3"), "mooncake": ("tcp",)}

#: Buffers of ``--total`` bytes each runner holds in host memory at its peak (both processes).
_HOST_BUFFERS = {"host": 3, "tcp": 4, "posix": 3, "s3": 3, "gds": 2, "cuda": 2}

#: Files of ``--total`` bytes each file runner keeps in its directory at once.
_FILES = {"posix": 3, "gds": 2}

#: Largest ``--total`` taken at all (the arithmetic of block ids and offsets stays far from 2**63).
MAX_TOTAL = 1 << 50

#: Most timed runs per point (``--iters``) and latency samples taken.
MAX_ITERS = 1_000_000
MAX_ROUNDS = 100

_SEGS = ("dram", "pinned", "vram")


def check(opts: BenchOptions, json_path: str | None = None, plot_path: str | None = None) -> None:
    """Check ``opts`` and the environment for a ``kvx bench`` run; raise UsageError if it cannot run."""
    from .. import config

    config.check_env()
    _check_numbers(opts)
    _check_backend(opts)
    _check_memory(opts)
    if opts.backend in _FILES:
        _check_dir(opts)
    elif opts.path is not None:
        raise UsageError(f"--path applies to --backend {' or '.join(_FILES)}, not {opts.backend}")
    if json_path is not None and json_path != "-":
        check_output_file("--json", json_path)
    if plot_path is not None:
        _check_plot(plot_path)
    if opts.backend == "s3":
        _check_s3()


def _check_numbers(opts: BenchOptions) -> None:
    if not 0 < opts.total <= MAX_TOTAL:
        raise UsageError(f"--total must be > 0 and at most {fmt_size(MAX_TOTAL)}, not {opts.total}")
    if not 1 <= opts.iters <= MAX_ITERS:
        raise UsageError(f"--iters must be in 1..{MAX_ITERS}, not {opts.iters}")
    if not 1 <= opts.rounds <= MAX_ROUNDS:
        raise UsageError(f"--rounds must be in 1..{MAX_ROUNDS}, not {opts.rounds}")
    if not 0 <= opts.latency_samples <= MAX_ITERS:
        raise UsageError(f"--latency-samples must be in 0..{MAX_ITERS}, not {opts.latency_samples}")
    if opts.seed < 0:
        raise UsageError(f"--seed must be >= 0, not {opts.seed}")
    if not opts.block_sizes:
        raise UsageError("--block-sizes: no block size given (e.g. --block-sizes 4K,2M)")
    for bs in opts.block_sizes:
        if not 0 < bs <= opts.total:
            raise UsageError(f"block size {bs} must be in 1..--total ({opts.total})")
    for s in opts.seg:
        if s not in _SEGS:
            raise UsageError(f"--seg takes {', '.join(_SEGS)} (LOCAL or LOCAL,REMOTE), not {s!r}")
    if opts.peer is not None:
        raise UsageError("--peer: a remote bench target is not supported yet; run over loopback")


def _check_backend(opts: BenchOptions) -> None:
    from ..backends import registry

    if opts.backend not in BACKENDS:
        raise UsageError(f"unknown backend {opts.backend!r} (choose from {', '.join(BACKENDS)})")
    try:
        reason = registry.get(opts.backend).unavailable_reason()
    except KVXError as exc:
        reason = str(exc)
    if reason is not None:
        raise UsageError(f"the {opts.backend} backend is not available here: {reason}")
    for c in opts.compare:
        if c not in COMPARES:
            raise UsageError(f"--compare: unknown comparison {c!r} (choose from {', '.join(COMPARES)})")
        if opts.backend not in COMPARES[c]:
            raise UsageError(f"--compare {c} is not wired for --backend {opts.backend}")
        if c == "nixl":
            from ..compare.nixl import nixl_available

            why = nixl_available()
            if why is not None:
                raise UsageError(f"--compare nixl: {why}")
        elif c == "mooncake":
            from ..compare.mooncake import mooncake_available

            why = mooncake_available()
            if why is not None:
                raise UsageError(f"--compare mooncake: {why}")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(opts: BenchOptions) -> None:
    need = _HOST_BUFFERS.get(opts.backend, 2) * opts.total
    have = _mem_available()
    if have is not None and need > have:
        raise UsageError(f"--total {fmt_size(opts.total)}: the {opts.backend} bench holds about "
                         f"{need / 2**30:.1f} GiB of host memory at once; {have / 2**30:.1f} GiB is available")


def _check_dir(opts: BenchOptions) -> None:
    d = opts.path if opts.path is not None else tempfile.gettempdir()
    if not os.path.isdir(d):
        raise UsageError(f"--path {d}: not an existing directory")
    try:  # a real file, as the bench makes them: root passes os.access() on /proc and read-only mounts
        with tempfile.NamedTemporaryFile(dir=d, prefix=".kvx-bench-probe-"):
            pass
        st = os.statvfs(d)
    except OSError as exc:
        raise UsageError(f"--path {d}: cannot create files there: {exc.strerror or exc}") from None
    need = _FILES[opts.backend] * opts.total
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise UsageError(f"--path {d}: the {opts.backend} bench writes {fmt_size(need)} there "
                         f"({_FILES[opts.backend]} files of --total); {free / 2**20:.1f} MiB is free")


def check_output_file(flag: str, path: str) -> None:
    """Make sure ``path`` can be written (created and removed again if it did not exist)."""
    if "\x00" in path:
        raise UsageError(f"{flag} {path!r}: a file name cannot hold a NUL byte")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a directory")
    try:
        if os.path.exists(path):
            with open(path, "ab"):
                pass
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            os.close(fd)
            os.unlink(path)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write it: {exc.strerror or exc}") from None


def _check_plot(path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError as exc:
        raise UsageError(f"--plot needs matplotlib ({exc}): pip install kvx[bench]") from None
    check_output_file("--plot", path)


def _check_s3() -> None:
    from .. import config

    url = config.get("KVX_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if not url:
        return  # the bench starts its own SeaweedFS
    u = urlparse(url if "://" in url else f"http://{url}")
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise UsageError(f"S3 endpoint {url}: bad port") from None
    if not u.hostname:
        raise UsageError(f"S3 endpoint {url}: no host")
    try:
        socket.create_connection((u.hostname, port), timeout=5.0).close()
    except OSError as exc:
        raise UsageError(f"S3 endpoint {url} does not answer: {exc.strerror or exc}") from None
