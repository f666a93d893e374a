"""NIXL comparison runner for ``kvx bench --compare nixl``.

Drives NVIDIA NIXL (the ``nixl-cu12`` or ``nixl-cu13`` wheel, Python API in ``nixl_cu1x._api``) "at its best"
on the workload kvx benchmarks, and returns the figures in kvx's benchmark JSON shape.

``mem="dram"`` (first priority): two separate processes, an *initiator* and a *target*, each
with one NIXL agent on the UCX backend and one host-DRAM numpy buffer of ``total`` bytes that
is registered once.  The calling process only orchestrates: it spawns both roles as
``python -m kvx.compare.nixl --role ...``, hands them the two ends of a ``socketpair`` for the
out-of-band metadata exchange and control messages (newline-delimited JSON), and reads the
initiator's result file.  Per block size the initiator carves ``n = total // bs`` blocks,
prepares both descriptor lists once (``prep_xfer_dlist``), builds one transfer request with
``make_prepped_xfer`` whose local indices are in order and whose remote indices are a
permutation (paged KV blocks are not contiguous, so NIXL must not be able to merge them), then
times ``iters`` posts of all ``n`` blocks, each from ``transfer`` to ``check_xfer_state`` =
DONE, after a warm-up (``kvx.bench.warm``: one post at least, 20 ms at least, as for kvx).
The buffer that receives data is zeroed before every block size and
checked afterwards against the expected permuted layout (by the target for writes, after a
NIXL notification; by the initiator for reads).  Latency is measured last: single prepared
4 KiB descriptors posted to completion.

``mem="vram"``: the same two processes with GPU memory on both sides (cupy arrays): the
initiator's on GPU 0, the target's on GPU 1 when two GPUs exist (else GPU 0), registered as
``"VRAM"`` with the GPU index as device id (descriptor lists too), so UCX moves them with its
cuda_ipc transport (NVLink between the GPUs). Bytes are checked on the GPU. ``mem="pinned"``:
initiator VRAM, target host memory page-locked with ``cudaHostRegister`` (NIXL ``"DRAM"``).

``mem="file"``: one process, NIXL's POSIX plugin moving permuted blocks between a registered
DRAM buffer and a registered file (DRAM<->FILE in the same agent, loopback prepared list).

Everything runs in child processes so the UCX environment (``env``) applies from process start,
and so a hung NIXL call can be killed: the whole run is bounded by ``timeout``.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import numpy as np

from .. import config as _kvx_config
from ..bench.timing import warm

__all__ = ["nixl_available", "nixl_version", "run_nixl", "parse_size", "main"]


logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl-cu12==1.5.1"
TARGET_NAME = "kvx-nixl-target"
INITIATOR_NAME = "kvx-nixl-initiator"
LATENCY_BLOCK = 4096
_OPS = {"write": "WRITE", "read": "READ"}
_STDERR_TAIL = 4000


# --------------------------------------------------------------------------------------------
# availability


def _import_nixl_api() -> ModuleType:
    """Import NIXL's Python API (``nixl_cu12._api``, ``nixl_cu13._api``, or ``nixl._api``)."""
    import importlib

    first: ImportError | None = None
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            first = first or exc
    assert first is not None
    raise first


def nixl_available() -> str | None:
    """Return None if NIXL's Python API can be imported here, else the reason and the fix."""
    try:
        _import_nixl_api()
    except Exception as exc:  # ImportError, or a missing shared library (OSError)
        return f"NIXL is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


def nixl_version() -> str:
    """Return the installed NIXL wheel version ("unknown" if it cannot be determined)."""
    from importlib import metadata

    for dist in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


# --------------------------------------------------------------------------------------------
# helpers shared by the roles


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse ``4K``, ``256M``, ``2MiB``, ``1G`` or a plain byte count (binary multiples)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"bad size {text!r} (expected e.g. 4096, 4K, 256M, 1G)")
    value, unit = int(match.group(1)), match.group(2).lower()
    return value << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[unit]


