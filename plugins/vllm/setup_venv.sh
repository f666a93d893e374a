#!/usr/bin/env bash
# Create (once) the dedicated virtual environment in which the kvx vLLM plugin is tested.
#
# vLLM pins its own torch, so the plugin gets a venv of its own:
#   ${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm-0.33.0}
# A stamp file records what was installed; re-runs with the same inputs return at once.
# The editable installs of kvx and kvx_vllm point at this checkout, so code changes need no
# reinstall. Prints the venv path on stdout (last line); progress goes to stderr.
set -euo pipefail

VLLM_VERSION="${KVX_VLLM_VERSION:-0.33.0}"
VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-vllm-${VLLM_VERSION}}"
PYTHON="${KVX_VLLM_PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
STAMP="$VENV/.kvx-vllm-stamp"
WANT="vllm==${VLLM_VERSION} repo=${REPO}"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "$VENV"
    exit 0
fi

log() { echo "[setup_venv] $*" >&2; }
start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" --version 2>&1)"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip >&2
log "installing vllm==${VLLM_VERSION} (pulls its pinned torch; several GB on first run)"
"${PIP[@]}" install "vllm==${VLLM_VERSION}" pytest pytest-timeout >&2
log "installing kvx (editable) from $REPO"
"${PIP[@]}" install -e "$REPO" >&2
log "installing kvx_vllm (editable) from $HERE"
"${PIP[@]}" install --no-deps -e "$HERE" >&2
echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start ))s"
echo "$VENV"
