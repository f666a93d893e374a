"""The same-node link's listener (host and cuda backends) against hostile local processes:
another user, oversized and slow handshakes, connection floods (issue 14, items 4 and 5)."""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import numpy as np
import pytest

import kvx
from kvx import wire
from kvx.testing.procs import forked_ok

NOBODY = 65534

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a child as another user")


def _host(name: str, **kw: Any) -> kvx.Agent:
    return kvx.Agent(name, kvx.AgentConfig(backends=("host",), **kw))


def _uds(agent: kvx.Agent) -> str:
    return "\0" + str(kvx.Agent.parse_metadata(agent.metadata()).sections["host"]["uds"])


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _recv_frame_with_fds(s: socket.socket) -> tuple[bytes, list[int]]:
    """One frame as the dialling side reads it: header (with any fds), then the body."""
    fds: list[int] = []
    hdr = b""
    while len(hdr) < wire.HEADER:
        data, anc, _f, _a = s.recvmsg(wire.HEADER - len(hdr), socket.CMSG_SPACE(8 * 4))
        for level, typ, raw in anc:
            if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) - len(raw) % 4]))
        if not data:
            return b"", fds
        hdr += data
    n = int.from_bytes(hdr[4:8], "little")
    body = b""
    while len(body) < n:
        part = s.recv(n - len(body))
        if not part:
            break
        body += part
    return body, fds


@needs_root
def test_root_agent_refuses_a_peer_of_another_user() -> None:
    """A root agent's same-node listener serves only root: a process running as uid 65534 is
    refused with the reason, gets no descriptor (control table, memory) and moves no byte
    (issue 14.4). Checked with a real agent in the child and with a raw connection."""
    with _host("root-target") as tgt:
        mem = kvx.alloc_host(1 << 16)
        np.frombuffer(mem, np.uint8)[:] = 0x5A
        treg = tgt.register(mem)
        meta = tgt.metadata()
        before = bytes(np.frombuffer(mem, np.uint8))
        uds = _uds(tgt)

        def intruder_agent() -> bool:
            _as_nobody()
            with _host("intruder") as a:
                try:
                    name = a.add_peer(meta)
                except kvx.AuthError as exc:
                    return "another user" in str(exc)
                buf = np.full(1 << 16, 0xEE, np.uint8)
                loc = a.prepare(kvx.DescList.blocks(a.register(buf), 4096))
                rem = a.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
                a.write(loc, [0], rem, [0]).wait(10)
                return False

        def intruder_raw() -> bool:
            _as_nobody()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(uds)
            body, fds = _recv_frame_with_fds(s)
            got = list(fds)
            if body:
                msg = wire.unpack(body)
                if msg["t"] == "challenge":  # not refused: try to complete the handshake
                    h = wire.pack("hello", name="x", id="nobody", mac=b"")
                    s.sendall(wire.frame_header(1, len(h)) + h)
                    body, fds = _recv_frame_with_fds(s)
                    got += fds
                    return False
                if msg["t"] != "denied" or "another user" not in msg.get("msg", ""):
                    return False
            for fd in got:
                os.close(fd)
            return not got

        assert forked_ok(intruder_agent, 60.0)
        assert forked_ok(intruder_raw, 30.0)
        assert bytes(np.frombuffer(mem, np.uint8)) == before
        # the listener still serves its own user
        with _host("friend") as f:
            name = f.add_peer(meta)
            buf = np.full(1 << 16, 7, np.uint8)
            loc = f.prepare(kvx.DescList.blocks(f.register(buf), 4096))
            rem = f.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
            f.write(loc, [1], rem, [1]).wait(10)
        assert bytes(np.frombuffer(mem, np.uint8)[4096:8192]) == b"\x07" * 4096


# ---- bounds before authentication (issue 14.5) ----------------------------------------------
def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS here (/proc/self/clear_refs)")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def _raw(agent: kvx.Agent, timeout: float = 5.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(_uds(agent))
    return s


def _closed_within(s: socket.socket, secs: float) -> bool:
    """Whether the listener closes ``s`` within ``secs`` (reading and dropping what it sends)."""
    s.settimeout(secs)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _good_peer(tgt: kvx.Agent) -> None:
    """A legitimate same-node peer still connects and moves data."""
    treg = tgt.register(np.zeros(1 << 14, np.uint8))
    with _host("good") as g:
        name = g.add_peer(tgt.metadata())
        buf = np.full(1 << 14, 3, np.uint8)
        loc = g.prepare(kvx.DescList.blocks(g.register(buf), 4096))
        rem = g.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=name)
        g.write(loc, [0, 1, 2, 3], rem, [0, 1, 2, 3]).wait(10)
    treg.release()


