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


def _agent(hosts: netns.TwoHosts, etcd: Etcd, name: str, ns: str, addr: str, procs: list[Any]) -> netns.NsAgent:
    a = netns.NsAgent(name, f"{addr}:0", etcd.endpoint, prefix=hosts.prefix(ns),
                      config={"peer_timeout": PEER_TIMEOUT})
    procs.append(a)
    return a


def _connected_pair(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any]
                    ) -> tuple[netns.NsAgent, dict[str, Any], netns.NsAgent, dict[str, Any]]:
    """A target in namespace A (256 MiB registered with seed 0, published) and an initiator in B
    (seed 3) connected to it: (target, its registration, initiator, its registration)."""
    tgt = _agent(hosts, etcd, "target", hosts.a, netns.ADDR_A, procs)
    tid = tgt.call(cmd="register", nbytes=TOTAL, seed=0)
    tgt.call(cmd="publish")
    ini = _agent(hosts, etcd, "initiator", hosts.b, netns.ADDR_B, procs)
    iid = ini.call(cmd="register", nbytes=TOTAL, seed=3)
    ini.call(cmd="connect", peer="target")
    return tgt, tid, ini, iid


def _expected(seed: int, n: int) -> str:
    src = np.random.default_rng(seed).integers(0, 256, n * BS, dtype=np.uint8)
    exp = np.empty_like(src)
    exp.reshape(n, BS)[np.random.default_rng(1).permutation(n)] = src.reshape(n, BS)
    return hashlib.blake2b(memoryview(exp), digest_size=16).hexdigest()


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
        other = _agent(hosts, etcd, "other", hosts.a, netns.ADDR_A, procs)
        oid = other.call(cmd="register", nbytes=16 * BS, seed=5)
        assert other.call(cmd="connect", peer="target")["peer"] == "target"
        other.call(cmd="start", op="read", id=oid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=2)
        res = other.call(cmd="result", timeout=60)
        assert res["status"] == "DONE", res
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
        ini2 = _agent(hosts, etcd, "initiator2", hosts.b, netns.ADDR_B, procs)
        i2 = ini2.call(cmd="register", nbytes=TOTAL, seed=4)
        ini2.call(cmd="connect", peer="target")
        ini2.call(cmd="start", op="write", id=i2["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1)
        res = ini2.call(cmd="result", timeout=120)
        assert res["status"] == "DONE", res
        assert tgt.call(cmd="digest", id=tid["id"])["digest"] == _expected(4, TOTAL // BS)
    finally:
        for p in procs:
            p.close()


def test_killed_target_mid_read_fails_within_bound(hosts: netns.TwoHosts, etcd: Etcd) -> None:
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _connected_pair(hosts, etcd, procs)
        ini.call(cmd="start", op="read", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        tgt.kill()
        t_kill = time.monotonic()
        res = ini.call(cmd="result", timeout=60)
        assert res["status"] == "FAILED" and "PeerDisconnected" in res["err"], res
        assert res["t_end"] - t_kill < PEER_TIMEOUT + 2.0
    finally:
        for p in procs:
            p.close()
