"""The processes of the soak (``benchmarks/soak.py``): target agents and workers.

``python benchmarks/soak_procs.py target ...`` registers memory, publishes its metadata and
descriptors in a file (atomically: a restarted target replaces it) and waits until its stdin
closes or it is killed. ``python benchmarks/soak_procs.py worker --kind host|tcp|files|tiers ...``
runs one worker until ``--until`` (a wall-clock time), checks its ledger and prints one JSON line:
operations, kvx errors by kind (with the first message of each), errors that are not kvx errors,
corruptions, acknowledged data it could not verify, bytes verified, and resource samples (open fds,
threads, RSS) at the end of its warm-up and at its end. SIGUSR1 asks it to ``remove_peer`` while
one of its transfers is in flight (host and tcp workers). Only kvx's public API is used.
"""

from __future__ import annotations

import argparse
import base64
import gc
import hashlib
import json
import os
import random
import signal
import sys
import time
import traceback
from collections import Counter
from typing import Any

import numpy as np

import kvx

BUCKET = "kvx-soak"


def _digest(b: Any) -> str:
    return hashlib.blake2b(np.ascontiguousarray(b).data, digest_size=16).hexdigest()


def _where(exc: BaseException) -> str:
    """`` (at file:line in function)`` of the innermost kvx frame that raised ``exc``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/kvx/" in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename.split('/kvx/', 1)[1]}:{f.lineno} in {f.name})"


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
            self.foreign[f"{what}: {type(exc).__name__}: {exc}"[:200] + _where(exc)] += 1

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
                self.foreign[f"step: {type(exc).__name__}: {exc}"[:200] + _where(exc)] += 1
                time.sleep(0.5)
            time.sleep(self.a.pause)
        gc.collect()
        time.sleep(2.0)  # let transient state go (mappings of dead incarnations, finished threads)
        end = _sample()
        deadline = time.time() + 180
        while self.a.restored and not os.path.exists(self.a.restored) and time.time() < deadline:
            time.sleep(0.5)  # the orchestrator says when every fault is undone (S3 up, link up, disk free)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
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
    w.add_argument("--restored", help="file whose existence says every fault is undone (final check then)")
    a = ap.parse_args(argv)
    if a.role == "target":
        return target_main(a)
    import faulthandler

    faulthandler.enable()  # a crash prints the Python stacks to the worker's log
    return worker_main(a)


if __name__ == "__main__":
    sys.exit(main())
