"""Property tests (hypothesis) of every frame kvx listeners accept: the tcp data listener (before
and after authentication), the same-node link's listener (before and after its handshake) and
the discovery side channel. The property: a fuzzed frame gets a clean refusal (an error reply or
the connection closed), no handler raises anything but a kvx error (nothing logged with a
traceback, no thread dies), memory outside the registrations is never touched, and the listener
keeps serving a good peer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvx
from kvx import auth, wire
from kvx.channel import Channel
from kvx.discovery import SideChannel, fetch_metadata
from kvx.net import client_handshake, recv_frame

TOKEN = "fuzz-token"
GUARD = 1 << 14  # bytes kept unregistered on each side of every registration
SETTINGS = settings(max_examples=80, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


class _Trap(logging.Handler):
    """Collects log records carrying a traceback (a handler raised something unexpected)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is not None and record.levelno >= logging.ERROR:
            self.bad.append(self.format(record))


class _World:
    """One target agent (host + tcp, token, side channel on its own listener) with guarded
    registrations, and the traps that catch unexpected exceptions."""

    def __init__(self) -> None:
        self.agent = kvx.Agent("fuzz-target", kvx.AgentConfig(
            backends=("host", "tcp"), auth_token=TOKEN, handshake_timeout=1.0, peer_timeout=1.5))
        self.side = SideChannel(self.agent, "127.0.0.1", 0)
        self.bufs = [kvx.alloc_host(4 * GUARD), np.zeros(4 * GUARD, np.uint8)]
        self.regs = []
        for b in self.bufs:
            a = np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) else b
            a[:] = 0xA5
            self.regs.append(self.agent.register(a[GUARD: 3 * GUARD]))
        self.views = [np.frombuffer(b, np.uint8) if not isinstance(b, np.ndarray) else b for b in self.bufs]
        info = kvx.Agent.parse_metadata(self.agent.metadata())
        self.tcp = tuple(info.sections["tcp"]["addrs"][0])
        self.uds = "\0" + info.sections["host"]["uds"]
        self.agent_id = info.agent_id
        self.trap = _Trap()
        logging.getLogger("kvx").addHandler(self.trap)
        self.thread_errors: list[str] = []
        self._old_hook = threading.excepthook
        threading.excepthook = self._hook

    def _hook(self, args: Any) -> None:
        self.thread_errors.append(f"{args.exc_type.__name__}: {args.exc_value} in {args.thread}")

    def addresses(self) -> list[tuple[int, int]]:
        """(address, size) of every registration."""
        return [(int(r.descs.addr[0]), int(r.descs.nbytes[0])) for r in self.regs]

    def check(self) -> None:
        """Nothing unexpected raised (since the last check), guards untouched."""
        bad, self.trap.bad = self.trap.bad, []
        dead, self.thread_errors = self.thread_errors, []
        assert not bad, bad[:3]
        assert not dead, dead[:3]
        for v in self.views:
            assert (v[:GUARD] == 0xA5).all() and (v[3 * GUARD:] == 0xA5).all(), "a guard zone was written"

    def close(self) -> None:
        threading.excepthook = self._old_hook
        logging.getLogger("kvx").removeHandler(self.trap)
        self.side.close()
        self.agent.close()


@pytest.fixture(scope="module")
def world() -> Iterator[_World]:
    w = _World()
    yield w
    try:
        w.check()
        _good_peers(w)
        w.check()
    finally:
        w.close()


