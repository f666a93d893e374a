"""The ucx backend (UCX 1.22 from the libucx wheel): the conformance suite between two processes
on host memory, over UCX's tcp transport and over its shared-memory transports, plus the parts
only ucx has (the control-channel handshake and its token, release revoking remote keys)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest

import kvx
from kvx.backends import registry
from kvx.backends.base import Op
from kvx.testing.conformance import TransferConformance, digest, pattern
from kvx.testing.procs import PeerProcess

_reason = registry.get("ucx").unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"ucx backend unavailable: {_reason}")

TCP = {"UCX_TLS": "tcp,self"}
SHM = {"UCX_TLS": "sm,self"}
TOKEN = "ucx-s3cret"


class _UcxConformance(TransferConformance):
    backend = "ucx"
    mem = "numpy"
    env: ClassVar[dict[str, str]] = {}
    # a bound, not a speed check: the control handshake runs through UCX's progress thread, which a
    # loaded 2-core machine can starve for seconds
    config: ClassVar[dict[str, Any]] = {"handshake_timeout": 20.0}

    @pytest.fixture(autouse=True)
    def _ucx_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for k, v in self.env.items():  # the initiator (this process) uses the peer's transports
            monkeypatch.setenv(k, v)


class TestUcxTcp(_UcxConformance):
    env = TCP


class TestUcxShm(_UcxConformance):
    """Same-node host memory goes through kvx's same-node engine (KVX_UCX_SAMENODE=host):
    shared mappings of alloc_host memory here, batched process_vm_* below."""

    env = SHM
    mem = "alloc"


class TestUcxShmCma(_UcxConformance):
    env = SHM


class TestUcxShmByUcx(_UcxConformance):
    """UCX's own shared-memory transports (one kernel copy per block over cma)."""

    env = {**SHM, "KVX_UCX_SAMENODE": "ucx"}


class TestUcxTcpToken(_UcxConformance):
    """The same suite with authentication on (sealed control messages)."""

    env = TCP
    config: ClassVar[dict[str, Any]] = {**_UcxConformance.config, "auth_token": TOKEN}


