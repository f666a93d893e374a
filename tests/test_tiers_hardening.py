"""Regression tests of issue 14 in the tiers: durability after a read, bad arguments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvx
from kvx.tiers import DiskTier, HostTier, TieredStore

BB = 256


def _src(st: TieredStore, data: np.ndarray) -> kvx.PreparedList:
    return st.agent.prepare(kvx.DescList.blocks(st.agent.register(data), BB))


def test_disk_block_survives_clean_close_after_read(tmp_path: Path) -> None:
    """14.7: a read promoted the block to host memory and deleted it from disk, so after a
    clean close() and reopening it was gone."""
    data = np.random.default_rng(1).integers(0, 256, 4 * BB, dtype=np.uint8)
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru") as st:
        st.put([b"a", b"b", b"c", b"d"], _src(st, data))  # a and b go down to disk
        out = np.zeros(2 * BB, np.uint8)
        assert st.get([b"a", b"b"], _src(st, out)) == 2  # read back from disk (promoted)
        assert np.array_equal(out, data[:2 * BB])
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru") as st:
        assert st.lookup([b"a", b"b"]).hits == 2, "a block read before close() is gone after reopening"
        out = np.zeros(2 * BB, np.uint8)
        assert st.get([b"a", b"b"], _src(st, out)) == 2
        assert np.array_equal(out, data[:2 * BB])


def test_disk_block_survives_close_after_read_with_write_through(tmp_path: Path) -> None:
    data = np.random.default_rng(2).integers(0, 256, 4 * BB, dtype=np.uint8)
    keys = [1, 2, 3, 4]
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru",
                     write_through=True) as st:
        st.put(keys, _src(st, data))
        out = np.zeros(4 * BB, np.uint8)
        assert st.get(keys, _src(st, out)) == 4
    with TieredStore([HostTier(blocks=2), DiskTier(tmp_path, blocks=8)], block_bytes=BB, policy="lru") as st:
        assert st.lookup(keys).hits == 4
        out = np.zeros(4 * BB, np.uint8)
        assert st.get(keys, _src(st, out)) == 4
        assert np.array_equal(out, data)


@pytest.mark.parametrize("op", ["put", "get", "lookup", "pin", "unpin", "delete", "prefetch"])
@pytest.mark.parametrize("bad", [None, 5, [None], [1.5], [[1, 2]], [{"a": 1}]])
def test_bad_hashes_are_usage_errors(op: str, bad: object) -> None:
    """14.8: None (or a non-sequence, or unhashable/unsupported keys) raised TypeError/AttributeError
    from inside the store."""
    with TieredStore([HostTier(blocks=4)], block_bytes=BB, policy="lru") as st:
        src = _src(st, np.zeros(4 * BB, np.uint8))
        st.put([b"x"], src, [0])
        args: tuple = (bad, src) if op in ("put", "get") else (bad,)
        if op in ("put", "get") and isinstance(bad, list):
            args = (bad, src, list(range(len(bad))))
        with pytest.raises(kvx.UsageError) as ei:
            getattr(st, op)(*args)
        assert isinstance(ei.value, TypeError)
        assert st.lookup([b"x"]).hits == 1  # nothing lost


def test_bad_destination_is_usage_error() -> None:
    with TieredStore([HostTier(blocks=4)], block_bytes=BB, policy="lru") as st:
        with pytest.raises(kvx.UsageError):
            st.put([b"x"], None)  # type: ignore[arg-type]
        with pytest.raises(kvx.UsageError):
            st.get([b"x"], None)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/proc/x", "/proc/self/status/x"])
def test_disk_tier_in_unusable_directory(path: str) -> None:
    """14.8: DiskTier('/proc/x') raised FileNotFoundError."""
    with pytest.raises(kvx.TierError, match="disk tier"):
        TieredStore([HostTier(blocks=2), DiskTier(path, blocks=4)], block_bytes=BB)


def test_disk_tier_path_type() -> None:
    with pytest.raises(kvx.UsageError):
        DiskTier(None, blocks=4)  # type: ignore[arg-type]


def _full_fs(tmp_path: Path) -> Path:
    """A small tmpfs mounted for the test (unmounted by the caller's finalizer); root only."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    return mnt


def test_disk_tier_with_a_full_filesystem_gives_only_kvx_errors(tmp_path: Path) -> None:
    """The soak's finding: with the disk tier's filesystem full, put/get raised a bare OSError
    (ENOSPC from the journal) and then KeyError (the store's map pointed at a tier whose index no
    longer held the block, because the failed journal write cut the removal short). Now a put or
    get under a full filesystem ends with a kvx error or succeeds, and every block returned is
    the one stored."""
    import os
    import subprocess

    mnt = _full_fs(tmp_path)
    try:
        rng = np.random.default_rng(7)
        with TieredStore([HostTier(blocks=4), DiskTier(mnt, blocks=64)], block_bytes=BB, policy="lru") as st:
            src = rng.integers(0, 256, 256 * BB, dtype=np.uint8)
            plist = _src(st, src)
            out = np.zeros(BB, np.uint8)
            dst = _src(st, out)
            fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # fill what the slab left, so the journal cannot grow
                while os.write(fd, b"\0" * 4096) > 0:
                    pass
            except OSError:
                pass
            finally:
                os.close(fd)
            stored: dict[bytes, int] = {}
            for i in range(256):
                key = i.to_bytes(4, "little")
                try:
                    st.put([key], plist, [i])
                    stored[key] = i
                except kvx.KVXError:
                    pass
                for k in list(stored)[-8:]:
                    try:
                        if st.get([k], dst) == 1:
                            j = stored[k]
                            assert np.array_equal(out, src[j * BB:(j + 1) * BB]), f"block {k!r} came back wrong"
                    except kvx.KVXError:
                        pass  # a miss or a tier error: allowed; a bare OSError/KeyError is not
            assert stored, "no put succeeded: the test would prove nothing"
            disk = st.tiers[1]
            assert disk.retired > 0, "the journal never failed: the test would prove nothing"
            os.unlink(mnt / "filler")  # space again: pending removals are recorded, slots come back
            for i in range(256, 256 + 3 * 64):
                key = i.to_bytes(4, "little")
                st.put([key], plist, [i % 256])
                stored[key] = i % 256
            st.flush()
            assert disk.retired == 0
            for k in list(stored)[-64:]:
                assert st.get([k], dst) == 1
                j = stored[k]
                assert np.array_equal(out, src[j * BB:(j + 1) * BB])
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
