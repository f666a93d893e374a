"""Arguments are checked at the public boundary (issue 26, item 4).

Every public constructor and method checks the types and ranges of its arguments once, before
it allocates, registers or sends anything, and raises a ``kvx.UsageError`` naming the argument:
``ArgumentTypeError`` (also a ``TypeError``) for a wrong type, ``ArgumentValueError`` (also a
``ValueError``) for a value out of range, ``IndexOutOfRange`` (also an ``IndexError``) for a
``DescList`` index past its end. Python's internals (``OverflowError``, ``AttributeError``,
numpy's broadcast errors, ``os.fspath``'s ``TypeError``) never escape.

The first tests pin the calls of the issue, one each. The hypothesis tests call the public API's
constructors and methods with wrong types and out-of-range values and accept only kvx errors,
and call them with valid values, which must still work. No value drawn here reaches another
process or resolver: hosts are fixed, ports invalid or closed, timeouts short.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvx
from kvx import DescList, MemoryKind
from kvx.backends.base import ThreadRequest
from kvx.memory import _ALLOCS
from kvx.tiers import DiskTier, HostTier, ObjectTier

SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

BB = 4096


class World:
    """Live objects the calls act on: an agent with host memory and a file, a tcp pair, a transfer."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.agent = kvx.Agent("args", kvx.AgentConfig(backends=("host", "posix"), handshake_timeout=1.0))
        self.mem = np.zeros(8 * BB, np.uint8)
        self.reg = self.agent.register(self.mem)
        self.local = self.agent.prepare(DescList.blocks(self.reg, BB))
        self.freg = self.agent.register(kvx.FileRegion(tmp / "slab.bin", 8 * BB))
        self.file = self.agent.prepare(DescList.blocks(self.freg, BB))
        self.done = self.agent.write(self.local, [0], self.local, [1]).wait(5)
        # a transfer in flight until its request is finished (backends complete theirs this way)
        self.pending = kvx.Transfer(ThreadRequest(BB), BB, "test", 600.0)
        # a tcp pair in this process: index checks of a route with a peer
        cfg = kvx.AgentConfig(backends=("tcp",), handshake_timeout=2.0, peer_timeout=2.0)
        self.t1, self.t2 = kvx.Agent("args-t1", cfg), kvx.Agent("args-t2", cfg)
        self.tmem = [np.zeros(4 * BB, np.uint8), np.zeros(4 * BB, np.uint8)]
        r1, r2 = self.t1.register(self.tmem[0]), self.t2.register(self.tmem[1])
        self.t1.add_peer(self.t2.metadata())
        self.tlocal = self.t1.prepare(DescList.blocks(r1, BB))
        self.tremote = self.t1.prepare(DescList.from_bytes(DescList.blocks(r2, BB).to_bytes()), peer="args-t2")
        self.files = 0

    def path(self) -> Path:
        self.files += 1
        return self.tmp / f"f{self.files}"

    def close(self) -> None:
        for a in (self.agent, self.t1, self.t2):
            a.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("args"))
    yield w
    w.close()


def _kvx_error_only(call: Callable[[], Any], label: str) -> Any:
    try:
        return call()
    except kvx.KVXError:
        return None
    except Exception as exc:  # the property: nothing but the kvx tree escapes
        raise AssertionError(f"{label} raised {type(exc).__name__}: {exc}") from exc


# ---- the calls of the issue, one regression test each ----------------------------------------