# ---- GPU memory (make gpu-check; UCX's cuda_copy moves device memory, tcp carries it) ----------
CUDA_TCP = {"UCX_TLS": "tcp,cuda_copy,self", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


@pytest.mark.gpu
class TestUcxCudaAcrossGpus(_UcxConformance):
    env = CUDA_TCP
    mem, local_mem = "vram:1", "vram:0"


@pytest.mark.gpu
class TestUcxCudaToPinnedHost(_UcxConformance):
    env = CUDA_TCP
    mem, local_mem = "pinned", "vram:0"


@pytest.mark.gpu
class TestUcxHostToCuda(_UcxConformance):
    env = CUDA_TCP
    mem, local_mem = "vram:1", "numpy"


# ---- two agents in one process ---------------------------------------------------------------
@pytest.fixture
def tcp_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in TCP.items():
        monkeypatch.setenv(k, v)


def _agent(name: str, **kw: Any) -> kvx.Agent:
    kw.setdefault("peer_timeout", 3.0)
    return kvx.Agent(name, kvx.AgentConfig(backends=("ucx",), **kw))


@pytest.fixture
def shm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in SHM.items():
        monkeypatch.setenv(k, v)


def _connected(a: kvx.Agent, b: kvx.Agent, n: int, bs: int, meta: bytes | None = None
               ) -> tuple[Any, Any, np.ndarray, np.ndarray, Any]:
    src, dst = pattern(n * bs, 7), np.zeros(n * bs, np.uint8)
    ra, rb = a.register(src), b.register(dst)
    peer = a.add_peer(meta if meta is not None else b.metadata())
    loc = a.prepare(kvx.DescList.blocks(ra, bs))
    rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
    return loc, rem, src, dst, rb


@pytest.mark.parametrize("alloc", [False, True])
def test_same_node_host_memory_takes_kvx_engine(shm_env: None, alloc: bool, monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """With shared memory allowed and the peer on this host, host memory moves through the
    same-node engine (its prepared lists and route), byte-exact both ways; KVX_UCX_SAMENODE=ucx
    leaves it to UCX."""
    from kvx.backends.ucx import _SameNodeHost, _SameNodeRoute, _UcxRoute

    n, bs = 64, 32 << 10
    for samenode, route in (("host", _SameNodeRoute), ("ucx", _UcxRoute)):
        monkeypatch.setenv("KVX_UCX_SAMENODE", samenode)
        with _agent("a") as a, _agent("b") as b:
            src, dst = pattern(n * bs, 7), (kvx.alloc_host(n * bs) if alloc else np.zeros(n * bs, np.uint8))
            dst[:] = 0
            ra, rb = a.register(src), b.register(dst)
            peer = a.add_peer(b.metadata())
            loc = a.prepare(kvx.DescList.blocks(ra, bs))
            rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
            assert (_SameNodeHost.name in rem.bdata) == (samenode == "host")
            perm = np.random.default_rng(3).permutation(n)
            x = a.write(loc, np.arange(n), rem, perm, notify=b"in").wait(10)
            assert x.backend == "ucx" and x.nbytes == n * bs
            assert type(loc.routes(Op.WRITE)[rem]) is route
            exp = np.zeros((n, bs), np.uint8)
            exp[perm] = src.reshape(n, bs)
            assert np.array_equal(np.asarray(dst).reshape(n, bs), exp)
            assert b.notifications(timeout=5) == {"a": [b"in"]}
            back = np.zeros_like(src)
            lb = a.prepare(kvx.DescList.blocks(a.register(back), bs))
            a.read(lb, perm, rem, np.arange(n)).wait(10)
            assert np.array_equal(back.reshape(n, bs)[perm], np.asarray(dst).reshape(n, bs))


def test_same_node_release_fails_later_posts(shm_env: None) -> None:
    """Through the same-node engine too: once the target's release returns, a post to that
    region fails and the memory keeps its bytes."""
    with _agent("a") as a, _agent("b") as b:
        loc, rem, _src, dst, rb = _connected(a, b, 16, 4096)
        a.write(loc, [0], rem, [0]).wait(10)
        before = digest(dst)
        rb.release()
        with pytest.raises((kvx.RemoteError, kvx.TransferError)):
            a.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
        assert digest(dst) == before


def test_same_node_pid_is_the_listeners(shm_env: None) -> None:
    """The pid that one-sided copies go to is the one the kernel names for the peer's listener:
    metadata naming another pid is refused (ProtocolError, no peer added)."""
    from kvx import wire

    with _agent("target") as t, _agent("a") as a:
        info = wire.unpack(t.metadata())
        info["backends"]["ucx"]["host"] = dict(info["backends"]["ucx"]["host"], pid=os.getppid())
        fields = {k: v for k, v in info.items() if k not in ("v", "t")}
        with pytest.raises(kvx.ProtocolError):
            a.add_peer(wire.pack("meta", **fields))
        assert a.peers() == []


def test_same_node_listener_out_of_reach_falls_back_to_ucx(shm_env: None) -> None:
    """A same-host peer whose listener cannot be reached (another network namespace has its own
    abstract sockets): UCX carries its host memory, byte-exact."""
    from kvx import wire
    from kvx.backends.ucx import _SameNodeHost, _UcxRoute

    with _agent("target") as t, _agent("a") as a:
        dst = np.zeros(16 * 4096, np.uint8)
        rb = t.register(dst)
        info = wire.unpack(t.metadata())
        info["backends"]["ucx"]["host"] = dict(info["backends"]["ucx"]["host"], uds="kvx-nobody-listens-here")
        fields = {k: v for k, v in info.items() if k not in ("v", "t")}
        peer = a.add_peer(wire.pack("meta", **fields))
        src = pattern(16 * 4096, 9)
        loc = a.prepare(kvx.DescList.blocks(a.register(src), 4096))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, 4096), peer=peer)
        assert _SameNodeHost.name not in rem.bdata
        a.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
        assert type(loc.routes(Op.WRITE)[rem]) is _UcxRoute
        assert digest(dst) == digest(src)