def _pattern(nbytes: int, xp: Any = np) -> Any:
    """A deterministic byte pattern in which every aligned 4-byte word is unique (< 16 GiB).

    ``xp`` is numpy (host) or cupy (the same bytes built on the current GPU).
    """
    words = xp.arange((nbytes + 3) // 4, dtype=xp.uint32)
    return words.view(xp.uint8)[:nbytes]


def _permutation(n: int, seed: int, permute: bool) -> np.ndarray:
    """Remote block index for local block ``i`` (int32, as ``make_prepped_xfer`` wants)."""
    if permute:
        return np.random.default_rng(seed).permutation(n).astype(np.int32)
    return np.arange(n, dtype=np.int32)


def _block_descs(base: int, block_bytes: int, nblocks: int, dev_id: int = 0) -> np.ndarray:
    """An Nx3 uint64 array of (address/offset, length, device id) for ``nblocks`` blocks."""
    descs = np.empty((nblocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base) + np.arange(nblocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = dev_id
    return descs


def _layout_ok(received: np.ndarray, source: np.ndarray, block_bytes: int, perm: np.ndarray,
               source_is_local: bool) -> bool:
    """Check that local block ``i`` and remote block ``perm[i]`` hold the same bytes.

    ``source_is_local`` (writes): ``received`` is the remote side, so ``received[perm] == source``.
    Otherwise (reads): ``received`` is local, so ``received == source[perm]``.
    """
    n = len(perm)
    used = n * block_bytes
    got = received[:used].reshape(n, block_bytes)
    src = source[:used].reshape(n, block_bytes)
    xp = _xp(received)
    if xp is not np:
        perm = xp.asarray(perm)
    if source_is_local:
        return bool(xp.array_equal(got[perm], src))
    return bool(xp.array_equal(got, src[perm]))


def _xp(arr: Any) -> Any:
    """numpy for host arrays, cupy for GPU arrays."""
    if isinstance(arr, np.ndarray):
        return np
    import cupy  # type: ignore[import-not-found,unused-ignore]

    return cupy


#: mem mode -> (initiator memory, target memory): "dram" host, "vram" GPU, "pinned" host memory
#: page-locked with cudaHostRegister (registered with NIXL as DRAM)
_MEMS = {"dram": ("dram", "dram"), "vram": ("vram", "vram"), "pinned": ("vram", "pinned")}


def _gpu_count() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


class _Buffer:
    """One side's registered buffer: host numpy (``dram``/``pinned``) or a cupy GPU array (``vram``).

    The initiator's GPU is 0; the target's is 1 when this machine has two GPUs, else 0.
    """

    def __init__(self, kind: str, nbytes: int, role: str, fill: bool) -> None:
        self.kind = kind
        self.dev = 0
        self._pinned = False
        if kind == "vram":
            import cupy

            self.dev = 1 if role == "target" and _gpu_count() > 1 else 0
            cupy.cuda.Device(self.dev).use()  # this thread's CUDA context: UCX's cuda_ipc uses it
            self.arr: Any = _pattern(nbytes, cupy).copy() if fill else cupy.zeros(nbytes, cupy.uint8)
            self.addr = int(self.arr.data.ptr)
        else:
            self.arr = _pattern(nbytes).copy() if fill else np.zeros(nbytes, np.uint8)
            self.addr = int(self.arr.ctypes.data)
            if kind == "pinned":
                import cupy

                cupy.cuda.runtime.hostRegister(self.addr, nbytes, 1)  # cudaHostRegisterPortable
                self._pinned = True
        self.sync()

    @property
    def seg(self) -> str:
        """NIXL's memory segment type."""
        return "VRAM" if self.kind == "vram" else "DRAM"

    def descs(self, block_bytes: int, nblocks: int) -> np.ndarray:
        return _block_descs(self.addr, block_bytes, nblocks, dev_id=self.dev)

    def pattern(self, nbytes: int) -> Any:
        return _pattern(nbytes, _xp(self.arr))

    def zero(self) -> None:
        self.arr[:] = 0
        self.sync()

    def sync(self) -> None:
        if self.kind == "vram":
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    def close(self) -> None:
        if self._pinned:
            import cupy

            cupy.cuda.runtime.hostUnregister(self.addr)
            self._pinned = False


class _Deadline:
    """An absolute wall-clock deadline, also expressed on the ``perf_counter`` clock."""

    def __init__(self, wall_deadline: float) -> None:
        self.wall = wall_deadline
        self.perf = time.perf_counter() + (wall_deadline - time.time())

    def remaining(self) -> float:
        return self.wall - time.time()

    def check(self, what: str) -> None:
        if time.perf_counter() > self.perf:
            raise TimeoutError(f"deadline passed while {what}")


def _post_and_wait(agent: Any, handle: Any, deadline: _Deadline) -> float:
    """Post a prepared transfer and poll it to completion; return seconds post->DONE."""
    perf = time.perf_counter
    limit = deadline.perf
    t0 = perf()
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if perf() > limit:
            raise TimeoutError("deadline passed while waiting for a NIXL transfer")
    t1 = perf()
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed (state {state})")
    return t1 - t0


def _summarize(block_bytes: int, nblocks: int, times: Sequence[float], verified: bool
               ) -> dict[str, Any]:
    """One entry of ``results``: median/min seconds per transfer and GB/s (1e9 B/s)."""
    median = float(np.median(times))
    total_bytes = nblocks * block_bytes
    return {
        "block_bytes": block_bytes,
        "nblocks": nblocks,
        "total_bytes": total_bytes,
        "iters": len(times),
        "seconds_median": median,
        "seconds_min": float(np.min(times)),
        "gbps": total_bytes / median / 1e9,
        "verified": verified,
    }


def _measure_latency(agent: Any, handle: Any, samples: int, deadline: _Deadline
                     ) -> dict[str, Any]:
    """Post ``handle`` (one 4 KiB descriptor) ``samples`` times; median and p99 in µs."""
    for _ in range(min(100, samples)):  # warm-up
        _post_and_wait(agent, handle, deadline)
    lat = np.array([_post_and_wait(agent, handle, deadline) for _ in range(samples)]) * 1e6
    return {
        "block_bytes": LATENCY_BLOCK,
        "op": "write",
        "samples": samples,
        "median": float(np.median(lat)),
        "p99": float(np.percentile(lat, 99)),
    }


@dataclass
class _Config:
    """What every role needs; travels to the children as JSON on the command line."""

    mem: str
    op: str
    block_sizes: list[int]
    total: int
    iters: int
    permute: bool
    seed: int
    latency_samples: int
    backend: str
    deadline: float
    progress_thread: bool = False
    target_progress_delay_us: int = 1000
    file_dir: str | None = None

    def to_arg(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_arg(cls, text: str) -> "_Config":
        return cls(**json.loads(text))


class _Channel:
    """Newline-delimited JSON over a connected stream socket, every wait bounded by a deadline."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = b""

    def _timeout(self, what: str) -> float:
        left = self._deadline.remaining()
        if left <= 0:
            raise TimeoutError(f"deadline passed while {what}")
        return left

    def send(self, msg: dict[str, Any]) -> None:
        self._sock.settimeout(self._timeout("sending a control message"))
        self._sock.sendall(json.dumps(msg).encode() + b"\n")

    def recv(self, expect: str | None = None) -> dict[str, Any]:
        while b"\n" not in self._buf:
            self._sock.settimeout(self._timeout(f"waiting for {expect or 'a message'}"))
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError:  # socket.timeout
                raise TimeoutError(
                    f"deadline passed while waiting for {expect or 'a message'}") from None
            if not chunk:
                raise RuntimeError(f"peer closed the control channel (waiting for {expect})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg.get("type") == "error":
            raise RuntimeError(f"peer failed: {msg.get('error')}")
        if expect is not None and msg.get("type") != expect:
            raise RuntimeError(f"protocol error: expected {expect!r}, got {msg.get('type')!r}")
        return msg

    def close(self) -> None:
        self._sock.close()


def _make_agent(api: ModuleType, name: str, backend: str, progress_thread: bool,
                progress_delay_us: int = 0) -> Any:
    """A NIXL agent with exactly one backend and no listener thread (we exchange metadata).

    ``nixl_agent`` hard-codes the progress thread's poll delay (``pthrDelay``) to 0, which makes
    that thread busy-spin a whole core.  A positive ``progress_delay_us`` is applied through a
    subclass of the bindings' config type for the duration of the constructor call: the thread
    then sleeps in ``poll()`` on the UCX worker's event fd and still wakes for every event.
    """
    config = api.nixl_agent_config(enable_prog_thread=progress_thread,
                                   enable_listen_thread=False, backends=[backend])
    bindings = api.nixlBind
    original = bindings.nixlAgentConfig
    if progress_thread and progress_delay_us > 0:

        class _DelayedConfig(original):  # type: ignore[misc,valid-type]
            def __setattr__(self, key: str, value: Any) -> None:
                super().__setattr__(key, progress_delay_us if key == "pthrDelay" else value)

        bindings.nixlAgentConfig = _DelayedConfig
    try:
        agent = api.nixl_agent(name, config)
    finally:
        bindings.nixlAgentConfig = original
    if backend not in agent.backends:
        raise RuntimeError(f"NIXL backend {backend!r} unavailable (plugins: "
                           f"{agent.get_plugin_list()})")
    return agent


# --------------------------------------------------------------------------------------------
# role: target (passive side of the DRAM benchmark)


def _target_main(cfg: _Config, ch: _Channel, deadline: _Deadline) -> None:
    """Register the target buffer, publish metadata, serve prepare/verify requests."""
    api = _import_nixl_api()
    mem = _Buffer(_MEMS[cfg.mem][1], cfg.total, "target", fill=cfg.op == "read")
    buf = mem.arr
    agent = _make_agent(api, TARGET_NAME, cfg.backend, True, cfg.target_progress_delay_us)
    reg = agent.register_memory([(mem.addr, cfg.total, mem.dev, "")], mem.seg,
                                backends=[cfg.backend])
    ch.send({"type": "hello", "name": TARGET_NAME, "addr": mem.addr, "size": cfg.total,
             "dev": mem.dev, "seg": mem.seg,
             "md": base64.b64encode(agent.get_agent_metadata()).decode()})
    hello = ch.recv("hello")
    agent.add_remote_agent(base64.b64decode(hello["md"]))
    while True:
        msg = ch.recv()
        kind = msg["type"]
        if kind == "prepare":
            if cfg.op == "write":
                mem.zero()  # so that the verification proves this block size's bytes arrived
            ch.send({"type": "ready"})
        elif kind == "verify":
            tag = msg["tag"].encode()
            while not agent.check_remote_xfer_done(INITIATOR_NAME, tag):
                deadline.check(f"waiting for notification {tag!r}")
                time.sleep(0.0005)
            bs, n = msg["block_bytes"], msg["nblocks"]
            perm = _permutation(n, cfg.seed, cfg.permute)
            mem.sync()
            ok = _layout_ok(buf, mem.pattern(n * bs), bs, perm, source_is_local=True)
            logger.info("target verified block size %d: %s", bs, ok)
            ch.send({"type": "verified", "ok": ok})
        elif kind == "done":
            break
        else:
            raise RuntimeError(f"protocol error: unexpected {kind!r}")
    agent.remove_remote_agent(INITIATOR_NAME)
    agent.deregister_memory(reg, backends=[cfg.backend])
    mem.close()
    ch.send({"type": "bye"})


# --------------------------------------------------------------------------------------------
# role: initiator (active side of the DRAM benchmark)


def _initiator_main(cfg: _Config, ch: _Channel, deadline: _Deadline) -> dict[str, Any]:
    """Run the sweep and the latency test against the target; return the result dict."""
    api = _import_nixl_api()
    backends = [cfg.backend]
    mem = _Buffer(_MEMS[cfg.mem][0], cfg.total, "initiator", fill=cfg.op == "write")
    buf = mem.arr
    agent = _make_agent(api, INITIATOR_NAME, cfg.backend, cfg.progress_thread)
    reg = agent.register_memory([(mem.addr, cfg.total, mem.dev, "")], mem.seg,
                                backends=backends)
    hello = ch.recv("hello")
    remote_name = agent.add_remote_agent(base64.b64decode(hello["md"]))
    if isinstance(remote_name, bytes):
        remote_name = remote_name.decode()
    if remote_name != TARGET_NAME or hello["size"] < cfg.total:
        raise RuntimeError(f"unexpected target {remote_name!r} / size {hello['size']}")
    remote_addr, remote_dev, remote_seg = int(hello["addr"]), int(hello.get("dev", 0)), \
        str(hello.get("seg", "DRAM"))
    ch.send({"type": "hello", "name": INITIATOR_NAME,
             "md": base64.b64encode(agent.get_agent_metadata()).decode()})
    agent.make_connection(TARGET_NAME, backends)

    op = _OPS[cfg.op]
    results: list[dict[str, Any]] = []
    for bs in cfg.block_sizes:
        n = cfg.total // bs
        perm = _permutation(n, cfg.seed, cfg.permute)
        ch.send({"type": "prepare", "block_bytes": bs, "nblocks": n})
        ch.recv("ready")
        if cfg.op == "read":
            mem.zero()
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mem.descs(bs, n), mem.seg,
                                      backends=backends)
        remote = agent.prep_xfer_dlist(TARGET_NAME, _block_descs(remote_addr, bs, n, remote_dev),
                                       remote_seg, backends=backends)
        xfer = agent.make_prepped_xfer(op, local, np.arange(n, dtype=np.int32), remote, perm,
                                       backends=backends)
        warm(lambda: _post_and_wait(agent, xfer, deadline))  # as kvx's points are (kvx.bench.warm)
        times = [_post_and_wait(agent, xfer, deadline) for _ in range(cfg.iters)]
        if cfg.op == "write":
            tag = f"kvx-verify:{bs}"
            agent.send_notif(TARGET_NAME, tag.encode())
            ch.send({"type": "verify", "block_bytes": bs, "nblocks": n, "tag": tag})
            ok = bool(ch.recv("verified")["ok"])
        else:
            mem.sync()
            ok = _layout_ok(buf, mem.pattern(n * bs), bs, perm, source_is_local=False)
        xfer.release()
        local.release()
        remote.release()
        entry = _summarize(bs, n, times, ok)
        logger.info("nixl %s %d B x %d: %.3f GB/s verified=%s", cfg.op, bs, n, entry["gbps"], ok)
        results.append(entry)

    latency = None
    if cfg.latency_samples > 0:
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(mem.addr, LATENCY_BLOCK, mem.dev)],
                                      mem.seg, backends=backends)
        remote = agent.prep_xfer_dlist(TARGET_NAME, [(remote_addr, LATENCY_BLOCK, remote_dev)],
                                       remote_seg, backends=backends)
        xfer = agent.make_prepped_xfer("WRITE", local, [0], remote, [0], backends=backends)
        latency = _measure_latency(agent, xfer, cfg.latency_samples, deadline)
        xfer.release()
        local.release()
        remote.release()

    ch.send({"type": "done"})
    ch.recv("bye")
    agent.remove_remote_agent(TARGET_NAME)
    agent.deregister_memory(reg, backends=backends)
    mem.close()
    return _result(cfg, results, latency)


def _result(cfg: _Config, results: list[dict[str, Any]], latency: dict[str, Any] | None
            ) -> dict[str, Any]:
    return {
        "impl": "nixl",
        "version": nixl_version(),
        "backend": cfg.backend,
        "mem": cfg.mem,
        "op": cfg.op,
        "permute": cfg.permute,
        "results": results,
        "latency_us": latency,
        "verified": bool(results) and all(r["verified"] for r in results),
    }


# --------------------------------------------------------------------------------------------
# role: file (DRAM <-> FILE through the POSIX plugin, one process)


def _file_main(cfg: _Config, deadline: _Deadline) -> dict[str, Any]:
    """Write/read permuted blocks between a registered DRAM buffer and a registered file."""
    api = _import_nixl_api()
    backends = [cfg.backend]
    agent = _make_agent(api, INITIATOR_NAME, cfg.backend, cfg.progress_thread)
    buf = _pattern(cfg.total).copy() if cfg.op == "write" else np.zeros(cfg.total, np.uint8)
    fd_file = tempfile.NamedTemporaryFile(prefix="kvx-nixl-", suffix=".bin", dir=cfg.file_dir)
    try:
        fd = fd_file.fileno()
        if cfg.op == "read":
            _pattern(cfg.total).tofile(fd_file)
            fd_file.flush()
        os.ftruncate(fd, cfg.total)
        dram_reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM",
                                         backends=backends)
        file_reg = agent.register_memory([(0, cfg.total, fd, "")], "FILE", backends=backends)
        op = _OPS[cfg.op]
        results: list[dict[str, Any]] = []
        for bs in cfg.block_sizes:
            n = cfg.total // bs
            perm = _permutation(n, cfg.seed, cfg.permute)
            if cfg.op == "write":
                os.ftruncate(fd, 0)  # drop the previous block size's bytes
                os.ftruncate(fd, cfg.total)
            else:
                buf[:] = 0
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _block_descs(buf.ctypes.data, bs, n),
                                          "DRAM", backends=backends)
            remote = agent.prep_xfer_dlist(agent.name, _block_descs(0, bs, n, dev_id=fd), "FILE",
                                           backends=backends)
            xfer = agent.make_prepped_xfer(op, local, np.arange(n, dtype=np.int32), remote, perm,
                                           backends=backends)
            warm(lambda: _post_and_wait(agent, xfer, deadline))
            times = [_post_and_wait(agent, xfer, deadline) for _ in range(cfg.iters)]
            if cfg.op == "write":
                on_disk = np.fromfile(fd_file.name, dtype=np.uint8, count=n * bs)
                ok = _layout_ok(on_disk, _pattern(n * bs), bs, perm, source_is_local=True)
            else:
                ok = _layout_ok(buf, _pattern(n * bs), bs, perm, source_is_local=False)
            xfer.release()
            local.release()
            remote.release()
            results.append(_summarize(bs, n, times, ok))

        latency = None
        if cfg.latency_samples > 0:
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data, LATENCY_BLOCK, 0)],
                                          "DRAM", backends=backends)
            remote = agent.prep_xfer_dlist(agent.name, [(0, LATENCY_BLOCK, fd)], "FILE",
                                           backends=backends)
            xfer = agent.make_prepped_xfer("WRITE", local, [0], remote, [0], backends=backends)
            latency = _measure_latency(agent, xfer, cfg.latency_samples, deadline)
            xfer.release()
            local.release()
            remote.release()
        agent.deregister_memory(file_reg, backends=backends)
        agent.deregister_memory(dram_reg, backends=backends)
    finally:
        fd_file.close()
    return _result(cfg, results, latency)


# --------------------------------------------------------------------------------------------
# orchestration (runs in the caller's process; never imports NIXL)


def _tail(path: Path, limit: int = _STDERR_TAIL) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode(errors="replace")


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    root = str(Path(__file__).resolve().parents[2])  # the directory holding the kvx package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _reap(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill whatever is still running and wait for everything, so no zombie remains."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL could not be delivered
            logger.error("NIXL child %d did not exit after SIGKILL", proc.pid)


def run_nixl(*, mem: str = "dram", op: str = "write", block_sizes: list[int], total: int,
             iters: int = 5, permute: bool = True, seed: int = 0, latency_samples: int = 2000,
             backend: str = "UCX", env: dict[str, str] | None = None, timeout: float = 300.0,
             progress_thread: bool = False, target_progress_delay_us: int = 1000,
             file_dir: str | None = None) -> dict[str, Any]:
    """Benchmark NIXL on kvx's workload and return kvx-shaped results.

    Args:
        mem: ``"dram"`` (two processes, DRAM->DRAM over ``backend``, default UCX), ``"vram"``
            (two processes, GPU memory on both sides: initiator on GPU 0, target on GPU 1 when
            there are two GPUs, registered as VRAM with the GPU index as device id; over UCX
            that is its cuda_ipc transport, NVLink where present; needs cupy), ``"pinned"``
            (initiator VRAM on GPU 0, target host DRAM page-locked with ``cudaHostRegister``)
            or ``"file"`` (one process, DRAM<->file over the POSIX plugin; ``backend`` UCX is
            replaced by POSIX).
        op: ``"write"`` or ``"read"``, from the initiator's point of view.
        block_sizes: block sizes in bytes; each is swept over ``total // bs`` blocks.
        total: bytes of each buffer (and of the file).
        iters: timed transfers per block size (after a warm-up of 20 ms, one transfer at least).
        permute: remote block ids permuted (``default_rng(seed).permutation(n)``), local in order.
        seed: permutation seed.
        latency_samples: number of single 4 KiB write transfers for the latency figure (0: skip).
        backend: NIXL backend plugin name.
        env: extra environment for the NIXL processes (e.g. ``{"UCX_TLS": "tcp,self"}``).
        timeout: bound on the whole run in seconds.
        progress_thread: enable NIXL's progress thread in the initiator agent.  Off by default:
            the initiator's own ``check_xfer_state`` polling progresses UCX.
        target_progress_delay_us: poll delay of the target agent's progress thread, which is
            always on (the passive target is otherwise blocked on the control channel, and
            UCX wire-up, notifications and TCP puts need target-side progress; without it the
            first transfer hangs).  0 (NIXL's Python default) busy-spins a core; the default
            1000 makes the thread sleep in ``poll()`` between UCX events, which measured faster
            and steadier on a small (2-core) host where the spinner competes with the
            initiator.  Over TCP (``UCX_TLS=tcp``) 0 gives lower latency at the cost of a core.
        file_dir: directory of the temporary file for ``mem="file"`` (default: the temp dir).

    Returns:
        ``{"impl": "nixl", "version", "backend", "mem", "op", "results": [...],
        "latency_us": {...}, "verified": bool}`` (see the module docstring).

    Raises:
        RuntimeError: NIXL is missing, a child failed, or the run exceeded ``timeout``.
        ValueError: bad arguments.
    """
    reason = nixl_available()
    if reason is not None:
        raise RuntimeError(reason)
    if mem not in ("dram", "vram", "pinned", "file"):
        raise ValueError(f"mem must be 'dram', 'vram', 'pinned' or 'file', not {mem!r}")
    if op not in _OPS:
        raise ValueError(f"op must be 'write' or 'read', not {op!r}")
    if not block_sizes or any(bs <= 0 or bs > total for bs in block_sizes):
        raise ValueError(f"block sizes {block_sizes} must be in 1..total ({total})")
    if total < LATENCY_BLOCK or iters < 1 or latency_samples < 0 or timeout <= 0:
        raise ValueError("need total >= 4096, iters >= 1, latency_samples >= 0, timeout > 0")
    if mem == "file" and backend == "UCX":
        backend = "POSIX"

    start = time.time()
    margin = min(5.0, 0.1 * timeout)  # children give up first, with a readable error
    cfg = _Config(mem=mem, op=op, block_sizes=[int(b) for b in block_sizes], total=int(total),
                  iters=int(iters), permute=bool(permute), seed=int(seed),
                  latency_samples=int(latency_samples), backend=backend,
                  deadline=start + timeout - margin, progress_thread=progress_thread,
                  target_progress_delay_us=int(target_progress_delay_us), file_dir=file_dir)
    child_env = _child_env(env)
    logger.info("running NIXL %s %s %s, block sizes %s, total %d", backend, mem, op,
                cfg.block_sizes, total)

    with tempfile.TemporaryDirectory(prefix="kvx-nixl-") as tmp:
        tmpdir = Path(tmp)
        result_path = tmpdir / "result.json"
        logs: dict[str, Path] = {}
        procs: dict[str, subprocess.Popen[bytes]] = {}

        def spawn(role: str, fd: int | None) -> None:
            logs[role] = tmpdir / f"{role}.log"
            argv = [sys.executable, "-m", "kvx.compare.nixl", "--role", role,
                    "--config", cfg.to_arg(), "--result", str(result_path)]
            if fd is not None:
                argv += ["--fd", str(fd)]
            with open(logs[role], "wb") as log:
                procs[role] = subprocess.Popen(
                    argv, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=() if fd is None else (fd,))

        def tails() -> str:
            return "\n".join(f"--- {role} output (tail) ---\n{_tail(path)}"
                             for role, path in logs.items())

        try:
            if mem != "file":
                init_sock, target_sock = socket.socketpair()
                try:
                    spawn("target", target_sock.fileno())
                    spawn("initiator", init_sock.fileno())
                finally:  # the children hold their own copies now
                    init_sock.close()
                    target_sock.close()
                main_role = "initiator"
            else:
                spawn("file", None)
                main_role = "file"
            try:
                procs[main_role].wait(timeout=max(0.1, start + timeout - time.time()))
                for proc in procs.values():
                    proc.wait(timeout=max(5.0, start + timeout - time.time()))
            except subprocess.TimeoutExpired:
                _reap(list(procs.values()))
                raise RuntimeError(f"NIXL {mem} {op} benchmark timed out after {timeout:.0f} s"
                                   f"\n{tails()}") from None
        finally:
            _reap(list(procs.values()))

        outcome: dict[str, Any] | None = None
        if result_path.exists():
            outcome = json.loads(result_path.read_text())
        if outcome is None or "error" in outcome or procs[main_role].returncode != 0:
            error = (outcome or {}).get("error", f"exit status {procs[main_role].returncode}")
            what = (f"timed out after {timeout:.0f} s" if error.startswith("TimeoutError")
                    else "failed")
            raise RuntimeError(f"NIXL {mem} {op} benchmark {what}: {error}\n{tails()}")
        for role, proc in procs.items():
            if proc.returncode != 0:
                logger.warning("NIXL %s exited with %s:\n%s", role, proc.returncode,
                               _tail(logs[role]))
    return outcome


# --------------------------------------------------------------------------------------------
# command line


def _write_result(path: str, payload: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, path)


def _role_main(args: argparse.Namespace) -> int:
    """Entry point of a child process (``--role target|initiator|file``)."""
    logging.basicConfig(level=str(_kvx_config.get("KVX_NIXL_LOG")), stream=sys.stderr,
                        format=f"%(asctime)s {args.role} %(levelname)s %(name)s: %(message)s")
    cfg = _Config.from_arg(args.config)
    deadline = _Deadline(cfg.deadline)
    ch = None
    try:
        if args.role == "file":
            _write_result(args.result, _file_main(cfg, deadline))
            return 0
        ch = _Channel(socket.socket(fileno=args.fd), deadline)
        if args.role == "target":
            _target_main(cfg, ch, deadline)
        else:
            _write_result(args.result, _initiator_main(cfg, ch, deadline))
        return 0
    except BaseException as exc:  # report, then exit non-zero; the parent raises
        text = f"{type(exc).__name__}: {exc}"
        logger.error("NIXL %s failed: %s\n%s", args.role, text, traceback.format_exc())
        if ch is not None:
            try:
                ch.send({"type": "error", "error": f"{args.role}: {text}"})
            except Exception:
                pass
        if args.role != "target":
            _write_result(args.result, {"error": text, "traceback": traceback.format_exc()})
        return 1
    finally:
        if ch is not None:
            ch.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvx.compare.nixl --block-sizes 4K,32K,256K,2M --total 256M --op write``."""
    parser = argparse.ArgumentParser(prog="python -m kvx.compare.nixl",
                                     description="Benchmark NIXL like kvx bench does; print JSON.")
    parser.add_argument("--mem", choices=["dram", "vram", "pinned", "file"], default="dram")
    parser.add_argument("--op", choices=sorted(_OPS), default="write")
    parser.add_argument("--block-sizes", default="4K,32K,256K,2M",
                        help="comma-separated block sizes (e.g. 4K,32K,256K,2M)")
    parser.add_argument("--total", default="256M", help="bytes per buffer (e.g. 256M)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--no-permute", action="store_true",
                        help="remote block ids in order (lets NIXL merge descriptors)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-samples", type=int, default=2000)
    parser.add_argument("--backend", default="UCX")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the NIXL processes (repeatable)")
    parser.add_argument("--progress-thread", action="store_true",
                        help="enable the initiator agent's NIXL progress thread")
    parser.add_argument("--target-progress-delay-us", type=int, default=1000,
                        help="target progress thread poll delay in us (0: busy-spin, NIXL's default)")
    parser.add_argument("--file-dir", default=None, help="directory for --mem file")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--role", choices=["target", "initiator", "file"], help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        return _role_main(args)

    logging.basicConfig(level=logging.WARNING)
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env wants KEY=VALUE, got {item!r}")
        env[key] = value
    try:
        result = run_nixl(mem=args.mem, op=args.op,
                          block_sizes=[parse_size(s) for s in args.block_sizes.split(",") if s],
                          total=parse_size(args.total), iters=args.iters,
                          permute=not args.no_permute, seed=args.seed,
                          latency_samples=args.latency_samples, backend=args.backend, env=env,
                          timeout=args.timeout, progress_thread=args.progress_thread,
                          target_progress_delay_us=args.target_progress_delay_us,
                          file_dir=args.file_dir)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
