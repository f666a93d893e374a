"""The ucx backend across two "hosts": agents in two network namespaces joined by a veth pair,
UCX over its tcp transport (``UCX_TLS=tcp``), metadata through etcd. A link cut or a killed
peer fails the transfer within the bound and the survivor keeps serving others (the same cases
as tests/test_netns.py runs for the tcp backend)."""

from __future__ import annotations

import time
from typing import Any, Iterator

import pytest
from test_netns import BS, PEER_TIMEOUT, TOTAL, _expected, etcd, hosts  # noqa: F401 (fixtures)

from kvx.backends import registry
from kvx.testing import netns
from kvx.testing.etcd import Etcd

_reason = registry.get("ucx").unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.services,
              pytest.mark.skipif(_reason is not None, reason=f"ucx backend unavailable: {_reason}")]


@pytest.fixture(autouse=True)
def _ucx_tcp(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # the agents (child processes) inherit it
    yield


def _agent(hosts: netns.TwoHosts, etcd: Etcd, name: str, ns: str, addr: str,  # noqa: F811
           procs: list[Any]) -> netns.NsAgent:
    a = netns.NsAgent(name, f"{addr}:0", etcd.endpoint, prefix=hosts.prefix(ns),
                      config={"peer_timeout": PEER_TIMEOUT, "backends": ["ucx"]})
    procs.append(a)
    return a


def _pair(hosts: netns.TwoHosts, etcd: Etcd, procs: list[Any]) -> tuple[Any, Any, Any, Any]:  # noqa: F811
    tgt = _agent(hosts, etcd, "target", hosts.a, netns.ADDR_A, procs)
    tid = tgt.call(cmd="register", nbytes=TOTAL, seed=0)
    tgt.call(cmd="publish")
    ini = _agent(hosts, etcd, "initiator", hosts.b, netns.ADDR_B, procs)
    iid = ini.call(cmd="register", nbytes=TOTAL, seed=3)
    assert ini.call(cmd="connect", peer="target")["peer"] == "target"
    return tgt, tid, ini, iid


def test_ucx_cross_host_link_cut_and_survivor(hosts: netns.TwoHosts, etcd: Etcd) -> None:  # noqa: F811
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _pair(hosts, etcd, procs)
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1)
        res = ini.call(cmd="result", timeout=120)
        assert res["status"] == "DONE", res
        assert tgt.call(cmd="digest", id=tid["id"])["digest"] == _expected(3, TOTAL // BS)
        # a stream of large writes; the link goes down in the middle (no RST: only the bounds notice)
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        hosts.cut()
        t_cut = time.monotonic()
        res = ini.call(cmd="result", timeout=60)
        assert res["status"] == "FAILED", res
        assert "PeerDisconnected" in res["err"] or "TransferTimeout" in res["err"], res
        assert res["t_end"] - t_cut < PEER_TIMEOUT + 2.0, res
        # the target keeps serving another peer on its side of the cut
        other = _agent(hosts, etcd, "other", hosts.a, netns.ADDR_A, procs)
        oid = other.call(cmd="register", nbytes=16 * BS, seed=5)
        assert other.call(cmd="connect", peer="target")["peer"] == "target"
        other.call(cmd="start", op="read", id=oid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=2)
        res = other.call(cmd="result", timeout=60)
        assert res["status"] == "DONE", res
    finally:
        for p in procs:
            p.close()


def test_ucx_killed_initiator_target_survives(hosts: netns.TwoHosts, etcd: Etcd) -> None:  # noqa: F811
    """A killed initiator's puts still in the target's socket: with UCX's software-emulated put
    (UCX_RNDV_THRESH at UCX's default) the target's UCX acknowledged them on the failed endpoint
    and aborted the process (3 of 6 runs); with the backend's RNDV_THRESH=inf puts go through
    the tcp transport's own put and the target survives (docs/networking.md)."""
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _pair(hosts, etcd, procs)
        ini.call(cmd="start", op="write", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        ini.kill()
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


def test_ucx_killed_initiator_mid_read_target_survives(hosts: netns.TwoHosts, etcd: Etcd) -> None:  # noqa: F811
    """The same with reads: over tcp UCX emulates get with active messages the target's UCX
    answers, so the target is still sending replies to the initiator when it dies."""
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _pair(hosts, etcd, procs)
        ini.call(cmd="start", op="read", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        ini.kill()
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


def test_ucx_killed_target_mid_read_fails_within_bound(hosts: netns.TwoHosts, etcd: Etcd) -> None:  # noqa: F811
    procs: list[netns.NsAgent] = []
    try:
        tgt, tid, ini, iid = _pair(hosts, etcd, procs)
        ini.call(cmd="start", op="read", id=iid["id"], peer="target", descs=tid["descs"], bs=BS, repeat=1000)
        time.sleep(0.5)
        tgt.kill()
        t_kill = time.monotonic()
        res = ini.call(cmd="result", timeout=60)
        assert res["status"] == "FAILED" and "PeerDisconnected" in res["err"], res
        assert res["t_end"] - t_kill < PEER_TIMEOUT + 2.0, res
    finally:
        for p in procs:
            p.close()
