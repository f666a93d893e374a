"""A kvx agent in a separate process, driven over JSON lines (for tests and conformance).

Run as ``python -m kvx.testing.peer --name NAME [--config JSON]``. It prints
``{"meta": b64}`` and then answers one JSON command per stdin line:

``register {mem: alloc|numpy|file|object, nbytes, seed?, path?, bucket?, key?}`` ->
``{id, descs}``; ``release {id}``; ``digest {id}``; ``fill {id, seed}``; ``zero {id}``;
``peek {id, off, n}`` -> ``{data}``; ``meta``; ``add_peer {meta}`` -> ``{name}``;
``notifs``; ``hang {seconds}`` (stop answering); ``quit``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np

import kvx


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--config", default="{}")
    a = ap.parse_args(argv)
    cfgd = json.loads(a.config)
    if "listen" in cfgd and cfgd["listen"] is not None:
        cfgd["listen"] = tuple(cfgd["listen"])
    if "backends" in cfgd:
        cfgd["backends"] = tuple(cfgd["backends"])
    agent = kvx.Agent(a.name, kvx.AgentConfig(**cfgd))
    regs: dict[int, tuple[kvx.Registration, Any]] = {}
    nid = 0
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"meta": _b64(agent.metadata()), "pid": __import__("os").getpid()})
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c.get("cmd")
        try:
            if cmd == "register":
                mem = c["mem"]
                n = int(c["nbytes"])
                buf: Any
                if mem == "alloc":
                    buf = kvx.alloc_host(n)
                elif mem == "numpy":
                    buf = np.zeros(n, dtype=np.uint8)
                elif mem == "file":
                    buf = kvx.FileRegion(c["path"], n)
                elif mem == "object":
                    buf = kvx.ObjectRegion(c["bucket"], c["key"], n)
                else:
                    raise ValueError(f"unknown mem {mem!r}")
                if isinstance(buf, np.ndarray) and "seed" in c:
                    buf[:] = np.random.default_rng(int(c["seed"])).integers(0, 256, n, dtype=np.uint8)
                reg = agent.register(buf)
                nid += 1
                regs[nid] = (reg, buf)
                say({"id": nid, "descs": _b64(reg.descs.to_bytes())})
            elif cmd == "release":
                regs[int(c["id"])][0].release()
                say({"ok": True})
            elif cmd == "digest":
                buf = regs[int(c["id"])][1]
                say({"digest": hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()})
            elif cmd == "fill":
                buf = regs[int(c["id"])][1]
                buf[:] = np.random.default_rng(int(c["seed"])).integers(0, 256, buf.nbytes, dtype=np.uint8)
                say({"ok": True})
            elif cmd == "zero":
                regs[int(c["id"])][1][:] = 0
                say({"ok": True})
            elif cmd == "peek":
                buf = regs[int(c["id"])][1]
                off, n = int(c["off"]), int(c["n"])
                say({"data": _b64(bytes(buf[off: off + n]))})
            elif cmd == "meta":
                say({"meta": _b64(agent.metadata())})
            elif cmd == "add_peer":
                say({"name": agent.add_peer(base64.b64decode(c["meta"]))})
            elif cmd == "notifs":
                got = agent.notifications(timeout=float(c.get("wait", 0)) or None)
                say({"notifs": {k: [_b64(m) for m in v] for k, v in got.items()}})
            elif cmd == "hang":
                time.sleep(float(c["seconds"]))
                say({"ok": True})
            elif cmd == "quit":
                say({"ok": True})
                break
            else:
                say({"error": f"unknown command {cmd!r}"})
        except Exception as exc:  # report to the test, keep serving
            say({"error": f"{type(exc).__name__}: {exc}"})
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
