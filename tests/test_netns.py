"""Multi-host cases on one machine: agents in two network namespaces joined by a veth pair,
metadata through etcd (listening inside namespace a), link cuts and killed peers."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Iterator

import numpy as np
import pytest

from kvx.testing import netns
from kvx.testing.etcd import Etcd, etcd_binary

pytestmark = [pytest.mark.netns, pytest.mark.services]

BS = 1 << 20
TOTAL = 256 << 20
PEER_TIMEOUT = 3.0


@pytest.fixture
def hosts() -> Iterator[netns.TwoHosts]:
    why = netns.unavailable()
    if why:
        pytest.skip(why)
    if etcd_binary() is None:
        pytest.skip("etcd binary not found: apt-get install etcd-server")
    h = netns.TwoHosts()
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def etcd(hosts: netns.TwoHosts) -> Iterator[Etcd]:
    e = Etcd(host=netns.ADDR_A, prefix=hosts.prefix(hosts.a))
    try:
        yield e
    finally:
        e.stop()


def _agent(hosts: netns.TwoHosts, etcd: Etcd, name: str, ns: str, addr: str, procs: list[Any],
           backends: tuple[str, ...] = ()) -> netns.NsAgent:
    """An agent process in namespace ``ns`` (``backends``: the agent's, default its own choice)."""
    config: dict[str, Any] = {"peer_timeout": PEER_TIMEOUT}
    if backends:
        config["backends"] = list(backends)
    a = netns.NsAgent(name, f"{addr}:0", etcd.endpoint, prefix=hosts.prefix(ns), config=config)
    procs.append(a)
    return a


def _connected_pair(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any], backends: tuple[str, ...] = ()
                    ) -> tuple[netns.NsAgent, dict[str, Any], netns.NsAgent, dict[str, Any]]:
    """A target in namespace A (256 MiB registered with seed 0, published) and an initiator in B
    (seed 3) connected to it: (target, its registration, initiator, its registration)."""
    tgt = _agent(hosts, etcd, "target", hosts.a, netns.ADDR_A, procs, backends)
    tid = tgt.call(cmd="register", nbytes=TOTAL, seed=0)
    tgt.call(cmd="publish")
    ini = _agent(hosts, etcd, "initiator", hosts.b, netns.ADDR_B, procs, backends)
    iid = ini.call(cmd="register", nbytes=TOTAL, seed=3)
    assert ini.call(cmd="connect", peer="target")["peer"] == "target"
    return tgt, tid, ini, iid


def _expected(seed: int, n: int) -> str:
    src = np.random.default_rng(seed).integers(0, 256, n * BS, dtype=np.uint8)
    exp = np.empty_like(src)
    exp.reshape(n, BS)[np.random.default_rng(1).permutation(n)] = src.reshape(n, BS)
    return hashlib.blake2b(memoryview(exp), digest_size=16).hexdigest()


def _other_reads(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any], tid: dict[str, Any],
                 backends: tuple[str, ...] = ()) -> netns.NsAgent:
    """A new agent in the target's namespace reads from the target (it still serves); returns it."""
    other = _agent(hosts, etcd, "other", hosts.a, netns.ADDR_A, procs, backends)
    oid = other.call(cmd="register", nbytes=16 * BS, seed=5)
    assert other.call(cmd="connect", peer="target")["peer"] == "target"
    other.call(cmd="start", op="read", id=oid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=2)
    res = other.call(cmd="result", timeout=60)
    assert res["status"] == "DONE", res
    return other


