"""One configuration mechanism: each backend's options dataclass, seeded from ``KVX_*`` by
``kvx.config`` and passed in through ``AgentConfig(options=...)`` (issue 15.2)."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import numpy as np
import pytest

import kvx
from kvx import config
from kvx.backends import registry
from kvx.backends.posix import PosixOptions
from kvx.backends.s3 import S3Options
from kvx.backends.tcp import TcpOptions
from kvx.testing import seaweed as _seaweed

seaweedfs = _seaweed.seaweedfs


def test_defaults_come_from_the_environment_when_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVX_POSIX_THREADS", "3")
    monkeypatch.setenv("KVX_POSIX_SYNC", "data")
    o = PosixOptions()
    assert (o.threads, o.sync) == (3, "data")
    monkeypatch.setenv("KVX_POSIX_THREADS", "5")
    assert o.threads == 3 and PosixOptions().threads == 5  # read once, when the object is made
    monkeypatch.setenv("KVX_POSIX_THREADS", "zero")
    with pytest.raises(kvx.UsageError, match="KVX_POSIX_THREADS"):
        PosixOptions()


def test_options_reach_the_backend(tmp_path: pathlib.Path) -> None:
    cfg = kvx.AgentConfig(backends=("posix",), options={"posix": PosixOptions(threads=2, sync="full", mmap=False)})
    with kvx.Agent("a", cfg) as a:
        be: Any = a.backend("posix")
        assert (be.threads, be.mmap, be.opts.sync) == (2, False, "full")
        reg = a.register(kvx.FileRegion(str(tmp_path / "f"), 1 << 16))
        src = np.arange(1 << 16, dtype=np.uint8)
        mem = a.prepare(kvx.DescList.blocks(a.register(src), 4096))
        sto = a.prepare(kvx.DescList.blocks(reg, 4096))
        a.write(mem, np.arange(16), sto, np.arange(16)).wait(30)
        assert (tmp_path / "f").read_bytes() == src.tobytes()


@pytest.mark.parametrize("fast_max", [0, 65536])
def test_tcp_options_reach_the_wire(fast_max: int) -> None:
    """Three streams are advertised to the peer; with the low-latency path off, small transfers
    take the regular streams and still land."""
    opts = {"tcp": TcpOptions(streams=3, fast_max=fast_max, spin_us=0.0)}
    with kvx.Agent("t", kvx.AgentConfig(backends=("tcp",), options=opts)) as t, \
            kvx.Agent("i", kvx.AgentConfig(backends=("tcp",), options=opts)) as i:
        be: Any = i.backend("tcp")
        assert (be.streams, be.fast_max, be.spin) == (3, fast_max, 0.0)
        dst = np.zeros(1 << 16, np.uint8)
        remote_descs = kvx.DescList.blocks(t.register(dst), 4096)
        src = np.arange(1 << 16, dtype=np.uint8)
        local = i.prepare(kvx.DescList.blocks(i.register(src), 4096))
        remote = i.prepare(remote_descs, peer=i.add_peer(t.metadata()))
        assert i.backend("tcp").metadata()["streams"] == 3
        i.write(local, [0, 1], remote, [3, 2]).wait(10)
        assert np.array_equal(dst[2 * 4096:3 * 4096], src[4096:8192])  # block 1 -> 2
        assert np.array_equal(dst[3 * 4096:4 * 4096], src[:4096])  # block 0 -> 3
        assert not dst[:2 * 4096].any() and not dst[4 * 4096:].any()


@pytest.mark.parametrize("kw, match", [
    ({"threads": 0}, "threads"),
    ({"sync": "sometimes"}, "sync"),
    ({"threads": True}, "threads"),
])
def test_values_set_in_code_pass_the_settings_rules(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(kvx.UsageError, match=match):
        kvx.AgentConfig(options={"posix": PosixOptions(**kw)})


def test_options_must_fit_their_backend() -> None:
    with pytest.raises(kvx.UsageError, match="must be a PosixOptions"):
        kvx.Agent("a", kvx.AgentConfig(backends=("posix",), options={"posix": S3Options(threads=2)}))
    with pytest.raises(kvx.UsageError, match="no such backend|unknown backend"):
        kvx.Agent("a", kvx.AgentConfig(backends=("posix",), options={"nope": PosixOptions()}))
    with pytest.raises(kvx.UsageError, match="takes no options"):
        kvx.Agent("a", kvx.AgentConfig(backends=("host",), options={"host": PosixOptions()}))
    with pytest.raises(kvx.UsageError, match="options maps"):
        kvx.AgentConfig(options={"posix": {"threads": 2}})  # type: ignore[dict-item]


def test_s3_credentials_through_options(seaweedfs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials given in code reach both request paths, with none in the environment; the
    options' repr never shows the secret."""
    env = seaweedfs.env()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
              "AWS_ENDPOINT_URL_S3", "KVX_S3_ENDPOINT", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    opts = S3Options(endpoint=env["AWS_ENDPOINT_URL"], access_key_id=env["AWS_ACCESS_KEY_ID"],
                     secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
    assert env["AWS_SECRET_ACCESS_KEY"] not in repr(opts)
    with kvx.Agent("a", kvx.AgentConfig(backends=("host", "s3"), options={"s3": opts})) as a:
        objs = [kvx.ObjectRegion("kvx-options", f"k{i}", 1 << 16) for i in range(4)]
        sto = a.prepare(a.register(objs))
        src = np.random.default_rng(1).integers(0, 256, 4 << 16, dtype=np.uint8)
        mem = a.prepare(kvx.DescList.blocks(a.register(src), 1 << 16))
        a.write(mem, np.arange(4), sto, np.arange(4)).wait(60)
        dst = np.zeros_like(src)
        back = a.prepare(kvx.DescList.blocks(a.register(dst), 1 << 16))
        a.read(back, np.arange(4), sto, np.arange(4)[::-1].copy()).wait(60)
        assert np.array_equal(dst.reshape(4, -1), src.reshape(4, -1)[::-1])
    with pytest.raises(kvx.UsageError, match="both"):
        S3Options(access_key_id="x")


def test_settings_doc_lists_every_option() -> None:
    """docs/settings.md names every options class and each of its fields with its variable."""
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "settings.md").read_text()
    for name in registry.names():
        cls = registry.get(name)
        if cls.Options is None:
            continue
        assert f"`{cls.Options.__name__}`" in doc, f"{cls.Options.__name__} missing from docs/settings.md"
        for fname, env in config.options_fields(cls.Options):
            assert f"`{fname}` | `{env}`" in doc, f"{cls.Options.__name__}.{fname} ({env}) missing"


def test_settings_doc_lists_every_field() -> None:
    """Every field of every options class, the advanced ones without a variable (``CudaOptions``)
    included, has a row of its class in docs/settings.md."""
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "settings.md").read_text()
    for name in registry.names():
        cls = registry.get(name).Options
        if cls is None:
            continue
        rows = "\n".join(line for line in doc.splitlines() if line.startswith(f"| `{cls.__name__}` |"))
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in rows, f"{cls.__name__}.{f.name} missing from docs/settings.md"
