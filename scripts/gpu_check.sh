#!/usr/bin/env bash
# `make gpu-check`: on a GPU machine, build kvx, run the GPU tests, run the cuda benchmark sweep
# and print a compact table. Results (logs, JSON, PNG, table) go to $OUT (default ./out).
# Needs numpy, msgpack, cupy and (for some tests) torch; msgpack is installed from ./.carry if
# missing and no index is reachable.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# NVLink multicast stays off on shared machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
TOTAL=${GPU_CHECK_TOTAL:-256M}
SIZES=${GPU_CHECK_SIZES:-4K,32K,256K,2M,64M}
SEGS=${GPU_CHECK_SEGS:-vram,vram vram,pinned}
ITERS=${GPU_CHECK_ITERS:-9}
TESTS=${GPU_CHECK_TESTS:-1}
# after the table: the CPU time of one kernel post at 4K/32K (call to return) and the wait after it
PROFILE=${GPU_CHECK_PROFILE:-1}

$PY -c "import msgpack" 2>/dev/null || $PY -m pip install -q --no-index --find-links .carry msgpack \
  || { echo "msgpack missing and not installable"; exit 1; }
# NIXL for the side-by-side comparison: the nixl-cu13 wheel from .venv-nixl (git-ignored; carry it)
if ! $PY -c "import nixl_cu13._api" 2>/dev/null && ls .venv-nixl/nixl_cu13*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-deps --no-index .venv-nixl/nixl_cu13*.whl || echo "nixl-cu13 not installable"
fi
# UCX for CUDA 13 and NIXL, slimmed into one carry by `make gpu-carry` (scripts/gpu_carry.sh)
if [ -f .carry/gpu-site.tar.xz ]; then
  [ -d build/gpu-site ] || { mkdir -p build && tar xJf .carry/gpu-site.tar.xz -C build; }
  export PYTHONPATH="$PWD/build/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
COMPARE=""
$PY -c "import kvx.compare.nixl as n; raise SystemExit(n.nixl_available() is not None)" 2>/dev/null \
  && COMPARE="--compare nixl" || echo "NIXL not importable: no NIXL columns"
echo "== build"
$PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
export KVX_BENCH_GPU_NAME="$GPU_NAME x$(nvidia-smi -L | wc -l)"
echo "== device: $KVX_BENCH_GPU_NAME, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1), $(date -u +%F)"
nvidia-smi topo -m 2>/dev/null | head -4
$PY -c "import kvx.backends.cuda as c; print('cuda backend:', c.CudaBackend.unavailable_reason() or 'available')"
UCX_OK=0
$PY -c "import kvx.backends.ucx as u; w = u.UcxBackend.unavailable_reason(); print('ucx backend:', w or 'available'); raise SystemExit(w is not None)" && UCX_OK=1
NGPU=$(nvidia-smi -L | wc -l)

rc=0
if [ "$TESTS" = 1 ]; then
  echo "== tests (gpu)"
  $PY -m pytest -q -p kvx.testing.plugin -rfEs --timeout ${GPU_CHECK_TEST_TIMEOUT:-300} -o addopts="" tests/test_cuda.py tests/test_tcp_gpu.py \
    $([ "$UCX_OK" = 1 ] && echo tests/test_ucx.py tests/test_ucx_staged.py) 2>&1 | tee "$OUT/tests.log" | tail -40
  rc=${PIPESTATUS[0]}
fi

echo "== benchmark: $TOTAL, permuted, block sizes $SIZES"
for seg in $SEGS; do
  tag=${seg/,/-}
  $PY -m kvx.cli bench --backend cuda --seg "$seg" --total "$TOTAL" --block-sizes "$SIZES" --iters "$ITERS" \
    $COMPARE --latency-samples 500 --quiet --json "$OUT/bench-cuda-$tag.json" --plot "$OUT/bench-cuda-$tag.png" \
    >"$OUT/bench-cuda-$tag.txt" 2>&1 || { echo "bench $seg failed:"; tail -30 "$OUT/bench-cuda-$tag.txt"; rc=1; }
done

