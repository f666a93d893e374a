"""Agent API: registration, selection, loopback transfers, errors, config."""

from __future__ import annotations

import numpy as np
import pytest

import kvx
from kvx import config


@pytest.fixture
def agent() -> kvx.Agent:
    a = kvx.Agent("a", kvx.AgentConfig(backends=("host",)))
    yield a
    a.close()


def test_public_names_match_design() -> None:
    for name in ["Agent", "AgentConfig", "Registration", "DescList", "MemoryKind", "Transfer", "Status",
                 "alloc_host", "FileRegion", "ObjectRegion", "KVXError", "UsageError", "RegistrationError",
                 "BackendUnavailable", "ProtocolError", "AuthError", "TransferError", "TransferTimeout",
                 "PeerDisconnected", "RemoteError", "TierError", "BlockNotFound", "TierFull"]:
        assert name in kvx.__all__ and hasattr(kvx, name)
    assert issubclass(kvx.UsageError, RuntimeError) and issubclass(kvx.BlockNotFound, KeyError)
    for sub in (kvx.TransferTimeout, kvx.PeerDisconnected, kvx.RemoteError):
        assert issubclass(sub, kvx.TransferError)
    assert {m.name for m in kvx.MemoryKind} == {"HOST", "CUDA", "FILE", "OBJECT"}
    assert {s.name for s in kvx.Status} == {"PENDING", "DONE", "FAILED", "CANCELLED"}


def test_loopback_copy(agent: kvx.Agent) -> None:
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    a, b = agent.register(src), agent.register(dst)
    la = agent.prepare(kvx.DescList.blocks(a, 256))
    lb = agent.prepare(kvx.DescList.blocks(b, 256))
    perm = np.random.default_rng(0).permutation(256)
    agent.write(la, np.arange(256), lb, perm, notify=b"self").wait(5)
    assert np.array_equal(dst.reshape(256, 256)[perm], src.reshape(256, 256))
    assert agent.notifications() == {"a": [b"self"]}
    dst[:] = 0
    agent.read(lb, perm, la, np.arange(256)).wait(5)  # read: lb <- la
    assert np.array_equal(dst.reshape(256, 256)[perm], src.reshape(256, 256))


def test_big_loopback_uses_threads(agent: kvx.Agent) -> None:
    src = np.random.default_rng(1).integers(0, 255, 64 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    la = agent.prepare(kvx.DescList.blocks(agent.register(src), 1 << 20))
    lb = agent.prepare(kvx.DescList.blocks(agent.register(dst), 1 << 20))
    x = agent.write(la, np.arange(64), lb, np.arange(64))
    assert x.wait(30).status is kvx.Status.DONE
    assert np.array_equal(src, dst)


def test_overlap_and_kinds(agent: kvx.Agent) -> None:
    buf = np.zeros(4096, np.uint8)
    agent.register(buf[:2048])
    with pytest.raises(kvx.RegistrationError, match="overlaps"):
        agent.register(buf[1024:3000])
    with pytest.raises(kvx.RegistrationError):
        agent.register([np.zeros(8, np.uint8), kvx.FileRegion("/tmp/kvx-x", 8)])
    r = agent.register(buf[2048:])
    r.release()
    r.release()
    agent.register(buf[2048:])  # the range is free again
    with pytest.raises(kvx.BackendUnavailable):
        kvx.Agent("b", kvx.AgentConfig(backends=("host",))).register(kvx.FileRegion("/tmp/kvx-y", 8))


def test_prepare_refuses_unregistered(agent: kvx.Agent) -> None:
    x = np.zeros(1024, np.uint8)
    d = kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=[x.ctypes.data], nbytes=[64])
    with pytest.raises(kvx.RegistrationError):
        agent.prepare(d)
    with pytest.raises(kvx.UsageError):
        agent.prepare("nope")  # type: ignore[arg-type]
    with pytest.raises(kvx.UsageError):
        agent.prepare(d[0:0])
    with pytest.raises(kvx.UsageError):
        agent.prepare(d, peer="ghost")


def test_regions_are_the_live_registrations(agent: kvx.Agent) -> None:
    """``Agent.regions()``: a snapshot of slot -> (region, generation), generations as prepared
    lists record them; a released registration leaves it, one made again takes a new generation."""
    x = np.zeros(4096, np.uint8)
    reg = agent.register(x)
    plist = agent.prepare(kvx.DescList.blocks(reg, 1024))
    snap = agent.regions()
    assert {s: g for s, (_r, g) in snap.items()} == plist.gens
    (region, _gen), = snap.values()
    assert (region.addr, region.nbytes, region.owner is not None) == (x.ctypes.data, 4096, True)
    reg.release()
    assert agent.regions() == {} and len(snap) == 1  # a snapshot, not a view
    agent.register(x)
    (_again, gen), = agent.regions().values()
    assert gen not in plist.gens.values()


