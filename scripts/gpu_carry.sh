#!/usr/bin/env bash
# `make gpu-carry`: the optional packages `make gpu-check` uses on a GPU machine without network,
# slimmed to fit one carry: UCX 1.22 for CUDA 13 (libucx-cu13: the ucx backend is built against
# it) and NIXL (nixl-cu13, the --compare nixl columns), for Python 3.12. Downloaded from PyPI here,
# unpacked, stripped of what kvx never loads (static libraries, UCX's perftest, NIXL's EP kernels
# and scripts) and packed as .carry/gpu-site.tar.xz (about 30 MB). scripts/gpu_check.sh unpacks it
# into build/gpu-site and puts it on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
UCX=${GPU_CARRY_UCX:-libucx-cu13==1.22.*}
NIXL=${GPU_CARRY_NIXL:-nixl-cu13==1.5.1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$tmp/whl" "$UCX" "$NIXL"
mkdir -p "$tmp/gpu-site" .carry
for w in "$tmp"/whl/*.whl; do (cd "$tmp/gpu-site" && $PY -m zipfile -e "$w" .); done
cd "$tmp/gpu-site"
rm -rf nixl_ep_cu1* libucx/bin nixl_cu1*.scripts
find . -name '*.a' -delete
find . -name '*perftest*' -prune -exec rm -rf {} +
cd "$tmp"
tar cJf gpu-site.tar.xz gpu-site
mv gpu-site.tar.xz "$ROOT/.carry/gpu-site.tar.xz"
echo "wrote .carry/gpu-site.tar.xz ($(du -h "$ROOT/.carry/gpu-site.tar.xz" | cut -f1)): carry .carry to the GPU machine"
