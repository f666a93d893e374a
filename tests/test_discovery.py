"""Discovery: the TCP side channel (with auth) and etcd (real server, leases, watch)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import kvx
from kvx import wire
from kvx.discovery import EtcdDiscovery, SideChannel, fetch_descs, fetch_metadata
from kvx.testing.etcd import Etcd, etcd_server  # noqa: F401  (fixture)
from kvx.testing.procs import PeerProcess

TOKEN = "side-secret"


def _agent(name: str, **kw: object) -> kvx.Agent:
    return kvx.Agent(name, kvx.AgentConfig(backends=("tcp",), peer_timeout=3.0, **kw))  # type: ignore[arg-type]


def test_side_channel_serves_metadata_and_descs() -> None:
    with _agent("srv", auth_token=TOKEN) as a, SideChannel(a, "127.0.0.1", 0) as sc:
        reg = a.register(np.arange(1 << 16, dtype=np.uint8))
        sc.publish_descs("kv", kvx.DescList.blocks(reg, 4096))
        h, p = sc.address
        meta = fetch_metadata(h, p, token=TOKEN)
        assert kvx.Agent.parse_metadata(meta).name == "srv"
        d = fetch_descs(h, p, "kv", token=TOKEN)
        assert len(d) == 16 and int(d.addr[1]) == int(reg.descs.addr[0]) + 4096
        with pytest.raises(KeyError):
            fetch_descs(h, p, "nope", token=TOKEN)
        with pytest.raises(kvx.AuthError):
            fetch_metadata(h, p, token="wrong")
        with pytest.raises(kvx.AuthError):
            fetch_metadata(h, p, token="")
        # the side channel keeps serving after refusals; then a peer connects with the metadata
        with _agent("cli", auth_token=TOKEN) as c:
            name = c.add_peer(fetch_metadata(h, p, token=TOKEN))
            rem = c.prepare(fetch_descs(h, p, "kv", token=TOKEN), peer=name)
            buf = np.zeros(1 << 16, np.uint8)
            loc = c.prepare(kvx.DescList.blocks(c.register(buf), 4096))
            c.read(loc, np.arange(16), rem, np.arange(16)).wait(10)
            assert np.array_equal(buf, np.arange(1 << 16, dtype=np.uint8))


def test_side_channel_shares_the_tcp_listener() -> None:
    with kvx.Agent("one", kvx.AgentConfig(backends=("tcp",), listen=("127.0.0.1", 0))) as a:
        sc = SideChannel(a, "127.0.0.1", 0)
        try:
            assert sc.address == a.backend("tcp").address  # type: ignore[attr-defined]
            assert kvx.Agent.parse_metadata(fetch_metadata(*sc.address, token="")).name == "one"
        finally:
            sc.close()


def test_side_channel_refuses_garbage_and_slow_clients() -> None:
    with _agent("srv", handshake_timeout=1.0) as a, SideChannel(a, "127.0.0.1", 0) as sc:
        s = socket.create_connection(sc.address, timeout=5)
        s.recv(4096)
        s.sendall(b"\xff" * 64)
        s.settimeout(5)
        try:
            assert s.recv(10) == b""
        except ConnectionResetError:
            pass
        s.close()
        slow = socket.create_connection(sc.address, timeout=5)
        slow.recv(4096)
        slow.sendall(wire.frame_header(1, 100)[:4])  # and then nothing
        t0 = time.monotonic()
        slow.settimeout(5)
        try:
            assert slow.recv(10) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 3
        slow.close()
        assert kvx.Agent.parse_metadata(fetch_metadata(*sc.address, token="")).name == "srv"


def test_fetch_metadata_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(kvx.PeerDisconnected):
        fetch_metadata("127.0.0.1", port, timeout=1.0)


@pytest.mark.services
def test_etcd_publish_lookup_watch_and_revoke(etcd_server: Etcd) -> None:  # noqa: F811
    with _agent("alpha") as a, _agent("beta") as b:
        da = EtcdDiscovery([etcd_server.endpoint], namespace="t1", ttl=3)
        db = EtcdDiscovery([etcd_server.endpoint], namespace="t1", ttl=3)
        try:
            da.publish(a)
            meta = db.lookup("alpha", timeout=5)
            assert meta == a.metadata()
            assert db.names() == ["alpha"]
            assert b.add_peer(meta) == "alpha"
            events: list[str] = []
            ev = threading.Event()

            def cb(kind: str, value: bytes | None) -> None:
                events.append(kind)
                if kind == "delete":
                    ev.set()

            cancel = db.watch("alpha", cb)
            time.sleep(0.5)
            da.close()  # revokes the lease: the key is gone now
            assert db.wait_removed("alpha", 5)
            assert ev.wait(5) and "delete" in events
            cancel()
            with pytest.raises(kvx.TransferTimeout):
                db.lookup("alpha", timeout=0.5)
        finally:
            da.close()
            db.close()


@pytest.mark.services
def test_etcd_lease_expires_when_the_process_dies(etcd_server: Etcd) -> None:  # noqa: F811
    import subprocess
    import sys

    code = ("import kvx,sys,time; from kvx.discovery import EtcdDiscovery;"
            "a=kvx.Agent('dying', kvx.AgentConfig(backends=('tcp',)));"
            f"d=EtcdDiscovery(['{etcd_server.endpoint}'], namespace='t2', ttl=2); d.publish(a);"
            "print('up', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        d = EtcdDiscovery([etcd_server.endpoint], namespace="t2", ttl=2)
        try:
            assert kvx.Agent.parse_metadata(d.lookup("dying", 5)).name == "dying"
            p.kill()
            p.wait(5)
            t0 = time.monotonic()
            assert d.wait_removed("dying", 10)
            assert time.monotonic() - t0 < 2 + 2
        finally:
            d.close()
    finally:
        p.kill()
        p.wait(5)


@pytest.mark.services
def test_etcd_metadata_reaches_a_peer_process(etcd_server: Etcd) -> None:  # noqa: F811
    p = PeerProcess("far", {"backends": ["tcp"]})
    try:
        d = EtcdDiscovery([etcd_server.endpoint], namespace="t3", ttl=5)
        try:
            rid, rd = p.register("numpy", 1 << 16, seed=9)
            d.publish("far", p.call(cmd="meta")["meta"].encode() and __import__("base64").b64decode(
                p.call(cmd="meta")["meta"]))
            with _agent("near") as a:
                name = a.add_peer(d.lookup("far", 5))
                buf = np.zeros(1 << 16, np.uint8)
                loc = a.prepare(kvx.DescList.blocks(a.register(buf), 4096))
                rem = a.prepare(kvx.DescList.blocks(rd, 4096), peer=name)
                a.read(loc, np.arange(16), rem, np.arange(16)).wait(10)
                assert p.digest(rid) == __import__("kvx.testing.conformance").testing.conformance.digest(buf)
        finally:
            d.close()
    finally:
        p.close()


def test_etcd_without_endpoints_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVX_ETCD_ENDPOINTS", raising=False)
    with pytest.raises(kvx.UsageError):
        EtcdDiscovery([])
