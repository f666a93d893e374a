"""``kvx bench --backend tcp``: two processes over loopback through the tcp backend, permuted
blocks, plus the raw ceiling measured in the same run (one TCP stream, ``sendall`` /
``recv_into`` of the same total bytes, impl ``raw-tcp``) and the latency of one 4 KiB write.

``--seg LOCAL,REMOTE`` picks each side's memory: ``dram`` (the default, ``--mem``), ``pinned``
(``kvx.alloc_host(pinned=True)``) or ``vram`` (a cupy array; the target uses GPU 1 when there are
two): CUDA memory travels through the tcp backend's pinned staging (both agents run only the tcp
backend, so CUDA IPC is never used: the stand-in for two nodes).

The target is this module run as ``python -m kvx.bench.tcp --target`` (an agent with only
the tcp backend, listening on ``--listen``, default ``127.0.0.1:0``). It speaks the JSON
lines of :mod:`kvx.bench.target` plus ``{"cmd": "raw", "op": "write"|"read", "iters": n}``,
which opens a plain TCP listener and answers ``{"port": p}``.
"""

from __future__ import annotations

import argparse
import base64
import json
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

import kvx

from . import BenchError, BenchOptions, Progress, iter_sizes, row
from .host import Target, latency, sweep
from .target import alloc, digest, guarded, pattern

__all__ = ["run", "TcpTarget", "raw_tcp"]


_SEGS = ("dram", "pinned", "vram")


def _segs(opts: BenchOptions) -> tuple[str, str]:
    """(local, remote) memory of ``--seg`` for the tcp and ucx benches."""
    segs = tuple(s or "dram" for s in opts.seg)
    for s in segs:
        if s not in _SEGS:
            raise kvx.UsageError(f"kvx bench --backend {opts.backend}: --seg takes {', '.join(_SEGS)}, not {s!r}")
    if "vram" in segs:  # GPU memory comes from cupy, as the cuda backend's does
        from ..backends.cuda import CudaBackend

        why = CudaBackend.unavailable_reason()
        if why is not None:
            raise kvx.BackendUnavailable(f"kvx bench --backend {opts.backend} --seg {','.join(segs)}: {why}")
    return segs[0], segs[-1]


class _DevView:
    """A cupy array seen as the host buffer the sweep fills and checks: assignments upload,
    slices come back as numpy copies (so ``digest`` and comparisons work unchanged)."""

    def __init__(self, arr: Any, dev: int) -> None:
        self.arr = arr
        self.dev = dev
        self.nbytes = int(arr.nbytes)

    def __setitem__(self, key: Any, value: Any) -> None:
        import cupy

        with cupy.cuda.Device(self.dev):
            self.arr[key] = value if np.isscalar(value) else cupy.asarray(value)
            cupy.cuda.runtime.deviceSynchronize()

    def __getitem__(self, key: Any) -> np.ndarray:
        import cupy

        with cupy.cuda.Device(self.dev):
            return cupy.asnumpy(self.arr[key])  # type: ignore[no-any-return]

    @property
    def data(self) -> memoryview:
        return self[:].data


def _alloc_seg(seg: str, mem: str, nbytes: int, dev: int) -> tuple[Any, Any]:
    """(object to register, buffer the sweep fills and checks) of one memory segment."""
    if seg == "dram":
        buf = alloc(mem, nbytes)
        return buf, buf
    if seg == "pinned":
        buf = kvx.alloc_host(nbytes, pinned=True)
        return buf, buf
    import cupy

    with cupy.cuda.Device(dev):
        arr = cupy.zeros(nbytes, dtype=cupy.uint8)
    return arr, _DevView(arr, dev)


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no cupy or no GPU: the segments that need one fail at allocation
        return 0


class TcpTarget(Target):
    """A tcp (or ucx) bench target process (this module with ``--target``) whose memory is any
    ``--seg`` kind."""

    def __init__(self, opts: BenchOptions, listen: str = "127.0.0.1:0", env: dict[str, str] | None = None,
                 seg: str = "dram", dev: int = 0, backend: str = "tcp") -> None:
        cmd = [sys.executable, "-m", "kvx.bench.tcp", "--target", "--mem", opts.mem, "--total", str(opts.total),
               "--listen", listen, "--seg", seg, "--dev", str(dev), "--backend", backend]
        self._spawn(cmd, env)


