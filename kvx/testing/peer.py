"""A kvx agent in a separate process, driven over JSON lines (for tests and conformance).

Run as ``python -m kvx.testing.peer --name NAME [--config JSON]``. It prints
``{"meta": b64}`` and then answers one JSON command per stdin line:

``register {mem: alloc|numpy|pinned|vram:D|torch:D|file|object, nbytes, seed?, path?, bucket?, key?}`` ->
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

import kvx
from kvx.testing.memory import Memory, memory, pattern


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _mem(m: Memory | None) -> Memory:
    if m is None:
        raise ValueError("files and objects are read through the agent, not by the peer process")
    return m


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
    # id -> (registration, flat uint8 view, its Memory; None for files and objects)
    regs: dict[int, tuple[kvx.Registration, Any, Memory | None]] = {}
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
                n = int(c["nbytes"])
                m: Memory | None = None
                obj: Any
                view: Any
                if c["mem"] == "file":
                    obj = view = kvx.FileRegion(c["path"], n)
                elif c["mem"] == "object":
                    obj = view = kvx.ObjectRegion(c["bucket"], c["key"], n)
                else:
                    m = memory(c["mem"])
                    obj, view = m.alloc(n)
                    if "seed" in c:
                        m.fill(view, pattern(n, int(c["seed"])))
                reg = agent.register(obj)
                nid += 1
                regs[nid] = (reg, view, m)
                say({"id": nid, "descs": _b64(reg.descs.to_bytes())})
            elif cmd == "release":
                regs[int(c["id"])][0].release()
                say({"ok": True})
            elif cmd == "digest":
                _, view, m = regs[int(c["id"])]
                say({"digest": hashlib.blake2b(_mem(m).read(view).tobytes(), digest_size=16).hexdigest()})
            elif cmd == "fill":
                _, view, m = regs[int(c["id"])]
                _mem(m).fill(view, pattern(int(view.nbytes), int(c["seed"])))
                say({"ok": True})
            elif cmd == "zero":
                _, view, m = regs[int(c["id"])]
                _mem(m).fill(view, 0)
                say({"ok": True})
            elif cmd == "peek":
                _, view, m = regs[int(c["id"])]
                say({"data": _b64(_mem(m).read(view, int(c["off"]), int(c["n"])).tobytes())})
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
