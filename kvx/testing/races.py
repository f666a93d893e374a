"""Races of ``close`` / ``remove_peer`` / ``release`` against in-flight transfers (issue 14).

Each scenario runs in a process of its own, so that a crash (SIGSEGV, abort) is observed by
the caller as a failure instead of taking the test runner down::

    python -m kvx.testing.races run --path shm --scenario init_close [--rounds 3] [--seed 0]

prints one JSON line ``{"path", "scenario", "violations": [...], "outcomes": {...}}`` and exits
0 when every invariant held, 1 when one did not (a crash shows as the signal in the exit status).
The target agent lives in another process, ``python -m kvx.testing.races target`` (driven by
:class:`RaceTarget` over JSON lines).

Paths: ``shm`` (shared mappings of ``kvx.alloc_host`` memory), ``cma`` (process_vm_readv/writev
on numpy memory), ``uds`` (AF_UNIX, two-sided), ``tcp`` (loopback).

Invariants checked in every scenario:

- no process crashes (the target's exit status is checked too);
- every posted transfer ends DONE, or FAILED with a kvx ``TransferError`` / ``UsageError``,
  within a bound (never stays pending), and a post raises nothing but those;
- memory whose ``release()`` / ``close()`` returned is filled with a guard pattern at once and
  must still hold it a while later (no late byte lands); for the initiator's own memory after
  its ``close`` / ``remove_peer`` / ``release``, and on the one-sided paths (shm, cma) also for
  the target's memory after the initiator's ``close`` / ``remove_peer`` (on uds/tcp the target
  may still apply a frame it already received);
- a remote prepared list made for a peer that was removed, or that restarted under the same
  name, never moves a byte: posting with it raises ``UsageError`` or ``PeerDisconnected`` (or
  the transfer fails with a ``TransferError``), and the memory of both incarnations is untouched.
"""

from __future__ import annotations

import argparse
import base64
import faulthandler
import functools
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import kvx
from kvx.testing.procs import PeerProcess

__all__ = ["PATHS", "SCENARIOS", "RaceTarget", "run_scenario"]

BS = 1 << 20  # block size: transfers above inline_bytes run on native threads (in flight)
NBLOCKS = 16
NBYTES = BS * NBLOCKS
#: seconds within which every transfer must end once its fate is sealed
BOUND = 10.0
#: seconds a guard pattern is watched for late bytes
WATCH = 0.25
ALLOWED = (kvx.TransferError, kvx.UsageError)
#: seconds a target process may take to quit (close its agent) when asked
QUIT = 10.0


@dataclass(frozen=True)
class PathSpec:
    backend: str
    host_path: str | None
    mem: str  # the target's memory: "alloc" (kvx.alloc_host) or "numpy"
    one_sided: bool

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"backends": [self.backend], "peer_timeout": 3.0, "transfer_timeout": 8.0}
        if self.host_path is not None:
            cfg["host_path"] = self.host_path
        return cfg


PATHS: dict[str, PathSpec] = {
    "shm": PathSpec("host", "shm", "alloc", True),
    "cma": PathSpec("host", "cma", "numpy", True),
    "uds": PathSpec("host", "uds", "numpy", False),
    "tcp": PathSpec("tcp", None, "numpy", False),
}


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=np.uint8)


