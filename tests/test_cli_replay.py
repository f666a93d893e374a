"""`kvx replay`: every bad input is one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REQS = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9], [1, 2, 3]]


def kvx(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvx.cli", "replay", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def one_line_exit_2(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvx replay: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "hash_ids": r}) + "\n" for i, r in enumerate(REQS)))
    return p


@pytest.mark.parametrize("line, word", [
    ("[1, 2, 3]", "hash_ids"),                                    # a JSON array, not an object
    ('{"hash_ids": [[1, 2], 3]}', "integers"),                    # nested hash_ids
    ('{"hash_ids": [1, "x"]}', "integers"),
    ('{"hash_ids": 7}', "hash_ids"),
    ('{"hash_ids": [1, 2]', "not JSON"),                          # truncated
    ("\xff\xfe", "not JSON"),
])
def test_bad_trace_lines(tmp_path: Path, line: str, word: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"hash_ids": [1, 2]}\n' + line.encode("utf-8", "surrogateescape") + b"\n")
    one_line_exit_2(kvx(str(p), "--capacity", "10"), word, ":2:")


@pytest.mark.parametrize("args, word", [
    (["--block-bytes", "0"], "--block-bytes"),
    (["--block-bytes", "-4"], "--block-bytes"),
    (["--disk", "-1"], "--disk"),
    (["--s3", "-1"], "--s3"),
    (["--limit", "-1"], "--limit"),
    (["--policy", "bogus"], "bogus"),
    (["--capacity", "0"], "--capacity"),
    (["--capacity", str(1 << 50)], "memory"),
    (["--capacity", "10", "--disk", str(1 << 50), "--block-bytes", "4096"], "free space"),
])
def test_bad_arguments(trace: Path, args: list[str], word: str) -> None:
    if "--capacity" not in args:
        args = ["--capacity", "10", *args]
    one_line_exit_2(kvx(str(trace), *args), word)


def test_limit_zero_means_all_and_limit_counts(trace: Path) -> None:
    r = kvx(str(trace), "--capacity", "10", "--json", "--limit", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["requests"] == 2
    r = kvx(str(trace), "--capacity", "10", "--json")
    assert json.loads(r.stdout.splitlines()[-1])["requests"] == len(REQS)


def test_unreachable_s3(trace: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"KVX_S3_ENDPOINT": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"}
    one_line_exit_2(kvx(str(trace), "--capacity", "1", "--s3", "4", env=env, timeout=180), "unreachable")


def test_progress_bar_shows_hit_rate(trace: Path) -> None:
    r = kvx(str(trace), "--capacity", "100", "--policy", "lru", "--progress", "--json")
    assert r.returncode == 0, r.stderr
    assert "hit rate 0.5714" in r.stderr and f"{len(REQS)}/{len(REQS)} req" in r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["hits"] == 8