def test_alloc_host_past_64_bits() -> None:
    before = dict(_ALLOCS)
    with pytest.raises(kvx.ArgumentValueError, match="alloc_host nbytes") as ei:
        kvx.alloc_host(2**70)
    assert isinstance(ei.value, kvx.UsageError) and isinstance(ei.value, ValueError)
    assert set(_ALLOCS) <= set(before)  # nothing was allocated
    with pytest.raises(kvx.ArgumentTypeError, match="alloc_host nbytes"):
        kvx.alloc_host(4096.0)  # type: ignore[arg-type]
    with pytest.raises(kvx.ArgumentTypeError, match="alloc_host pinned"):
        kvx.alloc_host(4096, pinned="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("path", [None, 123])
def test_file_region_path_of_wrong_type(path: Any) -> None:
    with pytest.raises(kvx.ArgumentTypeError, match="FileRegion path must be a str or os.PathLike") as ei:
        kvx.FileRegion(path, 10)
    assert isinstance(ei.value, TypeError) and isinstance(ei.value, kvx.UsageError)


def test_register_file_region_past_64_bits(world: World) -> None:
    path = world.path()
    table = list(world.agent.table())
    with pytest.raises(kvx.ArgumentValueError, match="FileRegion nbytes"):
        world.agent.register(kvx.FileRegion(path, 2**70))
    assert not path.exists() and world.agent.table() == table  # nothing created, nothing registered
    # the largest size the check lets through reaches the backend, which refuses it as kvx does
    with pytest.raises(kvx.RegistrationError):
        world.agent.register(kvx.FileRegion(path, 2**62))
    assert world.agent.table() == table


@pytest.mark.parametrize("args", [("x", 10), (None, None)])
def test_raw_region_of_wrong_types(args: tuple[Any, Any]) -> None:
    with pytest.raises(kvx.ArgumentTypeError, match="RawRegion addr must be an int"):
        kvx.RawRegion(*args)


def test_from_arrays_lengths_differ() -> None:
    with pytest.raises(kvx.ArgumentValueError, match="nbytes must be one int or hold one per address"):
        DescList.from_arrays(kind=MemoryKind.HOST, addr=[1, 2], nbytes=[1, 2, 3])
    with pytest.raises(kvx.ArgumentValueError, match="dev must be one int or hold one per address"):
        DescList.from_arrays(kind=MemoryKind.HOST, addr=[1, 2], nbytes=1, dev=[])


def test_blocks_of_none() -> None:
    with pytest.raises(kvx.ArgumentTypeError, match="Registration or DescList"):
        DescList.blocks(None, 4096)  # type: ignore[arg-type]


def test_notifications_timeout_of_wrong_type(world: World) -> None:
    with pytest.raises(kvx.ArgumentTypeError, match="notifications timeout"):
        world.agent.notifications(timeout="x")  # type: ignore[arg-type]
    for bad in (-1, math.nan, math.inf, 2**70):
        with pytest.raises(kvx.ArgumentValueError, match="notifications timeout"):
            world.agent.notifications(timeout=bad)


def test_agent_config_listen_without_port() -> None:
    threads = threading.active_count()
    with pytest.raises(kvx.ArgumentTypeError, match=r"listen must be a \(host, port\) tuple"):
        kvx.AgentConfig(listen="127.0.0.1")  # type: ignore[arg-type]
    with pytest.raises(kvx.ArgumentValueError, match="listen port"):
        kvx.AgentConfig(listen=("127.0.0.1", 70000))
    with pytest.raises(kvx.ArgumentTypeError, match="config must be a kvx.AgentConfig"):
        kvx.Agent("x", "127.0.0.1")  # type: ignore[arg-type]
    assert threading.active_count() == threads  # no backend was started
    assert kvx.AgentConfig(listen=["127.0.0.1", 0]).listen == ("127.0.0.1", 0)  # type: ignore[arg-type]


def test_desclist_index_past_its_end() -> None:
    d = DescList.from_arrays(kind=MemoryKind.HOST, addr=[16, 32], nbytes=16)
    for bad in (2, -3, 2**64):
        with pytest.raises(kvx.IndexOutOfRange):
            d[bad]
    with pytest.raises(kvx.ArgumentValueError, match="one-dimensional"):
        d[np.zeros((1, 1), np.int64)]
    with pytest.raises(kvx.ArgumentValueError, match="step"):
        d[::0]
    assert d[-1].addr.tolist() == [32] and d[np.int64(0)].addr.tolist() == [16] and len(d[[]]) == 0


def test_wait_timeout_is_checked_before_waiting(world: World) -> None:
    for bad in ("x", [1], True):
        with pytest.raises(kvx.ArgumentTypeError, match="wait timeout"):
            world.pending.wait(bad)  # type: ignore[arg-type]
    for bad in (math.nan, -1, 2**70):
        with pytest.raises(kvx.ArgumentValueError, match="wait timeout"):
            world.pending.wait(bad)
    with pytest.raises(kvx.TransferTimeout):
        world.pending.wait(0.001)
    # a finished transfer returns at once, timeout unread (Future.result does the same)
    assert world.done.wait("x") is world.done  # type: ignore[arg-type]


def test_post_index_past_64_bits(world: World) -> None:
    for lidx, ridx in ((2**64, 0), ([0], [2**70]), (2**63, [1])):
        with pytest.raises(kvx.UsageError):
            world.agent.write(world.local, lidx, world.local, ridx)
        with pytest.raises(kvx.UsageError):
            world.t1.write(world.tlocal, lidx, world.tremote, ridx)


# ---- hypothesis: wrong types and out-of-range values ------------------------------------------

_ints = st.one_of(
    st.integers(-(2**70), 0),
    st.integers(1, 4096),  # valid sizes stay small: a drawn valid call allocates at most this
    st.integers(2**62 + 1, 2**70),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70]),
)
#: any value a caller might pass by mistake (ints: negative, zero, small or past 2**62)
BAD = st.one_of(
    st.none(),
    st.booleans(),
    _ints,
    _ints.map(lambda i: np.int64(max(-(2**63), min(i, 2**63 - 1)))),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, np.float32("nan"), -0.0, 1.5]),
    st.text(max_size=6).map(lambda s: s + " x"),  # never a resolvable host name
    st.binary(max_size=8),
    st.lists(_ints, max_size=4),
    st.tuples(_ints, _ints, _ints),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), _ints, max_size=2),
    st.sampled_from([object(), (), [], b"", "", "\0", np.array([[1, 2]]), np.array([1.5]), np.array(["a"]),
                     np.array([-1]), np.array([2**64 - 1], np.uint64), np.zeros(0), slice(None, None, 0),
                     slice("a", 2), MemoryKind.FILE, 1j]),
)
#: timeouts: anything above, but a valid one is short (a drawn valid wait must not hang the test)
BAD_SECONDS = BAD.filter(lambda v: not (isinstance(v, (int, float, np.integer, np.floating))
                                        and not isinstance(v, bool) and 0.01 < float(v) <= 1e7))
