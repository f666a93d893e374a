"""The tcp backend: conformance between two processes over loopback, plus fault cases
(authentication, garbage, oversized frames, slow loris, forged requests, killed peers, leaks)."""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import threading
import time
from typing import Any

import msgpack
import numpy as np
import pytest

import kvx
from kvx import auth, wire
from kvx.backends.tcp import client_handshake, recv_frame, send_frame
from kvx.testing.conformance import TransferConformance, digest, pattern
from kvx.testing.procs import PeerProcess

TOKEN = "s3cret-token"


class TestTcp(TransferConformance):
    backend = "tcp"
    mem = "numpy"


def _addr(meta: bytes) -> tuple[str, int]:
    info = kvx.Agent.parse_metadata(meta)
    h, p = info.sections["tcp"]["addrs"][0]
    return h, p


def _agent(name: str = "initiator", **kw: Any) -> kvx.Agent:
    kw.setdefault("peer_timeout", 3.0)
    return kvx.Agent(name, kvx.AgentConfig(backends=("tcp",), **kw))


@pytest.fixture
def tpeer() -> Any:
    p = PeerProcess("target", {"backends": ["tcp"], "peer_timeout": 3.0, "auth_token": TOKEN})
    yield p
    p.close()


def _good_transfer(peer: PeerProcess, token: str = TOKEN) -> None:
    """A fresh agent with the right token moves data correctly (the target keeps serving)."""
    with _agent("good", auth_token=token) as a:
        rid, rd = peer.register("numpy", 1 << 16)
        name = a.add_peer(peer.meta)
        buf = pattern(1 << 16, 5)
        reg = a.register(buf)
        loc = a.prepare(kvx.DescList.blocks(reg, 4096))
        rem = a.prepare(kvx.DescList.blocks(rd, 4096), peer=name)
        a.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
        assert peer.digest(rid) == digest(buf)


def test_wrong_token_is_refused_and_no_data_moves(tpeer: PeerProcess) -> None:
    rid, _ = tpeer.register("numpy", 4096)
    before = tpeer.digest(rid)
    for tok in ("wrong", None):
        with _agent("intruder", auth_token=tok) as a:
            with pytest.raises(kvx.AuthError):
                a.add_peer(tpeer.meta)
            assert a.peers() == []
    assert tpeer.digest(rid) == before
    _good_transfer(tpeer)


def _raw_connect(addr: tuple[str, int]) -> socket.socket:
    return socket.create_connection(addr, timeout=5)


def test_garbage_on_the_data_port(tpeer: PeerProcess, caplog: Any) -> None:
    addr = _addr(tpeer.meta)
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(4096), b"\x00" * 7, b"KX\x01\x00\xff\xff"):
        s = _raw_connect(addr)
        try:
            s.recv(4096)  # the challenge
            s.sendall(junk)
            s.settimeout(8)
            try:
                while s.recv(4096):
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
        finally:
            s.close()
    _good_transfer(tpeer)


def test_oversized_frame_is_refused(tpeer: PeerProcess) -> None:
    addr = _addr(tpeer.meta)
    s = _raw_connect(addr)
    try:
        s.recv(4096)
        s.sendall(wire.frame_header(1, 1 << 30))  # 1 GiB "hello" before authentication
        s.settimeout(8)
        assert s.recv(4096) == b""  # closed by the target
    finally:
        s.close()
    _good_transfer(tpeer)


def test_slow_loris_is_cut_at_the_handshake_deadline(tmp_path: Any) -> None:
    p = PeerProcess("target", {"backends": ["tcp"], "peer_timeout": 3.0, "handshake_timeout": 1.0,
                               "auth_token": TOKEN})
    try:
        addr = _addr(p.meta)
        s = _raw_connect(addr)
        t0 = time.monotonic()
        closed_after = None
        try:
            s.recv(4096)
            hello = wire.pack("hello", name="x", id="y", mac=b"z" * 32, svc="data")
            frame = wire.frame_header(1, len(hello)) + hello
            for b in frame:  # one byte every 0.2 s: never finishes within 1 s
                try:
                    s.sendall(bytes([b]))
                    s.settimeout(0.2)
                    if s.recv(1) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    closed_after = time.monotonic() - t0
                    break
        finally:
            s.close()
        assert closed_after is not None and closed_after < 3.0
        _good_transfer(p)
    finally:
        p.close()