def _second_initiator(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any], tid: dict[str, Any], op: str,
                      nbytes: int, backends: tuple[str, ...] = ()) -> tuple[netns.NsAgent, dict[str, Any]]:
    """A new initiator in B (``nbytes`` registered, seed 4) completes one ``op`` with the target:
    (it, its registration)."""
    ini2 = _agent(hosts, etcd, "initiator2", hosts.b, netns.ADDR_B, procs, backends)
    i2 = ini2.call(cmd="register", nbytes=nbytes, seed=4)
    ini2.call(cmd="connect", peer="target")
    ini2.call(cmd="start", op=op, id=i2["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1)
    res = ini2.call(cmd="result", timeout=120)
    assert res["status"] == "DONE", res
    return ini2, i2


def _kill_target_mid_read(tgt: netns.NsAgent, tid: dict[str, Any], ini: netns.NsAgent, reg_id: int) -> None:
    """Kill the target in the middle of a stream of reads: the reader fails within the bound."""
    ini.call(cmd="start", op="read", id=reg_id, peer="target", descs=tid["descs"], bs=BS, repeat=1000)
    time.sleep(0.5)
    tgt.kill()
    t_kill = time.monotonic()
    res = ini.call(cmd="result", timeout=60)
    assert res["status"] == "FAILED" and "PeerDisconnected" in res["err"], res
    assert res["t_end"] - t_kill < PEER_TIMEOUT + 2.0, res


def test_cross_host_transfer_link_cut_and_survivor(hosts: netns.TwoHosts, etcd: Etcd) -> None:
    procs: list[netns.NsAgent] = []
    try:
        tgt = _agent(hosts, etcd, "target", hosts.a, netns.ADDR_A, procs)
        ini = _agent(hosts, etcd, "initiator", hosts.b, netns.ADDR_B, procs)
        tid = tgt.call(cmd="register", nbytes=TOTAL, seed=0)
        tgt.call(cmd="publish")
        iid = ini.call(cmd="register", nbytes=TOTAL, seed=11)
        ini.call(cmd="publish")
        assert ini.call(cmd="connect", peer="target")["peer"] == "target"
        # one full 256 MiB write of permuted 1 MiB blocks across the veth link
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1)
        res = ini.call(cmd="result", timeout=120)
        assert res["status"] == "DONE", res
        assert tgt.call(cmd="digest", id=tid["id"])["digest"] == _expected(11, TOTAL // BS)
        # now a stream of large writes, and the link goes down in the middle
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        hosts.cut()
        t_cut = time.monotonic()
        res = ini.call(cmd="result", timeout=60)
        assert res["status"] == "FAILED", res
        assert "PeerDisconnected" in res["err"] or "TransferTimeout" in res["err"]
        assert res["t_end"] - t_cut < PEER_TIMEOUT + 2.0, res
        # the survivor keeps serving others on its side of the cut
        other = _other_reads(hosts, etcd, procs, tid)
        # the cut-off initiator's etcd lease runs out (it cannot reach etcd any more)
        assert other.call(cmd="removed", peer="initiator", within=10, timeout=20)["removed"] is True
    finally:
        for p in procs:
            p.close()


def test_killed_initiator_mid_transfer_target_survives(hosts: netns.TwoHosts, etcd: Etcd) -> None:
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _connected_pair(hosts, etcd, procs)
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        ini.kill()
        # the target serves a new peer from the other namespace right away
        _second_initiator(hosts, etcd, procs, tid, "write", TOTAL)
        assert tgt.call(cmd="digest", id=tid["id"])["digest"] == _expected(4, TOTAL // BS)
    finally:
        for p in procs:
            p.close()


def test_killed_target_mid_read_fails_within_bound(hosts: netns.TwoHosts, etcd: Etcd) -> None:
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _connected_pair(hosts, etcd, procs)
        _kill_target_mid_read(tgt, tid, ini, iid["id"])
    finally:
        for p in procs:
            p.close()


# ---- the staging path (TcpOptions.stage_host: host memory through the GPU pipeline's slots) ----
STAGED_ENV = {"KVX_TCP_STAGE_HOST": "1", "KVX_TCP_STAGE_BYTES": str(256 << 10), "KVX_TCP_STAGE_SLOTS": "2"}
STAGED_TOTAL = 64 << 20


def _settled(agent: netns.NsAgent, want: dict[str, int], within: float) -> dict[str, int]:
    """The agent's census once threads, fds and staging slots are back to ``want`` (or the last
    census when ``within`` seconds pass first)."""
    deadline = time.monotonic() + within
    while True:
        c = agent.call(cmd="census")
        if all(c[k] <= want[k] for k in want) or time.monotonic() > deadline:
            return c
        time.sleep(0.2)


def _staged_pair(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any], monkeypatch: pytest.MonkeyPatch, op: str
                 ) -> tuple[netns.NsAgent, dict[str, Any], dict[str, int], netns.NsAgent]:
    """A target in A and an initiator in B, both staging host memory, the initiator running a
    stream of ``op`` transfers through the target's slots: (target, its registration, its census
    before the initiator came, initiator)."""
    for k, v in STAGED_ENV.items():  # the agents' processes inherit it
        monkeypatch.setenv(k, v)
    tgt = _agent(hosts, etcd, "target", hosts.a, netns.ADDR_A, procs)
    tid = tgt.call(cmd="register", nbytes=STAGED_TOTAL, seed=0)
    tgt.call(cmd="publish")
    base = tgt.call(cmd="census")
    assert base["slots"] == 0
    ini = _agent(hosts, etcd, "initiator", hosts.b, netns.ADDR_B, procs)
    iid = ini.call(cmd="register", nbytes=STAGED_TOTAL, seed=11)
    ini.call(cmd="connect", peer="target")
    ini.call(cmd="start", op=op, id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
    time.sleep(0.5)
    assert tgt.call(cmd="census")["slots"] > 0  # the staging path is the one in use
    return tgt, tid, base, ini


def test_staged_link_cut_mid_write_fails_within_bound_and_nothing_leaks(
        hosts: netns.TwoHosts, etcd: Etcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides stage (slots, copier thread, pipelined frames); the link goes down in the middle
    of a stream of writes: the write fails within the peer timeout, the target's serving thread
    gives up its connection, slots and pins (census back to before the peer came), and it serves
    an agent on its side of the cut."""
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, base, ini = _staged_pair(hosts, etcd, procs, monkeypatch, "write")
        hosts.cut()
        t_cut = time.monotonic()
        res = ini.call(cmd="result", timeout=60)
        assert res["status"] == "FAILED", res
        assert res["done"] >= 1, res  # whole transfers went through staging before the cut
        assert "PeerDisconnected" in res["err"] or "TransferTimeout" in res["err"], res
        assert res["t_end"] - t_cut < PEER_TIMEOUT + 2.0, res
        assert _settled(ini, {"slots": 0}, 5.0)["slots"] == 0, ini.call(cmd="census")
        # the target notices the dead connection within its own peer timeout and frees everything
        after = _settled(tgt, base, PEER_TIMEOUT + 5.0)
        assert after["slots"] == 0 and after["threads"] <= base["threads"] and after["fds"] <= base["fds"], \
            (base, after)
        _other_reads(hosts, etcd, procs, tid)
    finally:
        for p in procs:
            p.close()


def test_staged_killed_peers_mid_read(hosts: netns.TwoHosts, etcd: Etcd, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged reads (the target gathers into slots, the initiator scatters from them): an initiator
    killed mid-read leaves the target with nothing of it (census) and serving a new peer with the
    right bytes; a target killed mid-read fails the reader within the bound, and the reader's
    staging slots are freed."""
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, base, ini = _staged_pair(hosts, etcd, procs, monkeypatch, "read")
        ini.kill()
        after = _settled(tgt, base, PEER_TIMEOUT + 5.0)
        assert after["slots"] == 0 and after["threads"] <= base["threads"] and after["fds"] <= base["fds"], \
            (base, after)
        # a new reader from the other namespace gets the target's bytes (permuted) through staging
        ini2, i2 = _second_initiator(hosts, etcd, procs, tid, "read", STAGED_TOTAL)
        n = STAGED_TOTAL // BS
        src = np.random.default_rng(0).integers(0, 256, n * BS, dtype=np.uint8)
        exp = src.reshape(n, BS)[np.random.default_rng(1).permutation(n)].reshape(-1)
        assert ini2.call(cmd="digest", id=i2["id"])["digest"] == hashlib.blake2b(
            memoryview(exp), digest_size=16).hexdigest()
        # now the target dies in the middle of a stream of staged reads
        _kill_target_mid_read(tgt, tid, ini2, i2["id"])
        assert _settled(ini2, {"slots": 0}, 5.0)["slots"] == 0
    finally:
        for p in procs:
            p.close()