def _digest(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def _agent_config(cfg: dict[str, Any]) -> kvx.AgentConfig:
    c = dict(cfg)
    c["backends"] = tuple(c.get("backends", ()))
    return kvx.AgentConfig(**c)


# ---- the target process ------------------------------------------------------------------------
def target_main(name: str, cfg: dict[str, Any]) -> int:
    """JSON-lines target: ``register {mem, nbytes, seed}`` -> ``{id, descs}``;
    ``release {id, guard}`` (release, then fill the memory with the guard pattern at once);
    ``fill {id, guard}``; ``close {guard}`` (close the agent, then fill every buffer); ``reopen``
    (a new agent of the same name) -> ``{meta}``; ``reregister {id}`` (that memory again, in the
    current agent); ``check {id, guard}`` -> ``{bad}`` (bytes differing from the guard);
    ``digest {id}``; ``quit``."""
    agent = kvx.Agent(name, _agent_config(cfg))
    bufs: dict[int, Any] = {}
    regs: dict[int, kvx.Registration] = {}
    out = sys.stdout

    def say(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say({"meta": base64.b64encode(agent.metadata()).decode(), "pid": os.getpid()})
    for line in sys.stdin:
        c = json.loads(line)
        cmd = c.get("cmd")
        try:
            if cmd == "register":
                n = int(c["nbytes"])
                buf = kvx.alloc_host(n) if c["mem"] == "alloc" else np.zeros(n, dtype=np.uint8)
                buf[:] = _pattern(n, int(c["seed"]))
                rid = len(bufs) + 1
                bufs[rid] = buf
                regs[rid] = agent.register(buf)
                say({"id": rid, "descs": base64.b64encode(regs[rid].descs.to_bytes()).decode()})
            elif cmd == "release":
                rid = int(c["id"])
                regs[rid].release()
                bufs[rid][:] = _pattern(bufs[rid].nbytes, int(c["guard"]))
                say({"ok": True})
            elif cmd == "fill":
                b = bufs[int(c["id"])]
                b[:] = _pattern(b.nbytes, int(c["guard"]))
                say({"ok": True})
            elif cmd == "close":
                agent.close()
                for b in bufs.values():
                    b[:] = _pattern(b.nbytes, int(c["guard"]))
                say({"ok": True})
            elif cmd == "reregister":  # the same memory again, in the current agent
                rid = int(c["id"])
                regs[rid] = agent.register(bufs[rid])
                say({"ok": True})
            elif cmd == "reopen":
                agent = kvx.Agent(name, _agent_config(cfg))
                say({"meta": base64.b64encode(agent.metadata()).decode()})
            elif cmd == "check":
                b = bufs[int(c["id"])]
                say({"bad": int(np.count_nonzero(b != _pattern(b.nbytes, int(c["guard"]))))})
            elif cmd == "digest":
                say({"digest": _digest(bufs[int(c["id"])])})
            elif cmd == "quit":
                say({"ok": True})
                break
            else:
                say({"error": f"unknown command {cmd!r}"})
        except Exception as exc:  # report to the driver, keep serving
            say({"error": f"{type(exc).__name__}: {exc}"})
    agent.close()
    return 0


class RaceTarget(PeerProcess):
    """:func:`target_main` in another process."""

    ARGS = ("-m", "kvx.testing.races", "target")
    WHAT = "race target"

    def check(self, rid: int, guard: int) -> int:
        return int(self.call(cmd="check", id=rid, guard=guard)["bad"])


# ---- the initiator side ------------------------------------------------------------------------
class Race:
    """One scenario's state: the path, the target process(es), outcomes and violations."""

    def __init__(self, path: str, rounds: int, seed: int) -> None:
        self.path = path
        self.spec = PATHS[path]
        self.cfg = self.spec.config()
        self.rounds = rounds
        self.rng = random.Random(seed)
        self.violations: list[str] = []
        self.outcomes: Counter[str] = Counter()
        self.targets: list[RaceTarget] = []
        self.killed: set[int] = set()
        self.local_reg: kvx.Registration | None = None
        self._lock = threading.Lock()
        self.target = self.new_target()

    # ---- bookkeeping
    def violate(self, what: str) -> None:
        with self._lock:
            if len(self.violations) < 50:
                self.violations.append(what)

    def count(self, what: str) -> None:
        with self._lock:
            self.outcomes[what] += 1

    def new_target(self) -> RaceTarget:
        t = RaceTarget("target", self.cfg, timeout=30.0)
        self.targets.append(t)
        return t

    def kill(self, t: RaceTarget) -> None:
        self.killed.add(t.pid)
        t.kill()

    def close(self) -> None:
        for t in self.targets:
            t0 = time.monotonic()
            rc = t.proc.poll()
            if rc is None:
                try:
                    t.call(cmd="quit", timeout=QUIT)
                    rc = t.proc.wait(QUIT)
                except Exception as exc:
                    self.violate(f"the target process did not quit within {QUIT:.0f} s "
                                 f"({type(exc).__name__}; killed)")
                    self.kill(t)
            t.close()
            rc = t.proc.returncode
            if t.pid not in self.killed and rc != 0:
                self.violate(f"the target process (pid {t.pid}) exited with {rc}"
                             + (" (killed by a signal: crashed)" if rc < 0 else ""))
            self.outcomes[f"target quit {'slow' if time.monotonic() - t0 > 5 else 'fast'}"] += 1

    # ---- building blocks
    def initiator(self, name: str = "initiator") -> kvx.Agent:
        return kvx.Agent(name, _agent_config(self.cfg))

    def connect(self, agent: kvx.Agent, target: RaceTarget | None = None, seed: int = 1
                ) -> tuple[str, kvx.PreparedList, kvx.PreparedList, np.ndarray, int]:
        """Register target memory (pattern ``seed``) and local memory; (peer, local, remote, buf, rid)."""
        t = target or self.target
        rid, rdescs = t.register(self.spec.mem, NBYTES, seed=seed)
        name = agent.add_peer(t.meta)
        buf = kvx.alloc_host(NBYTES)
        buf[:] = _pattern(NBYTES, seed + 1000)
        reg = self.local_reg = agent.register(buf)
        local = agent.prepare(kvx.DescList.blocks(reg, BS))
        remote = agent.prepare(kvx.DescList.blocks(rdescs, BS), peer=name)
        return name, local, remote, buf, rid

    def post(self, fn: Callable[[], kvx.Transfer], what: str) -> kvx.Transfer | None:
        """Post; a refused post is an outcome, any other exception a violation."""
        try:
            return fn()
        except ALLOWED as exc:
            self.count(f"{what} refused: {type(exc).__name__}")
        except Exception as exc:
            self.violate(f"{what}: posting raised {type(exc).__name__}: {exc} (not a kvx error)")
        return None

    def settle(self, x: kvx.Transfer | None, what: str) -> str:
        """Wait for ``x`` within BOUND; count how it ended; a hang or a foreign error is a violation."""
        if x is None:
            return "refused"
        try:
            x.wait(BOUND)
            self.count(f"{what} DONE")
            return "done"
        except ALLOWED as exc:
            if x.status is kvx.Status.PENDING:
                self.violate(f"{what}: still pending {BOUND} s after the race (hang)")
                return "hang"
            self.count(f"{what} FAILED: {type(exc).__name__}")
            return "failed"
        except Exception as exc:
            self.violate(f"{what}: wait raised {type(exc).__name__}: {exc} (not a kvx error)")
            return "error"

    def burst(self, agent: kvx.Agent, local: kvx.PreparedList, remote: kvx.PreparedList, k: int = 4
              ) -> list[tuple[str, kvx.Transfer | None]]:
        """Post ``k`` whole-list transfers (writes and reads alternating) without waiting."""
        idx = np.arange(NBLOCKS)
        out = []
        for i in range(k):
            op = "write" if i % 2 == 0 else "read"
            fn = agent.write if op == "write" else agent.read
            perm = np.array(self.rng.sample(range(NBLOCKS), NBLOCKS))
            out.append((op, self.post(functools.partial(fn, local, idx, remote, perm), op)))
        return out

    def hammer(self, agent: kvx.Agent, local: kvx.PreparedList, remote: kvx.PreparedList, op: str
               ) -> tuple[threading.Event, threading.Thread]:
        """A thread posting ``op`` of 8 blocks back to back (each waited) until the event is set."""
        stop = threading.Event()
        fn = agent.write if op == "write" else agent.read

        def run() -> None:
            i = 0
            while not stop.is_set():
                s = (i * 8) % NBLOCKS
                x = self.post(lambda: fn(local, np.arange(s, s + 8), remote, np.arange(s, s + 8)), f"hammer {op}")
                if x is None:
                    time.sleep(0.002)  # refused: do not spin the (shared) cores
                if self.settle(x, f"hammer {op}") in ("hang", "error"):
                    return
                i += 1

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return stop, th

    def race(self, agent: kvx.Agent, local: kvx.PreparedList, remote: kvx.PreparedList,
             action: Callable[[], object]) -> None:
        """Transfers in flight (two hammers and a burst), then ``action`` after a random short
        delay; every transfer must end within the bound."""
        hams = [self.hammer(agent, local, remote, "write"), self.hammer(agent, local, remote, "read")]
        time.sleep(0.02)
        posted = self.burst(agent, local, remote)
        time.sleep(self.rng.uniform(0.0, 0.01))
        action()
        posted += self.burst(agent, local, remote, 2)  # racing the end: must be refused or fail
        for op, x in posted:
            self.settle(x, f"burst {op}")
        for stop, _ in hams:
            stop.set()
        for _, th in hams:
            th.join(2 * BOUND)
            if th.is_alive():
                self.violate("a hammer thread did not stop within its bound (a transfer hung)")

    def guard_local(self, buf: np.ndarray, guard: int, after: str) -> None:
        """Fill our own memory with a guard at once and watch it: nothing may land any more."""
        buf[:] = _pattern(buf.nbytes, guard)
        time.sleep(WATCH)
        bad = int(np.count_nonzero(buf != _pattern(buf.nbytes, guard)))
        if bad:
            self.violate(f"{bad} bytes landed in the initiator's memory after {after} returned")

    def guard_target(self, t: RaceTarget, rid: int, guard: int, after: str, fill: bool) -> None:
        """Check the target's memory still holds the guard (filled now if ``fill``)."""
        if fill:
            t.call(cmd="release", id=rid, guard=guard)  # release (no-op if done) and fill at once
        time.sleep(WATCH)
        bad = t.check(rid, guard)
        if bad:
            self.violate(f"{bad} bytes landed in the target's memory after {after} returned")

    def stale_post(self, agent: kvx.Agent, local: kvx.PreparedList, stale: kvx.PreparedList, why: str,
                   refusals: tuple[type[BaseException], ...] = (kvx.UsageError, kvx.PeerDisconnected)) -> None:
        """A write and a read with a remote list of a previous incarnation (or of released
        memory) must move nothing: the post raises one of ``refusals``, or the transfer fails."""
        for op in ("write", "read"):
            fn = agent.write if op == "write" else agent.read
            try:
                x = fn(local, np.arange(NBLOCKS), stale, np.arange(NBLOCKS))
            except refusals as exc:
                self.count(f"stale {op} refused: {type(exc).__name__}")
                continue
            except Exception as exc:
                self.violate(f"stale {op} ({why}): posting raised {type(exc).__name__}: {exc} "
                             f"(expected {' or '.join(e.__name__ for e in refusals)})")
                continue
            want = " or ".join(e.__name__ for e in refusals)
            try:
                x.wait(BOUND)
                self.violate(f"a {op} with a prepared list of {why} reported DONE (expected {want})")
            except refusals as exc:
                self.count(f"stale {op} FAILED: {type(exc).__name__}")
            except Exception as exc:
                self.violate(f"a {op} with a prepared list of {why} was posted and failed with "
                             f"{type(exc).__name__}: {exc} (expected {want} at the post)")


# ---- scenarios ---------------------------------------------------------------------------------
def init_close(r: Race) -> None:
    """The initiator closes its agent while its transfers are in flight."""
    for i in range(r.rounds):
        a = r.initiator()
        _name, local, remote, buf, rid = r.connect(a, seed=10 + i)
        r.race(a, local, remote, a.close)
        for op, fn in (("write", a.write), ("read", a.read)):
            r.post(functools.partial(fn, local, [0], remote, [0]), f"{op} after close")
        r.guard_local(buf, 900 + i, "the initiator's close()")
        if r.spec.one_sided:
            r.guard_target(r.target, rid, 950 + i, "the initiator's close()", fill=True)


def init_remove_peer(r: Race) -> None:
    """The initiator removes the peer while its transfers to it are in flight."""
    for i in range(r.rounds):
        a = r.initiator()
        try:
            name, local, remote, buf, rid = r.connect(a, seed=20 + i)
            r.race(a, local, remote, lambda: a.remove_peer(name))
            r.guard_local(buf, 900 + i, "remove_peer()")
            if r.spec.one_sided:
                r.guard_target(r.target, rid, 950 + i, "remove_peer()", fill=True)
        finally:
            a.close()


def init_release(r: Race) -> None:
    """The initiator releases its own registration while transfers from/into it are in flight."""
    for i in range(r.rounds):
        a = r.initiator()
        try:
            _name, local, remote, buf, _rid = r.connect(a, seed=30 + i)
            reg = r.local_reg
            assert reg is not None
            r.race(a, local, remote, reg.release)
            r.guard_local(buf, 900 + i, "the initiator's release()")
            try:
                a.write(local, [0], remote, [0])
                r.violate("a write from a released local registration was accepted")
            except kvx.UsageError:
                r.count("write from released local refused: UsageError")
        finally:
            a.close()


def target_release(r: Race) -> None:
    """The target releases the registration the initiator is writing into and reading from."""
    for i in range(r.rounds):
        a = r.initiator()
        try:
            _name, local, remote, _buf, rid = r.connect(a, seed=40 + i)
            r.race(a, local, remote, lambda: r.target.call(cmd="release", id=rid, guard=800 + i))
            r.guard_target(r.target, rid, 800 + i, "the target's release()", fill=False)
            r.stale_post(a, local, remote, "a released target registration", ALLOWED)
            r.guard_target(r.target, rid, 800 + i, "the target's release()", fill=False)
        finally:
            a.close()


def target_close(r: Race) -> None:
    """The target closes its agent while the initiator's transfers to it are in flight."""
    for i in range(r.rounds):
        t = r.target if i == 0 else r.new_target()
        a = r.initiator()
        try:
            _name, local, remote, _buf, rid = r.connect(a, t, seed=50 + i)
            r.race(a, local, remote, lambda: t.call(cmd="close", guard=700 + i))
            r.guard_target(t, rid, 700 + i, "the target's close()", fill=False)
            r.stale_post(a, local, remote, "a closed target agent", ALLOWED)
            r.guard_target(t, rid, 700 + i, "the target's close()", fill=False)
        finally:
            a.close()


def stale_readd(r: Race) -> None:
    """remove_peer + add_peer of the same metadata: the old remote list must not be usable."""
    a = r.initiator()
    try:
        name, local, old, _buf, rid = r.connect(a, seed=60)
        a.write(local, np.arange(NBLOCKS), old, np.arange(NBLOCKS)).wait(BOUND)
        r.target.call(cmd="fill", id=rid, guard=600)  # still registered: watch it
        a.remove_peer(name)
        r.stale_post(a, local, old, "a removed peer")
        a.add_peer(r.target.meta)
        r.stale_post(a, local, old, "a removed (then re-added) peer")
        time.sleep(WATCH)
        if r.target.check(rid, 600):
            r.violate("a transfer with a stale list wrote into the target's memory")
    finally:
        a.close()


def stale_reopen(r: Race) -> None:
    """The target closes its agent and a new agent of the same name (same process) is added,
    registering new memory and the old memory again (same addresses): the old list must move
    nothing into either."""
    a = r.initiator()
    try:
        _name, local, old, _buf, rid = r.connect(a, seed=70)
        a.write(local, np.arange(NBLOCKS), old, np.arange(NBLOCKS)).wait(BOUND)
        r.target.call(cmd="close", guard=500)  # fills the old incarnation's memory with guard 500
        meta = base64.b64decode(r.target.call(cmd="reopen")["meta"])
        rid2, _ = r.target.register(r.spec.mem, NBYTES, seed=501)
        r.target.call(cmd="reregister", id=rid)
        a.add_peer(meta)
        r.stale_post(a, local, old, "a peer that restarted under the same name")
        time.sleep(WATCH)
        if r.target.check(rid, 500):
            r.violate("a write with a stale list landed in the old memory (registered again by the new incarnation)")
        if r.target.check(rid2, 501):
            r.violate("a write with a stale list landed in the new incarnation's memory")
    finally:
        a.close()


def stale_restart(r: Race) -> None:
    """The target process is killed and restarted under the same name: the old list must be refused."""
    a = r.initiator()
    try:
        _name, local, old, _buf, _rid = r.connect(a, seed=80)
        a.write(local, np.arange(NBLOCKS), old, np.arange(NBLOCKS)).wait(BOUND)
        r.kill(r.target)
        t2 = r.new_target()
        rid2, _ = t2.register(r.spec.mem, NBYTES, seed=801)
        a.add_peer(t2.meta)
        r.stale_post(a, local, old, "a peer process that restarted under the same name")
        time.sleep(WATCH)
        if t2.check(rid2, 801):
            r.violate("a write with a stale list landed in the restarted peer's memory")
    finally:
        a.close()


SCENARIOS: dict[str, Callable[[Race], None]] = {
    f.__name__: f for f in (init_close, init_remove_peer, init_release, target_release, target_close,
                            stale_readd, stale_reopen, stale_restart)
}


def run_scenario(path: str, scenario: str, rounds: int = 2, seed: int = 0) -> dict[str, Any]:
    """Run one scenario here (in this process); the result as a JSON-able dict."""
    t0 = time.monotonic()
    r = Race(path, rounds, seed)
    try:
        try:
            SCENARIOS[scenario](r)
        except Exception as exc:
            r.violate(f"the scenario raised {type(exc).__name__}: {exc}")
    finally:
        r.close()
    return {"path": path, "scenario": scenario, "violations": r.violations, "outcomes": dict(r.outcomes),
            "seconds": round(time.monotonic() - t0, 1)}


def run_forked(path: str, scenario: str, rounds: int, seed: int, limit: float) -> dict[str, Any]:
    """Run one scenario in a forked child of this process (which must hold no agent and no
    thread): its result, plus ``crash`` (how the child died, or None) and ``stderr`` (its tail:
    the Python stacks faulthandler printed at a crash). A child past ``limit`` seconds is killed
    with its process group and reported as a hang."""
    import tempfile

    rfd, wfd = os.pipe()
    errf = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # the child: its own process group (its targets join it), stderr to the file
        code = 2
        try:
            os.close(rfd)
            os.setpgid(0, 0)
            os.dup2(errf.fileno(), 2)
            faulthandler.enable()
            res = run_scenario(path, scenario, rounds, seed)
            os.write(wfd, json.dumps(res).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(wfd)
    chunks: list[bytes] = []
    deadline = time.monotonic() + limit
    crash = None
    status = 0
    while True:
        got, status = os.waitpid(pid, os.WNOHANG)
        while True:  # drain the pipe as the child writes (a result larger than a pipe buffer)
            import select

            ready, _, _ = select.select([rfd], [], [], 0.05)
            if not ready:
                break
            b = os.read(rfd, 1 << 16)
            if not b:
                break
            chunks.append(b)
        if got:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            crash = f"did not finish within {limit:.0f} s (hang; killed)"
            break
    while True:
        b = os.read(rfd, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(rfd)
    try:  # targets left behind by a crashed child
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if crash is None and os.WIFSIGNALED(status):
        crash = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    elif crash is None and os.WEXITSTATUS(status) != 0:
        crash = f"exited with status {os.WEXITSTATUS(status)}"
    errf.seek(0)
    err = errf.read().decode(errors="replace")
    errf.close()
    try:
        res = json.loads(b"".join(chunks))
    except ValueError:
        res = {"path": path, "scenario": scenario, "violations": [], "outcomes": {}}
    res["crash"] = crash
    res["stderr"] = err[-4000:]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvx.testing.races")
    sub = ap.add_subparsers(dest="what", required=True)
    rp = sub.add_parser("run", help="run scenarios, each in a forked child; one JSON line per scenario")
    rp.add_argument("--path", choices=sorted(PATHS), required=True)
    rp.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="repeatable; default: every scenario")
    rp.add_argument("--rounds", type=int, default=2)
    rp.add_argument("--seed", type=int, default=0)
    rp.add_argument("--limit", type=float, default=60.0, help="seconds one scenario may run")
    tp = sub.add_parser("target")
    tp.add_argument("--name", required=True)
    tp.add_argument("--config", default="{}")
    a = ap.parse_args(argv)
    if a.what == "target":
        faulthandler.enable()
        return target_main(a.name, json.loads(a.config))
    bad = 0
    for sc in a.scenario or sorted(SCENARIOS):
        res = run_forked(a.path, sc, a.rounds, a.seed, a.limit)
        bad += bool(res["violations"] or res["crash"])
        print(json.dumps(res), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