def test_forged_request_after_auth_gets_remote_error_and_memory_untouched(tpeer: PeerProcess) -> None:
    """A client that passed authentication but sends descriptors outside the target's
    registrations (bypassing prepare) is refused by the target itself."""
    rid, rd = tpeer.register("numpy", 8192, seed=3)
    before = tpeer.digest(rid)
    info = kvx.Agent.parse_metadata(tpeer.meta)
    s = _raw_connect(_addr(tpeer.meta))
    try:
        rep = client_handshake(s, TOKEN, "forger-id", "forger", "data", 5.0, expect_id=info.agent_id)
        assert rep["t"] == "welcome"
        a, n = int(rd.addr[0]), int(rd.nbytes[0])
        forged = [(a - 4096, 4096), (a + n - 100, 200), (a + 8, n), (1 << 40, 64)]
        for i, (fa, fn) in enumerate(forged):
            body = wire.pack("w", rid=i + 1, addr=np.array([fa], np.uint64).tobytes(),
                             nbytes=np.array([fn], np.uint64).tobytes())
            s.sendall(wire.frame_header(1, len(body)) + body + b"\xee" * fn)
            r = recv_frame(s, time.monotonic() + 5, 1 << 20)
            assert r["t"] == "err" and r["re"] == i + 1 and "outside registered memory" in r["msg"]
            body = wire.pack("r", rid=100 + i, addr=np.array([fa], np.uint64).tobytes(),
                             nbytes=np.array([fn], np.uint64).tobytes())
            s.sendall(wire.frame_header(1, len(body)) + body)
            r = recv_frame(s, time.monotonic() + 5, 1 << 20)
            assert r["t"] == "err" and r["re"] == 100 + i
        # a legitimate request on the same connection still works
        body = wire.pack("r", rid=7, addr=np.array([a], np.uint64).tobytes(),
                         nbytes=np.array([64], np.uint64).tobytes())
        s.sendall(wire.frame_header(1, len(body)) + body)
        r = recv_frame(s, time.monotonic() + 5, 1 << 20)
        assert r["t"] == "rd" and r["n"] == 64
        got = b""
        while len(got) < 64:
            got += s.recv(64 - len(got))
        assert got == pattern(8192, 3)[:64].tobytes()
    finally:
        s.close()
    assert tpeer.digest(rid) == before


def test_unauthenticated_client_cannot_read_the_region_table(tpeer: PeerProcess) -> None:
    tpeer.register("numpy", 4096)
    s = _raw_connect(_addr(tpeer.meta))
    try:
        s.recv(4096)
        body = wire.pack("regions", rid=1)
        s.sendall(wire.frame_header(1, len(body)) + body)
        s.settimeout(8)
        data = s.recv(4096)
        assert data == b"" or b"rows" not in data
    finally:
        s.close()


def test_killed_peer_mid_transfer_fails_within_bound(tpeer: PeerProcess) -> None:
    with _agent(auth_token=TOKEN) as a:
        bs, n = 1 << 20, 192
        rid, rd = tpeer.register("numpy", bs * n)
        name = a.add_peer(tpeer.meta)
        reg = a.register(np.ones(bs * n, np.uint8))
        loc = a.prepare(kvx.DescList.blocks(reg, bs))
        rem = a.prepare(kvx.DescList.blocks(rd, bs), peer=name)
        xs = [a.write(loc, np.arange(n), rem, np.arange(n)) for _ in range(8)]
        tpeer.kill()
        t0 = time.monotonic()
        for x in xs:
            try:
                x.wait(10)
            except kvx.TransferError:
                pass
        assert time.monotonic() - t0 < 3.0 + 2.0
        assert any(x.status is kvx.Status.FAILED for x in xs)
        assert all(isinstance(x.error, kvx.PeerDisconnected) for x in xs if x.status is kvx.Status.FAILED)
        with pytest.raises(kvx.PeerDisconnected):
            a.write(loc, [0], rem, [0]).wait(5)