#: ports: nothing that a listener of this machine could have
BAD_PORTS = BAD.filter(lambda v: not (isinstance(v, (int, np.integer)) and not isinstance(v, bool)
                                      and 0 < int(v) < 65536))


def _calls(w: World) -> list[tuple[str, Callable[[Any], Any], Any]]:
    """(label, call taking the drawn value, strategy) for every argument of the public API."""
    loc, fil = w.local, w.file
    A = w.agent
    return [
        ("alloc_host(nbytes)", lambda v: kvx.alloc_host(v), BAD),
        ("alloc_host(pinned)", lambda v: kvx.alloc_host(16, pinned=v), BAD),
        ("FileRegion(path)", lambda v: kvx.FileRegion(v, 16), BAD),
        ("FileRegion(nbytes)", lambda v: kvx.FileRegion(w.path(), v), BAD),
        ("register(FileRegion)", lambda v: A.register(kvx.FileRegion(w.path(), v)).release(), BAD),
        ("ObjectRegion(bucket)", lambda v: kvx.ObjectRegion(v, "k", 16), BAD),
        ("ObjectRegion(key)", lambda v: kvx.ObjectRegion("b", v, 16), BAD),
        ("ObjectRegion(nbytes)", lambda v: kvx.ObjectRegion("b", "k", v), BAD),
        ("RawRegion(addr)", lambda v: kvx.RawRegion(v, 16), BAD),
        ("RawRegion(nbytes)", lambda v: kvx.RawRegion(4096, v), BAD),
        ("RawRegion(kind)", lambda v: kvx.RawRegion(4096, 16, v), BAD),
        ("RawRegion(dev)", lambda v: kvx.RawRegion(4096, 16, MemoryKind.CUDA, v), BAD),
        ("register(RawRegion)", lambda v: A.register(kvx.RawRegion(v, 16)).release(), BAD),
        ("DescList(kind)", lambda v: DescList(v, np.array([16]), np.array([16]), np.array([0])), BAD),
        ("DescList(addr)", lambda v: DescList(MemoryKind.HOST, v, np.array([16]), np.array([0])), BAD),
        ("DescList(nbytes)", lambda v: DescList(MemoryKind.HOST, np.array([16]), v, np.array([0])), BAD),
        ("DescList(dev)", lambda v: DescList(MemoryKind.HOST, np.array([16]), np.array([16]), v), BAD),
        ("from_arrays(kind)", lambda v: DescList.from_arrays(kind=v, addr=[16], nbytes=16), BAD),
        ("from_arrays(addr)", lambda v: DescList.from_arrays(kind=MemoryKind.HOST, addr=v, nbytes=16), BAD),
        ("from_arrays(nbytes)", lambda v: DescList.from_arrays(kind=MemoryKind.HOST, addr=[16, 32], nbytes=v), BAD),
        ("from_arrays(dev)", lambda v: DescList.from_arrays(kind=MemoryKind.HOST, addr=[16, 32], nbytes=1, dev=v),
         BAD),
        ("blocks(reg)", lambda v: DescList.blocks(v, BB), BAD),
        ("blocks(block_bytes)", lambda v: DescList.blocks(w.reg, v), BAD),
        ("DescList[idx]", lambda v: loc.descs[v], BAD),
        ("from_bytes(data)", lambda v: DescList.from_bytes(v), BAD),
        ("from_bytes(max_bytes)", lambda v: DescList.from_bytes(loc.descs.to_bytes(), max_bytes=v), BAD),
        ("Agent(name)", lambda v: kvx.Agent(v, kvx.AgentConfig(backends=("posix",))).close(), BAD),
        ("Agent(config)", lambda v: kvx.Agent("x", v).close(), BAD.filter(lambda v: v is not None)),
        ("register(obj)", lambda v: A.register(v).release(), BAD),
        ("Registration()", lambda v: kvx.Registration(v, [1], v, None), BAD),
        ("PreparedList()", lambda v: kvx.PreparedList(v, None, v, np.zeros(1, np.int64), {}, None), BAD),
        ("parse_metadata(meta)", lambda v: kvx.Agent.parse_metadata(v), BAD),
        ("add_peer(meta)", lambda v: A.add_peer(v), BAD),
        ("remove_peer(name)", lambda v: A.remove_peer(v), BAD),
        ("prepare(descs)", lambda v: A.prepare(v), BAD),
        ("prepare(peer)", lambda v: A.prepare(w.reg, peer=v), BAD),
        ("read(local)", lambda v: A.read(v, [0], loc, [1]), BAD),
        ("read(local_idx)", lambda v: A.read(loc, v, loc, [1]), BAD),
        ("write(remote_idx)", lambda v: A.write(loc, [0], loc, v), BAD),
        ("write(remote)", lambda v: A.write(loc, [0], v, [1]), BAD),
        ("write(file idx)", lambda v: A.write(loc, v, fil, v), BAD),
        ("read(file idx)", lambda v: A.read(loc, [2], fil, v), BAD),
        ("write(notify)", lambda v: A.write(loc, [0], loc, [1], notify=v), BAD),
        ("write(backend)", lambda v: A.write(loc, [0], loc, [1], backend=v), BAD),
        ("tcp write(local_idx)", lambda v: w.t1.write(w.tlocal, v, w.tremote, [0]).wait(5), BAD),
        ("tcp read(remote_idx)", lambda v: w.t1.read(w.tlocal, [0], w.tremote, v).wait(5), BAD),
        ("make_transfer(op)", lambda v: A.make_transfer(v, loc, [0], loc, [1]), BAD),
        ("make_transfer(idx)", lambda v: A.make_transfer("write", loc, v, loc, v), BAD),
        ("notify(peer)", lambda v: A.notify(v, b"m"), BAD),
        ("notify(message)", lambda v: w.t1.notify("args-t2", v), BAD),
        ("notifications(timeout)", lambda v: A.notifications(timeout=v), BAD_SECONDS),
        ("fetch_peer(host)", lambda v: A.fetch_peer(v, 0, timeout=0.5), BAD),
        ("fetch_peer(port)", lambda v: A.fetch_peer("127.0.0.1", v, timeout=0.5), BAD_PORTS),
        ("fetch_peer(timeout)", lambda v: A.fetch_peer("127.0.0.1", 0, timeout=v), BAD),
        ("backend(name)", lambda v: A.backend(v), BAD),
        ("Transfer.wait(timeout)", lambda v: w.pending.wait(v), BAD_SECONDS.filter(lambda v: v is not None)),
        ("AgentConfig(backends)", lambda v: kvx.AgentConfig(backends=v), BAD),
        ("AgentConfig(transfer_timeout)", lambda v: kvx.AgentConfig(transfer_timeout=v), BAD),
        ("AgentConfig(peer_timeout)", lambda v: kvx.AgentConfig(peer_timeout=v), BAD),
        ("AgentConfig(handshake_timeout)", lambda v: kvx.AgentConfig(handshake_timeout=v), BAD),
        ("AgentConfig(host_path)", lambda v: kvx.AgentConfig(host_path=v), BAD),
        ("AgentConfig(copy_threads)", lambda v: kvx.AgentConfig(copy_threads=v), BAD),
        ("AgentConfig(inline_bytes)", lambda v: kvx.AgentConfig(inline_bytes=v), BAD),
        ("AgentConfig(auth_token)", lambda v: kvx.AgentConfig(auth_token=v), BAD),
        ("AgentConfig(listen)", lambda v: kvx.AgentConfig(listen=v), BAD),
        ("AgentConfig(listen host)", lambda v: kvx.AgentConfig(listen=(v, 0)), BAD),
        ("AgentConfig(listen port)", lambda v: kvx.AgentConfig(listen=("127.0.0.1", v)), BAD),
        ("AgentConfig(options)", lambda v: kvx.AgentConfig(options=v), BAD),
        ("HostTier(nbytes)", lambda v: HostTier(nbytes=v), BAD),
        ("HostTier(blocks)", lambda v: HostTier(blocks=v), BAD),
        ("DiskTier(path)", lambda v: DiskTier(v, blocks=4), BAD),
        ("DiskTier(blocks)", lambda v: DiskTier(w.tmp, blocks=v), BAD),
        ("DiskTier(fsync)", lambda v: DiskTier(w.tmp, blocks=4, fsync=v), BAD),
        ("ObjectTier(bucket)", lambda v: ObjectTier(v, blocks=4), BAD),
        ("ObjectTier(prefix)", lambda v: ObjectTier("b", blocks=4, prefix=v), BAD),
        ("ObjectTier(pack_blocks)", lambda v: ObjectTier("b", blocks=4, pack_blocks=v), BAD),
        ("ObjectTier(journal)", lambda v: ObjectTier("b", blocks=4, journal=v), BAD),
    ]