def test_add_self_and_unknown_backend(agent: kvx.Agent) -> None:
    with pytest.raises(kvx.UsageError):
        agent.add_peer(agent.metadata())
    with pytest.raises(kvx.BackendUnavailable):
        kvx.Agent("x", kvx.AgentConfig(backends=("nope",)))
    with pytest.raises(kvx.UsageError):
        kvx.Agent("")


def test_two_agents_one_process_notify_and_refresh() -> None:
    with kvx.Agent("p", kvx.AgentConfig(backends=("host",))) as p, kvx.Agent("q", kvx.AgentConfig(
            backends=("host",))) as q:
        name = p.add_peer(q.metadata())
        assert p.add_peer(q.metadata()) == name  # idempotent
        late = kvx.alloc_host(8192)
        reg = q.register(late)  # registered after p saw q's metadata
        rl = p.prepare(kvx.DescList.blocks(reg, 4096), peer=name)  # refreshed from q's control table
        src = np.full(8192, 7, np.uint8)
        ll = p.prepare(kvx.DescList.blocks(p.register(src), 4096))
        p.write(ll, [0, 1], rl, [1, 0]).wait(5)
        assert (late == 7).all()
        p.notify(name, b"n1")
        assert q.notifications(timeout=5) == {"p": [b"n1"]}
        p.remove_peer(name)
        with pytest.raises(kvx.PeerDisconnected):
            p.write(ll, [0], rl, [0])


def test_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_PEER_TIMEOUT", "2.5")
    monkeypatch.setenv("KVX_BACKENDS", "host, tcp")
    monkeypatch.setenv("KVX_POSIX_DIRECT", "yes")
    c = kvx.AgentConfig()
    assert c.peer_timeout == 2.5 and c.backends == ("host", "tcp")
    assert config.get("KVX_POSIX_DIRECT") is True
    monkeypatch.setenv("KVX_PEER_TIMEOUT", "soon")
    with pytest.raises(kvx.UsageError):
        kvx.AgentConfig()
    with pytest.raises(kvx.UsageError):
        kvx.AgentConfig(host_path="teleport")
    with pytest.raises(kvx.UsageError):
        kvx.AgentConfig(transfer_timeout=0)
    with pytest.raises(kvx.UsageError):
        config.get("KVX_NOPE")


def test_every_setting_is_documented() -> None:
    import pathlib

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "settings.md").read_text()
    for name in config.SETTINGS:
        assert f"`{name}`" in doc, f"{name} missing from docs/settings.md"
    import re

    for name in re.findall(r"`(KVX_[A-Z0-9_]+)`", doc):
        assert name in config.SETTINGS, f"docs/settings.md documents unknown {name}"


def test_fetch_peer_over_side_channel() -> None:
    cfg = kvx.AgentConfig(backends=("host", "tcp"), listen=("127.0.0.1", 0), auth_token="s3cret")
    with kvx.Agent("served", cfg) as served, kvx.Agent("client", kvx.AgentConfig(
            backends=("host", "tcp"), auth_token="s3cret")) as client:
        host, port = served.side_channel.address
        assert client.fetch_peer(host, port) == "served"
        with kvx.Agent("intruder", kvx.AgentConfig(backends=("host", "tcp"), auth_token="wrong")) as bad:
            with pytest.raises(kvx.AuthError):
                bad.fetch_peer(host, port)


def test_torch_cpu_tensors_register_and_move() -> None:
    torch = pytest.importorskip("torch")
    with kvx.Agent("t", kvx.AgentConfig(backends=("host",))) as a:
        src = torch.arange(4096, dtype=torch.float32)
        dst = torch.zeros(4096, dtype=torch.float32)
        ls = a.prepare(kvx.DescList.blocks(a.register(src), 1024))
        ld = a.prepare(kvx.DescList.blocks(a.register(dst), 1024))
        a.write(ls, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], ld,
                [15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0]).wait(5)
        assert torch.equal(dst.view(16, 256).flip(0), src.view(16, 256))
        with pytest.raises(kvx.RegistrationError):
            a.register(torch.zeros(4, 4).t())  # not contiguous


def test_registry_third_party_backend() -> None:
    from kvx.backends import Backend, Op, register_backend, registry
    from kvx.backends.base import DoneRequest, Route

    class NullRoute(Route):
        def post(self, lidx, ridx, notify):  # type: ignore[no-untyped-def]
            type(self.backend).posts += 1
            assert self.op in (Op.READ, Op.WRITE)
            return DoneRequest(0)

    class Null(Backend):
        """Pretends to move host memory locally; counts posts."""

        name = "null"
        kinds = frozenset({kvx.MemoryKind.HOST})
        local = True
        posts = 0

        def route(self, op, local, remote):  # type: ignore[no-untyped-def]
            return NullRoute(self, op, local, remote)

    register_backend("null", Null)
    assert "null" in registry.names()
    with kvx.Agent("r", kvx.AgentConfig(backends=("null", "host"))) as a:
        b = np.zeros(64, np.uint8)
        pl = a.prepare(kvx.DescList.blocks(a.register(b), 32))
        x = a.write(pl, [0], pl, [1])
        assert x.backend == "null" and Null.posts == 1  # first in preference order
        assert a.write(pl, [0], pl, [1], backend="host").backend == "host"
        with pytest.raises(kvx.BackendUnavailable):
            a.write(pl, [0], pl, [1], backend="tcp")
        # a pair's route for a named backend is made once and kept apart from the default one
        forced = pl.froutes[(Op.WRITE, pl, "host")]
        assert a.write(pl, [0], pl, [1], backend="host").backend == "host"
        assert pl.froutes == {(Op.WRITE, pl, "host"): forced}
        assert type(pl.wroutes[pl]) is NullRoute
        assert a.write(pl, [0], pl, [1]).backend == "null" and Null.posts == 2


