"""The posix backend: conformance (buffered and O_DIRECT), faults, durability modes."""

from __future__ import annotations

import errno
import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvx
from kvx.testing.conformance import StorageConformance, pattern


class TestPosix(StorageConformance):
    backend = "posix"

    def storage_regions(self, tmp_path: Any, nblocks: int, block_bytes: int) -> Any:
        return kvx.FileRegion(tmp_path / "kv.bin", nblocks * block_bytes)


class TestPosixDirect(TestPosix):
    """The same cases with every file opened O_DIRECT (aligned, bounce and buffered paths)."""

    @pytest.fixture(autouse=True)
    def _direct(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KVX_POSIX_DIRECT", "1")


# ---- helpers -------------------------------------------------------------------------------------

def _agent(**opts: Any) -> kvx.Agent:
    a = kvx.Agent("posix-test", kvx.AgentConfig(backends=("host", "posix"), **opts))
    return a


def _lists(agent: kvx.Agent, buf: Any, region: Any, bs: int) -> tuple[Any, Any, Any, Any]:
    sreg = agent.register(region)
    mreg = agent.register(buf)
    mem = agent.prepare(kvx.DescList.blocks(mreg, bs))
    sto = agent.prepare(kvx.DescList.blocks(sreg, bs))
    return mem, sto, mreg, sreg


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {r.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def _fill(d: Path) -> None:
    """Fill the filesystem under ``d`` completely."""
    fd = os.open(d / f"filler-{uuid.uuid4().hex}", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        chunk = b"\xff" * 4096
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


# ---- registration --------------------------------------------------------------------------------

def test_register_creates_preallocated_private_file(tmp_path: Path) -> None:
    p = tmp_path / "kv.bin"
    with _agent() as a:
        a.register(kvx.FileRegion(p, 3 << 20))
        st = os.stat(p)
        assert st.st_size == 3 << 20
        assert st.st_mode & 0o777 == 0o600
        assert st.st_blocks * 512 >= 3 << 20  # allocated, not sparse (posix_fallocate)


def test_register_existing_file_keeps_data_and_size(tmp_path: Path) -> None:
    p = tmp_path / "kv.bin"
    p.write_bytes(b"abc" * 5000)
    with _agent() as a:
        a.register(kvx.FileRegion(p, 4096))
        assert p.read_bytes() == b"abc" * 5000  # not shrunk, not zeroed


def test_register_full_disk_raises_and_leaves_no_file(tiny_fs: Path) -> None:
    p = tiny_fs / "kv.bin"
    with _agent() as a:
        with pytest.raises(kvx.RegistrationError, match="disk full") as ei:
            a.register(kvx.FileRegion(p, 4 << 20))
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
        assert not p.exists()
        # and an existing file keeps its size
        p.write_bytes(b"x" * 8192)
        with pytest.raises(kvx.RegistrationError, match="disk full"):
            a.register(kvx.FileRegion(p, 4 << 20))
        assert os.path.getsize(p) == 8192


def test_register_directory_or_bad_path_is_refused(tmp_path: Path) -> None:
    with _agent() as a:
        with pytest.raises(kvx.RegistrationError):
            a.register(kvx.FileRegion(tmp_path, 4096))
        with pytest.raises(kvx.RegistrationError):
            a.register(kvx.FileRegion(tmp_path / "missing-dir" / "kv.bin", 4096))


def test_posix_serves_only_host_file(tmp_path: Path) -> None:
    with kvx.Agent("p", kvx.AgentConfig(backends=("posix",))) as a:
        b = a.backend("posix")
        assert b.serves(kvx.MemoryKind.HOST, kvx.MemoryKind.FILE, True)
        assert b.serves(kvx.MemoryKind.FILE, kvx.MemoryKind.HOST, True)
        assert not b.serves(kvx.MemoryKind.HOST, kvx.MemoryKind.HOST, True)
        assert not b.serves(kvx.MemoryKind.HOST, kvx.MemoryKind.FILE, False)
        r1 = a.register(np.zeros(8192, np.uint8))
        r2 = a.register(np.zeros(8192, np.uint8))
        with pytest.raises(kvx.BackendUnavailable):
            a.write(a.prepare(r1), [0], a.prepare(r2), [0])


# ---- data paths ----------------------------------------------------------------------------------

def test_several_files_in_one_transfer(tmp_path: Path) -> None:
    bs, per = 8192, 16
    regions = [kvx.FileRegion(tmp_path / f"f{i}.bin", per * bs) for i in range(3)]
    buf = pattern(3 * per * bs, 5)
    with _agent() as a:
        mem, sto, _, _ = _lists(a, buf, regions, bs)
        perm = np.random.default_rng(1).permutation(3 * per)
        a.write(mem, np.arange(3 * per), sto, perm).wait(30)
        disk = b"".join((tmp_path / f"f{i}.bin").read_bytes() for i in range(3))
        exp = np.empty_like(buf)
        exp.reshape(-1, bs)[perm] = buf.reshape(-1, bs)
        assert disk == exp.tobytes()
        out = np.zeros_like(buf)
        mreg = a.register(out)
        a.read(a.prepare(kvx.DescList.blocks(mreg, bs)), np.arange(3 * per), sto, perm).wait(30)
        assert np.array_equal(out, buf)


def test_file_as_the_local_list(tmp_path: Path) -> None:
    """FILE as the first list and HOST as the second works too (write = file -> memory)."""
    bs, n = 4096, 8
    with _agent() as a:
        buf = pattern(n * bs, 2)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        buf2 = np.zeros_like(buf)
        m2 = a.prepare(kvx.DescList.blocks(a.register(buf2), bs))
        a.write(sto, np.arange(n), m2, np.arange(n)).wait(10)
        assert np.array_equal(buf, buf2)


def test_large_transfer_runs_on_the_pool(tmp_path: Path) -> None:
    bs, n = 1 << 20, 48
    with _agent(inline_bytes=0) as a:
        buf = pattern(n * bs, 9)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        perm = np.random.default_rng(0).permutation(n)
        x = a.write(mem, np.arange(n), sto, perm)
        x.wait(60)
        assert x.status is kvx.Status.DONE and x.nbytes == n * bs
        exp = np.empty_like(buf)
        exp.reshape(n, bs)[perm] = buf.reshape(n, bs)
        assert (tmp_path / "kv.bin").read_bytes() == exp.tobytes()


def test_notify_loopback(tmp_path: Path) -> None:
    with _agent() as a:
        buf = pattern(64 * 4096, 1)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", 64 * 4096), 4096)
        a.write(mem, np.arange(64), sto, np.arange(64), notify=b"stored").wait(10)
        assert a.notifications(timeout=5) == {"posix-test": [b"stored"]}


def test_read_past_written_length_returns_zeros(tmp_path: Path) -> None:
    bs = 4096
    with _agent() as a:
        buf = pattern(8 * bs, 3)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", 8 * bs), bs)
        a.write(mem, [0], sto, [0]).wait(10)
        a.read(mem, [1, 2], sto, [5, 7]).wait(10)  # never written: preallocated zeros
        assert not buf[bs:3 * bs].any()
        assert np.array_equal(buf[:bs], pattern(8 * bs, 3)[:bs])


# ---- faults --------------------------------------------------------------------------------------

def test_full_disk_mid_write_fails_clearly(tiny_fs: Path) -> None:
    """Preallocation reserves the space; here the file is shrunk and the disk filled behind our back."""
    bs, n = 4096, 64
    p = tiny_fs / "kv.bin"
    with _agent() as a:
        buf = pattern(n * bs, 4)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        a.write(mem, [0], sto, [0]).wait(10)
        os.truncate(p, 0)  # give the space back to the filesystem ...
        _fill(tiny_fs)  # ... and let something else take it
        x = a.write(mem, np.arange(n), sto, np.arange(n))
        with pytest.raises(kvx.TransferError, match="disk full") as ei:
            x.wait(10)
        assert x.status is kvx.Status.FAILED
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC


def test_full_disk_fails_on_the_pool_too(tiny_fs: Path) -> None:
    bs, n = 65536, 8
    p = tiny_fs / "kv.bin"
    with _agent(inline_bytes=0) as a:
        mem, sto, _, _ = _lists(a, pattern(n * bs, 4), kvx.FileRegion(p, n * bs), bs)
        os.truncate(p, 0)
        _fill(tiny_fs)
        x = a.write(mem, np.arange(n), sto, np.arange(n))
        with pytest.raises(kvx.TransferError, match="disk full"):
            x.wait(10)
        assert x.status is kvx.Status.FAILED


def test_unlinked_file_keeps_working_on_its_inode(tmp_path: Path) -> None:
    """The registration holds the descriptor: after unlink the transfers go to the (nameless)
    inode, which the filesystem frees when the registration is released."""
    bs, n = 4096, 16
    p = tmp_path / "kv.bin"
    with _agent() as a:
        buf = pattern(n * bs, 6)
        mem, sto, _, sreg = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        os.unlink(p)
        a.write(mem, np.arange(n), sto, np.arange(n)[::-1].copy()).wait(10)
        orig = buf.copy()
        buf[:] = 0
        a.read(mem, np.arange(n), sto, np.arange(n)[::-1].copy()).wait(10)
        assert np.array_equal(buf, orig)
        assert not p.exists()
        sreg.release()
        # the path is free again: registering it creates a new, zeroed file
        mem2, sto2, _, _ = _lists(a, np.ones(n * bs, np.uint8), kvx.FileRegion(p, n * bs), bs)
        assert p.exists() and not p.read_bytes().strip(b"\0")


def test_truncated_file_read_fails_clearly(tmp_path: Path) -> None:
    bs, n = 4096, 16
    p = tmp_path / "kv.bin"
    with _agent() as a:
        mem, sto, _, _ = _lists(a, pattern(n * bs, 6), kvx.FileRegion(p, n * bs), bs)
        os.truncate(p, 2 * bs)
        with pytest.raises(kvx.TransferError, match="truncated"):
            a.read(mem, [0, 1, 2], sto, [0, 1, 9]).wait(10)


def test_release_is_final_and_closes_the_descriptor(tmp_path: Path) -> None:
    import threading

    bs, n = 65536, 64
    with _agent(inline_bytes=0) as a:
        mem, sto, _, sreg = _lists(a, pattern(n * bs, 8), kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        b = a.backend("posix")
        slot = sreg.slots[0]
        fd = int(b._fd[slot])
        outcomes: list[str] = []
        stop = threading.Event()

        def hammer() -> None:
            while not stop.is_set():
                try:
                    a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
                    outcomes.append("done")
                except (kvx.TransferError, kvx.UsageError):
                    outcomes.append("failed")

        t = threading.Thread(target=hammer)
        t.start()
        import time

        time.sleep(0.2)
        sreg.release()
        after = len(outcomes)
        time.sleep(0.2)
        stop.set()
        t.join(15)
        assert "done" in outcomes[:after]
        assert all(o == "failed" for o in outcomes[after + 1:])
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (the number may only be reused once no transfer holds it)


# ---- O_DIRECT ------------------------------------------------------------------------------------

def _fd_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise AssertionError("no flags")


@pytest.mark.parametrize("memkind", ["aligned", "unaligned", "mixed"])
@pytest.mark.parametrize("bs", [4096, 1 << 20, 20 << 20, 4097])
def test_direct_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, memkind: str, bs: int) -> None:
    monkeypatch.setenv("KVX_POSIX_DIRECT", "1")
    n = 4 if bs > (1 << 20) else 24
    raw = kvx.alloc_host(n * bs + 2 * 4096)  # page aligned
    if memkind == "aligned":
        buf = raw[: n * bs]
    elif memkind == "unaligned":
        buf = raw[64: 64 + n * bs]
    else:  # some blocks aligned, some not
        buf = raw[: n * bs]
    data = pattern(n * bs, bs)
    buf[:] = data
    with _agent() as a:
        sreg = a.register(kvx.FileRegion(tmp_path / "kv.bin", n * bs))
        mreg = a.register(buf)
        b = a.backend("posix")
        dfd = int(b._dfd[sreg.slots[0]])
        assert dfd >= 0 and _fd_flags(dfd) & os.O_DIRECT
        blocks = kvx.DescList.blocks(mreg, bs)
        if memkind == "mixed" and bs % 4096 == 0:
            # shift odd memory blocks by 512 bytes inside a larger registration is not possible
            # without overlap; use a second, unaligned buffer for odd blocks instead
            blocks = kvx.DescList.blocks(mreg, bs)
        mem = a.prepare(blocks)
        sto = a.prepare(kvx.DescList.blocks(sreg, bs))
        perm = np.random.default_rng(bs).permutation(n)
        a.write(mem, np.arange(n), sto, perm).wait(60)
        exp = np.empty_like(data)
        exp.reshape(n, bs)[perm] = data.reshape(n, bs)
        with open(tmp_path / "kv.bin", "rb") as f:
            assert f.read() == exp.tobytes()
        buf[:] = 0
        a.read(mem, np.arange(n), sto, perm).wait(60)
        assert np.array_equal(buf, data)


def test_direct_mixed_alignment_in_one_transfer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Aligned blocks go zero-copy, unaligned memory through the bounce, odd offsets buffered."""
    monkeypatch.setenv("KVX_POSIX_DIRECT", "1")
    bs, n = 65536, 16
    al = kvx.alloc_host(n * bs)
    raw = kvx.alloc_host(n * bs + 4096)
    un = raw[100: 100 + n * bs]
    al[:] = pattern(n * bs, 1)
    un[:] = pattern(n * bs, 2)
    fsize = 2 * n * bs + 4096
    with _agent() as a:
        sreg = a.register(kvx.FileRegion(tmp_path / "kv.bin", fsize))
        r1, r2 = a.register(al), a.register(un)
        d1, d2 = kvx.DescList.blocks(r1, bs), kvx.DescList.blocks(r2, bs)
        mem = a.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.HOST, addr=np.concatenate((d1.addr, d2.addr)),
                                                 nbytes=np.concatenate((d1.nbytes, d2.nbytes)),
                                                 dev=np.concatenate((d1.dev, d2.dev))))
        slot = int(sreg.descs.dev[0])
        # file blocks: first n at aligned offsets, next n at offsets shifted by 512 (unaligned)
        offs = np.concatenate((np.arange(n) * bs, n * bs + 512 + np.arange(n) * bs)).astype(np.uint64)
        sto = a.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.FILE, addr=offs,
                                                 nbytes=np.full(2 * n, bs, np.uint64), dev=np.full(2 * n, slot)))
        # memory block i (aligned for i < n, unaligned after) -> file block perm[i]
        perm = np.random.default_rng(4).permutation(2 * n)
        a.write(mem, np.arange(2 * n), sto, perm).wait(60)
        src = np.concatenate((al, un)).reshape(2 * n, bs)
        disk = np.fromfile(tmp_path / "kv.bin", dtype=np.uint8)
        for i in range(2 * n):
            o = int(offs[perm[i]])
            assert np.array_equal(disk[o: o + bs], src[i]), i
        al[:] = 0
        un[:] = 0
        a.read(mem, np.arange(2 * n), sto, perm).wait(60)
        assert np.array_equal(np.concatenate((al, un)).reshape(2 * n, bs), src)


def test_direct_refused_where_unsupported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without O_DIRECT is a clear RegistrationError (checked where one exists)."""
    monkeypatch.setenv("KVX_POSIX_DIRECT", "1")
    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    try:
        os.close(os.open(tmp_path / "probe", os.O_RDWR | os.O_DIRECT))
    except OSError:
        with _agent() as a, pytest.raises(kvx.RegistrationError, match="O_DIRECT"):
            a.register(kvx.FileRegion(tmp_path / "kv.bin", 4096))
        return
    pytest.skip("this filesystem supports O_DIRECT")


# ---- durability ----------------------------------------------------------------------------------

_SYNC_SCRIPT = r"""
import sys, numpy as np, kvx
bs, n = 4096, 64
with kvx.Agent("s", kvx.AgentConfig(backends=("host", "posix"), inline_bytes=int(sys.argv[2]))) as a:
    s = a.register(kvx.FileRegion(sys.argv[1], n * bs))
    buf = np.full(n * bs, 7, np.uint8)
    m = a.prepare(kvx.DescList.blocks(a.register(buf), bs))
    f = a.prepare(kvx.DescList.blocks(s, bs))
    print("MARK", flush=True)
    for _ in range(3):
        a.write(m, np.arange(n), f, np.arange(n)[::-1].copy()).wait(10)
    a.read(m, np.arange(n), f, np.arange(n)).wait(10)
    print("END", flush=True)
"""


@pytest.mark.parametrize("direct", ["0", "1"])
@pytest.mark.parametrize("inline", [1 << 30, 0])
@pytest.mark.parametrize("mode,call", [("none", None), ("data", "fdatasync"), ("full", "fsync")])
def test_sync_modes_issue_the_right_call(tmp_path: Path, mode: str, call: str | None, inline: int,
                                         direct: str) -> None:
    import shutil
    import sys

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    env = {**os.environ, "KVX_POSIX_SYNC": mode, "KVX_POSIX_DIRECT": direct}
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,write", "-e", "signal=none",
                        sys.executable, "-c", _SYNC_SCRIPT, str(tmp_path / "kv.bin"), str(inline)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # only the calls between MARK and END (the transfers; registration may fsync the new file)
    tail = r.stderr.split('MARK', 1)[1].split('END', 1)[0]
    n_fdatasync = tail.count("fdatasync(")
    n_fsync = tail.count("fsync(")  # "fdatasync(" does not contain it
    if call is None:
        assert n_fdatasync == 0 and n_fsync == 0
    elif call == "fdatasync":
        assert n_fdatasync == 3 and n_fsync == 0  # one per write transfer, none for the read
    else:
        assert n_fsync == 3 and n_fdatasync == 0


def test_bad_sync_mode_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_POSIX_SYNC", "sometimes")
    with pytest.raises(kvx.UsageError, match="KVX_POSIX_SYNC"):
        kvx.Agent("x", kvx.AgentConfig(backends=("posix",)))


def test_configure_overrides_environment(tmp_path: Path) -> None:
    with _agent() as a:
        b = a.backend("posix")
        b.configure(direct=True, sync="data", threads=3)
        assert (b.direct, b.sync, b.threads) == (True, 1, 3)
        s = a.register(kvx.FileRegion(tmp_path / "kv.bin", 8192))
        assert int(b._dfd[s.slots[0]]) >= 0
        with pytest.raises(kvx.UsageError):
            b.configure(sync="maybe")


def test_repeated_and_sparse_blocks(tmp_path: Path) -> None:
    """The offset ordering handles repeats (sort fallback) and sparse subsets of a big file."""
    bs, n = 4096, 64
    with _agent(inline_bytes=0) as a:
        buf = pattern(n * bs, 11)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", 16 * n * bs), bs)
        a.write(mem, np.arange(n), sto, np.arange(n) * 7).wait(10)  # sparse, strided
        out = np.zeros_like(buf)
        m2 = a.prepare(kvx.DescList.blocks(a.register(out), bs))
        a.read(m2, np.arange(n), sto, (np.arange(n) * 7)[::-1].copy()).wait(10)
        assert np.array_equal(out.reshape(n, bs), buf.reshape(n, bs)[::-1])
        out[:] = 0
        a.read(m2, [0, 1, 2, 3], sto, [14, 14, 0, 14]).wait(10)  # repeats
        b = buf.reshape(n, bs)
        assert np.array_equal(out.reshape(n, bs)[[0, 1, 2, 3]], b[[2, 2, 0, 2]])


def test_make_transfer_plan(tmp_path: Path) -> None:
    bs, n = 4096, 64
    with _agent() as a:
        if not hasattr(a, "make_transfer"):
            pytest.skip("Agent.make_transfer is not in this tree")
        buf = pattern(n * bs, 12)
        mem, sto, _, sreg = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        perm = np.random.default_rng(2).permutation(n)
        plan = a.make_transfer("write", mem, np.arange(n), sto, perm)
        for _ in range(3):
            plan.post().wait(10)
        exp = np.empty_like(buf)
        exp.reshape(n, bs)[perm] = buf.reshape(n, bs)
        assert (tmp_path / "kv.bin").read_bytes() == exp.tobytes()
        one = a.make_transfer("read", mem, [0], sto, [int(perm[5])])
        buf[:bs] = 0
        one.post().wait(10)
        assert np.array_equal(buf[:bs], exp.reshape(n, bs)[perm[5]])
        sreg.release()
        with pytest.raises((kvx.UsageError, kvx.TransferError)):
            plan.post().wait(10)


def test_cancel_and_timeout_turn_failed(tmp_path: Path) -> None:
    bs, n = 1 << 20, 64
    with _agent(inline_bytes=0, transfer_timeout=30.0) as a:
        mem, sto, _, _ = _lists(a, pattern(n * bs, 1), kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        x = a.write(mem, np.arange(n), sto, np.arange(n))
        x.cancel()
        try:
            x.wait(30)
        except kvx.TransferError:
            pass
        assert x.status in (kvx.Status.DONE, kvx.Status.CANCELLED, kvx.Status.FAILED)