def _good_peers(w: _World) -> None:
    """A good peer still connects on every path and moves data; the side channel still serves."""
    assert kvx.Agent.parse_metadata(fetch_metadata(*w.side.address, token=TOKEN)).name == "fuzz-target"
    for backends, reg in ((("tcp",), w.regs[1]), (("host",), w.regs[0])):
        with kvx.Agent("good", kvx.AgentConfig(backends=backends, auth_token=TOKEN)) as g:
            name = g.add_peer(w.agent.metadata())
            buf = np.full(2 * GUARD, 0x3C, np.uint8)
            loc = g.prepare(kvx.DescList.blocks(g.register(buf), 4096))
            rem = g.prepare(kvx.DescList.blocks(reg.descs, 4096), peer=name)
            g.write(loc, [0, 1], rem, [0, 1]).wait(10)
            back = np.zeros(2 * GUARD, np.uint8)
            bl = g.prepare(kvx.DescList.blocks(g.register(back), 4096))
            g.read(bl, [0, 1], rem, [0, 1]).wait(10)
            assert (back[:8192] == 0x3C).all()


def _drain(s: socket.socket, secs: float) -> bytes:
    """Read what comes within ``secs`` (stopping at EOF)."""
    out = b""
    end = time.monotonic() + secs
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return out
        s.settimeout(left)
        try:
            d = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            return out
        if not d:
            return out
        out += d


# ---- strategies ------------------------------------------------------------------------------
_ints = st.one_of(st.integers(-2, 70), st.sampled_from([1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
                                                        -(1 << 63)]))
_leaves = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=12), st.binary(max_size=48))
_values = st.recursive(_leaves, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=6), ch,
                                                                                        max_size=4), max_leaves=10)


def _fields(names: list[str]) -> Any:
    return st.dictionaries(st.sampled_from(names), _values, max_size=len(names))


def _pack(t: str, fields: dict[str, Any]) -> bytes:
    """A message of type ``t`` with ``fields`` (which may override the version and type too)."""
    return msgpack.packb({"v": wire.VERSION, "t": t, **fields}, use_bin_type=True)  # type: ignore[no-any-return]


def _frame(body: bytes, kind: int = 1, length: int | None = None) -> bytes:
    return wire.frame_header(kind, len(body) if length is None else length) + body


@st.composite
def _preauth_bytes(draw: Any, hello_fields: list[str]) -> bytes:
    """What an unauthenticated client sends after the challenge: raw bytes, a frame with a
    wrong kind or length, or a well-framed message with fuzzed fields."""
    how = draw(st.sampled_from(["raw", "msg", "msg", "badlen", "badkind"]))
    if how == "raw":
        return draw(st.binary(max_size=128))  # type: ignore[no-any-return]
    fields = draw(_fields(hello_fields))
    t = draw(st.sampled_from(["hello", "hello", "welcome", "x"]))
    body = _pack(t, fields) if draw(st.booleans()) else draw(st.binary(max_size=64))
    if how == "badlen":
        return _frame(body, length=draw(st.sampled_from([0, 1, len(body) + 1, 1 << 20, (1 << 32) - 1])))
    if how == "badkind":
        return _frame(body, kind=draw(st.integers(0, 65535)))
    return _frame(body)


def _descs(w: _World, ragged: bool = True) -> Any:
    """Descriptor arrays (raw u64 bytes) around the registrations' edges, or junk (of lengths
    that are not multiples of 8 too, unless not ``ragged``)."""
    edges = []
    for a, n in w.addresses():
        edges += [a - GUARD, a - 1, a, a + 1, a + n - 8, a + n - 1, a + n, a + n + 1]
    addr = st.one_of(st.sampled_from(edges), _ints.filter(lambda x: 0 <= x < 1 << 64))
    size = st.one_of(st.sampled_from([0, 1, 7, 8, 64, 4096, GUARD + 1]), st.integers(0, 1 << 16))
    pairs = st.lists(st.tuples(addr, size), min_size=0, max_size=20)

    def enc(ps: list[tuple[int, int]]) -> tuple[bytes, bytes]:
        return (np.array([p[0] for p in ps], np.uint64).tobytes(), np.array([p[1] for p in ps], np.uint64).tobytes())

    junk = st.tuples(st.binary(max_size=40), st.binary(max_size=40))
    if not ragged:
        junk = junk.filter(lambda ab: len(ab[0]) % 8 == 0 and len(ab[1]) % 8 == 0)
    return st.one_of(pairs.map(enc), junk)