def test_ucx_defaults_yield_to_environment_and_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvx's UCX defaults (RNDV_THRESH=inf, as NIXL sets it; two RMA rails for puts of 512 KiB
    and more) apply only where neither the environment nor UcxOptions.ucx names the setting."""
    from kvx.backends.ucx import UcxOptions

    names = ("RNDV_THRESH", "MAX_RMA_RAILS", "MIN_RMA_CHUNK_SIZE")
    for n in names:
        monkeypatch.delenv(f"UCX_{n}", raising=False)
    ours = [("RNDV_THRESH", "inf"), ("MAX_RMA_RAILS", "2"), ("MIN_RMA_CHUNK_SIZE", "256K")]
    assert UcxOptions().worker_settings() == ours
    assert UcxOptions(ucx=(("TLS", "tcp"),)).worker_settings() == [*ours, ("TLS", "tcp")]
    assert UcxOptions(ucx=(("rndv_thresh", "8k"),)).worker_settings() == [*ours[1:], ("rndv_thresh", "8k")]
    for n in names:
        monkeypatch.setenv(f"UCX_{n}", "1")
    assert UcxOptions().worker_settings() == []


def test_two_agents_in_one_process(tcp_env: None) -> None:
    with _agent("a") as a, _agent("b") as b:
        n, bs = 128, 4096
        src = pattern(n * bs, 1)
        dst = np.zeros(n * bs, np.uint8)
        ra, rb = a.register(src), b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(ra, bs))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
        perm = np.random.default_rng(2).permutation(n)
        x = a.write(loc, np.arange(n), rem, perm, notify=b"landed").wait(10)
        assert x.backend == "ucx" and x.nbytes == n * bs
        exp = np.zeros_like(dst).reshape(n, bs)
        exp[perm] = src.reshape(n, bs)
        assert np.array_equal(dst, exp.reshape(-1))
        assert b.notifications(timeout=5) == {"a": [b"landed"]}
        back = np.zeros_like(src)
        rback = a.register(back)
        lb = a.prepare(kvx.DescList.blocks(rback, bs))
        a.read(lb, perm, rem, np.arange(n)).wait(10)
        assert np.array_equal(back.reshape(n, bs)[perm], dst.reshape(n, bs))


def test_registration_after_add_peer_is_reachable(tcp_env: None) -> None:
    """A region the target registers after the initiator read its metadata: prepare refreshes
    the region table and remote keys over the control channel."""
    with _agent("a") as a, _agent("b") as b:
        peer = a.add_peer(b.metadata())
        dst = np.zeros(1 << 16, np.uint8)
        rb = b.register(dst)
        src = pattern(1 << 16, 3)
        loc = a.prepare(kvx.DescList.blocks(a.register(src), 4096))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, 4096), peer=peer)
        a.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
        assert digest(dst) == digest(src)


def test_release_revokes_and_later_writes_fail(tcp_env: None) -> None:
    """After the target's release returns, the initiator's remote key for it is gone: a post
    fails at once with RemoteError and the released memory keeps its bytes."""
    with _agent("a") as a, _agent("b") as b:
        dst = np.zeros(1 << 16, np.uint8)
        rb = b.register(dst)
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(a.register(pattern(1 << 16, 4)), 4096))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, 4096), peer=peer)
        a.write(loc, [0], rem, [0]).wait(10)
        before = digest(dst)
        rb.release()
        with pytest.raises(kvx.RemoteError):
            a.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
        assert digest(dst) == before
        assert a.backend("ucx")._peers[peer].rkeys == {}  # destroyed after the revoke


def test_local_release_stops_a_used_route(tcp_env: None) -> None:
    """A list pair that already moved data (its route's check passed) stops at its next post once
    its local registration is released: UsageError, nothing moved (batched and one-sided)."""
    for bs in (4096, 256 << 10):
        with _agent("a") as a, _agent("b") as b:
            dst = np.zeros(4 * bs, np.uint8)
            rb = b.register(dst)
            peer = a.add_peer(b.metadata())
            ra = a.register(pattern(4 * bs, 5))
            loc = a.prepare(kvx.DescList.blocks(ra, bs))
            rem = a.prepare(kvx.DescList.blocks(rb.descs, bs), peer=peer)
            a.write(loc, [0], rem, [0]).wait(10)
            before = digest(dst)
            ra.release()
            with pytest.raises(kvx.UsageError):
                a.write(loc, [1, 2], rem, [1, 2]).wait(10)
            assert digest(dst) == before


def test_wrong_token_is_refused(tcp_env: None) -> None:
    with _agent("target", auth_token=TOKEN) as t:
        dst = np.zeros(4096, np.uint8)
        t.register(dst)
        for tok in ("wrong", None):
            with _agent("intruder", auth_token=tok) as a:
                with pytest.raises(kvx.AuthError):
                    a.add_peer(t.metadata())
                assert a.peers() == []
        with _agent("good", auth_token=TOKEN) as g:
            g.add_peer(t.metadata())
            g.notify("target", b"hi")
            assert t.notifications(timeout=5) == {"good": [b"hi"]}


def test_forged_and_replayed_control_messages_are_dropped(tcp_env: None) -> None:
    """With a token, a sealed message with a wrong MAC or a replayed sequence number is dropped."""
    from kvx import wire
    from kvx.backends.ucx import _Session

    with _agent("target", auth_token=TOKEN) as t, _agent("a", auth_token=TOKEN) as a:
        a.add_peer(t.metadata())
        ub = a.backend("ucx")
        p = ub._peers["target"]
        good = p.session.seal(ub.me, "i", wire.pack("notif", msg=b"one"))
        ub.w.am_send(p.ep, good)
        assert t.notifications(timeout=5) == {"a": [b"one"]}
        ub.w.am_send(p.ep, good)  # replay
        forged = _Session(b"k" * 32).seal(ub.me, "i", wire.pack("notif", msg=b"forged"))
        ub.w.am_send(p.ep, forged)
        garbage = os.urandom(64)
        ub.w.am_send(p.ep, garbage)
        assert t.notifications(timeout=1.0) == {}
        a.notify("target", b"two")  # the channel still works
        assert t.notifications(timeout=5) == {"a": [b"two"]}


def test_malformed_ucx_section_is_a_protocol_error(tcp_env: None) -> None:
    from kvx import wire

    with _agent("target") as t, _agent("a") as a:
        info = wire.unpack(t.metadata())
        for bad in ({"addr": "text", "rkeys": []}, {"addr": b"x" * 4, "rkeys": []},
                    {"addr": info["backends"]["ucx"]["addr"], "rkeys": [[0, 1, b"k"]]},
                    {"addr": info["backends"]["ucx"]["addr"], "rkeys": [[1, 1, "k"]]}, []):
            meta = dict(info)
            meta["backends"] = {"ucx": bad}
            fields = {k: v for k, v in meta.items() if k not in ("v", "t")}
            with pytest.raises(kvx.ProtocolError):
                a.add_peer(wire.pack("meta", **fields))
        assert a.peers() == []


@pytest.mark.parametrize("env", [TCP, SHM], ids=["tcp", "shm"])
def test_malformed_host_entry_is_a_protocol_error(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The same-node engine's entry of a peer's ucx section: not a dict, or a dict out of shape,
    is a ProtocolError at add_peer, whether or not this agent would use it (tcp: no engine here,
    shm: one); a well-formed entry connects."""
    from kvx import wire

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with _agent("target") as t, _agent("a") as a:
        info = wire.unpack(t.metadata())
        sec = info["backends"]["ucx"]
        assert ("host" in sec) == (env is SHM)
        host = sec.get("host", {"uds": "kvx-none", "pid": 1, "uid": 0, "ctrl": 4096})

        def meta(entry: Any) -> bytes:
            fields = {k: v for k, v in info.items() if k not in ("v", "t")}
            fields["backends"] = {"ucx": {**sec, "host": entry}}
            return wire.pack("meta", **fields)

        for bad in ("host", 7, None, [host], {**host, "pid": "1"}, {**host, "pid": 0},
                    {k: v for k, v in host.items() if k != "ctrl"}):
            with pytest.raises(kvx.ProtocolError, match="host section"):
                a.add_peer(meta(bad))
        assert a.peers() == []
        assert a.add_peer(meta(host)) == "target"


def test_ucx_options_through_agent_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """UcxOptions pass through AgentConfig(options=...) as every backend's options do: its UCX
    settings make the worker (tcp, where the environment allows shared memory only), its batch
    mode picks the route; the timeouts stay the agent's."""
    from kvx.backends.tcp import TcpOptions
    from kvx.backends.ucx import UcxOptions, _UcxRoute

    monkeypatch.setenv("UCX_TLS", "sm,self")
    opts = UcxOptions(ucx=(("TLS", "tcp,self"),), batch="never")
    with _agent("a", options={"ucx": opts}, handshake_timeout=7.0) as a, \
            _agent("b", options={"ucx": opts}) as b:
        be: Any = a.backend("ucx")
        assert be.opts is opts
        assert (be.peer_timeout, be.handshake_timeout) == (3.0, 7.0)
        loc, rem, src, dst, _rb = _connected(a, b, 16, 4096)
        transports = {t for t, _dev in be.w.ep_transports(be._peers["b"].ep)}
        assert "tcp" in transports and not transports & {"posix", "sysv", "cma"}, transports
        a.write(loc, np.arange(16), rem, np.arange(16)[::-1].copy()).wait(10)
        route = loc.routes(Op.WRITE)[rem]
        assert type(route) is _UcxRoute and not route._am  # batch="never": one put per block
        assert np.array_equal(dst.reshape(16, -1)[::-1], src.reshape(16, -1))
    with pytest.raises(kvx.UsageError, match="must be a UcxOptions"):
        _agent("c", options={"ucx": TcpOptions()})


def _round_trip() -> None:
    with _agent("a") as a, _agent("b") as b:
        rb = b.register(np.zeros(4096, np.uint8))
        peer = a.add_peer(b.metadata())
        loc = a.prepare(kvx.DescList.blocks(a.register(pattern(4096, 1)), 4096))
        rem = a.prepare(kvx.DescList.blocks(rb.descs, 4096), peer=peer)
        a.write(loc, [0], rem, [0]).wait(10)


@pytest.mark.parametrize("env", [TCP, SHM], ids=["tcp", "shm"])
def test_close_leaves_no_threads_or_fds(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents with ucx, connected and used, then closed: no thread and no file descriptor stays
    (after one warm-up round, which lets UCX open what it keeps for the process); with shared
    memory allowed, the same-node engine's listener, links and control tables go too."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _round_trip()
    time.sleep(0.2)
    threads = {t.ident for t in threading.enumerate()}
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        _round_trip()
    time.sleep(0.2)
    assert [t.name for t in threading.enumerate() if t.ident not in threads] == []
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_killed_initiator_leaves_the_target_serving() -> None:
    """A peer process that reached us is killed mid-stream; we keep serving another peer."""
    env = dict(TCP)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with _agent("target") as t:
            dst = np.zeros(1 << 20, np.uint8)
            rt = t.register(dst)
            p = PeerProcess("doomed", {"backends": ["ucx"], "peer_timeout": 3.0}, env)
            try:
                name = p.call(cmd="add_peer", meta=__import__("base64").b64encode(t.metadata()).decode())
                assert name
            finally:
                p.kill()
                p.close()
            with _agent("other") as o:
                peer = o.add_peer(t.metadata())
                loc = o.prepare(kvx.DescList.blocks(o.register(pattern(1 << 20, 9)), 1 << 16))
                rem = o.prepare(kvx.DescList.blocks(rt.descs, 1 << 16), peer=peer)
                o.write(loc, np.arange(16), rem, np.arange(16)).wait(10)
                assert digest(dst) == digest(pattern(1 << 20, 9))