def raw_tcp(target: Target, opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """One raw TCP stream over loopback moving ``opts.total`` bytes per iteration, per op."""
    out = []
    buf = alloc("numpy", opts.total)
    buf[:] = 1
    view = memoryview(buf)  # type: ignore[arg-type]
    iters = max(opts.iters, 3)
    for op in opts.ops:
        prog.step(f"raw-tcp {op}")
        port = int(target.call(cmd="raw", op=op, iters=iters + 1)["port"])
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ts = []
        try:
            for i in range(iters + 1):
                t0 = time.perf_counter()
                if op == "write":
                    s.sendall(view)
                    if s.recv(1) != b"k":
                        raise BenchError("raw tcp target did not acknowledge")
                else:
                    s.sendall(b"g")
                    got = 0
                    while got < opts.total:
                        k = s.recv_into(view[got:], opts.total - got)
                        if k == 0:
                            raise BenchError("raw tcp target closed early")
                        got += k
                if i:
                    ts.append(time.perf_counter() - t0)
        finally:
            s.close()
        target._read(60.0)  # the target's "done"
        ts.sort()
        med, mn = ts[len(ts) // 2], ts[0]
        for bs, n in iter_sizes(opts):
            out.append(row("raw-tcp", op, bs, n, iters, med * (n * bs) / opts.total, mn * (n * bs) / opts.total))
    return out


def run(opts: BenchOptions, prog: Progress) -> list[dict[str, Any]]:
    """Run the tcp benchmark (kvx rows, raw-tcp ceiling rows, 4 KiB latency row)."""
    listen = "127.0.0.1:0"
    lseg, rseg = _segs(opts)
    rdev = 1 if rseg == "vram" and _gpus() > 1 else 0
    target = TcpTarget(opts, listen, seg=rseg, dev=rdev)
    try:
        with kvx.Agent("bench-initiator", kvx.AgentConfig(backends=("tcp",))) as agent:
            obj, buf = _alloc_seg(lseg, opts.mem, opts.total, 0)
            reg = agent.register(obj)
            if opts.peer:
                raise kvx.UsageError("--peer (a remote tcp target) is not supported yet; run over loopback")
            peer = agent.add_peer(target.meta)
            rows = sweep(agent, peer, reg, buf, target, opts, prog, backend="tcp")
            prog.step("latency")
            lat: Any = latency(agent, peer, reg, target, opts.latency_samples, backend="tcp")
            rows += lat if isinstance(lat, list) else [lat]
            for r in rows:
                r["path"] = "tcp-loopback"
                r["seg"] = f"{lseg}->{rseg}"
        rows += raw_tcp(target, opts, prog)
    finally:
        target.close()
    return rows


# ---- the target process ----------------------------------------------------------------------
def _raw_serve(lsock: socket.socket, buf: np.ndarray, op: str, iters: int, say: Any) -> None:
    c, _ = lsock.accept()
    lsock.close()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(buf)  # type: ignore[arg-type]
    n = buf.nbytes
    try:
        for _ in range(iters):
            if op == "write":
                got = 0
                while got < n:
                    k = c.recv_into(view[got:], n - got)
                    if k == 0:
                        raise RuntimeError("initiator closed early")
                    got += k
                c.sendall(b"k")
            else:
                if c.recv(1) != b"g":
                    raise RuntimeError("bad raw request")
                c.sendall(view)
    finally:
        c.close()
    say({"ok": True})


def target_main(argv: list[str] | None = None) -> int:
    return guarded(_target_main, argv)


def _target_main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.bench.tcp --target")
    ap.add_argument("--target", action="store_true")
    ap.add_argument("--mem", default="alloc")
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--name", default="bench-target")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--seg", default="dram", choices=_SEGS)
    ap.add_argument("--dev", type=int, default=0)
    ap.add_argument("--backend", default="tcp", choices=("tcp", "ucx"))
    a = ap.parse_args(argv)
    h, _, p = a.listen.rpartition(":")
    agent = kvx.Agent(a.name, kvx.AgentConfig(backends=(a.backend,), listen=(h, int(p))))
    obj, buf = _alloc_seg(a.seg, a.mem, a.total, a.dev)
    reg = agent.register(obj)
    out = sys.stdout
    lock = threading.Lock()

    def say(obj: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(obj) + "\n")
            out.flush()

    from ..discovery import SideChannel

    side = SideChannel(agent, h, int(p))
    say({"meta": base64.b64encode(agent.metadata()).decode(), "descs": base64.b64encode(reg.descs.to_bytes()).decode(),
         "side": list(side.address)})
    raw: threading.Thread | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "digest":
            say({"digest": digest(buf)})
        elif c == "zero":
            buf[:] = 0
            say({"ok": True})
        elif c == "fill":
            buf[:] = pattern(a.total, int(cmd["seed"]))
            say({"ok": True})
        elif c == "notifs":
            n = agent.notifications()
            say({"notifs": {k: [base64.b64encode(m).decode() for m in v] for k, v in n.items()}})
        elif c == "raw":
            ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)
            rbuf = alloc("numpy", a.total)
            raw = threading.Thread(target=_raw_serve, args=(ls, rbuf, cmd["op"], int(cmd["iters"]), say), daemon=True)
            raw.start()
            say({"port": ls.getsockname()[1]})
        elif c == "quit":
            break
        else:
            say({"error": f"unknown command {c!r}"})
    side.close()
    reg.release()
    agent.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m kvx.bench.tcp``: ``--target`` runs the target; otherwise a bench."""
    args = sys.argv[1:] if argv is None else argv
    if "--target" in args:
        return target_main(args)
    from . import format_table, parse_size
    from . import run as bench_run

    ap = argparse.ArgumentParser(prog="python -m kvx.bench.tcp")
    ap.add_argument("--total", default="256M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mem", default="numpy")
    ap.add_argument("--block-sizes", default="4K,32K,256K,2M")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(args)
    opts = BenchOptions(backend="tcp", total=parse_size(a.total), iters=a.iters, mem=a.mem,
                        block_sizes=[parse_size(x) for x in a.block_sizes.split(",")], ops=a.ops.split(","))
    hdr, rows = bench_run(opts, quiet=True)
    print(format_table(rows))
    if a.json:
        from . import dump_json

        dump_json(a.json, hdr, rows, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
