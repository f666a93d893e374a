"""Compare a pytest-benchmark JSON run with the saved baseline: one line per operation.

    python benchmarks/micro/compare.py NEW.json [--baseline benchmarks/micro/baseline.json] [--save]

Prints the medians side by side with their ratio (new / baseline; above 1 is slower) and flags
operations more than ``--tolerance`` (default 1.5x) slower: micro-benchmarks on a shared 2-core
machine move by tens of percent between runs, so only large changes mean something. ``--save``
makes NEW the baseline. Exit status 0 unless ``--strict`` and something is flagged.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def medians(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    return {b["fullname"].split("::", 1)[-1]: float(b["stats"]["median"]) for b in data["benchmarks"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new", type=Path)
    ap.add_argument("--baseline", type=Path, default=HERE / "baseline.json")
    ap.add_argument("--tolerance", type=float, default=1.5)
    ap.add_argument("--save", action="store_true", help="make NEW the baseline")
    ap.add_argument("--strict", action="store_true", help="exit 1 if an operation is flagged")
    a = ap.parse_args(argv)
    new = medians(a.new)
    if a.save or not a.baseline.exists():
        data = json.loads(a.new.read_text())
        for b in data["benchmarks"]:
            b["stats"].pop("data", None)  # every raw sample: the comparison needs the summary only
        a.baseline.write_text(json.dumps(data, indent=1) + "\n")
        print(f"baseline saved: {a.baseline}")
        return 0
    base = medians(a.baseline)
    flagged = 0
    print(f"{'operation':58} {'baseline':>11} {'now':>11} {'ratio':>7}")
    for name in sorted(set(base) | set(new)):
        b, n = base.get(name), new.get(name)
        if b is None or n is None:
            print(f"{name:58} {'-' if b is None else f'{b * 1e6:9.1f}us':>11} "
                  f"{'-' if n is None else f'{n * 1e6:9.1f}us':>11}")
            continue
        r = n / b
        mark = "  SLOWER" if r > a.tolerance else ""
        flagged += bool(mark)
        print(f"{name:58} {b * 1e6:9.1f}us {n * 1e6:9.1f}us {r:7.2f}{mark}")
    return 1 if a.strict and flagged else 0


if __name__ == "__main__":
    sys.exit(main())
