#!/usr/bin/env bash
# Run the kvx SGLang plugin's tests in its own venv (created on first use by setup_venv.sh).
# Extra arguments go to pytest, e.g.  plugins/sglang/run_tests.sh -k hicache -x
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$("$HERE/setup_venv.sh" | tail -n 1)"
cd "$HERE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1 SGLANG_DISABLE_USAGE_STATS=1
exec "$VENV/bin/python" -m pytest tests -p no:cacheprovider "$@"
