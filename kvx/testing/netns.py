"""Multi-host tests on one machine: two network namespaces joined by a veth pair.

:class:`TwoHosts` makes namespaces ``kvxa<id>`` (10.77.0.1/24) and ``kvxb<id>`` (10.77.0.2/24)
joined by a veth pair; nothing else is routed, so all traffic stays between them. Processes
run inside with ``ip netns exec NS ...`` (:meth:`TwoHosts.prefix`). :meth:`TwoHosts.close`
deletes both namespaces (and so the veth pair); the pytest fixture always calls it.

``python -m kvx.testing.netns --name N --listen HOST:PORT --etcd URL`` runs an agent that
publishes itself in etcd and answers JSON lines (see :func:`main`); :class:`NsAgent` drives it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

__all__ = ["TwoHosts", "NsAgent", "unavailable", "ADDR_A", "ADDR_B"]

ADDR_A = "10.77.0.1"
ADDR_B = "10.77.0.2"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"kvxprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class TwoHosts:
    """Two namespaces ``a`` and ``b`` joined by a veth pair (see the module docstring)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        self.a = f"kvxa{tag}"
        self.b = f"kvxb{tag}"
        self.dev_a = f"kva{tag}"[:15]
        self.dev_b = f"kvb{tag}"[:15]
        self._made: list[str] = []
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", self.dev_a, "netns", self.a, "type", "veth", "peer", "name", self.dev_b,
                "netns", self.b)
            for ns, dev, addr in ((self.a, self.dev_a, ADDR_A), (self.b, self.dev_b, ADDR_B)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def prefix(self, ns: str) -> list[str]:
        """Command prefix running a program inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def cut(self) -> None:
        """Take the link down on both ends (packets stop, no RST is sent)."""
        _ip("-n", self.b, "link", "set", self.dev_b, "down", check=False)
        _ip("-n", self.a, "link", "set", self.dev_a, "down", check=False)

    def restore(self) -> None:
        """Bring the link back up."""
        _ip("-n", self.a, "link", "set", self.dev_a, "up", check=False)
        _ip("-n", self.b, "link", "set", self.dev_b, "up", check=False)

    def close(self) -> None:
        """Delete both namespaces (the veth pair goes with them). Idempotent."""
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> "TwoHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NsAgent:
    """An agent process (this module's :func:`main`), optionally inside a namespace."""

    def __init__(self, name: str, listen: str, etcd: str, prefix: list[str] | None = None,
                 config: dict[str, Any] | None = None, timeout: float = 60.0) -> None:
        self.name = name
        self.timeout = timeout
        cmd = (prefix or []) + [sys.executable, "-m", "kvx.testing.netns", "--name", name, "--listen", listen,
                                "--etcd", etcd, "--config", json.dumps(config or {})]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._read(timeout)

    def _read(self, timeout: float) -> dict[str, Any]:
        from .procs import read_reply

        res = read_reply(self.proc, timeout, self.name)
        if "error" in res:
            raise RuntimeError(f"{self.name}: {res['error']}")
        return res

    def call(self, timeout: float | None = None, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(self.timeout if timeout is None else timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit", timeout=15)
                self.proc.wait(15)
            except (TimeoutError, EOFError, OSError, RuntimeError, subprocess.TimeoutExpired):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    """JSON-lines agent: ``register {nbytes, seed}`` -> ``{id, descs}``; ``publish``;
    ``connect {peer}`` (etcd lookup + add_peer); ``start {op, id, peer, descs, bs, repeat}``
    (transfers in the background); ``result`` -> ``{status, err, t_end, done}``;
    ``digest {id}``; ``census`` -> ``{threads, fds, slots}``; ``removed {peer, within}``; ``quit``."""
    import kvx
    from kvx.discovery import EtcdDiscovery

    ap = argparse.ArgumentParser(prog="python -m kvx.testing.netns")
    ap.add_argument("--name", required=True)
    ap.add_argument("--listen", required=True)
    ap.add_argument("--etcd", required=True)
    ap.add_argument("--config", default="{}")
    a = ap.parse_args(argv)
    h, _, p = a.listen.rpartition(":")
    cfg = json.loads(a.config)
    cfg.setdefault("backends", ("tcp",))
    cfg["backends"] = tuple(cfg["backends"])
    agent = kvx.Agent(a.name, kvx.AgentConfig(listen=(h, int(p)), **cfg))
    disc = EtcdDiscovery([a.etcd], namespace="netns", ttl=3)
    regs: dict[int, tuple[Any, np.ndarray]] = {}
    out = sys.stdout
    lock = threading.Lock()
    state: dict[str, Any] = {"status": "idle", "err": None, "t_end": None, "done": 0}

    def say(obj: dict[str, Any]) -> None:
        with lock:
            out.write(json.dumps(obj) + "\n")
            out.flush()

    def run_xfer(c: dict[str, Any]) -> None:
        try:
            reg, _buf = regs[int(c["id"])]
            bs = int(c["bs"])
            loc = agent.prepare(kvx.DescList.blocks(reg, bs))
            rem = agent.prepare(kvx.DescList.blocks(kvx.DescList.from_bytes(base64.b64decode(c["descs"])), bs),
                                peer=c["peer"])
            n = min(len(loc), len(rem))
            perm = np.random.default_rng(1).permutation(n)
            fn = agent.write if c["op"] == "write" else agent.read
            for _ in range(int(c.get("repeat", 1))):
                fn(loc, np.arange(n), rem, perm).wait()
                state["done"] += 1
            state["status"] = "DONE"
        except kvx.KVXError as exc:
            state["status"] = "FAILED"
            state["err"] = f"{type(exc).__name__}: {exc}"
        state["t_end"] = time.monotonic()

    say({"meta": base64.b64encode(agent.metadata()).decode()})
    worker: threading.Thread | None = None
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c.get("cmd")
        try:
            if cmd == "register":
                buf = np.random.default_rng(int(c.get("seed", 0))).integers(0, 256, int(c["nbytes"]), dtype=np.uint8)
                reg = agent.register(buf)
                rid = len(regs) + 1
                regs[rid] = (reg, buf)
                say({"id": rid, "descs": base64.b64encode(reg.descs.to_bytes()).decode()})
            elif cmd == "publish":
                disc.publish(agent)
                say({"ok": True})
            elif cmd == "connect":
                say({"peer": agent.add_peer(disc.lookup(c["peer"], float(c.get("timeout", 10))))})
            elif cmd == "start":
                state.update(status="PENDING", err=None, t_end=None, done=0)
                worker = threading.Thread(target=run_xfer, args=(c,), daemon=True)
                worker.start()
                say({"ok": True, "t_start": time.monotonic()})
            elif cmd == "result":
                if worker is not None:
                    worker.join(float(c.get("timeout", 60)))
                say(dict(state))
            elif cmd == "digest":
                data = memoryview(regs[int(c["id"])][1])  # type: ignore[arg-type]
                say({"digest": hashlib.blake2b(data, digest_size=16).hexdigest()})
            elif cmd == "census":  # what a leak check counts: threads, open fds, staging slots
                from kvx.backends.tcp.staging import live_slots

                say({"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
                     "slots": live_slots()})
            elif cmd == "removed":
                say({"removed": disc.wait_removed(c["peer"], float(c["within"]))})
            elif cmd == "quit":
                say({"ok": True})
                break
            else:
                say({"error": f"unknown command {cmd!r}"})
        except Exception as exc:  # report to the test, keep serving
            say({"error": f"{type(exc).__name__}: {exc}"})
    disc.close()
    agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
