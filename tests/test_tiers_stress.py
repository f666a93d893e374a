"""Issue 26: the tiers stress loop in CI -- three seeds of a tiny host tier over a small disk tier,
one thread doing everything, and the two-thread variant (one thread putting, one getting), each
beside a CPU hog for about half a minute. Zero wrong bytes, zero checksum drops, zero errors.
Before the fix of the promotion race (test_tiers_integrity.py) a run like this dropped a block in
most runs; before the loop fix in the policies' prefix tree (test_policies.py) a two-thread seed
now and then never answered (its eviction walked a loop forever)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvx.testing import tier_stress


@pytest.mark.timeout(420)
@pytest.mark.parametrize("threads", [1, 2])
def test_tiers_stress_beside_a_cpu_hog(tmp_path: Path, threads: int) -> None:
    out = tmp_path / "stress.json"
    rc = tier_stress.main(["--seconds", "25", "--seeds", "15,1,2", "--threads", str(threads), "--hog",
                           "--dir", str(tmp_path), "--json", str(out)])
    report = json.loads(out.read_text())
    total = report["total"]
    assert total["ops"] > 1000, report  # it really ran
    assert total["hits"] > 100, report  # and really read blocks back
    assert (total["wrong"], total["drops"], total["errors"]) == (0, 0, 0), report["seeds"]
    assert rc == 0
