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
from kvx.backends.posix import PosixOptions
from kvx.testing.conformance import StorageConformance, pattern, race_release


class TestPosix(StorageConformance):
    backend = "posix"

    def storage_regions(self, tmp_path: Any, nblocks: int, block_bytes: int) -> Any:
        return kvx.FileRegion(tmp_path / "kv.bin", nblocks * block_bytes)


class TestPosixPwritev(TestPosix):
    """The same cases with buffered writes through pwritev instead of the file mapping."""

    @pytest.fixture(autouse=True)
    def _no_mmap(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KVX_POSIX_MMAP", "0")


class TestPosixDirect(TestPosix):
    """The same cases with every file opened O_DIRECT (aligned, bounce and buffered paths)."""

    @pytest.fixture(autouse=True)
    def _direct(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("KVX_POSIX_DIRECT", "1")


# ---- helpers -------------------------------------------------------------------------------------

def _agent(posix: PosixOptions | None = None, **opts: Any) -> kvx.Agent:
    options = {"posix": posix} if posix is not None else {}
    return kvx.Agent("posix-test", kvx.AgentConfig(backends=("host", "posix"), options=options, **opts))


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

# With pwritev (mmap=False) a write past the shrunk end extends the file again, so it is the full
# disk that fails it (ENOSPC); through the mapping it is the truncation itself (EFAULT).
_SHRUNK = {False: ("disk full", errno.ENOSPC), True: ("truncated under its registration", errno.EFAULT)}


@pytest.mark.parametrize("mmap", [False, True])
def test_full_disk_mid_write_fails_clearly(tiny_fs: Path, mmap: bool) -> None:
    """Preallocation reserves the space; here the file is shrunk and the disk filled behind our back."""
    bs, n = 4096, 64
    p = tiny_fs / "kv.bin"
    with _agent(PosixOptions(mmap=mmap)) as a:
        buf = pattern(n * bs, 4)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        a.write(mem, [0], sto, [0]).wait(10)
        os.truncate(p, 0)  # give the space back to the filesystem ...
        _fill(tiny_fs)  # ... and let something else take it
        x = a.write(mem, np.arange(n), sto, np.arange(n))
        what, code = _SHRUNK[mmap]
        with pytest.raises(kvx.TransferError, match=what) as ei:
            x.wait(10)
        assert x.status is kvx.Status.FAILED
        assert str(p) in str(ei.value) and "undefined content" in str(ei.value)
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == code


@pytest.mark.parametrize("mmap", [False, True])
def test_full_disk_fails_on_the_pool_too(tiny_fs: Path, mmap: bool) -> None:
    bs, n = 65536, 8
    p = tiny_fs / "kv.bin"
    with _agent(PosixOptions(mmap=mmap), inline_bytes=0) as a:
        mem, sto, _, _ = _lists(a, pattern(n * bs, 4), kvx.FileRegion(p, n * bs), bs)
        os.truncate(p, 0)
        _fill(tiny_fs)
        x = a.write(mem, np.arange(n), sto, np.arange(n))
        with pytest.raises(kvx.TransferError, match=_SHRUNK[mmap][0]):
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


def _resident(path: Path) -> np.ndarray:
    """Whether each 4 KiB page of ``path`` is in the page cache (mincore over a mapping of it)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    vec = np.zeros(-(-size // mmap.PAGESIZE), np.uint8)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        rc = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), ctypes.c_void_p(vec.ctypes.data))
        del view
    assert rc == 0, os.strerror(ctypes.get_errno())
    return (vec & 1).astype(bool)


@pytest.mark.parametrize("evict", ["unprobed", "last"])
def test_mapped_read_of_a_partly_evicted_run(tmp_path: Path, evict: str) -> None:
    """A read through the mapping probes a run's residency on its first, middle and last page:
    with the last page evicted the run goes through preadv; with pages evicted where the probe
    does not look, the copy's own faults read them. Both deliver the file's bytes."""
    bs, n = 65536, 64  # one run of 4 MiB (MM_RUN_MAX)
    p = tmp_path / "kv.bin"
    want = pattern(n * bs, 11)
    pages = n * bs // 4096
    gone = [pages - 1, 300, 301] if evict == "last" else [1, 100, 101, 102, 700, pages - 2]
    with _agent() as a:
        buf = np.zeros(n * bs, np.uint8)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        fd = os.open(p, os.O_RDWR)
        try:  # page-sized writes: page-sized page-cache folios, which DONTNEED drops one by one
            for i in range(pages):
                os.pwrite(fd, want[i * 4096:(i + 1) * 4096], i * 4096)
            os.fsync(fd)  # clean pages
            for g in gone:  # everything cached but these
                os.posix_fadvise(fd, g * 4096, 4096, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        res = _resident(p)
        if res[gone].any() or not res[[0, pages // 2]].all():
            pytest.skip("this filesystem keeps the pages cached (tmpfs?)")
        a.read(mem, np.arange(n), sto, np.arange(n)).wait(10)
        assert (buf == want).all()


def test_truncated_file_read_fails_clearly(tmp_path: Path) -> None:
    bs, n = 4096, 16
    p = tmp_path / "kv.bin"
    with _agent() as a:
        mem, sto, _, _ = _lists(a, pattern(n * bs, 6), kvx.FileRegion(p, n * bs), bs)
        os.truncate(p, 2 * bs)
        with pytest.raises(kvx.TransferError, match="truncated"):
            a.read(mem, [0, 1, 2], sto, [0, 1, 9]).wait(10)


def test_release_is_final_and_closes_the_descriptor(tmp_path: Path) -> None:
    bs, n = 65536, 64
    with _agent(inline_bytes=0) as a:
        mem, sto, _, sreg = _lists(a, pattern(n * bs, 8), kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        b = a.backend("posix")
        slot = sreg.slots[0]
        fd = int(b._fd[slot])
        outcomes, after = race_release(a, mem, sto, n, sreg.release, trail=0.2)
        assert "done" in outcomes[:after]
        assert all(o == "failed" for o in outcomes[after + 1:])
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (the number may only be reused once no transfer holds it)


# ---- buffered writes through the file mapping (OP_MMWRITE) ---------------------------------------

def _maps(path: Path) -> bool:
    """Whether this process has ``path`` mapped."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip().removesuffix(" (deleted)").endswith(str(path)) for line in f)


# OP_MMWRITE's switches (process-wide): "default" = populate + the pwritev fallback for runs not
# cached with data on disk; "populate" = always the mapping, faults turn into EFAULT at the
# madvise; "guard" = always the mapping, no populate: faults are SIGBUS in the copy, caught.
_FLAGS = {"default": 3, "populate": 1, "guard": 0}


class _MmFlags:
    def __init__(self, name: str) -> None:
        self.flags = _FLAGS[name]
        self.before = 3

    def __enter__(self) -> None:
        from kvx import _native

        assert _native.MMWRITE_POPULATE | _native.MMWRITE_RESIDENT == 3
        self.before = _native.mmwrite_flags(self.flags)

    def __exit__(self, *exc: Any) -> None:
        from kvx import _native

        _native.mmwrite_flags(self.before)


def _punch(path: Path, off: int, ln: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        if libc.fallocate(fd, 3, ctypes.c_long(off), ctypes.c_long(ln)) != 0:  # PUNCH_HOLE | KEEP_SIZE
            pytest.skip(f"cannot punch a hole here: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def _blocks_at(path: Path, offs: Any, bs: int) -> list[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return [os.pread(fd, bs, int(o)) for o in offs]
    finally:
        os.close(fd)


@pytest.mark.parametrize("inline", [1 << 40, 0])
@pytest.mark.parametrize("bs", [4096, 32768, 2 << 20, 4097, 12345])
def test_mmap_write_permuted_unaligned(tmp_path: Path, bs: int, inline: int) -> None:
    """Byte for byte, at odd sizes, odd file offsets and odd memory addresses, inline and on the pool."""
    n = 6 if bs >= (1 << 20) else 40
    shift, tail = 100, 777
    raw = pattern(n * bs + 3, bs)
    buf = raw[3:]  # memory not aligned either
    p = tmp_path / "kv.bin"
    with _agent(inline_bytes=inline) as a:
        sreg = a.register(kvx.FileRegion(p, shift + n * bs + tail))
        mreg = a.register(buf)
        assert int(a.backend("posix")._base[sreg.slots[0]]) != 0 and _maps(p)
        slot = int(sreg.descs.dev[0])
        offs = (shift + np.arange(n) * bs).astype(np.uint64)
        sto = a.prepare(kvx.DescList.from_arrays(kind=kvx.MemoryKind.FILE, addr=offs,
                                                 nbytes=np.full(n, bs, np.uint64), dev=np.full(n, slot)))
        mem = a.prepare(kvx.DescList.blocks(mreg, bs))
        perm = np.random.default_rng(bs).permutation(n)
        x = a.write(mem, np.arange(n), sto, perm)
        x.wait(60)
        assert x.status is kvx.Status.DONE and x.nbytes == n * bs
        got = _blocks_at(p, offs[perm], bs)
        for i in range(n):
            assert got[i] == buf[i * bs:(i + 1) * bs].tobytes(), i
        head, end = _blocks_at(p, [0], shift)[0], _blocks_at(p, [shift + n * bs], tail)[0]
        assert head == bytes(shift) and end == bytes(tail)  # nothing written outside the blocks
        out = np.zeros(n * bs, np.uint8)
        a.read(a.prepare(kvx.DescList.blocks(a.register(out), bs)), np.arange(n), sto, perm).wait(60)
        assert np.array_equal(out, buf)
        # overwrite a sparse subset: the rest keeps its bytes
        buf2 = pattern(n * bs, bs + 1)
        m2 = a.prepare(kvx.DescList.blocks(a.register(buf2), bs))
        a.write(m2, [0, 1], sto, [n - 1, 0]).wait(60)
        got2 = _blocks_at(p, offs, bs)
        want = [buf[int(np.flatnonzero(perm == k)[0]) * bs:][:bs].tobytes() for k in range(n)]
        want[n - 1], want[0] = buf2[:bs].tobytes(), buf2[bs:2 * bs].tobytes()
        assert got2 == want


def test_mmap_one_large_block_split_over_threads_keeps_its_file(tmp_path: Path) -> None:
    """A few large blocks are cut into pieces for the pool; each piece still syncs its file."""
    bs = 8 << 20
    p = tmp_path / "kv.bin"
    with _agent(PosixOptions(sync="data", threads=2), inline_bytes=0) as a:
        buf = pattern(bs, 3)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, 2 * bs), bs)
        x = a.write(mem, [0], sto, [1])
        x.wait(60)
        assert x.status is kvx.Status.DONE
        assert _blocks_at(p, [bs], bs)[0] == buf.tobytes()


def test_mmap_setting_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KVX_POSIX_MMAP=0 / PosixOptions(mmap=False): no mapping, pwritev (which re-extends a shrunk file)."""
    bs, n = 4096, 16
    buf = pattern(n * bs, 5)
    monkeypatch.setenv("KVX_POSIX_MMAP", "0")
    with _agent() as a:
        assert a.backend("posix").mmap is False
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(tmp_path / "env.bin", n * bs), bs)
        assert not _maps(tmp_path / "env.bin")
        os.truncate(tmp_path / "env.bin", 0)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)  # pwritev extends the file again
        assert (tmp_path / "env.bin").read_bytes() == buf.tobytes()
    monkeypatch.delenv("KVX_POSIX_MMAP")
    with _agent() as a:
        b = a.backend("posix")
        assert b.mmap is True
        p = tmp_path / "cfg.bin"
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        assert _maps(p)
        os.truncate(p, 0)
        with pytest.raises(kvx.TransferError, match="truncated"):
            a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
    with _agent(PosixOptions(mmap=False)) as a:  # set in code: not mapped, pwritev
        assert a.backend("posix").mmap is False
        q = tmp_path / "cfg2.bin"
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(q, n * bs), bs)
        assert not _maps(q)
        os.truncate(q, 0)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        assert q.read_bytes() == buf.tobytes()


@pytest.mark.parametrize("flags", list(_FLAGS))
@pytest.mark.parametrize("inline", [1 << 40, 0])
def test_mmap_write_to_truncated_file_fails_cleanly(tmp_path: Path, flags: str, inline: int) -> None:
    """Truncated under the registration: FAILED naming the file, the process lives on; blocks still
    inside the file, and all blocks once it is extended again, can be written. (Past the end there
    is no data on disk, so the default mode takes the mapping there too, and fails the same way.)"""
    bs, n = 4096, 64
    p = tmp_path / "kv.bin"
    with _MmFlags(flags), _agent(inline_bytes=inline) as a:
        buf = pattern(n * bs, 21)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        plan = a.make_transfer("write", mem, np.arange(n), sto, np.arange(n)[::-1].copy())
        os.truncate(p, 8 * bs)
        x = a.write(mem, np.arange(n), sto, np.arange(n)[::-1].copy())
        with pytest.raises(kvx.TransferError, match="truncated under its registration") as ei:
            x.wait(10)
        assert x.status is kvx.Status.FAILED
        assert str(p) in str(ei.value) and "undefined content" in str(ei.value)
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.EFAULT
        with pytest.raises(kvx.TransferError, match="truncated"):
            plan.post().wait(10)
        # blocks inside the new end work
        a.write(mem, np.arange(8), sto, np.arange(8)[::-1].copy()).wait(10)
        assert _blocks_at(p, np.arange(8) * bs, bs) == [buf[(7 - k) * bs:(8 - k) * bs].tobytes() for k in range(8)]
        os.truncate(p, n * bs)  # extended again: the whole registration works
        plan.post().wait(10)
        assert p.read_bytes() == buf.reshape(n, bs)[::-1].tobytes()


@pytest.mark.parametrize("flags", list(_FLAGS))
def test_mmap_write_into_punched_hole_on_full_disk(tiny_fs: Path, flags: str) -> None:
    """A hole punched in the preallocated file while the disk is full cannot be filled: FAILED, disk
    full. (By default the run, not all cached and with data after the hole, goes through pwritev:
    ENOSPC; through the mapping it is EFAULT from the populate or a SIGBUS in the copy.)"""
    bs, n = 4096, 32
    p = tiny_fs / "kv.bin"
    with _MmFlags(flags), _agent() as a:
        buf = pattern(n * bs, 22)
        mem, sto, _, _ = _lists(a, buf, kvx.FileRegion(p, n * bs), bs)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        _punch(p, 4 * bs, 8 * bs)
        _fill(tiny_fs)
        x = a.write(mem, np.arange(n), sto, np.arange(n)[::-1].copy())
        with pytest.raises(kvx.TransferError, match="disk full") as ei:
            x.wait(10)
        assert x.status is kvx.Status.FAILED and str(p) in str(ei.value)
        want = errno.ENOSPC if flags == "default" else errno.EFAULT
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == want
        a.write(mem, [0, 1], sto, [1, 0]).wait(10)  # blocks outside the hole still work
        assert _blocks_at(p, [0, bs], bs) == [buf[bs:2 * bs].tobytes(), buf[:bs].tobytes()]


_SIGBUS_SCRIPT = r"""
import ctypes, faulthandler, os, signal, sys
import numpy as np, kvx
p, how, late = sys.argv[1], sys.argv[2], sys.argv[3] == "after"
with kvx.Agent("s", kvx.AgentConfig(backends=("host", "posix"))) as a:
    s = a.register(kvx.FileRegion(p, 1 << 20))
    m = a.prepare(kvx.DescList.blocks(a.register(np.ones(1 << 20, np.uint8)), 4096))
    f = a.prepare(kvx.DescList.blocks(s, 4096))
    kvx._native.mmwrite_flags(0)  # no populate: the fault below is a SIGBUS in the copy
    a.write(m, [0], f, [0]).wait(10)  # installs kvx's SIGBUS handler
    if late:
        faulthandler.enable()  # installed over kvx's: it runs first, then re-raises to kvx's
    os.truncate(p, 0)
    try:
        a.write(m, [0], f, [0]).wait(10)  # SIGBUS inside the guarded copy
    except kvx.TransferError as exc:
        print("CAUGHT", exc, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGBUS)
    else:
        ctypes.string_at(int(a.backend("posix")._base[s.slots[0]]), 1)  # unguarded, beyond the end
    print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("faulthandler", ["off", "before", "after"])
@pytest.mark.parametrize("how", ["fault", "kill"])
def test_sigbus_outside_a_guarded_copy_is_not_swallowed(tmp_path: Path, how: str, faulthandler: str) -> None:
    """kvx's SIGBUS handler only catches faults of its own copies; anything else reaches the handler
    installed before it (faulthandler) or the default action. A faulthandler enabled after kvx's
    handler dumps a traceback on the guarded fault too, but the process survives it."""
    import signal
    import sys

    args = [sys.executable, *(["-X", "faulthandler"] if faulthandler == "before" else []), "-c", _SIGBUS_SCRIPT,
            str(tmp_path / "kv.bin"), how, faulthandler]
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert "CAUGHT" in r.stdout and "truncated" in r.stdout, r.stdout + r.stderr[-2000:]
    assert "SURVIVED" not in r.stdout
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stderr[-2000:])
    if faulthandler != "off":
        assert "Bus error" in r.stderr


_UNCACHED_SCRIPT = r"""
import os, sys
import numpy as np, kvx
p, n, bs = sys.argv[1], 64, 4096
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.pwrite(fd, b"\x01" * (n * bs), 0)  # data on disk ...
os.fsync(fd)
os.posix_fadvise(fd, 0, n * bs, os.POSIX_FADV_DONTNEED)  # ... and not in the page cache
os.close(fd)
with kvx.Agent("u", kvx.AgentConfig(backends=("host", "posix"), inline_bytes=0)) as a:
    s = a.register(kvx.FileRegion(p, n * bs))
    m = a.prepare(kvx.DescList.blocks(a.register(np.full(n * bs, 2, np.uint8)), bs))
    f = a.prepare(kvx.DescList.blocks(s, bs))
    for k in range(2):
        print(f"MARK{k}", flush=True)
        a.write(m, np.arange(n), f, np.arange(n)[::-1].copy()).wait(10)
        print(f"END{k}", flush=True)
    assert open(p, "rb").read() == b"\x02" * (n * bs)
"""


def test_mmap_uncached_pages_with_data_go_through_pwritev(tmp_path: Path) -> None:
    """A write fault on a page that is not cached but has data on disk would read it first:
    such runs go through pwritev; once cached, through the mapping."""
    import shutil
    import sys

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=pwritev,madvise,write", "-e", "signal=none",
                        sys.executable, "-c", _UNCACHED_SCRIPT, str(tmp_path / "kv.bin")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    first = r.stderr.split("MARK0", 1)[1].split("END0", 1)[0]
    second = r.stderr.split("MARK1", 1)[1].split("END1", 1)[0]
    assert "pwritev(" in first and "MADV_POPULATE_WRITE" not in first
    assert "MADV_POPULATE_WRITE" in second and "pwritev(" not in second


def test_mmap_release_and_close_unmap(tmp_path: Path) -> None:
    bs, n = 4096, 8
    with _agent() as a:
        mem, sto, _, sreg = _lists(a, pattern(n * bs, 1), kvx.FileRegion(tmp_path / "a.bin", n * bs), bs)
        a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
        assert _maps(tmp_path / "a.bin")
        sreg.release()
        assert not _maps(tmp_path / "a.bin")
        a.register(kvx.FileRegion(tmp_path / "b.bin", n * bs))
        assert _maps(tmp_path / "b.bin")
    assert not _maps(tmp_path / "b.bin")


def test_unmappable_file_falls_back_to_pwritev(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A file the kernel will not map (ENOMEM, ...) stays on pwritev, logged once; a list mixing
    mapped and unmapped files uses pwritev; either way the bytes land."""
    import logging

    from kvx.backends import posix as mod

    real = mod._native.map_fd

    def refuse_f1_f2(fd: int, size: int, off: int, writable: bool) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(("f1.bin", "f2.bin")):
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return int(real(fd, size, off, writable))

    monkeypatch.setattr(mod._native, "map_fd", refuse_f1_f2)
    bs, per = 8192, 8
    caplog.set_level(logging.DEBUG, logger="kvx.backends.posix")
    with _agent() as a:
        regions = [kvx.FileRegion(tmp_path / f"f{i}.bin", per * bs) for i in range(3)]
        buf = pattern(3 * per * bs, 7)
        mem, sto, _, sreg = _lists(a, buf, regions, bs)
        assert [_maps(tmp_path / f"f{i}.bin") for i in range(3)] == [True, False, False]
        warned = [r for r in caplog.records if "cannot map" in r.getMessage()]
        assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG]
        perm = np.random.default_rng(3).permutation(3 * per)
        a.write(mem, np.arange(3 * per), sto, perm).wait(30)  # mixed list: pwritev
        exp = np.empty_like(buf)
        exp.reshape(-1, bs)[perm] = buf.reshape(-1, bs)
        assert b"".join((tmp_path / f"f{i}.bin").read_bytes() for i in range(3)) == exp.tobytes()
        only0 = a.prepare(kvx.DescList.blocks(sreg, bs)[np.arange(per)])  # the mapped file alone
        a.write(mem, np.arange(per), only0, np.arange(per)[::-1].copy()).wait(30)
        assert (tmp_path / "f0.bin").read_bytes() == buf[: per * bs].reshape(per, bs)[::-1].tobytes()


def _cachestat(fd: int, nbytes: int) -> tuple[int, int, int] | None:
    """(cached, dirty, writeback) pages of the file's first ``nbytes`` (cachestat, Linux >= 6.5)."""
    import ctypes

    class Range(ctypes.Structure):
        _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]

    class Stat(ctypes.Structure):
        _fields_ = [(k, ctypes.c_uint64) for k in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    st = Stat()
    rng = Range(0, nbytes)
    if libc.syscall(ctypes.c_long(451), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)):
        return None
    return int(st.cache), int(st.dirty), int(st.writeback)


@pytest.mark.parametrize("mode", ["data", "full"])
def test_mmap_write_sync_writes_back_the_mapped_pages(tmp_path: Path, mode: str) -> None:
    """fdatasync/fsync cover pages dirtied through the mapping: none is dirty after a synced DONE."""
    bs, n = 4096, 256
    with _agent(inline_bytes=0) as a:
        b = a.backend("posix")
        buf = pattern(n * bs, 9)
        mem, sto, _, sreg = _lists(a, buf, kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
        fd = int(b._fd[sreg.slots[0]])
        if _cachestat(fd, n * bs) is None:
            pytest.skip("no cachestat(2) here")
        for _ in range(5):  # without sync the pages stay dirty (unless something else synced meanwhile)
            a.write(mem, np.arange(n), sto, np.arange(n)).wait(10)
            st = _cachestat(fd, n * bs)
            assert st is not None
            if st[1] > 0:
                break
        else:
            pytest.fail("mmap writes never left a dirty page: the check below would prove nothing")
        with _agent(PosixOptions(sync=mode), inline_bytes=0) as synced:  # the same file, written with sync
            mem2, sto2, _, _ = _lists(synced, buf, kvx.FileRegion(tmp_path / "kv.bin", n * bs), bs)
            synced.write(mem2, np.arange(n), sto2, np.arange(n)[::-1].copy()).wait(10)
            st = _cachestat(fd, n * bs)
            assert st is not None and st[0] > 0 and st[1] == 0 and st[2] == 0, st
        assert (tmp_path / "kv.bin").read_bytes() == buf.reshape(n, bs)[::-1].tobytes()


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


_PATHS = {"mmap": {"KVX_POSIX_DIRECT": "0", "KVX_POSIX_MMAP": "1"},
          "pwritev": {"KVX_POSIX_DIRECT": "0", "KVX_POSIX_MMAP": "0"},
          "direct": {"KVX_POSIX_DIRECT": "1", "KVX_POSIX_MMAP": "1"}}


@pytest.mark.parametrize("path", list(_PATHS))
@pytest.mark.parametrize("inline", [1 << 30, 0])
@pytest.mark.parametrize("mode,call", [("none", None), ("data", "fdatasync"), ("full", "fsync")])
def test_sync_modes_issue_the_right_call(tmp_path: Path, mode: str, call: str | None, inline: int,
                                         path: str) -> None:
    """The sync calls per write transfer, and which write path ran (madvise+copy, pwritev)."""
    import shutil
    import sys

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    env = {**os.environ, "KVX_POSIX_SYNC": mode, **_PATHS[path]}
    r = subprocess.run(["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync,write,pwritev,pwrite64,madvise",
                        "-e", "signal=none", sys.executable, "-c", _SYNC_SCRIPT, str(tmp_path / "kv.bin"),
                        str(inline)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # only the calls between MARK and END (the transfers; registration may fsync the new file)
    tail = r.stderr.split('MARK', 1)[1].split('END', 1)[0]
    populate = tail.count("MADV_POPULATE_WRITE") + tail.count("0x17 /*")
    if path == "mmap":
        # at least one populate per write transfer (a run may still take pwritev: on the fresh file
        # another thread's faults read around into it, and cached zero pages look like data)
        assert populate >= 3 and "pwrite64(" not in tail
    elif path == "pwritev":
        assert populate == 0 and tail.count("pwritev(") >= 3
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


def test_options_override_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_POSIX_SYNC", "full")
    monkeypatch.setenv("KVX_POSIX_THREADS", "5")
    with _agent(PosixOptions(direct=True, sync="data", threads=3)) as a:
        b = a.backend("posix")
        assert (b.direct, b.sync, b.threads) == (True, 1, 3)
        s = a.register(kvx.FileRegion(tmp_path / "kv.bin", 8192))
        assert int(b._dfd[s.slots[0]]) >= 0
    with pytest.raises(kvx.UsageError, match="sync"):
        _agent(PosixOptions(sync="maybe"))


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
