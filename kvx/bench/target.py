"""The passive side of ``kvx bench``: a separate process holding the remote buffer.

Speaks JSON lines: on start it prints ``{"meta": b64, "descs": b64}``; then it answers
``{"cmd": "digest"}``, ``{"cmd": "zero"}``, ``{"cmd": "fill", "seed": s}``,
``{"cmd": "notifs"}`` and ``{"cmd": "quit"}`` on stdin/stdout.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
from typing import Callable

import numpy as np

import kvx


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (both sides can regenerate them)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(buf.data, digest_size=16).hexdigest()


def alloc(mem: str, nbytes: int) -> np.ndarray:
    if mem == "alloc":
        return kvx.alloc_host(nbytes)
    if mem == "numpy":
        return np.zeros(nbytes, dtype=np.uint8)
    raise SystemExit(f"unknown --mem {mem!r}")


def guarded(fn: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run a target's main; a kvx or OS error ends it with one line on stderr (which the
    initiator reports) and exit status 2."""
    try:
        return fn(argv)
    except (kvx.KVXError, OSError) as exc:
        print(f"bench target: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.bench.target")
    ap.add_argument("--mem", default="alloc")
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--name", default="bench-target")
    ap.add_argument("--listen", default=None, help="host:port for the tcp listener")
    a = ap.parse_args(argv)
    cfg = kvx.AgentConfig()
    if a.listen:
        h, _, p = a.listen.rpartition(":")
        cfg = kvx.AgentConfig(listen=(h, int(p)))
    agent = kvx.Agent(a.name, cfg)
    buf = alloc(a.mem, a.total)
    reg = agent.register(buf)
    out = sys.stdout
    out.write(json.dumps({"meta": base64.b64encode(agent.metadata()).decode(),
                          "descs": base64.b64encode(reg.descs.to_bytes()).decode()}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        c = cmd.get("cmd")
        if c == "digest":
            res: dict[str, object] = {"digest": digest(buf)}
        elif c == "zero":
            buf[:] = 0
            res = {"ok": True}
        elif c == "fill":
            buf[:] = pattern(a.total, int(cmd["seed"]))
            res = {"ok": True}
        elif c == "notifs":
            n = agent.notifications()
            res = {"notifs": {k: [base64.b64encode(m).decode() for m in v] for k, v in n.items()}}
        elif c == "quit":
            break
        else:
            res = {"error": f"unknown command {c!r}"}
        out.write(json.dumps(res) + "\n")
        out.flush()
    reg.release()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