def test_fast_path_keeps_every_check() -> None:
    with kvx.Agent("p", kvx.AgentConfig(backends=("host",))) as p, kvx.Agent("q", kvx.AgentConfig(
            backends=("host",))) as q:
        name = p.add_peer(q.metadata())
        dst = kvx.alloc_host(8192)
        reg = q.register(dst)
        src = np.arange(8192, dtype=np.uint8)
        ll = p.prepare(kvx.DescList.blocks(p.register(src), 4096))
        rl = p.prepare(kvx.DescList.blocks(reg, 4096), peer=name)
        p.write(ll, [0], rl, [1]).wait(5)  # the route is now cached
        assert (dst[4096:] == src[:4096]).all()
        for bad in (np.array([1.0]), np.array([True]), [0.5], [2]):
            with pytest.raises(kvx.UsageError):
                p.write(ll, [0], rl, bad)
        p.write(ll, np.array([1], np.int32), rl, np.array([0], np.uint64)).wait(5)
        assert (dst[:4096] == src[4096:]).all()
        dst[:] = 0  # every other index form the user may pass, through the cached route
        strided = (np.array([5, 0, 5, 1])[1::2], np.array([1, 9, 0])[::2])
        for li, ri in (((0,), (1,)), (np.int64(1), np.int32(0)), strided):
            p.write(ll, li, rl, ri).wait(5)
        assert (dst[:4096] == src[4096:]).all() and (dst[4096:] == src[:4096]).all()
        with pytest.raises(kvx.UsageError):
            p.write(ll, np.array([0, 1])[::2], rl, np.array([7]))  # a converted form still gets its range check
        reg.release()  # the target releases: the cached route must not reach it any more
        with pytest.raises(kvx.TransferError):
            p.write(ll, [0], rl, [0]).wait(5)
        p.remove_peer(name)
        with pytest.raises(kvx.PeerDisconnected):
            p.write(ll, [0], rl, [0])


def test_only_config_reads_kvx_variables() -> None:
    import pathlib
    import re

    root = pathlib.Path(kvx.__file__).parent
    pat = re.compile(r"""(environ(\.get)?\s*[\[(]\s*|getenv\(\s*)["']KVX_""")
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "config.py" and pat.search(p.read_text())]
    assert offenders == [], f"read KVX_* through kvx.config.get, not os.environ: {offenders}"


def test_a_backend_failing_to_start_closes_those_started_before_it() -> None:
    """A bad listen address makes the tcp backend refuse to start, after the host backend started
    its listener thread and socket: the agent's constructor closes that one before it raises."""
    import os
    import threading
    import time

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    kvx.Agent("warm", kvx.AgentConfig(backends=("host",))).close()  # native pools, imports
    t0, f0 = threading.active_count(), fds()
    for _ in range(5):
        with pytest.raises(kvx.UsageError):
            kvx.Agent("x", kvx.AgentConfig(backends=("host", "tcp"), listen=("256.0.0.1", 0)))
    deadline = time.monotonic() + 5
    while (threading.active_count() > t0 or fds() > f0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= t0 and fds() <= f0


def test_prepare_keeps_the_table_it_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CI run's concurrent add_peer test failed once with KeyError: prepare refreshed the peer's
    regions from its control table (the metadata predated the registration), then read the
    generations from pinfo.regions again, which another thread's add_peer of the same older
    metadata had just replaced with no rows. Here that add_peer lands exactly in between."""
    with kvx.Agent("t", kvx.AgentConfig(backends=("host",))) as t, \
            kvx.Agent("i", kvx.AgentConfig(backends=("host",))) as i:
        meta = t.metadata()  # before the registration: no region rows
        reg = t.register(kvx.alloc_host(1 << 16))
        name = i.add_peer(meta)
        import kvx.agent as kagent

        real = kagent.validate
        calls = []

        def racing(*args: object) -> object:
            out = real(*args)  # type: ignore[arg-type]
            calls.append(1)
            if len(calls) == 2:  # checked against the refreshed rows: now the other thread's add_peer
                i.add_peer(meta)
            return out

        monkeypatch.setattr(kagent, "validate", racing)
        remote = i.prepare(kvx.DescList.blocks(reg, 4096), peer=name)
        local = i.prepare(kvx.DescList.blocks(i.register(np.full(1 << 16, 3, np.uint8)), 4096))
        i.write(local, [0], remote, [5]).wait(10)