def test_preauth_frame_size_is_capped_and_allocates_nothing() -> None:
    """Four connections each declaring a 64 MiB 'hello' before authenticating: refused at the
    header, closed at once, and the listener's process did not grow by the declared sizes."""
    with _host("tgt", handshake_timeout=5.0) as tgt:
        socks = [_raw(tgt) for _ in range(4)]
        try:
            for s in socks:
                s.recv(4096)  # the challenge
            _reset_peak_rss()
            base = _peak_rss()
            for s in socks:
                s.sendall(wire.frame_header(1, 64 << 20) + b"\x81" * 16)
            assert all(_closed_within(s, 3.0) for s in socks)
            assert _peak_rss() - base < 32 << 20
        finally:
            for s in socks:
                s.close()
        _good_peer(tgt)


def test_slow_loris_is_cut_at_the_whole_handshake_deadline() -> None:
    """One byte of 'hello' every 0.2 s: the handshake timeout (1 s) bounds the whole handshake,
    not each recv, so the connection is closed within about a second."""
    import time

    with _host("tgt", handshake_timeout=1.0) as tgt:
        s = _raw(tgt)
        try:
            s.recv(4096)
            hello = wire.pack("hello", name="slow", id="slow-id", mac=b"m" * 32)
            frame = wire.frame_header(1, len(hello)) + hello
            t0 = time.monotonic()
            closed_after = None
            for b in frame:
                try:
                    s.sendall(bytes([b]))
                except (BrokenPipeError, ConnectionResetError):
                    closed_after = time.monotonic() - t0
                    break
                if _closed_within(s, 0.2):
                    closed_after = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > 8:
                    break
            assert closed_after is not None and closed_after < 3.0
        finally:
            s.close()
        _good_peer(tgt)


def test_concurrent_handshakes_are_capped_and_a_peer_is_told_why() -> None:
    """Idle connections flooding the listener hold at most MAX_HANDSHAKES handshake threads; one
    more connection is told 'busy', and a peer dialling during the flood gets PeerDisconnected
    saying so (not an authentication error); once the flood is gone it connects."""
    import threading
    import time

    from kvx.net import MAX_HANDSHAKES

    with _host("tgt", handshake_timeout=6.0) as tgt:
        base = threading.active_count()
        socks = [_raw(tgt) for _ in range(MAX_HANDSHAKES + 16)]
        try:
            time.sleep(0.5)
            assert threading.active_count() - base <= MAX_HANDSHAKES
            with _host("late") as late:
                with pytest.raises(kvx.PeerDisconnected, match="busy"):
                    late.add_peer(tgt.metadata())
        finally:
            for s in socks:
                s.close()
        deadline = time.monotonic() + 10
        while True:  # the handshake threads notice the closed connections
            try:
                _good_peer(tgt)
                break
            except kvx.PeerDisconnected:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


# ---- the dialling side checks who is behind the listener ------------------------------------
def _with_host_section(meta: bytes, **changes: Any) -> bytes:
    import msgpack

    m = msgpack.unpackb(meta, raw=False)
    m["backends"]["host"].update(changes)
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


@needs_root
def test_dialler_refuses_a_listener_of_another_user() -> None:
    """Abstract socket names are open to every user: a process of another user that bound the
    name a peer's metadata gives is refused before we answer its challenge (it gets no MAC, no
    hello, nothing of ours)."""
    import signal
    import time

    with _host("real", auth_token="t0ken") as real, _host("dialler", auth_token="t0ken") as dialler:
        fake = f"kvx-fake-{os.getpid()}-{time.monotonic_ns()}"
        agent_id = real.id
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the impostor, as uid 65534
            code = 2
            try:
                os.close(r)
                _as_nobody()
                ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                ls.bind("\0" + fake)
                ls.listen(1)
                os.write(w, b"1")
                ls.settimeout(10)
                c, _ = ls.accept()
                body = wire.pack("challenge", nonce=b"n" * 32, id=agent_id)
                c.settimeout(3)
                try:
                    c.sendall(wire.frame_header(1, len(body)) + body)
                    code = 1 if c.recv(4096) else 0  # 0: the dialler sent nothing and closed
                except OSError:  # the dialler closed first (reset, broken pipe) or stayed silent
                    code = 0
            finally:
                os._exit(code)
        os.close(w)
        try:
            assert os.read(r, 1) == b"1"
            with pytest.raises(kvx.AuthError, match="another user"):
                dialler.add_peer(_with_host_section(real.metadata(), uds=fake))
            _, status = os.waitpid(pid, 0)
            pid = 0
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the impostor received our hello"
        finally:
            os.close(r)
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def test_dialler_refuses_metadata_naming_another_pid() -> None:
    """Metadata naming the genuine listener but another process's pid (of our user: CMA would
    copy into that process at the addresses the real peer publishes) is a ProtocolError."""
    import signal
    import time

    with _host("real") as real, _host("dialler", host_path="cma") as dialler:
        pid = os.fork()
        if pid == 0:  # a copy of this process: the target's addresses are mapped here too
            time.sleep(30)
            os._exit(0)
        try:
            with pytest.raises(kvx.ProtocolError, match="pid"):
                dialler.add_peer(_with_host_section(real.metadata(), pid=pid))
            assert dialler.peers() == []
            assert dialler.add_peer(real.metadata()) == "real"
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
