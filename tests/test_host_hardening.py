"""What a careless or hostile peer found in the host backend's one-sided paths (shm, cma), each
reproduced as it was reported: crashes run in a child interpreter, so a segfault fails the test
instead of ending the run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvx
from kvx import wire
from kvx.errors import PeerDisconnected, ProtocolError, RegistrationError, UsageError

MB = 1 << 20
PATHS = ["shm", "cma", "uds"]


def _run_child(code: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a fresh interpreter; fail on a signal or a non-zero exit; return stdout."""
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"child exited with {p.returncode} (negative: killed by signal)\n{p.stderr[-3000:]}"
    return p.stdout


def _target_mem(path: str, n: int) -> np.ndarray:
    # shm needs kvx.alloc_host memory on the target; cma and uds work on any memory
    return kvx.alloc_host(n) if path == "shm" else np.zeros(n, dtype=np.uint8)


@pytest.mark.parametrize("action", ["remove_peer", "close"])
@pytest.mark.parametrize("path", ["shm", "cma"])
def test_initiator_drops_peer_with_transfer_in_flight(path: str, action: str) -> None:
    """Issue 14.1: removing the peer (or closing the initiator) while its own 32 MiB write is in
    flight used to unmap the peer's control table and data under the running copy (SIGSEGV)."""
    out = _run_child(f"""
        import numpy as np, kvx
        for rep in range(3):
            t = kvx.Agent("t")
            i = kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path={path!r}))
            tm = kvx.alloc_host(32 << 20) if {path!r} == "shm" else np.zeros(32 << 20, dtype=np.uint8)
            treg = t.register(tm)
            src = kvx.alloc_host(32 << 20); src[:] = 7
            ireg = i.register(src)
            p = i.add_peer(t.metadata())
            L = i.prepare(kvx.DescList.blocks(ireg, 1 << 20))
            R = i.prepare(kvx.DescList.blocks(treg, 1 << 20), peer=p)
            x = i.write(L, list(range(32)), R, list(range(32)))
            {"i.remove_peer(p)" if action == "remove_peer" else "i.close()"}
            del L, R  # the user lets go of the lists too: the mappings must outlive the copy anyway
            try:
                x.wait(10.0)
                assert (tm == 7).all(), "a completed write left bytes unwritten"
                print("DONE")
            except kvx.errors.TransferError as exc:
                print("FAILED", type(exc).__name__)
            i.close(); t.close()
    """)
    assert out.split() and all(w in ("DONE", "FAILED", "PeerDisconnected", "TransferError", "RemoteError")
                               for w in out.split()), out


@pytest.mark.parametrize("path", PATHS)
def test_list_of_removed_and_readded_peer_is_refused(path: str) -> None:
    """Issue 14.2: after remove_peer + add_peer of the same metadata, posting with the old list
    segfaulted (shm) or wrote (cma). A list is bound to one incarnation of its peer."""
    with kvx.Agent("t") as t, kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path=path)) as i:
        tm = _target_mem(path, 4 * MB)
        treg = t.register(tm)
        src = np.full(4 * MB, 9, dtype=np.uint8)
        ireg = i.register(src)
        meta = t.metadata()
        p = i.add_peer(meta)
        L = i.prepare(kvx.DescList.blocks(ireg, MB))
        R = i.prepare(kvx.DescList.blocks(treg, MB), peer=p)
        i.write(L, [0], R, [0]).wait(10.0)
        assert (tm[:MB] == 9).all()
        plan = i.make_transfer("write", L, [1], R, [1])
        i.remove_peer(p)
        with pytest.raises(PeerDisconnected):
            i.write(L, [1], R, [1])
        i.add_peer(meta)
        with pytest.raises(UsageError, match="prepare again"):
            i.write(L, [1], R, [1])
        with pytest.raises(UsageError, match="prepare again"):
            i.read(L, [1], R, [1])
        with pytest.raises(UsageError, match="prepare again"):
            plan.post()
        assert not tm[MB:].any(), "a list of the removed incarnation wrote into the target"
        R2 = i.prepare(kvx.DescList.blocks(treg, MB), peer=p)  # prepared again: works
        i.write(L, [1], R2, [1]).wait(10.0)
        assert (tm[MB:2 * MB] == 9).all()


