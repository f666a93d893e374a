"""A real etcd server for tests: free ports, a temporary data dir, bounded start and stop.

Usage::

    from kvx.testing.etcd import Etcd
    with Etcd() as e:
        d = kvx.discovery.EtcdDiscovery([e.endpoint])

and the session fixture ``etcd_server`` (import it into a test module or conftest). Tests skip
with a clear reason when the ``etcd`` binary is absent (Debian: ``apt-get install etcd-server``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

import pytest

__all__ = ["Etcd", "etcd_binary", "free_port", "etcd_server"]


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary, or None."""
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd") if os.path.exists(p)),
                                        None)


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Etcd:
    """One etcd member on ``host`` (client and peer ports free), data in a temp dir.

    Parameters
    ----------
    host
        Address to listen on (a veth address inside a namespace works with ``prefix``).
    prefix
        Command prefix, e.g. ``["ip", "netns", "exec", "ns1"]``.
    start_timeout
        Bound on waiting for ``/health``.
    """

    def __init__(self, host: str = "127.0.0.1", prefix: list[str] | None = None, start_timeout: float = 20.0,
                 client_port: int | None = None) -> None:
        exe = etcd_binary()
        if exe is None:
            raise FileNotFoundError("etcd binary not found (apt-get install etcd-server)")
        self.host = host
        self.prefix = prefix or []
        self.port = client_port or free_port("127.0.0.1" if prefix else host)
        self.peer_port = free_port("127.0.0.1" if prefix else host) if client_port is None else client_port + 1
        self.dir = tempfile.mkdtemp(prefix="kvx-etcd-")
        self.endpoint = f"http://{host}:{self.port}"
        cmd = self.prefix + [
            exe, "--name", "kvx-test", "--data-dir", os.path.join(self.dir, "data"),
            "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", f"http://{host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{host}:{self.peer_port}",
            "--initial-cluster", f"kvx-test=http://{host}:{self.peer_port}",
            "--initial-cluster-state", "new", "--log-level", "error",
        ]
        self._log = open(os.path.join(self.dir, "etcd.log"), "wb")
        env = {**os.environ, "ETCD_UNSUPPORTED_ARCH": os.environ.get("ETCD_UNSUPPORTED_ARCH", "")}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}: {self.log_tail()}")
            if self.prefix:
                r = subprocess.run(self.prefix + [sys.executable, "-c", f"import urllib.request as u;"
                                                  f"print(u.urlopen('{self.endpoint}/health', timeout=1).read())"],
                                   capture_output=True, timeout=10)
                if r.returncode == 0 and b"true" in r.stdout:
                    return
            else:
                try:
                    with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as resp:
                        if b"true" in resp.read():
                            return
                except Exception as exc:  # not up yet
                    last = exc
            time.sleep(0.1)
        raise TimeoutError(f"etcd not healthy within {timeout} s ({last}): {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        try:
            with open(os.path.join(self.dir, "etcd.log"), "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (its data dir stays until :meth:`stop`)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """Terminate (bounded), then remove the data dir. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                self.kill()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[Etcd]:
    """A session-wide etcd on loopback; skips when the binary is absent."""
    if etcd_binary() is None:
        pytest.skip("etcd binary not found: apt-get install etcd-server")
    e = Etcd()
    try:
        yield e
    finally:
        e.stop()
