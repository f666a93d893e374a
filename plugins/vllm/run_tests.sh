#!/usr/bin/env bash
# Run the kvx vLLM plugin's tests in its own venv (created on first use by setup_venv.sh).
# Extra arguments go to pytest, e.g.  plugins/vllm/run_tests.sh -k offload -x
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$("$HERE/setup_venv.sh" | tail -n 1)"
cd "$HERE"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
set +e
"$VENV/bin/python" -m pytest -p no:cacheprovider "$@"  # testpaths: tests
rc=$?
exit $rc