@pytest.mark.parametrize("path", PATHS)
def test_list_of_closed_target_is_refused_for_its_namesake(path: str) -> None:
    """Issue 14.2: after the target closed and a new agent of the same name was added, a write
    with the old list reported DONE and landed in the new agent's control table (shm) or in the
    closed agent's memory (cma)."""
    with kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path=path)) as i:
        src = np.full(MB, 5, dtype=np.uint8)
        L = i.prepare(kvx.DescList.blocks(i.register(src), MB))
        t1 = kvx.Agent("t")
        m1 = _target_mem(path, MB)
        r1 = t1.register(m1)
        R = i.prepare(kvx.DescList.blocks(r1, MB), peer=i.add_peer(t1.metadata()))
        t1.close()
        with kvx.Agent("t") as t2:
            m2 = _target_mem(path, MB)
            t2.register(m2)
            i.add_peer(t2.metadata())
            with pytest.raises(UsageError, match="prepare again"):
                i.write(L, [0], R, [0]).wait(10.0)
            assert not m1.any() and not m2.any()


def _widened(meta: bytes, extra: int) -> bytes:
    msg = wire.unpack(meta)
    rows = msg["regions"]
    rows[0][2] += extra  # widen the first region's length, as a writer of the discovery store could
    return wire.pack("meta", **{k: v for k, v in msg.items() if k not in ("t", "v")})


@pytest.mark.parametrize("path", PATHS)
def test_widened_metadata_row_is_refused(path: str) -> None:
    """Issue 14.3: one-sided paths trusted the region bounds in the metadata. Widen a row in
    otherwise genuine metadata: the initiator must check the bounds the target publishes in its
    control table, and the memory next to the registration stays untouched."""
    with kvx.Agent("t") as t, kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path=path)) as i:
        whole = _target_mem(path, 2 * MB)
        t.register(whole[:MB])  # only the first half is registered
        src = np.full(2 * MB, 3, dtype=np.uint8)
        L = i.prepare(kvx.DescList.blocks(i.register(src), MB))
        p = i.add_peer(_widened(t.metadata(), MB))
        beyond = kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=[whole.ctypes.data + MB], nbytes=[MB],
                                          dev=[0])
        with pytest.raises(RegistrationError, match="control table"):
            R = i.prepare(beyond, peer=p)
            i.write(L, [0], R, [0]).wait(10.0)
        assert not whole[MB:].any(), "bytes landed outside the target's registration"
        # what the target did register still works through the same (forged) metadata
        inside = kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=[whole.ctypes.data], nbytes=[MB], dev=[0])
        i.write(L, [0], i.prepare(inside, peer=p), [0]).wait(10.0)
        assert (whole[:MB] == 3).all()


def test_shm_maps_only_the_registered_pages() -> None:
    """Issue 14.3: over shm the initiator mapped the whole alloc_host memfd, not the registered slice."""
    with kvx.Agent("t") as t, kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path="shm")) as i:
        whole = kvx.alloc_host(64 * MB)
        treg = t.register(whole[8 * MB:9 * MB])
        src = np.full(MB, 1, dtype=np.uint8)
        L = i.prepare(kvx.DescList.blocks(i.register(src), MB))
        p = i.add_peer(t.metadata())
        R = i.prepare(kvx.DescList.blocks(treg, MB), peer=p)
        i.write(L, [0], R, [0]).wait(10.0)
        assert (whole[8 * MB:9 * MB] == 1).all() and not whole[:8 * MB].any() and not whole[9 * MB:].any()
        maps = i.backend("host")._peers[p].m.data
        assert maps and all(size <= MB for _base, size, _delta in maps.values()), maps


