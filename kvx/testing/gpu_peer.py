"""The GPU test and benchmark peer: a kvx agent in another process that registers GPU or pinned
memory and answers JSON lines (``register``, ``release``, ``free``, ``digest``, ``fill``, ``zero``,
``peek``, ``put``, ``notifs``, ``meta``, ``quit``), driven by :class:`Helper`.

Run as ``python -m kvx.testing.gpu_peer [--name N] [--config JSON]`` (what :class:`Helper` starts).
:func:`pattern` and :func:`digest` give the same bytes and checksums from numpy and cupy, so both
sides can rebuild and check what moved.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
from typing import Any

import numpy as np

import kvx
from kvx.testing.memory import Memory
from kvx.testing.procs import PeerProcess

__all__ = ["Helper", "alloc", "array_module", "digest", "pattern", "sync_all"]

_K1 = np.uint64(0x9E3779B97F4A7C15)
_K2 = np.uint64(0xBF58476D1CE4E5B9)
_K3 = np.uint64(0x94D049BB133111EB)


def pattern(xp: Any, nbytes: int, seed: int) -> Any:
    """Deterministic bytes, identical from numpy and cupy (``xp``), so both sides can rebuild them."""
    n8 = (nbytes + 7) // 8
    x = xp.arange(n8, dtype=xp.uint64)
    x += xp.uint64((seed * 0x2545F4914F6CDD1D) % (1 << 64))
    x *= _K2
    x ^= x >> xp.uint64(31)
    x *= _K3
    x ^= x >> xp.uint64(29)
    return x.view(xp.uint8)[:nbytes]


def digest(xp: Any, a: Any) -> int:
    """A position-sensitive 64-bit checksum of a uint8 array (numpy or cupy; same value)."""
    n8 = a.size // 8
    s = 0
    if n8:
        w = a[: n8 * 8].view(xp.uint64)
        i = xp.arange(n8, dtype=xp.uint64)
        i *= _K1
        h = w ^ i
        h *= _K2
        h ^= h >> xp.uint64(31)
        s = int(h.sum(dtype=xp.uint64))
    tail = bytes(xp.asnumpy(a[n8 * 8:]) if hasattr(xp, "asnumpy") else a[n8 * 8:])
    return (s ^ int.from_bytes(tail.ljust(8, b"\0"), "little") ^ (a.size << 1)) & ((1 << 64) - 1)


def array_module(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return np
    import cupy

    return cupy


def alloc(seg: str, nbytes: int, dev: int) -> tuple[Any, Any]:
    """(object to register, uint8 view to fill and check) for one memory segment: ``pinned``,
    ``vram`` or ``torch`` (a slice at an offset inside a caching-allocator block) on GPU ``dev``
    (as :class:`kvx.testing.memory.Memory` makes them)."""
    if seg not in ("pinned", "vram", "torch"):
        raise ValueError(f"unknown memory segment {seg!r} (vram, pinned, torch)")
    return Memory(seg, dev).alloc(nbytes)


# ---------------------------------------------------------------------------------------------
# The helper process


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.testing.gpu_peer")
    ap.add_argument("--name", default="gpu-target")
    ap.add_argument("--config", default="{}")
    a = ap.parse_args(argv)
    cfgd = json.loads(a.config)
    if "backends" in cfgd:
        cfgd["backends"] = tuple(cfgd["backends"])
    agent = kvx.Agent(a.name, kvx.AgentConfig(**cfgd))
    regs: dict[int, tuple[kvx.Registration, Any, Any]] = {}
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"meta": base64.b64encode(agent.metadata()).decode(), "pid": os.getpid()})
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c.get("cmd")
        try:
            with _on_device(regs.get(int(c.get("id", 0)), (None, None, None))[2]):
                _serve_one(c, cmd, agent, regs, say)
        except Exception as exc:  # report to the driver, keep serving
            say({"error": f"{type(exc).__name__}: {exc}"})
        if cmd == "quit":
            break
    agent.close()
    return 0


class _on_device:
    """Run on the GPU holding ``view`` (cupy launches on the current device)."""

    def __init__(self, view: Any) -> None:
        self.ctx: Any = None
        if view is not None and not isinstance(view, np.ndarray):
            import cupy

            self.ctx = cupy.cuda.Device(view.device.id)
        elif view is None:  # registering: make the new memory's initial fill visible too
            try:
                import cupy

                self.ctx = cupy.cuda.Device(cupy.cuda.runtime.getDevice())
            except ImportError:
                pass

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()  # the initiator's copies come from another process
            self.ctx.__exit__(*exc)


def _serve_one(c: dict[str, Any], cmd: Any, agent: kvx.Agent, regs: dict[int, Any], say: Any) -> None:
    nid = max(regs, default=0) + 1
    if cmd == "register":
        obj, view = alloc(c["seg"], int(c["nbytes"]), int(c.get("dev", 0)))
        if not isinstance(view, np.ndarray):
            import cupy

            sync_all(cupy)  # torch/cupy fills are asynchronous
        reg = agent.register(obj)
        regs[nid] = (reg, obj, view)
        say({"id": nid, "descs": base64.b64encode(reg.descs.to_bytes()).decode()})
    elif cmd == "release":
        regs[int(c["id"])][0].release()
        say({"ok": True})
    elif cmd == "free":
        regs.pop(int(c["id"]))[0].release()
        say({"ok": True})
    elif cmd == "digest":
        v = regs[int(c["id"])][2]
        say({"digest": str(digest(array_module(v), v))})
    elif cmd == "fill":
        v = regs[int(c["id"])][2]
        v[:] = pattern(array_module(v), v.size, int(c["seed"]))
        _settle(v)
        say({"ok": True})
    elif cmd == "zero":
        v = regs[int(c["id"])][2]
        v[:] = 0
        _settle(v)
        say({"ok": True})
    elif cmd == "peek":
        v = regs[int(c["id"])][2]
        off, n = int(c["off"]), int(c["n"])
        part = v[off: off + n]
        data = bytes(part) if isinstance(part, np.ndarray) else part.get().tobytes()
        say({"data": base64.b64encode(data).decode()})
    elif cmd == "put":
        v = regs[int(c["id"])][2]
        data = np.frombuffer(base64.b64decode(c["data"]), dtype=np.uint8)
        off = int(c["off"])
        xp = array_module(v)
        v[off: off + data.size] = data if xp is np else xp.asarray(data)
        _settle(v)
        say({"ok": True})
    elif cmd == "meta":
        say({"meta": base64.b64encode(agent.metadata()).decode()})
    elif cmd == "notifs":
        got = agent.notifications(timeout=float(c.get("wait", 0)) or None)
        say({"notifs": {k: [base64.b64encode(m).decode() for m in v] for k, v in got.items()}})
    elif cmd == "quit":
        say({"ok": True})
    else:
        say({"error": f"unknown command {cmd!r}"})


class Helper(PeerProcess):
    """A helper process (``python -m kvx.testing.gpu_peer``) driven over JSON lines, bounded."""

    ARGS = ("-m", "kvx.testing.gpu_peer")
    WHAT = "helper"
    QUIT_TIMEOUT = 30.0

    def __init__(self, name: str = "gpu-target", config: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, timeout: float = 120.0) -> None:
        super().__init__(name, config, env, timeout)

    def register(self, seg: str, nbytes: int, dev: int = 0) -> tuple[int, kvx.DescList]:  # type: ignore[override]
        res = self.call(cmd="register", seg=seg, nbytes=nbytes, dev=dev)
        return int(res["id"]), kvx.DescList.from_bytes(base64.b64decode(res["descs"]))

    def digest(self, rid: int) -> int:  # type: ignore[override]
        return int(self.call(cmd="digest", id=rid)["digest"])


def _settle(view: Any) -> None:
    """Wait for the GPU work that just wrote ``view`` (cupy/torch kernels are asynchronous): the
    target answers only once its own fill is done, so no timed transfer shares the GPU with it."""
    if not isinstance(view, np.ndarray):
        import cupy

        sync_all(cupy)


def sync_all(cp: Any) -> None:
    for d in range(cp.cuda.runtime.getDeviceCount()):
        with cp.cuda.Device(d):
            cp.cuda.runtime.deviceSynchronize()


def main(argv: list[str] | None = None) -> int:
    return _serve(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
