"""Fixtures of the vLLM suite (runs in .venv-vllm, without MLX): the model directories vLLM reads,
a real sidecar server (started from the main .venv), and the mlx-lm oracle (also there)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from pathlib import Path

import pytest

from sidecar.models.export import model_dir
from tests.server.serverproc import ROOT

MAIN_PYTHON = os.environ.get("MLX_SIDECAR_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
os.environ["MLX_SIDECAR_PYTHON"] = MAIN_PYTHON  # serverproc starts the sidecar with it
WORKER_CLS = "sidecar.vllm.worker.MLXSidecarWorker"
# builtin:tiny's KV page: block_size * kv heads * (K + V head dims) * fp32 * 2 layers
TINY_BLOCK_BYTES = 16 * 2 * (16 + 16) * 4 * 2
# The suite runs on this package's vLLM platform (sidecar/vllm/platform.py: async scheduling allowed);
# test_plugin.py runs plain vLLM (its CPU platform, --worker-cls alone) in a process of its own.
os.environ["MLX_SIDECAR_PLATFORM"] = "1"


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sidecar-home"))
    os.environ["MLX_SIDECAR_HOME"] = path
    return path


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """What a vLLM host without MLX has: `mlx-sidecar model-dir NAME --dest DIR` (no weights)."""
    def get(name: str) -> str:
        return str(model_dir(name, dest=str(tmp_path_factory.mktemp(name.replace(":", "-")))))

    return get


def oracle(request: dict, home: str) -> object:
    """Run tests/vllm/oracle.py in the main venv (mlx-lm)."""
    r = subprocess.run([MAIN_PYTHON, "-m", "tests.vllm.oracle"], input=json.dumps(request), capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "MLX_SIDECAR_HOME": home, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def generated(server) -> float:
    """The tokens a sidecar has sampled (its generation counter), over TCP or its Unix socket."""
    with server.client() as c:
        text = c.get("/metrics").text
    return sum(float(m) for m in re.findall(r"^mlx_worker_generation_tokens_total(?:\{[^}]*\})? (\S+)", text, re.M))


def sidecar_url_config(url: str) -> dict:
    return {"mlx_sidecar": {"url": url}}


def counter(llm, name: str) -> float:
    """One of an offline `vllm.LLM`'s metrics, summed over its labels."""
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def mixed_prompts(seed: int) -> list[list[int]]:
    """Eight prompts: four sharing two full blocks (prefix-cache hits), four of their own, three
    of them longer than a 32-token batch (chunked prefill)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(32)]
    ps = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (5, 9, 14, 20)]
    ps += [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 33, 41, 50)]
    return ps


if not Path(MAIN_PYTHON).exists():
    raise pytest.UsageError(f"{MAIN_PYTHON} is missing: run `make install` first (the sidecar runs from the main venv)")


@pytest.fixture(params=["--async-scheduling", "--no-async-scheduling"], ids=["async", "sync"])
def scheduling(request: pytest.FixtureRequest) -> str:
    """vLLM's scheduling mode for a test that must hold with two steps in flight and with one."""
    return request.param