@SETTINGS
@given(data=st.data())
def test_wrong_arguments_raise_only_kvx_errors(world: World, data: st.DataObject) -> None:
    calls = _calls(world)
    label, call, strategy = data.draw(st.sampled_from(calls), label="call")
    value = data.draw(strategy, label="value")
    _kvx_error_only(lambda: call(value), f"{label} with {value!r:.80}")


def test_every_argument_with_every_kind_of_wrong_value(world: World) -> None:
    """Not left to chance: each call with each fixed wrong value (None, str, bytes, float, nan,
    negative, 2**64, 2**70, lists, bool, object)."""
    fixed = [None, "x", b"x", 1.5, math.nan, math.inf, -1, 0, 2**63, 2**64, 2**70, [1, 2, 3], [], (), True,
             object(), np.array([[0]]), {"a": 1}]
    for label, call, _ in _calls(world):
        for v in fixed:
            waits = v is None or (isinstance(v, float) and v == 1.5)  # valid: 1.5 s, or the transfer's deadline
            if waits and label.startswith(("notifications", "Transfer.wait")):
                continue
            _kvx_error_only(lambda: call(v), f"{label} with {v!r:.80}")


# ---- valid calls still work ---------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 1 << 16), ni=st.integers(1, 1 << 16).map(np.int64), pinned=st.just(False))
def test_valid_sizes_allocate(n: int, ni: Any, pinned: bool) -> None:
    assert kvx.alloc_host(n, pinned=pinned).nbytes == n
    assert kvx.alloc_host(ni, pinned=np.bool_(pinned)).nbytes == int(ni)


