"""Property tests (hypothesis) of what crosses a process boundary as data: agent metadata and
descriptor lists, fuzzed by mutating genuine ones. The property: the decoder either accepts the
input or raises an exception of the kvx tree -- never another type, never a crash.

Mutations keep away from what would reach other processes of this machine: ports become numbers
no listener has (outside 1..65535), pids numbers no process has, host names strings no resolver
looks up, so a mutated peer is refused at once or is the genuine target itself.
"""

from __future__ import annotations

from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvx

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    database=None)

_state: dict[str, Any] = {}


def _target() -> kvx.Agent:
    """A live agent with host and tcp sections and a few regions: the genuine metadata's source."""
    if "target" not in _state:
        t = kvx.Agent("fuzz-target", kvx.AgentConfig(backends=("host", "tcp"), handshake_timeout=1.0))
        _state["mem"] = [kvx.alloc_host(1 << 16), np.zeros(1 << 14, np.uint8)]
        for m in _state["mem"]:
            t.register(m)
        _state["target"] = t
    return _state["target"]  # type: ignore[no-any-return]


def _initiator(backends: tuple[str, ...]) -> kvx.Agent:
    key = "ini-" + "-".join(backends)
    if key not in _state:
        _state[key] = kvx.Agent(key, kvx.AgentConfig(backends=backends, handshake_timeout=1.0, peer_timeout=2.0))
    return _state[key]  # type: ignore[no-any-return]


@pytest.fixture(scope="module", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    for k in list(_state):
        v = _state.pop(k)
        if isinstance(v, kvx.Agent):
            v.close()


# ---- value strategies ------------------------------------------------------------------------
#: strings a resolver never looks up (a space or a non-ASCII letter in them), and edge cases
_texts = st.one_of(
    st.text(max_size=12).map(lambda s: s + " x"),
    st.sampled_from(["", " ", "a" * 300, "é" * 40, "a\0b", "..", "::", "-", "x" * 64 + " .y", "kvx-"]),
)
#: integers no port, pid or slot of this machine has, and the edges of every integer width
_ints = st.one_of(
    st.sampled_from([0, -1, 65536, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 63)]),
    st.integers(min_value=1 << 22, max_value=(1 << 64) - 1),
    st.integers(max_value=0, min_value=-(1 << 63)),
)
_leaves = st.one_of(st.none(), st.booleans(), _ints, st.floats(), _texts, st.binary(max_size=40))
_values = st.recursive(
    _leaves,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(_texts, ch, max_size=4),
    max_leaves=12,
)


def _slots(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path (keys and indexes) into a decoded msgpack value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield (*path, k)
            yield from _slots(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield (*path, i)
            yield from _slots(v, (*path, i))


@st.composite
def _mutated(draw: Any, genuine: bytes) -> bytes:
    """Genuine msgpack bytes with one to three mutations: a value replaced or deleted, a key
    added, a container emptied, or raw bytes flipped, cut or inserted."""
    if draw(st.integers(0, 4)) == 0:  # byte level
        b = bytearray(genuine)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            i = draw(st.integers(0, max(0, len(b) - 1)))
            if op == "flip" and b:
                b[i] ^= 1 << draw(st.integers(0, 7))
            elif op == "cut":
                del b[i: i + draw(st.integers(1, 16))]
            else:
                b[i:i] = draw(st.binary(min_size=1, max_size=16))
        return bytes(b)
    m = msgpack.unpackb(genuine, raw=False, strict_map_key=False)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_slots(m))
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = m
        for k in path[:-1]:
            parent = parent[k]
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "empty"]))
        if op == "replace":
            parent[path[-1]] = draw(_values)
        elif op == "delete":
            del parent[path[-1]]
        elif op == "add" and isinstance(parent, dict):
            parent[draw(_texts)] = draw(_values)
        elif op == "add":
            parent.append(draw(_values))
        else:
            v = parent[path[-1]]
            parent[path[-1]] = type(v)() if isinstance(v, (list, dict, str, bytes)) else v
    return msgpack.packb(m, use_bin_type=True)  # type: ignore[no-any-return]


