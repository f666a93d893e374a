"""The kvx console script and the example, run as a user would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvx(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvx.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def refused(r: subprocess.CompletedProcess[str], cause: str) -> None:
    """Exit status 2 and one line on stderr that names the cause; nothing ran (no table printed)."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and cause in lines[0] and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "| op |" not in r.stdout


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SMALL = ("--total", "1M", "--block-sizes", "256K", "--iters", "1", "--latency-samples", "0", "--quiet")


def test_info() -> None:
    r = kvx("info", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backends"]["host"] == "available"
    assert info["host_paths"]["shm"].startswith("yes")


def test_bench_small_json(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    png = tmp_path / "b.png"
    r = kvx("bench", "--backend", "host", "--total", "8M", "--block-sizes", "4K,1M", "--iters", "2",
            "--latency-samples", "50", "--json", str(out), "--plot", str(png), "--quiet")
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    rows = [x for x in data["rows"] if x["impl"] == "kvx" and "gbps" in x]
    assert {(x["op"], x["block_bytes"]) for x in rows} == {("write", 4096), ("write", 1 << 20), ("read", 4096),
                                                            ("read", 1 << 20)}
    assert all(x["verified"] and x["gbps"] > 0 for x in rows)
    assert any(x["impl"] == "kvx-plan" for x in data["rows"])
    assert png.stat().st_size > 1000
    assert "| op | block |" in r.stdout


def test_bench_rejects_bad_sizes() -> None:
    r = kvx("bench", "--block-sizes", "4Q")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = kvx("bench", "--total", "4K", "--block-sizes", "8K")
    assert r.returncode == 2


def test_bench_without_latency_test(tmp_path: Path) -> None:
    """``--latency-samples 0`` skips the latency test (small totals time whole small transfers)."""
    out = tmp_path / "b.json"
    r = kvx("bench", "--backend", "host", "--total", "64K", "--block-sizes", "16K", "--iters", "3",
            "--latency-samples", "0", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert not [x for x in rows if "lat_us_median" in x]
    assert {(x["op"], x["block_bytes"]) for x in rows if x["impl"] == "kvx"} == {("write", 16384), ("read", 16384)}
    assert "| latency |" not in r.stdout
    for bad in (("--latency-samples", "-1"), ("--iters", "0"), ("--total", "0")):
        r = kvx("bench", "--backend", "host", "--total", "64K", "--block-sizes", "16K", *bad)
        assert r.returncode == 2 and "must be" in r.stderr and "Traceback" not in r.stderr


def test_bench_rounds_report_medians(tmp_path: Path) -> None:
    """``--rounds 3`` runs the benchmark three times and reports per point the median of the
    three rounds' figures, keeping each round's; a bad count is one line and exit 2."""
    out = tmp_path / "b.json"
    r = kvx("bench", "--backend", "host", "--total", "1M", "--block-sizes", "256K", "--iters", "1", "--rounds", "3",
            "--latency-samples", "20", "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    bw = [x for x in rows if x["impl"] == "kvx" and "gbps" in x]
    assert len(bw) == 2
    for x in bw:
        assert x["rounds"] == 3 and len(x["gbps_rounds"]) == 3
        assert x["gbps"] == sorted(x["gbps_rounds"])[1]
    assert all(x["rounds"] == 3 for x in rows if "lat_us_median" in x)
    for bad in ("0", "101", "x"):
        r = kvx("bench", "--backend", "host", "--total", "64K", "--block-sizes", "16K", "--rounds", bad)
        assert r.returncode == 2 and "Traceback" not in r.stderr


def test_merge_rounds_ratio_spread() -> None:
    """The table's ratio is of the medians, with the lowest and highest per-round ratio."""
    from kvx.bench import format_table, merge_rounds

    def rnd(a: float, b: float) -> list[dict[str, object]]:
        return [{"impl": "kvx", "op": "write", "block_bytes": 4096, "gbps": a},
                {"impl": "nixl", "op": "write", "block_bytes": 4096, "gbps": b}]

    rows = merge_rounds([rnd(2.0, 1.0), rnd(3.0, 1.0), rnd(1.0, 2.0)])
    assert [x["gbps"] for x in rows] == [2.0, 1.0]
    assert "| write | 4K | 2.00 | 1.00 | 2.00x (0.50-3.00) |" in format_table(rows)


PROGRESS = ("bench", "--backend", "host", "--total", "1M", "--block-sizes", "256K", "--iters", "1",
            "--latency-samples", "0")


def test_bench_progress_in_a_log_is_one_line_per_step(tmp_path: Path) -> None:
    """stdout and stderr to a file (``make bench > log 2>&1``): one plain line per step, no
    carriage-return frames of a bar, in either stream."""
    log = tmp_path / "log"
    with open(log, "wb") as f:
        r = subprocess.run([sys.executable, "-m", "kvx.cli", *PROGRESS], stdout=f, stderr=f, timeout=120)
    out = log.read_bytes()
    assert r.returncode == 0, out[-3000:]
    assert b"\r" not in out and b"| op | block |" in out
    steps = [ln for ln in out.splitlines() if ln.startswith(b"[")]
    assert steps[0].startswith(b"[1/") and b"kvx write 256K" in out and len(steps) >= 4, out[-3000:]


def test_bench_progress_on_a_terminal_is_a_live_bar() -> None:
    """stderr on a terminal (a pty), stdout to a pipe (``make bench > log``): the bar goes to the
    terminal, the table alone to stdout."""
    import fcntl
    import importlib.util
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kvx.cli", *PROGRESS], stdout=subprocess.PIPE,
                                stderr=slave, close_fds=True)
    finally:
        os.close(slave)
    term = b""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 1.0)[0]:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            term += chunk
        stdout = proc.communicate(timeout=10)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)
    assert proc.returncode == 0, term[-3000:]
    assert b"| op | block |" in stdout and b"\r" not in stdout and b"step" not in stdout
    if importlib.util.find_spec("tqdm") is not None:
        assert b"\r" in term and b"step" in term, term[-3000:]
    else:
        assert b"[1/" in term, term[-3000:]


def test_bench_path_must_be_a_directory(tmp_path: Path) -> None:
    """A mistyped ``--path`` is an error, not a directory created on the way."""
    missing = tmp_path / "no" / "such"
    r = kvx("bench", "--backend", "posix", "--path", str(missing), "--total", "1M", "--block-sizes", "64K")
    assert r.returncode == 2 and "not an existing directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "no").exists()


def test_bench_unknown_or_unavailable_backend_is_a_clear_error() -> None:
    r = kvx("bench", "--backend", "bogus", "--total", "4M")
    assert r.returncode == 2 and "unknown backend 'bogus'" in r.stderr and "Traceback" not in r.stderr
    from kvx.backends.cuda import CudaBackend

    if CudaBackend.unavailable_reason() is not None:  # a CPU machine: cupy or the GPU missing
        r = kvx("bench", "--backend", "cuda", "--total", "4M")
        assert r.returncode == 2 and "cuda backend is not available here" in r.stderr
        assert "Traceback" not in r.stderr


def test_replay_json(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    reqs = [[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [9], [1, 2, 3]]
    trace.write_text("".join(json.dumps({"timestamp": i, "hash_ids": r}) + "\n" for i, r in enumerate(reqs)))
    r = kvx("replay", str(trace), "--capacity", "100", "--json", "--policy", "lru")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # hits: req2 [1,2], req3 [1,2,3], req5 [1,2,3] -> 2+3+3 = 8 of 14 refs
    assert res["requests"] == 5 and res["block_refs"] == 14 and res["hits"] == 8
    assert abs(res["hit_rate"] - 8 / 14) < 1e-9 and res["ops_per_s"] > 0 and "tier_hits" in res
    r = kvx("replay", str(tmp_path / "missing.jsonl"), "--capacity", "10")
    assert r.returncode == 2


def test_quickstart_example() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DONE: 2097152 bytes via host")


@pytest.mark.parametrize(("args", "env", "cause"), [
    (("--backend", "posix", "--path", "/proc", *SMALL), {}, "--path /proc: cannot create files there"),
    (("--compare", "bogus", *SMALL), {}, "unknown comparison 'bogus'"),
    (("--json", "/nonexistent/x.json", *SMALL), {}, "--json /nonexistent/x.json: cannot write it"),
    (("--json", "/proc/x.json", *SMALL), {}, "--json /proc/x.json: cannot write it"),
    (("--json", "/tmp", *SMALL), {}, "--json /tmp: is a directory"),
    (("--plot", "/nonexistent/x.png", *SMALL), {}, "--plot /nonexistent/x.png: cannot write it"),
    (("--total", "99999999G", "--quiet"), {}, "--total must be"),
    (("--total", "100000G", "--quiet"), {}, "of host memory at once"),
    (("--block-sizes", "", "--total", "1M"), {}, "--block-sizes: no block size given"),
    (("--block-sizes", ",", "--total", "1M"), {}, "--block-sizes: no block size given"),
    (("--seed", "-1", *SMALL), {}, "--seed must be >= 0"),
    (("--seg", "dram,vram,pinned", *SMALL), {}, "--seg takes"),
    (("--seg", "hbm", *SMALL), {}, "--seg takes"),
    (("--backend", "tcp", "--peer", "h:1", *SMALL), {}, "--peer"),
    (("--path", "/tmp", *SMALL), {}, "--path applies to"),
    (SMALL, {"KVX_PEER_TIMEOUT": "soon"}, "KVX_PEER_TIMEOUT='soon'"),
    (SMALL, {"KVX_PEER_TIMEOUT": "inf"}, "KVX_PEER_TIMEOUT='inf'"),
    (SMALL, {"KVX_BACKENDS": "bogus"}, "KVX_BACKENDS='bogus': unknown backend"),
    (SMALL, {"KVX_HOST_PATH": "bogus"}, "KVX_HOST_PATH='bogus'"),
    (("--backend", "s3", *SMALL), {"KVX_S3_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}, "does not answer"),
    (("--backend", "s3", *SMALL), {"KVX_S3_ENDPOINT": "127.0.0.1:9000"}, "KVX_S3_ENDPOINT='127.0.0.1:9000'"),
])
def test_bench_refuses_with_one_line_before_running(args: tuple[str, ...], env: dict[str, str], cause: str) -> None:
    """Issue 14.9: each of these was a traceback ("bench target exited with 1"), or exit 0 for an empty
    --block-sizes; now one line naming the cause, exit 2, checked before anything runs."""
    refused(kvx("bench", *args, env=env, timeout=60), cause)


def test_bench_plot_without_matplotlib(tmp_path: Path) -> None:
    """``--plot`` where matplotlib cannot be imported is refused up front (a None entry in
    sys.modules is how Python marks a module as absent)."""
    code = ("import sys; sys.modules['matplotlib'] = None; from kvx.cli import main; "
            f"sys.exit(main(['bench', '--plot', {str(tmp_path / 'p.png')!r}, *{list(SMALL)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    refused(r, "--plot needs matplotlib")
    assert not (tmp_path / "p.png").exists()


def test_info_with_a_bad_setting_is_one_line() -> None:
    refused(kvx("info", env={"KVX_HOST_PATH": "teleport"}), "KVX_HOST_PATH='teleport'")


def test_argument_errors_are_one_line() -> None:
    for args in (("bench", "--total", "lots"), ("bench", "--iters", "x"), ("bench", "--bogus"), ("nope",), ()):
        r = kvx(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr, r.stderr


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> object:
    """A tmpfs mount of our own (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts: list[Path] = []

    def mount(opts: str) -> Path:
        d = tmp_path / f"mnt{len(mounts)}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(d)
        return d

    yield mount
    for d in mounts:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_bench_on_a_full_filesystem(small_tmpfs: object) -> None:
    """A filesystem without room for the bench's files is refused up front; one that runs out of
    space during the run (a tmpfs with inodes for two of the three files: ENOSPC on the third)
    ends the run with one line naming the error, exit 2, and leaves no file behind."""
    small = small_tmpfs("size=2M")  # type: ignore[operator]
    refused(kvx("bench", "--backend", "posix", "--path", str(small), *SMALL), "2.0 MiB is free")
    tight = small_tmpfs("size=16M,nr_inodes=3")  # type: ignore[operator]  # the root + two files
    r = kvx("bench", "--backend", "posix", "--path", str(tight), *SMALL)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "No space left on device" in r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tight) == []


def test_a_dying_bench_target_names_its_cause() -> None:
    """A target process that fails reports why (its last stderr line), not only its exit status."""
    from kvx.bench import BenchError, BenchOptions
    from kvx.bench.host import Target

    with pytest.raises(BenchError, match=r"exited with 2: bench target: KVX_HOST_PATH='bogus'"):
        Target(BenchOptions(total=1 << 20), env={"KVX_HOST_PATH": "bogus"})
