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
