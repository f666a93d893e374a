"""KVX_* settings: every bad value is a UsageError naming the variable, where config is read."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvx
from kvx import config

BAD = [
    ("KVX_PEER_TIMEOUT", "soon"), ("KVX_PEER_TIMEOUT", "-1"), ("KVX_PEER_TIMEOUT", "0"), ("KVX_PEER_TIMEOUT", "nan"),
    ("KVX_PEER_TIMEOUT", "inf"), ("KVX_TRANSFER_TIMEOUT", "1e999"), ("KVX_HANDSHAKE_TIMEOUT", "-inf"),
    ("KVX_BACKENDS", "bogus"), ("KVX_BACKENDS", "host,tpc"), ("KVX_HOST_PATH", "bogus"), ("KVX_HOST_PATH", "shm,cma"),
    ("KVX_COPY_THREADS", "0"), ("KVX_COPY_THREADS", "1.5"), ("KVX_COPY_THREADS", "99999999999999999999"),
    ("KVX_INLINE_BYTES", "-5"), ("KVX_MAX_MESSAGE", "-1"), ("KVX_MAX_MESSAGE", "10"), ("KVX_TCP_STREAMS", "0"),
    ("KVX_TCP_STREAMS", "100000"), ("KVX_TCP_CHUNK", "1"), ("KVX_TCP_RCVLOWAT", str(1 << 40)),
    ("KVX_TCP_SPIN_US", "nan"), ("KVX_TCP_SERVE_SPIN_US", "-3"), ("KVX_CUDA_SPIN_US", "inf"),
    ("KVX_CUDA_COPY", "fast"), ("KVX_CUDA_EXEC", "anywhere"), ("KVX_POSIX_SYNC", "always"),
    ("KVX_POSIX_DIRECT", "maybe"),
    ("KVX_S3_THREADS", "0"), ("KVX_POSIX_THREADS", "-2"), ("KVX_NIXL_LOG", "LOUD"),
    ("KVX_S3_ENDPOINT", "127.0.0.1:9000"), ("KVX_S3_ENDPOINT", "http://:9000"), ("KVX_S3_ENDPOINT", "http://h:99999"),
    ("KVX_S3_ENDPOINT", "ftp://h"), ("KVX_ETCD_ENDPOINTS", "http://ok:2379,gopher://x"),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_bad_value_is_a_usage_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str,
                                                        value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(kvx.UsageError, match=f"^{name}="):
        config.get(name)
    with pytest.raises(kvx.UsageError, match=f"^{name}="):
        config.check_env()


@pytest.mark.parametrize("name", ["KVX_PEER_TIMEOUT", "KVX_BACKENDS", "KVX_HOST_PATH", "KVX_COPY_THREADS"])
def test_agent_config_reports_the_variable(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "nan")
    with pytest.raises(kvx.UsageError, match=f"^{name}='nan'"):
        kvx.AgentConfig()


def test_good_values_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    good = {"KVX_PEER_TIMEOUT": ("2.5", 2.5), "KVX_BACKENDS": (" host, tcp ,", ("host", "tcp")),
            "KVX_HOST_PATH": ("CMA", "cma"), "KVX_COPY_THREADS": ("3", 3), "KVX_INLINE_BYTES": ("0", 0),
            "KVX_CUDA_SPIN_US": ("-1", -1.0), "KVX_NIXL_LOG": ("info", "INFO"), "KVX_POSIX_SYNC": ("Data", "data"),
            "KVX_S3_ENDPOINT": ("http://127.0.0.1:8333", "http://127.0.0.1:8333"),
            "KVX_ETCD_ENDPOINTS": ("127.0.0.1:2379,https://e:1", ("127.0.0.1:2379", "https://e:1"))}
    for name, (raw, want) in good.items():
        monkeypatch.setenv(name, raw)
        assert config.get(name) == want, name
    config.check_env()
    c = kvx.AgentConfig()
    assert (c.peer_timeout, c.backends, c.host_path, c.copy_threads) == (2.5, ("host", "tcp"), "cma", 3)


def test_defaults_pass_their_own_checks() -> None:
    """Every default, written as an environment value, parses back to itself."""
    for s in config.SETTINGS.values():
        if s.default is None or s.default == ():
            continue
        raw = ",".join(s.default) if isinstance(s.default, tuple) else str(s.default).lower() \
            if isinstance(s.default, bool) else str(s.default)
        assert s.kind(raw) == s.default, s.name


def test_explicit_agent_config_values_are_checked() -> None:
    for kw in ({"peer_timeout": float("inf")}, {"transfer_timeout": float("nan")}, {"handshake_timeout": True},
               {"copy_threads": 0}, {"copy_threads": 2.0}, {"inline_bytes": -1}, {"backends": (1,)}):
        with pytest.raises(kvx.UsageError):
            kvx.AgentConfig(**kw)  # type: ignore[arg-type]


def test_bad_variable_in_a_fresh_process_is_one_clear_error() -> None:
    """As a user meets it: the error names the variable (no OverflowError from deep inside a backend)."""
    r = subprocess.run([sys.executable, "-c", "import kvx; kvx.Agent('a').close()"], capture_output=True, text=True,
                       timeout=60, env={**__import__("os").environ, "KVX_PEER_TIMEOUT": "inf"})
    assert r.returncode == 1 and "kvx.errors.UsageError: KVX_PEER_TIMEOUT='inf'" in r.stderr
