# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: install serve test test-distributed bench fuzz clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/mlx-sidecar serve --preload $(ARGS)

test: install
	sh scripts/ensure-prometheus.sh
	$(PY) -m pytest -q -m "not distributed" $(ARGS)

# Scale-out: real 2-rank groups on loopback (ring backend, CPU), ~1 min; see README "Scale-out".
test-distributed: install
	$(PY) -m pytest -q -m distributed tests/distributed $(ARGS)

# The long run of the HTTP fuzz test (make test runs 20,000 mutants).
FUZZ_N ?= 200000
FUZZ_SEED ?= 9
fuzz: install
	MLX_SIDECAR_FUZZ_N=$(FUZZ_N) MLX_SIDECAR_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q tests/server/test_fuzz.py

bench: install
	$(VENV)/bin/mlx-sidecar bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