@SETTINGS
@given(n=st.integers(1, 2**62), addr=st.integers(1, 2**62), dev=st.integers(0, 2**31 - 1),
       kind=st.sampled_from([MemoryKind.HOST, MemoryKind.CUDA, 0, 1]), name=st.text(min_size=1, max_size=20))
def test_valid_regions_construct(n: int, addr: int, dev: int, kind: Any, name: str) -> None:
    fr = kvx.FileRegion(Path("/tmp") / "kvx-args-never-created", n)
    assert fr.nbytes == n and fr.path == "/tmp/kvx-args-never-created"
    assert kvx.ObjectRegion("bucket", "a/" + name.replace("\0", "") + "k", n).nbytes == n
    rr = kvx.RawRegion(addr, n, kind, dev)
    assert (rr.addr, rr.nbytes, rr.dev) == (addr, n, dev) and rr.kind is MemoryKind(kind)


@SETTINGS
@given(addr=st.lists(st.integers(0, 2**63), min_size=1, max_size=16), nb=st.integers(1, 2**62),
       dev=st.integers(0, 2**64 - 1), per=st.booleans())
def test_valid_desclists_build_and_index(addr: list[int], nb: int, dev: int, per: bool) -> None:
    n = len(addr)
    nbytes: Any = [nb] * n if per else nb
    d = DescList.from_arrays(kind=MemoryKind.FILE, addr=addr, nbytes=nbytes, dev=np.uint64(dev))
    assert d.addr.tolist() == addr and d.nbytes.tolist() == [nb] * n and d.dev.tolist() == [dev] * n
    ref = np.arange(n)
    for idx in (0, n - 1, -n, -1, slice(None, None, -1), slice(1, None, 2), ref[::-1].tolist(), ref.astype(np.uint32)):
        assert d[idx].addr.tolist() == np.asarray(addr, np.uint64)[np.atleast_1d(ref[idx])].tolist()
    assert DescList.from_bytes(d.to_bytes()) == d