def _add_peer_property(ini: kvx.Agent, meta: bytes) -> None:
    try:
        name = ini.add_peer(meta)
    except kvx.KVXError:
        return
    assert isinstance(name, str)
    ini.remove_peer(name)


# ---- metadata --------------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_mutated_metadata_over_tcp_raises_only_kvx_errors(data: Any) -> None:
    meta = data.draw(_mutated(_target().metadata()))
    _add_peer_property(_initiator(("tcp",)), meta)


@SETTINGS
@given(st.data())
def test_mutated_metadata_over_host_raises_only_kvx_errors(data: Any) -> None:
    meta = data.draw(_mutated(_target().metadata()))
    _add_peer_property(_initiator(("host",)), meta)


def test_host_pid_out_of_range_is_a_protocol_error() -> None:
    """Issue 14.8: a host section's pid of 2**64-1 raised OverflowError (what the host property
    above found now and then); the same-node dialler now checks it against the listener's pid."""
    m = msgpack.unpackb(_target().metadata(), raw=False)
    m["backends"]["host"]["pid"] = (1 << 64) - 1
    with pytest.raises(kvx.ProtocolError):
        _initiator(("host",)).add_peer(msgpack.packb(m, use_bin_type=True))


def test_genuine_metadata_still_connects() -> None:
    """The properties above are not vacuous: unmutated metadata connects on both paths."""
    for backends in (("tcp",), ("host",)):
        ini = _initiator(backends)
        name = ini.add_peer(_target().metadata())
        assert name == "fuzz-target"
        ini.remove_peer(name)


@SETTINGS
@given(st.data())
def test_parse_metadata_raises_only_protocol_errors(data: Any) -> None:
    meta = data.draw(_mutated(_target().metadata()))
    try:
        info = kvx.Agent.parse_metadata(meta)
    except kvx.ProtocolError:
        return
    assert isinstance(info.name, str) and info.name


# ---- descriptor lists ------------------------------------------------------------------------
def _genuine_descs() -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for kind in kvx.MemoryKind:
        n = int(rng.integers(1, 9))
        d = kvx.DescList.from_arrays(kind=kind, addr=rng.integers(1, 1 << 40, n).astype(np.uint64) * 64,
                                     nbytes=rng.integers(1, 1 << 20, n).astype(np.uint64),
                                     dev=rng.integers(0, 4, n).astype(np.uint64))
        out.append(d.to_bytes())
    return out


_DESCS = _genuine_descs()


@SETTINGS
@given(st.sampled_from(_DESCS).flatmap(_mutated))
def test_mutated_desclist_raises_only_protocol_errors(blob: bytes) -> None:
    try:
        d = kvx.DescList.from_bytes(blob)
    except kvx.ProtocolError:
        return
    assert isinstance(d, kvx.DescList)
    n = len(d)
    assert d.addr.shape == d.nbytes.shape == d.dev.shape == (n,)
    assert n == 0 or int(d.nbytes.min()) > 0
    assert kvx.DescList.from_bytes(d.to_bytes()) == d


@SETTINGS
@given(st.sampled_from(_DESCS).flatmap(_mutated))
def test_mutated_remote_desclist_is_refused_by_prepare(blob: bytes) -> None:
    """A mutated list from a peer either parses and is then checked by ``prepare`` against the
    peer's registrations (RegistrationError or accepted), or is a ProtocolError: kvx errors only."""
    ini = _initiator(("tcp",))
    if "fuzz-target" not in ini.peers():
        ini.add_peer(_target().metadata())
    try:
        d = kvx.DescList.from_bytes(blob)
        ini.prepare(d, peer="fuzz-target")
    except kvx.KVXError:
        return