@pytest.mark.parametrize("pid", [2**64 - 1, 2**31, 0, 1])
def test_forged_host_pid_is_refused(pid: int) -> None:
    """Issue 14.8 (host part): ``backends.host.pid = 2**64-1`` raised OverflowError. And a pid that
    is not the listener's own (the kernel says which process answered) would have sent CMA copies
    to another process: both are ProtocolError now."""
    with kvx.Agent("t") as t, kvx.Agent("i", kvx.AgentConfig(backends=("host",))) as i:
        t.register(np.zeros(MB, dtype=np.uint8))
        msg = wire.unpack(t.metadata())
        msg["backends"]["host"]["pid"] = pid
        forged = wire.pack("meta", **{k: v for k, v in msg.items() if k not in ("t", "v")})
        with pytest.raises(ProtocolError):
            i.add_peer(forged)
        assert i.peers() == []


def test_release_draining_while_the_peer_disconnects() -> None:
    """A release waits for the peers' in-flight counters of its slot (``drain``); a peer that
    disconnected meanwhile had its counters unmapped by another thread under that drain, which
    read them on (SIGSEGV in ``py_drain``, seen once in the SGLang PD suite). The unmap now waits
    for the last drain. Forced here: the counter is held non-zero, the release drains in a
    thread, the initiator closes."""
    out = _run_child("""
        import ctypes, threading, time
        import numpy as np, kvx
        t = kvx.Agent("t", kvx.AgentConfig(peer_timeout=2.0))
        i = kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path="cma"))
        treg = t.register(np.zeros(1 << 20, dtype=np.uint8))
        p = i.add_peer(t.metadata())
        hb = t.backend("host")
        deadline = time.monotonic() + 5
        while not any("infl" in c.extra for c in hb._accepted) and time.monotonic() < deadline:
            time.sleep(0.01)
        chan = next(c for c in hb._accepted if "infl" in c.extra)
        slot = next(s for s, (r, g) in hb._slots.items())
        ctypes.c_uint32.from_address(int(chan.extra["infl"]) + 4 * slot).value = 1  # "a copy in flight"
        th = threading.Thread(target=treg.release)
        th.start()
        time.sleep(0.2)  # the release is draining now
        i.close()
        deadline = time.monotonic() + 5
        while hb._accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        th.join(10)
        assert not th.is_alive()
        t.close()
        print("DONE")
    """)
    assert out.split() == ["DONE"], out


def test_routes_to_a_gone_peer_incarnation_are_dropped() -> None:
    """A local list caches its route per remote list; a route to a list of a peer incarnation that
    is gone (remove_peer + add_peer, a restarted target) can never be posted again but kept that
    incarnation's mappings alive: the soak's host worker grew ~17 MiB per target restart. Such
    routes are dropped when the next route is made."""
    import gc
    import weakref

    with kvx.Agent("t") as t, kvx.Agent("i", kvx.AgentConfig(backends=("host",), host_path="shm")) as i:
        treg = t.register(kvx.alloc_host(1 << 20))
        L = i.prepare(kvx.DescList.blocks(i.register(kvx.alloc_host(1 << 20)), 4096))
        old = []
        for _ in range(3):
            p = i.add_peer(t.metadata())
            R = i.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=p)
            i.write(L, [0, 1], R, [2, 3]).wait(10)
            old.append(weakref.ref(R))
            del R
            i.remove_peer(p)
        p = i.add_peer(t.metadata())
        R = i.prepare(kvx.DescList.blocks(treg.descs, 4096), peer=p)
        i.write(L, [0], R, [0]).wait(10)
        gc.collect()
        assert len(L.wroutes) == 1
        assert all(r() is None for r in old), "lists of gone incarnations are still held by the route cache"