def test_silent_peer_fails_within_bound(tpeer: PeerProcess) -> None:
    """A stopped (SIGSTOP) target: TCP stays up, the process makes no progress."""
    import signal

    with _agent(auth_token=TOKEN) as a:
        bs, n = 1 << 20, 64
        rid, rd = tpeer.register("numpy", bs * n)
        name = a.add_peer(tpeer.meta)
        reg = a.register(np.ones(bs * n, np.uint8))
        loc = a.prepare(kvx.DescList.blocks(reg, bs))
        rem = a.prepare(kvx.DescList.blocks(rd, bs), peer=name)
        os.kill(tpeer.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            x = a.read(loc, np.arange(n), rem, np.arange(n))
            with pytest.raises((kvx.PeerDisconnected, kvx.TransferTimeout)):
                x.wait(15)
            assert time.monotonic() - t0 < 3.0 + 2.0
        finally:
            os.kill(tpeer.pid, signal.SIGCONT)


def _census() -> tuple[int, int]:
    gc.collect()
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _settled_census(timeout: float = 5.0) -> tuple[int, int]:
    """The census once short-lived threads of earlier work have ended (stable for 0.5 s)."""
    deadline = time.monotonic() + timeout
    last, since = _census(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _census()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.5:
            break
    return last


def test_no_thread_or_fd_leaks(tpeer: PeerProcess) -> None:
    rid, rd = tpeer.register("numpy", 1 << 20)
    # warm up imports and the native pools
    _good_transfer(tpeer)
    t0, f0 = _settled_census()
    for _ in range(3):
        a = _agent(auth_token=TOKEN)
        name = a.add_peer(tpeer.meta)
        reg = a.register(np.ones(1 << 20, np.uint8))
        loc = a.prepare(kvx.DescList.blocks(reg, 4096))
        rem = a.prepare(kvx.DescList.blocks(rd, 4096), peer=name)
        a.write(loc, np.arange(256), rem, np.arange(256), notify=b"n").wait(10)
        a.read(loc, np.arange(256), rem, np.arange(256)).wait(10)
        a.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _census() != (t0, f0):
        time.sleep(0.1)
    threads, fds = _census()
    # a leak is growth; a helper thread of the warm-up ending late is not
    assert threads <= t0 and fds <= f0, f"threads {t0} -> {threads}, fds {f0} -> {fds}"


def test_target_side_leaks_after_peers_die() -> None:
    """The serving side drops connections of killed initiators: no threads or fds stay."""
    with _agent("target", auth_token=TOKEN) as tgt:
        reg = tgt.register(np.zeros(1 << 20, np.uint8))
        t0, f0 = _settled_census()
        for _ in range(2):
            p = PeerProcess("init", {"backends": ["tcp"], "peer_timeout": 3.0, "auth_token": TOKEN})
            try:
                p.call(cmd="add_peer", meta=__import__("base64").b64encode(tgt.metadata()).decode())
            finally:
                p.kill()
                p.close()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and _census() != (t0, f0):
            time.sleep(0.1)
        threads, fds = _census()
        assert threads <= t0 and fds <= f0, f"threads {t0} -> {threads}, fds {f0} -> {fds}"
        reg.release()


def test_refused_connection_is_logged(tpeer: PeerProcess) -> None:
    """The reason is logged by the target (checked in-process here)."""
    records: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = H()
    lg = logging.getLogger("kvx.backends.tcp")
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        with _agent("target", auth_token=TOKEN) as tgt:
            s = _raw_connect(_addr(tgt.metadata()))
            s.recv(4096)
            s.sendall(b"garbage!" * 4)
            s.settimeout(5)
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
            s.close()
            with _agent("bad", auth_token="nope") as bad, pytest.raises(kvx.AuthError):
                bad.add_peer(tgt.metadata())
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    msgs = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert any("bad frame header" in m for m in msgs)
    assert any("authentication" in m for m in msgs)


def test_notify_both_ways_and_many_peers() -> None:
    """One target serving several initiators at once; notifications after data."""
    with _agent("hub") as hub:
        hbuf = np.zeros(4 << 20, np.uint8)
        hreg = hub.register(hbuf)
        clients = [_agent(f"c{i}") for i in range(3)]
        try:
            xs = []
            for i, c in enumerate(clients):
                name = c.add_peer(hub.metadata())
                buf = np.full(1 << 20, i + 1, np.uint8)
                reg = c.register(buf)
                loc = c.prepare(kvx.DescList.blocks(reg, 65536))
                rem = c.prepare(kvx.DescList.blocks(hreg.descs, 65536), peer=name)
                xs.append(c.write(loc, np.arange(16), rem, np.arange(16) + 16 * i, notify=f"done{i}".encode()))
            for x in xs:
                x.wait(10)
            got: dict[str, list[bytes]] = {}
            deadline = time.monotonic() + 5
            while len(got) < 3 and time.monotonic() < deadline:
                for k, v in hub.notifications(timeout=0.5).items():
                    got.setdefault(k, []).extend(v)
            assert got == {f"c{i}": [f"done{i}".encode()] for i in range(3)}
            for i in range(3):
                assert (hbuf[i << 20:(i + 1) << 20] == i + 1).all()
            hub.add_peer(clients[0].metadata())
            hub.notify("c0", b"back")
            assert clients[0].notifications(timeout=5) == {"hub": [b"back"]}
        finally:
            for c in clients:
                c.close()


def test_metadata_section_and_listen_address() -> None:
    with kvx.Agent("l", kvx.AgentConfig(backends=("tcp",), listen=("127.0.0.1", 0))) as a:
        info = kvx.Agent.parse_metadata(a.metadata())
        (h, p), = info.sections["tcp"]["addrs"]
        assert h == "127.0.0.1" and p > 0
    with _agent("d") as a:  # default: loopback, any port
        info = kvx.Agent.parse_metadata(a.metadata())
        assert info.sections["tcp"]["addrs"][0][0] == "127.0.0.1"


def test_malformed_tcp_section_raises_protocol_error() -> None:
    with _agent("a") as a, _agent("b") as b:
        meta = msgpack.unpackb(b.metadata())
        meta["backends"]["tcp"] = {"addrs": [["127.0.0.1", "x"]]}
        with pytest.raises(kvx.ProtocolError):
            a.add_peer(msgpack.packb(meta))


def test_auth_helpers_agree() -> None:
    n = auth.new_nonce()
    auth.verify("t", n, "a", "b", auth.prove("t", n, "a", "b"))
    with pytest.raises(kvx.AuthError):
        auth.verify("t", n, "a", "b", auth.prove("u", n, "a", "b"))
    assert send_frame is not None


def test_fast_path_small_transfers_plans_and_fallback(tpeer: PeerProcess) -> None:
    """Small transfers go over the fast stream (reply read by the waiting thread): writes and
    reads land correctly, plans re-post, an un-waited request makes the next post fall back to
    the streams, a cancelled request does not block the stream, notifications follow the data."""
    bs, n = 4096, 64
    rid, rd = tpeer.register("numpy", bs * n)
    with _agent("fast", auth_token=TOKEN) as a:
        name = a.add_peer(tpeer.meta)
        buf = pattern(bs * n, 11)
        reg = a.register(buf)
        loc = a.prepare(kvx.DescList.blocks(reg, bs))
        rem = a.prepare(kvx.DescList.blocks(rd, bs), peer=name)
        conn = a.backend("tcp")._peers[name]  # type: ignore[attr-defined]
        assert conn.fast is not None
        perm = np.random.default_rng(2).permutation(n)
        for i in range(0, n, 16):  # 1..16 descriptors per post, mixed index types
            a.write(loc, list(range(i, i + 16)), rem, perm[i:i + 16]).wait(10)
        exp = np.zeros(bs * n, np.uint8)
        exp.reshape(n, bs)[perm] = buf.reshape(n, bs)
        assert tpeer.digest(rid) == digest(exp)
        # an un-waited request holds the fast stream: the next post takes the regular streams
        t1 = a.write(loc, [0], rem, [1])
        t2 = a.write(loc, [2], rem, [3], notify=b"n2")
        t2.wait(10)
        t1.wait(10)
        assert tpeer.notifs(5.0) == {"fast": [b"n2"]}
        # cancel, then keep going on the same stream
        a.write(loc, [4], rem, [5]).cancel()
        plan = a.make_transfer("write", loc, [7], rem, [9])
        for _ in range(50):
            plan.post().wait(10)
        back = np.zeros(bs * n, np.uint8)
        lreg = a.register(back)
        lb = a.prepare(kvx.DescList.blocks(lreg, bs))
        rplan = a.make_transfer("read", lb, [0], rem, [9])
        for _ in range(3):
            rplan.post().wait(10)
        assert back[:bs].tobytes() == buf[7 * bs:8 * bs].tobytes()
        a.read(lb, np.arange(16), rem, perm[:16]).wait(10)
        assert back[: 16 * bs].tobytes() == buf[: 16 * bs].tobytes()
        lreg.release()


def test_fast_path_release_refuses_small_writes(tpeer: PeerProcess) -> None:
    """After the target released a region, small writes (scalar validation path) fail with
    RemoteError and the connection keeps serving other regions."""
    rid, rd = tpeer.register("numpy", 1 << 16)
    rid2, rd2 = tpeer.register("numpy", 1 << 16, seed=4)
    with _agent("fast2", auth_token=TOKEN) as a:
        name = a.add_peer(tpeer.meta)
        buf = pattern(1 << 16, 9)
        reg = a.register(buf)
        loc = a.prepare(kvx.DescList.blocks(reg, 4096))
        rem = a.prepare(kvx.DescList.blocks(rd, 4096), peer=name)
        rem2 = a.prepare(kvx.DescList.blocks(rd2, 4096), peer=name)
        a.write(loc, [0], rem, [0]).wait(10)
        tpeer.call(cmd="release", id=rid)
        for k in range(5):
            with pytest.raises(kvx.RemoteError):
                a.write(loc, [k], rem, [k]).wait(10)
            with pytest.raises(kvx.RemoteError):
                a.read(loc, [k], rem, [k]).wait(10)
        before = tpeer.digest(rid2)
        a.write(loc, np.arange(16), rem2, np.arange(16)).wait(10)
        assert tpeer.digest(rid2) != before and tpeer.digest(rid2) == digest(buf)


def test_forged_many_descriptors_take_the_vector_check(tpeer: PeerProcess) -> None:
    """More descriptors than the scalar path takes: one forged among them refuses the request."""
    rid, rd = tpeer.register("numpy", 1 << 17, seed=6)
    before = tpeer.digest(rid)
    info = kvx.Agent.parse_metadata(tpeer.meta)
    s = _raw_connect(_addr(tpeer.meta))
    try:
        client_handshake(s, TOKEN, "forger-id", "forger", "data", 5.0, expect_id=info.agent_id)
        a = int(rd.addr[0])
        addrs = np.array([a + 4096 * i for i in range(31)] + [a - 4096], np.uint64)
        nbs = np.full(32, 4096, np.uint64)
        body = wire.pack("w", rid=1, addr=addrs.tobytes(), nbytes=nbs.tobytes())
        s.sendall(wire.frame_header(1, len(body)) + body + b"\xee" * (4096 * 32))
        r = recv_frame(s, time.monotonic() + 5, 1 << 20)
        assert r["t"] == "err" and r["re"] == 1 and "outside registered memory" in r["msg"]
    finally:
        s.close()
    assert tpeer.digest(rid) == before


def test_link_failure_while_a_read_payload_arrives_fails_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection fails while the payload of a read reply is being received -- the chunk has
    already left the pending table, where the connection's failure looks for transfers to fail:
    the transfer still turns FAILED with PeerDisconnected at once, not at its deadline."""
    from kvx.backends import tcp as ktcp

    real = ktcp._net.recvv
    calls = {"n": 0}

    def reset_once(*a: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")
        return real(*a)

    bs = 1 << 20  # one chunk, above the fast path's size limit
    with _agent("tgt") as tgt, _agent("ini", transfer_timeout=20.0) as ini:
        treg = tgt.register(np.full(bs, 7, np.uint8))
        name = ini.add_peer(tgt.metadata())
        buf = np.zeros(bs, np.uint8)
        loc = ini.prepare(kvx.DescList.blocks(ini.register(buf), bs))
        rem = ini.prepare(kvx.DescList.blocks(treg.descs, bs), peer=name)
        monkeypatch.setattr(ktcp._net, "recvv", reset_once)
        t0 = time.monotonic()
        x = ini.read(loc, [0], rem, [0])
        with pytest.raises(kvx.PeerDisconnected):
            x.wait(15)
        assert time.monotonic() - t0 < 10
        assert calls["n"] == 1 and x.status is kvx.Status.FAILED


def _tcp(agent: kvx.Agent) -> Any:
    return next(b for b in agent.backends if b.name == "tcp")


def test_small_write_to_two_blocks_of_one_region_leaves_no_pin() -> None:
    """Two descriptors of one region in one small request: the target pins the region once per
    distinct region and unpins it once, so release (and close) return at once instead of waiting
    out the peer timeout for a pin nothing holds (issue 14.6)."""
    with _agent("tgt", peer_timeout=4.0) as tgt, _agent("ini", peer_timeout=4.0) as ini:
        tb = _tcp(tgt)
        tregs = [tgt.register(np.zeros(1 << 14, np.uint8)) for _ in range(3)]
        name = ini.add_peer(tgt.metadata())
        buf = pattern(1 << 14, 3)
        loc = ini.prepare(kvx.DescList.blocks(ini.register(buf), 4096))
        for treg in tregs:
            rem = ini.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
            ini.write(loc, [0, 1], rem, [0, 1]).wait(10)
            ini.write(loc, [2, 3, 2], rem, [3, 2, 1]).wait(10)
        assert int(tb._pins.sum()) == 0
        t0 = time.monotonic()
        tregs[0].release()
        assert time.monotonic() - t0 < 2.0  # below the 4 s peer timeout a stuck pin waits out
        assert ini.peers() == [name]
        t0 = time.monotonic()
        tgt.close()  # releases the other two regions
        assert time.monotonic() - t0 < 2.0


def test_a_flooded_listener_tells_a_peer_it_is_busy_not_a_token_error() -> None:
    """With every handshake slot taken by idle connections, a peer with the right token learns
    the true reason (busy: PeerDisconnected), not 'wrong KVX_AUTH_TOKEN?' (issue 14.5)."""
    from kvx.net import MAX_HANDSHAKES

    with _agent("tgt", auth_token=TOKEN, handshake_timeout=5.0) as tgt:
        addr = _addr(tgt.metadata())
        socks = [_raw_connect(addr) for _ in range(MAX_HANDSHAKES)]
        try:
            for s in socks:
                s.recv(4096)  # each one is in its handshake now
            with _agent("late", auth_token=TOKEN) as late:
                with pytest.raises(kvx.PeerDisconnected, match="busy") as ei:
                    late.add_peer(tgt.metadata())
                assert "TOKEN" not in str(ei.value)
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 10
        with _agent("later", auth_token=TOKEN) as later:
            while True:
                try:
                    later.add_peer(tgt.metadata())
                    break
                except kvx.PeerDisconnected:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)


def _hostile_listener(script: Any) -> tuple[socket.socket, threading.Thread]:
    """A listener that runs ``script(conn)`` on the first connection."""
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)

    def run() -> None:
        try:
            c, _ = ls.accept()
        except OSError:
            return
        with c:
            try:
                script(c)
            except OSError:
                pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return ls, t


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_a_hostile_listener_cannot_make_the_dialler_allocate() -> None:
    """A listener answering the handshake with a frame that claims 256 MiB: the dialler refuses
    it at the header (ProtocolError) without allocating it (issue 14.5)."""
    def script(c: socket.socket) -> None:
        c.settimeout(5)
        send_frame(c, wire.pack("challenge", nonce=b"n" * 32, id="hostile"))
        c.recv(4096)  # the hello
        c.sendall(wire.frame_header(1, 256 << 20) + b"\xc0" * 64)
        time.sleep(1.0)

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here")
    from kvx.discovery import fetch_metadata

    for case in ("data", "meta"):
        ls, t = _hostile_listener(script)
        try:
            base = _peak_rss()
            with pytest.raises(kvx.ProtocolError, match="exceeds"):
                if case == "data":
                    s = _raw_connect(ls.getsockname())
                    try:
                        client_handshake(s, TOKEN, "me", "me", "data", 5.0)
                    finally:
                        s.close()
                else:
                    fetch_metadata(*ls.getsockname(), token=TOKEN, timeout=5.0)
            assert _peak_rss() - base < 64 << 20
        finally:
            ls.close()
            t.join(5)


def test_refused_requests_are_logged_a_few_and_counted() -> None:
    """200 forged requests on one authenticated connection: a handful of WARNING lines, the
    rest counted and summed up in one line at close (issue 14.10)."""
    records: list[logging.LogRecord] = []

    class H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    h = H(level=logging.WARNING)
    lg = logging.getLogger("kvx")
    lg.addHandler(h)
    try:
        with _agent("target", auth_token=TOKEN) as tgt:
            info = kvx.Agent.parse_metadata(tgt.metadata())
            s = _raw_connect(_addr(tgt.metadata()))
            try:
                client_handshake(s, TOKEN, "forger-id", "forger", "data", 5.0, expect_id=info.agent_id)
                for i in range(200):
                    body = wire.pack("r", rid=i + 1, addr=np.array([1 << 40], np.uint64).tobytes(),
                                     nbytes=np.array([64], np.uint64).tobytes())
                    s.sendall(wire.frame_header(1, len(body)) + body)
                    r = recv_frame(s, time.monotonic() + 5, 1 << 20)
                    assert r["t"] == "err" and r["re"] == i + 1
            finally:
                s.close()
            tb = _tcp(tgt)
    finally:
        lg.removeHandler(h)
    msgs = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    one_by_one = [m for m in msgs if "refused a read" in m]
    assert 1 <= len(one_by_one) <= 10
    assert tb.refused.counts.get("requests") == 200
    assert any(f"{200 - len(one_by_one)} more refused requests" in m for m in msgs), msgs


def test_refusal_log_sums_up_each_period(caplog: Any) -> None:
    """The refusal log: ``burst`` lines per kind and period, then one summary with the count."""
    from kvx.net import RefusalLog

    lg = logging.getLogger("kvx.test.refusals")
    r = RefusalLog(lg, burst=2, period=0.3)
    with caplog.at_level(logging.WARNING, logger="kvx.test.refusals"):
        for i in range(10):
            r("requests", "refused %d", i)
        r("connections", "conn %d", 0)
        assert [m.getMessage() for m in caplog.records] == ["refused 0", "refused 1", "conn 0"]
        time.sleep(0.35)
        r("requests", "refused %d", 10)
        msgs = [m.getMessage() for m in caplog.records][3:]
        assert msgs[0].startswith("8 more refused requests") and "(10 in all)" in msgs[0]
        assert msgs[1] == "refused 10"
        r.flush()  # nothing pending: no line
        assert len(caplog.records) == 5
    assert r.counts == {"requests": 11, "connections": 1}


def _with_tcp_addrs(meta: bytes, addrs: list[Any]) -> bytes:
    m = msgpack.unpackb(meta, raw=False)
    m["backends"]["tcp"]["addrs"] = addrs
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


def test_bad_addresses_are_kvx_errors() -> None:
    """A peer's metadata naming a host no resolver takes is a ProtocolError; a local listen address
    that cannot be bound is a UsageError (issue 14.8)."""
    with _agent("tgt") as tgt, _agent("ini") as ini:
        meta = tgt.metadata()
        port = _addr(meta)[1]
        for host in ("a" * 300, "é" * 20, "a\0b", "", "x" * 64 + ".example", "a..b", " "):
            with pytest.raises(kvx.ProtocolError):
                ini.add_peer(_with_tcp_addrs(meta, [[host, port]]))
        assert ini.peers() == []
        assert ini.add_peer(meta) == "tgt"
    for listen in (("256.0.0.1", 0), ("a" * 300, 0), ("127.0.0.1", 70000), ("127.0.0.1", -1), ("8.8.8.8", 0)):
        with pytest.raises(kvx.UsageError):
            kvx.Agent("bad", kvx.AgentConfig(backends=("tcp",), listen=listen))
    from kvx.discovery import fetch_metadata

    with pytest.raises(kvx.UsageError):
        fetch_metadata("a" * 300, 1, timeout=1.0)


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_transfer_of_many_chunks_is_spread_over_the_streams(op: str) -> None:
    """The chunks of one transfer go out on every stream, evenly. A read's request frames take
    microseconds to send: from one shared queue, whichever sender thread was awake took nearly
    all of them (15 of 16 seen) and the whole read came back on one connection, so reads ran at
    one stream's rate while writes used both (issue 16, 32 KiB reads)."""
    from kvx.backends.tcp import TcpOptions

    chunk, nchunks = 64 << 10, 16
    opts = {"tcp": TcpOptions(chunk=chunk, streams=2)}
    with _agent("tgt", options=opts) as tgt, _agent("ini", options=opts) as ini:
        n = chunk * nchunks
        tbuf = pattern(n, 7) if op == "read" else np.zeros(n, np.uint8)
        ibuf = np.zeros(n, np.uint8) if op == "read" else pattern(n, 8)
        treg, ireg = tgt.register(tbuf), ini.register(ibuf)
        name = ini.add_peer(tgt.metadata())
        loc = ini.prepare(kvx.DescList.blocks(ireg, 4096))
        rem = ini.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
        streams = _tcp(ini)._peers[name].streams
        assert len(streams) == 2
        counts = [0, 0]
        for st in streams:
            orig = st.send_chunk

            def counted(ch: Any, _orig: Any = orig, _i: int = st.idx) -> None:
                counts[_i] += 1
                _orig(ch)

            st.send_chunk = counted  # type: ignore[method-assign]
        nblk = n // 4096
        perm = np.random.default_rng(1).permutation(nblk)
        for rep in range(5):
            before = list(counts)
            getattr(ini, op)(loc, np.arange(nblk), rem, perm).wait(20)
            got = [counts[i] - before[i] for i in range(2)]
            assert sum(got) == nchunks
            assert abs(got[0] - got[1]) <= 1, f"transfer {rep}: chunks per stream {got}"
        src, dst = (tbuf, ibuf) if op == "read" else (ibuf, tbuf)
        if op == "read":
            assert digest(dst) == digest(src.reshape(nblk, 4096)[perm].reshape(-1))
        else:
            exp = np.zeros_like(src)
            exp.reshape(nblk, 4096)[perm] = src.reshape(nblk, 4096)
            assert digest(dst) == digest(exp)