@SETTINGS
@given(timeout=st.one_of(st.floats(0, 0.002), st.integers(0, 0), st.just(np.float32(0.001))),
       wait=st.one_of(st.floats(0, 1e7), st.integers(0, 10**7), st.none()))
def test_valid_timeouts_wait(world: World, timeout: Any, wait: Any) -> None:
    assert world.agent.notifications(timeout=timeout) == {}
    assert world.done.wait(wait) is world.done


@SETTINGS
@given(port=st.integers(0, 65535), t=st.floats(1e-6, 1e7), threads=st.integers(1, 1024),
       inline=st.integers(0, 2**62), token=st.one_of(st.none(), st.text(max_size=8)),
       backends=st.sampled_from(["", "host,tcp", ("posix",), ["host"], ()]))
def test_valid_configs_construct(port: int, t: float, threads: int, inline: int, token: Any, backends: Any) -> None:
    c = kvx.AgentConfig(listen=("127.0.0.1", port), transfer_timeout=t, peer_timeout=t, handshake_timeout=t,
                        copy_threads=threads, inline_bytes=inline, auth_token=token, backends=backends)
    assert c.listen == ("127.0.0.1", port) and c.transfer_timeout == t and c.copy_threads == threads
    assert isinstance(c.backends, tuple) and c.inline_bytes == inline


def test_valid_posts_and_tiers(world: World) -> None:
    """The checks let every documented form of a valid call through."""
    A, loc = world.agent, world.local
    world.mem[:BB] = 9
    for idx in ([0], 0, np.array([0]), np.array([0], np.int32), (0,), np.int64(0)):
        A.write(loc, idx, loc, [3]).wait(5)
        assert (world.mem[3 * BB:4 * BB] == 9).all()
        world.mem[3 * BB:4 * BB] = 0
    A.write(loc, [0], world.file, [5], notify=None, backend="posix").wait(5)
    A.read(loc, [4], world.file, [5]).wait(5)
    assert (world.mem[4 * BB:5 * BB] == 9).all()
    A.make_transfer("read", loc, [1], loc, [2]).post().wait(5)
    world.t1.write(world.tlocal, [0], world.tremote, [1], notify=b"n").wait(5)
    world.t1.notify("args-t2", bytearray(b"m"))
    got = world.t2.notifications(timeout=5.0)
    assert set(got) == {"args-t1"}
    assert A.backend("host").name == "host" and A.prepare(world.reg, peer=None).peer is None
    HostTier(nbytes=np.int64(1 << 20))
    DiskTier(world.tmp / "tier", blocks=4, fsync=True)
    ObjectTier("bucket", nbytes=1 << 20, prefix="", pack_blocks=np.int64(2), journal=world.tmp / "journal")
