"""Property tests of the ``kvx`` command line (``bench`` and ``info``; ``replay`` has its own).

Random argument lists never end in a traceback: parsing and checking either accept them or refuse
them with exit status 2 and one line on stderr. The in-process properties drive the parser and
``kvx bench``'s checks (what runs before any work starts) without running a benchmark; a few
random command lines run end to end in a subprocess, with tiny totals and a timeout.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvx
from kvx import cli, config
from kvx.bench import BenchOptions

VALUE_FLAGS = ["--backend", "--op", "--block-sizes", "--total", "--iters", "--seed", "--compare", "--mem", "--seg",
               "--peer", "--path", "--latency-samples", "--json", "--plot"]
BOOL_FLAGS = ["--no-permute", "--quiet", "--json", "--help", "-h", "--", "-", "--tot", "--bogus"]
WORDS = ["host", "tcp", "posix", "s3", "cuda", "gds", "bogus", "read", "write", "both", "4K", "0", "-1", "1M", "64K",
         "99999999G", "", ",", "4K,,2M", "nixl", "nixl,bogus", "alloc", "numpy", "dram,vram", "vram,pinned,dram",
         "/proc", "/proc/x.json", "/nonexistent/x", "/tmp", "-", "1e3", "0x10", "nan", "inf", "\u0661\u0662K", "\u00b2",
         "1_000", "4 K", "9" * 5000, "a\x00b", "\udcff", "h:1"]

value = st.one_of(st.sampled_from(WORDS), st.text(max_size=10), st.integers(-(2 ** 70), 2 ** 70).map(str))
token = st.one_of(st.sampled_from(VALUE_FLAGS + BOOL_FLAGS), value,
                  st.tuples(st.sampled_from(VALUE_FLAGS), value).map(lambda t: f"{t[0]}={t[1]}"))
# a valid base (most of the time) that the random tokens after it override or break, so that the checks
# behind the first ones are reached too
BASE = ["--total", "4M", "--block-sizes", "4K,64K", "--iters", "1", "--latency-samples", "0"]
pair = st.tuples(st.sampled_from(VALUE_FLAGS), st.sampled_from(WORDS)).map(list)
argvs = st.tuples(st.sampled_from(["bench", "info", "bench", "bogus", "--help"]), st.booleans(),
                  st.lists(st.one_of(token, pair, st.tuples(st.sampled_from(VALUE_FLAGS), value).map(list)),
                           max_size=6))


def _flatten(cmd: str, base: bool, parts: list[Any]) -> list[str]:
    out = [cmd] + (BASE if base and cmd == "bench" else [])
    for p in parts:
        out.extend(p if isinstance(p, list) else [p])
    return out


def _one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1 and "Traceback" not in text


def parse_and_check(argv: list[str]) -> tuple[int, str]:
    """What ``kvx`` does before any work: parse, then (bench) build and check the options.
    Returns (exit status, stderr): 0 when the command would start."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            a = cli.build_parser().parse_args(argv)
        except SystemExit as exc:
            return int(exc.code or 0), err.getvalue()
    if a.cmd != "bench":
        assert a.cmd == "info"
        return 0, ""
    try:
        opts = cli.bench_options(a)
    except kvx.UsageError as exc:
        return 2, f"kvx bench: {cli._one_line(exc)}\n"
    assert isinstance(opts, BenchOptions)
    assert opts.total > 0 and opts.block_sizes and all(0 < b <= opts.total for b in opts.block_sizes)
    return 0, ""


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argvs)
@example(("bench", True, [["--json", "a\x00b"]]))
@example(("bench", True, [["--plot", "a\x00b"]]))
@example(("bench", True, [["--backend", "posix"], ["--path", "a\x00b"]]))
@example(("bench", True, [["--json", "\udcff/x"]]))
@example(("bench", True, [["--iters", "9" * 30]]))
def test_random_arguments_parse_or_are_refused_in_one_line(parts: tuple[str, bool, list[Any]]) -> None:
    argv = _flatten(*parts)
    with tempfile.TemporaryDirectory() as d, contextlib.chdir(d):  # relative --json/--path land here
        rc, err = parse_and_check(argv)
        assert os.listdir(d) == [], "checking left files behind"
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:
        assert _one_line(err), (argv, err)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(config.SETTINGS)), st.one_of(st.sampled_from(WORDS), st.text(max_size=12)))
def test_any_setting_value_parses_or_is_a_usage_error(name: str, raw: str) -> None:
    """A KVX_* value is either taken or refused with a UsageError naming the variable."""
    if "\x00" in raw:
        return  # cannot be in an environment at all
    old = os.environ.get(name)
    os.environ[name] = raw
    try:
        try:
            config.get(name)
        except kvx.UsageError as exc:
            assert str(exc).startswith(f"{name}="), exc
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


# End to end, in a subprocess: the real console script, bounded. Sizes stay tiny, so a command line
# that passes the checks runs a short benchmark (or prints help/info) and exits 0.
# any text a command line can carry (an argv string has no NUL and no lone surrogate)
small_value = st.one_of(st.sampled_from(["64K", "256K", "1M", "0", "-4K", "", ",", "2M", "1G", "x", "4K,64K"]),
                        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=6))
run_argv = st.tuples(
    st.sampled_from(["bench", "info"]),
    st.sampled_from(["host", "tcp", "posix", "bogus", "s3"]),
    small_value, small_value,
    st.lists(st.sampled_from(["--no-permute", "--op=read", "--op=write", "--mem=numpy", "--compare=bogus",
                              "--seg=vram", "--json=/proc/x", "--seed=-1", "--iters=0", "--bogus", "--json"]),
             max_size=2),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run_argv)
def test_random_command_lines_end_to_end(t: tuple[str, str, str, str, list[str]]) -> None:
    cmd, backend, total, sizes, extra = t
    if cmd == "info":
        argv = ["info", *(["--json"] if "--json" in extra else [])]
    else:
        argv = ["bench", "--backend", backend, f"--total={total}", f"--block-sizes={sizes}", "--iters", "1",
                "--latency-samples", "5", "--quiet", *extra]
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([sys.executable, "-m", "kvx.cli", *argv], capture_output=True, text=True, timeout=120,
                           cwd=d, env={**os.environ, "KVX_S3_ENDPOINT": "http://127.0.0.1:1"})
    assert r.returncode in (0, 2), (argv, r.returncode, r.stderr[-3000:])
    if r.returncode == 2:
        assert _one_line(r.stderr), (argv, r.stderr[-3000:])
    else:
        assert "Traceback" not in r.stderr, (argv, r.stderr[-3000:])
