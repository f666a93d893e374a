#!/usr/bin/env bash
# Create (once) the dedicated virtual environment in which the kvx SGLang plugin is tested.
#
# SGLang pins its own torch, so the plugin gets a venv of its own:
#   ${KVX_SGLANG_VENV:-$HOME/.cache/kvx/venv-sglang-0.5.23}
# A stamp file records what was installed; re-runs with the same inputs return at once.
# The editable installs of kvx and kvx_sglang point at this checkout, so code changes need no
# reinstall. NIXL is installed too (its `nixl` meta package, which SGLang's HiCacheNixl imports,
# and the CUDA 13 wheel it picks beside SGLang's cu13 torch): HiCacheNixl is the benchmark's
# reference. Prints the venv path on stdout (last line); progress goes to stderr.
set -euo pipefail

SGLANG_VERSION="${KVX_SGLANG_VERSION:-0.5.23}"
NIXL_VERSION="${KVX_SGLANG_NIXL_VERSION:-1.5.1}"
VENV="${KVX_SGLANG_VENV:-$HOME/.cache/kvx/venv-sglang-${SGLANG_VERSION}}"
PYTHON="${KVX_SGLANG_PYTHON:-python3}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
STAMP="$VENV/.kvx-sglang-stamp"
# The plugin's pyproject (its entry points) is part of the stamp: editing it reinstalls the plugin.
WANT="sglang==${SGLANG_VERSION} nixl==${NIXL_VERSION} etcd3gw repo=${REPO} plugin=$(sha256sum "$HERE/pyproject.toml" | cut -c1-16)"

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
log "installing sglang==${SGLANG_VERSION} (pulls its pinned torch; ~11 GB on first run)"
"${PIP[@]}" install "sglang==${SGLANG_VERSION}" pytest pytest-timeout "etcd3gw>=2.4" >&2  # etcd3gw: kvx[etcd], the pool
log "installing nixl==${NIXL_VERSION} (HiCacheNixl, the benchmark's reference)"
"${PIP[@]}" install --no-deps "nixl==${NIXL_VERSION}" "nixl-cu13==${NIXL_VERSION}" >&2
log "installing kvx (editable) from $REPO"
"${PIP[@]}" install -e "$REPO" >&2
log "installing kvx_sglang (editable) from $HERE"
"${PIP[@]}" install --no-deps -e "$HERE" >&2
echo "$WANT" > "$STAMP"
log "done in $(( $(date +%s) - start ))s"
echo "$VENV"
