"""Wire format: anything fed to a decoder either decodes or raises ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvx
from kvx import wire

_agent: kvx.Agent | None = None


def agent() -> kvx.Agent:
    global _agent
    if _agent is None:
        _agent = kvx.Agent("wire-test", kvx.AgentConfig(backends=("host",)))
    return _agent


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_add_peer(data: bytes) -> None:
    with pytest.raises(kvx.ProtocolError):
        agent().add_peer(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash_desclist(data: bytes) -> None:
    try:
        d = kvx.DescList.from_bytes(data)
    except kvx.ProtocolError:
        return
    assert isinstance(d, kvx.DescList)


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "t", "name", "id", "boot", "pid", "backends", "regions", "x"]), _values))
def test_structured_garbage_metadata(fields: dict) -> None:
    data = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(kvx.ProtocolError):
        agent().add_peer(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200))
def test_every_truncation_of_real_metadata_is_refused(cut: int) -> None:
    a = kvx.Agent("other", kvx.AgentConfig(backends=("host",)))
    try:
        meta = a.metadata()
        cut = min(cut, len(meta) - 1)
        with pytest.raises(kvx.ProtocolError):
            agent().add_peer(meta[:cut])
    finally:
        a.close()


def test_version_checks() -> None:
    ok = wire.pack("x", a=1)
    assert wire.unpack(ok)["a"] == 1
    for v in (0, wire.VERSION + 1, "1", True, None):
        with pytest.raises(kvx.ProtocolError):
            wire.unpack(msgpack.packb({"v": v, "t": "x"}))
    with pytest.raises(kvx.ProtocolError):
        wire.unpack(msgpack.packb({"v": 1}))


def test_size_limit() -> None:
    big = wire.pack("x", blob=b"\0" * 1000)
    with pytest.raises(kvx.ProtocolError, match="exceeds"):
        wire.unpack(big, max_bytes=100)
    with pytest.raises(kvx.ProtocolError):
        wire.parse_frame_header(wire.frame_header(1, 10**9), 1000)
    with pytest.raises(kvx.ProtocolError):
        wire.parse_frame_header(b"XX\x01\x00\x00\x00\x00\x00", 1000)


def test_check_types() -> None:
    msg = wire.unpack(wire.pack("m", n=True, s="x"))
    with pytest.raises(kvx.ProtocolError):
        wire.check(msg, "m", {"n": int})
    with pytest.raises(kvx.ProtocolError):
        wire.check(msg, "m", {"missing": int})
    with pytest.raises(kvx.ProtocolError):
        wire.check(msg, "other", {})
    wire.check(msg, "m", {"s": str})


def test_no_pickle_anywhere() -> None:
    import pathlib

    root = pathlib.Path(kvx.__file__).parent
    for p in root.rglob("*.py"):
        text = p.read_text()
        assert "import pickle" not in text and "cPickle" not in text, p


def test_desclist_roundtrip() -> None:
    d = kvx.DescList.from_arrays(kind=kvx.MemoryKind.CUDA, addr=np.arange(5) * 64 + 4096, nbytes=64, dev=1)
    e = kvx.DescList.from_bytes(d.to_bytes())
    assert e == d and e.kind is kvx.MemoryKind.CUDA
    bad = msgpack.packb({"v": 1, "t": "descs", "kind": 0, "n": 2, "addr": b"\0" * 8, "nbytes": b"", "dev": b""})
    with pytest.raises(kvx.ProtocolError):
        kvx.DescList.from_bytes(bad)
    zero = msgpack.packb({"v": 1, "t": "descs", "kind": 0, "n": 1, "addr": b"\1" * 8, "nbytes": b"\0" * 8,
                          "dev": b"\0" * 8})
    with pytest.raises(kvx.ProtocolError):
        kvx.DescList.from_bytes(zero)
    with pytest.raises(kvx.ProtocolError):
        kvx.DescList.from_bytes(msgpack.packb({"v": 1, "t": "descs", "kind": 9, "n": 0, "addr": b"",
                                               "nbytes": b"", "dev": b""}))