# ucx between two GPUs over UCX's tcp + cuda_copy (the stand-in for two nodes), NIXL with the same UCX_TLS
if [ "$UCX_OK" = 1 ] && [ "$NGPU" -ge 2 ] && [ "${GPU_CHECK_UCX:-1}" = 1 ]; then
  echo "== benchmark: ucx vram->vram, UCX_TLS=tcp,cuda_copy"
  UCX_TLS=tcp,cuda_copy,self $PY -m kvx.cli bench --backend ucx --seg vram,vram --total "$TOTAL" \
    --block-sizes "${GPU_CHECK_UCX_SIZES:-4K,32K,256K,2M}" --iters "${GPU_CHECK_UCX_ITERS:-3}" $COMPARE --quiet \
    --json "$OUT/bench-ucx-vram-vram.json" >"$OUT/bench-ucx-vram-vram.txt" 2>&1 \
    || { echo "ucx bench failed:"; tail -30 "$OUT/bench-ucx-vram-vram.txt"; rc=1; }
fi

echo "== table"
$PY - "$OUT" <<'PYEOF' | tee "$OUT/gpu-table.md"
import glob, json, os, sys
out = sys.argv[1]
def fs(n):
    for u, m in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m}{u}"
    return str(n)
for path in sorted(glob.glob(os.path.join(out, "bench-cuda-*.json"))):
    d = json.load(open(path))
    h = d["header"]
    seg = "->".join(h.get("seg", []))
    print(f"\n### {seg}  ({h.get('gpu', '?')}, {h['date']}, total {h['total'] >> 20} MiB, permuted)\n")
    rows = [r for r in d["rows"] if "gbps" in r]
    raw = next((r["impl"] for r in rows if r["impl"].startswith("raw")), None)
    print(f"| op | block | kernel GB/s | ce GB/s | NIXL GB/s | {raw} GB/s | kernel/raw | ce/raw | best kvx/NIXL |")
    print("|---|---|---|---|---|---|---|---|---|")
    keys = []
    for r in rows:
        if (r["op"], r["block_bytes"]) not in keys:
            keys.append((r["op"], r["block_bytes"]))
    for op, bs in keys:
        v = {r["impl"]: r["gbps"] for r in rows if r["op"] == op and r["block_bytes"] == bs}
        k, c, w, x = v.get("kvx-kernel"), v.get("kvx-ce"), v.get(raw), v.get("nixl")
        f = lambda x: f"{x:.2f}" if x is not None and x < 10 else (f"{x:.1f}" if x is not None else "-")
        q = lambda a, b: f"{a / b:.2f}" if a and b else "-"
        b = max(k or 0, c or 0)
        print(f"| {op} | {fs(bs)} | {f(k)} | {f(c)} | {f(x)} | {f(w)} | {q(k, w)} | {q(c, w)} | {q(b, x)} |")
    for r in d["rows"]:
        if "error" in r:
            print(f"\n{r['impl']} {r['op']} failed: {r['error'][:300]}")
        if "lat_us_median" in r:
            print(f"\nlatency {r['impl']}, one 4 KiB write (auto path): median {r['lat_us_median']:.1f} us, "
                  f"p99 {r['lat_us_p99']:.1f} us")
for path in sorted(glob.glob(os.path.join(out, "bench-ucx-*.json"))):
    d = json.load(open(path))
    h = d["header"]
    print(f"\n### ucx {'->'.join(h.get('seg', []))}, UCX_TLS=tcp,cuda_copy ({h.get('gpu', '?')}, {h['date']}, permuted)\n")
    print("| op | block | kvx ucx GB/s | NIXL GB/s | kvx/NIXL |")
    print("|---|---|---|---|---|")
    v = {(r["impl"], r["op"], r["block_bytes"]): r["gbps"] for r in d["rows"] if "gbps" in r}
    for (impl, op, bs), g in v.items():
        if impl == "kvx":
            x = v.get(("nixl", op, bs))
            print(f"| {op} | {fs(bs)} | {g:.2f} | {x if x is None else f'{x:.2f}'} | {f'{g / x:.2f}' if x else '-'} |")
    for r in d["rows"]:
        if "error" in r:
            print(f"\n{r['impl']} {r['op']} failed: {r['error'][:300]}")
PYEOF
if [ "$PROFILE" = 1 ]; then
  # the CPU time of one kernel post (call to return) and the rest to completion, medians, timed from
  # outside; the pair's native route and the general path side by side
  echo "== profile: one kernel post at 4K/32K (benchmarks/gpu_tune.py stamps)"
  $PY benchmarks/gpu_tune.py stamps --total "$TOTAL" --block-sizes 4K,32K 2>&1 | tee "$OUT/profile.txt" \
    || echo "profile failed"
fi
exit $rc
