"""close / remove_peer / release (initiator and target side) racing in-flight transfers, and
prepared lists that outlive their peer, on every same-node path of the host backend (shm, cma,
uds) and on tcp (issue 14).

Every scenario runs in a forked child of a runner process (``python -m kvx.testing.races run``)
with its target agent in another process, so a segfault is a failed test that names the signal
and shows the Python stacks, not a dead test run. The four paths' runners start together (at the
first test) and each scenario is bounded in time. The invariants are listed in
:mod:`kvx.testing.races`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from kvx.testing.races import PATHS, SCENARIOS

#: seconds one scenario may run (it bounds every wait itself; this catches a hang)
LIMIT = 60.0
_runs: dict[str, subprocess.Popen[str]] = {}
_results: dict[str, dict[str, dict[str, Any]]] = {}


def _start_all() -> None:
    if _runs:
        return
    for path in PATHS:
        cmd = [sys.executable, "-m", "kvx.testing.races", "run", "--path", path, "--rounds", "1", "--limit", str(LIMIT)]
        _runs[path] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       start_new_session=True)


def _results_of(path: str) -> dict[str, dict[str, Any]]:
    _start_all()
    if path not in _results:
        proc = _runs[path]
        bound = LIMIT * (len(SCENARIOS) + 1)
        try:
            out, err = proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        res = {}
        for line in out.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                res[r["scenario"]] = r
        if proc.returncode not in (0, 1):
            how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit status {proc.returncode}")
            res["_runner"] = {"crash": f"the runner itself ended with {how}", "stderr": err[-4000:]}
        _results[path] = res
    return _results[path]


@pytest.fixture(scope="module", autouse=True)
def _stop_runners() -> Any:
    """Runners still going when the module ends (-x, -k, an interrupt) are killed with their children."""
    yield
    for proc in _runs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    _runs.clear()
    _results.clear()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_race(path: str, scenario: str) -> None:
    """One scenario on one path: no crash, no hang, no late or stale byte, only kvx errors."""
    res = _results_of(path)
    r = res.get(scenario)
    if r is None:
        runner = res.get("_runner", {})
        pytest.fail(f"{scenario} on {path}: no result. {runner.get('crash', '')}\n{runner.get('stderr', '')}")
    if r["crash"]:
        pytest.fail(f"{scenario} on {path}: the initiator process {r['crash']}\n{r['stderr']}")
    assert not r["violations"], (f"{scenario} on {path}:\n  " + "\n  ".join(r["violations"])
                                 + f"\noutcomes: {r['outcomes']}")
    assert r["outcomes"], "the scenario ran no transfer"
