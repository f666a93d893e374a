"""Drive a :mod:`kvx.testing.peer` process from a test, with bounded waits."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import kvx

__all__ = ["PeerProcess", "forked_ok", "read_reply"]


def forked_ok(fn: Callable[[], bool], timeout: float) -> bool:
    """Run ``fn`` in a forked child of this process: whether it returned True there, within ``timeout``
    seconds (``TimeoutError`` otherwise, the child killed). For code that must keep working after
    ``fork()`` (helper threads gone, locks and condition variables copied mid-use)."""
    with warnings.catch_warnings():  # Python 3.12 warns about fork() in a process with threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if fn() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TimeoutError(f"the forked child did not finish within {timeout} s")


def read_reply(proc: subprocess.Popen[str], timeout: float, who: str) -> dict[str, Any]:
    """The next JSON line ``proc`` writes, waiting at most ``timeout`` seconds (``TimeoutError``;
    ``EOFError`` if it exited). ``who`` names it in the errors."""
    assert proc.stdout is not None
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    if not r:
        raise TimeoutError(f"{who} did not answer within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise EOFError(f"{who} exited ({proc.poll()})")
    return json.loads(line)  # type: ignore[no-any-return]


class PeerProcess:
    """A kvx agent in another process. Every call is bounded by ``timeout`` seconds."""

    #: what runs after ``python`` (then ``--name`` and ``--config``), and the process's name in messages
    ARGS: tuple[str, ...] = ("-m", "kvx.testing.peer")
    WHAT = "peer process"
    #: how long ``close`` waits for the process to quit before it kills it
    QUIT_TIMEOUT = 10.0

    def __init__(self, name: str, config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 timeout: float = 30.0, prefix: list[str] | None = None) -> None:
        self.name = name
        self.timeout = timeout
        cmd = (prefix or []) + [sys.executable, *self.ARGS, "--name", name, "--config", json.dumps(config or {})]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        hello = self._read(timeout)
        self.meta = base64.b64decode(hello["meta"])
        self.pid = int(hello["pid"])

    def _read(self, timeout: float) -> dict[str, Any]:
        return read_reply(self.proc, timeout, f"{self.WHAT} {self.name!r}")

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float | None = None, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        res = self._read(self.timeout if timeout is None else timeout)
        if "error" in res:
            raise RuntimeError(f"{self.WHAT} {self.name!r}: {res['error']}")
        return res

    def register(self, mem: str, nbytes: int, **kw: Any) -> tuple[int, kvx.DescList]:
        res = self.call(cmd="register", mem=mem, nbytes=nbytes, **kw)
        return int(res["id"]), kvx.DescList.from_bytes(base64.b64decode(res["descs"]))

    def digest(self, rid: int) -> str:
        return str(self.call(cmd="digest", id=rid)["digest"])

    def peek(self, rid: int, off: int, n: int) -> bytes:
        return base64.b64decode(self.call(cmd="peek", id=rid, off=off, n=n)["data"])

    def notifs(self, timeout: float = 0.0) -> dict[str, list[bytes]]:
        res = self.call(cmd="notifs", wait=timeout, timeout=timeout + self.timeout)
        return {k: [base64.b64decode(m) for m in v] for k, v in res["notifs"].items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(cmd="quit", timeout=self.QUIT_TIMEOUT)
                self.proc.wait(self.QUIT_TIMEOUT)
            except (TimeoutError, EOFError, OSError, subprocess.TimeoutExpired, RuntimeError):
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def __enter__(self) -> "PeerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