# ---- tcp data listener -----------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_tcp_listener_before_authentication(world: _World, data: Any) -> None:
    junk = data.draw(_preauth_bytes(["v", "t", "name", "id", "mac", "svc", "key"]))
    s = socket.create_connection(world.tcp, timeout=5)
    try:
        s.recv(4096)  # the challenge
        try:
            s.sendall(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = _drain(s, 0.3)
        assert b"welcome" not in got and b"rows" not in got and b"meta" not in got
    finally:
        s.close()
    world.check()


def _authed_tcp(w: _World) -> socket.socket:
    s = socket.create_connection(w.tcp, timeout=5)
    rep = client_handshake(s, TOKEN, "fuzzer-id", "fuzzer", "data", 5.0, expect_id=w.agent_id)
    assert rep["t"] == "welcome"
    return s


@SETTINGS
@given(data=st.data())
def test_tcp_listener_after_authentication(world: _World, data: Any) -> None:
    """Requests of a token holder, fuzzed: every one answered (error or data) or the connection
    closed; guard zones never written; a sentinel request after it still answered."""
    t = data.draw(st.sampled_from(["w", "r", "w", "r", "notif", "regions", "x"]))
    fields = data.draw(_fields(["rid", "addr", "nbytes", "msg", "pl", "re"]))
    if t in ("w", "r") and data.draw(st.booleans()):
        fields["rid"] = data.draw(_ints)
        fields["addr"], fields["nbytes"] = data.draw(_descs(world))
    body = _pack(t, fields)
    payload = b""
    if t == "w":
        nb = fields.get("nbytes")
        total = int(np.frombuffer(nb, np.uint64).sum()) if isinstance(nb, bytes) and len(nb) % 8 == 0 else 0
        payload = b"\xee" * min(total, 1 << 17)
    s = _authed_tcp(world)
    try:
        sentinel = wire.pack("regions", rid=987654)
        try:
            s.sendall(_frame(body) + payload + _frame(sentinel))
        except (BrokenPipeError, ConnectionResetError):
            pass
        deadline = time.monotonic() + 5.0
        while True:  # until the sentinel's answer, or the listener closed the connection
            try:
                msg = recv_frame(s, deadline, 1 << 20)
            except (kvx.PeerDisconnected, ConnectionResetError):
                break
            except kvx.ProtocolError:  # a read reply's data between frames: skip it
                break
            if msg.get("re") == 987654 and msg.get("t") == "rows":
                break
            if msg.get("t") == "rd":
                n = msg.get("n")
                assert isinstance(n, int) and n <= 1 << 20
                left = n
                while left:
                    d = s.recv(min(left, 65536))
                    if not d:
                        break
                    left -= len(d)
    finally:
        s.close()
    world.check()


# ---- same-node link listener -----------------------------------------------------------------
def _uds_connect(w: _World) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(w.uds)
    return s


@SETTINGS
@given(data=st.data())
def test_samenode_listener_before_its_handshake(world: _World, data: Any) -> None:
    junk = data.draw(_preauth_bytes(["v", "t", "name", "id", "mac"]))
    s = _uds_connect(world)
    try:
        s.recv(4096)
        try:
            s.sendall(junk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        got = _drain(s, 0.3)
        assert b"welcome" not in got
    finally:
        s.close()
    world.check()


def _authed_uds(w: _World) -> Channel:
    s = _uds_connect(w)
    chan = Channel(s, 1 << 24, lambda *a: None, name="fuzz")
    msg, _, fds = chan.recv_one()
    mac = auth.prove(TOKEN, msg["nonce"], "fuzzer-id", msg["id"])
    chan.send(wire.pack("hello", name="fuzzer", id="fuzzer-id", mac=mac))
    msg, _, fds = chan.recv_one()
    for fd in fds:
        os.close(fd)
    assert msg["t"] == "welcome"
    return chan


@SETTINGS
@given(data=st.data())
def test_samenode_listener_after_its_handshake(world: _World, data: Any) -> None:
    """Messages of a same-user, token-holding peer, fuzzed (the uds path's requests among them):
    an error reply or a closed connection; guards never written; a sentinel still answered."""
    t = data.draw(st.sampled_from(["xfer", "xfer", "getfd", "revoke", "notif", "x"]))
    fields = data.draw(_fields(["rid", "op", "addr", "nbytes", "slot", "gen", "msg", "pl"]))
    if t == "xfer" and data.draw(st.booleans()):
        fields["rid"] = data.draw(_ints)
        fields["op"] = data.draw(st.sampled_from(["read", "write", "x"]))
        fields["addr"], fields["nbytes"] = data.draw(_descs(world))
    payload = None
    if data.draw(st.booleans()):
        payload = b"\xee" * data.draw(st.integers(0, 1 << 14))
    fields.pop("pl", None)
    chan = _authed_uds(world)
    try:
        try:
            chan.send(_pack(t, {**fields, "pl": payload is not None}), payload)
            chan.send(wire.pack("nothing", rid=987654))
        except kvx.PeerDisconnected:
            return
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                msg, _pl, fds = chan.recv_one()
            except (kvx.PeerDisconnected, kvx.ProtocolError, OSError):
                break
            for fd in fds:
                os.close(fd)
            if msg.get("re") == 987654:
                assert msg["t"] == "error"
                break
        else:
            pytest.fail("the same-node listener neither answered nor closed within 5 s")
    finally:
        chan.sock.close()
    world.check()


# ---- discovery side channel ------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_side_channel_frames(world: _World, data: Any) -> None:
    """Before authentication: refusal or close; after it, a fuzzed request (svc, key) is answered
    with metadata, a descriptor list or 'missing', or the connection is closed."""
    s = socket.create_connection(world.side.address, timeout=5)
    try:
        if data.draw(st.booleans()):
            s.recv(4096)
            try:
                s.sendall(data.draw(_preauth_bytes(["v", "t", "name", "id", "mac", "svc", "key"])))
            except (BrokenPipeError, ConnectionResetError):
                pass
            got = _drain(s, 0.3)
            assert b"meta" not in got or b"denied" in got or not got
        else:
            extra = data.draw(st.dictionaries(st.sampled_from(["key", "x"]), _values, max_size=2))
            svc = data.draw(st.one_of(st.sampled_from(["meta", "descs"]), st.text(max_size=8)))
            try:
                rep = client_handshake(s, TOKEN, "fuzzer-id", "fuzzer", svc, 5.0, max_reply=16 << 20, **extra)
            except (kvx.PeerDisconnected, kvx.ProtocolError, kvx.AuthError):
                rep = None
            if rep is not None:
                assert rep["t"] in ("meta", "descs", "missing", "denied")
    finally:
        s.close()
    world.check()


def test_samenode_xfer_with_ragged_arrays_is_refused(world: _World) -> None:
    """A uds transfer request whose descriptor arrays are not whole u64s: refused with an error
    reply at once (np.frombuffer raised ValueError and the request went unanswered until the
    requester's timeout)."""
    chan = _authed_uds(world)
    try:
        chan.send(_pack("xfer", {"rid": 5, "op": "read", "addr": b"abc", "nbytes": b"abcdefghi", "pl": False}))
        msg, _pl, _fds = chan.recv_one(deadline=time.monotonic() + 3.0)
        assert msg["t"] == "error" and msg["re"] == 5
    finally:
        chan.sock.close()
    bad, world.trap.bad = world.trap.bad, []
    assert not bad, bad[:1]  # refused as malformed, not by a handler's traceback
