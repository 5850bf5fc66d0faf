"""Shared fixtures: one generated home for the built-in models, loaded workers, the mlx-lm oracle."""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx
import pytest

from sidecar.config import Config
from sidecar.worker.mlx_worker import MLXWorker


@pytest.fixture(scope="session")
def home(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("sidecar-home"))
    os.environ["MLX_SIDECAR_HOME"] = path  # servers started as subprocesses find the same models
    return path


@pytest.fixture(scope="session")
def make_worker(home: str) -> Callable[..., MLXWorker]:
    def make(model: str = "builtin:tiny", num_blocks: int = 256, **overrides: object) -> MLXWorker:
        w = MLXWorker(Config(model=model, home=home, **overrides))  # type: ignore[arg-type]
        w.init_device()
        w.load_model()
        w.initialize_cache(num_blocks, 0)
        return w

    return make


def mlx_lm_greedy(model: object, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """The oracle: mlx-lm's own single-sequence generation, greedy, with the sampled tokens' logprobs."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        logprobs.append(float(lp[int(tok)]))
    return tokens, logprobs


@pytest.fixture(scope="session")
def oracle_model(home: str) -> Callable[[str], object]:
    from mlx_lm.utils import load_model

    from sidecar.models import resolve_model

    cache: dict[str, object] = {}

    def get(name: str) -> object:
        if name not in cache:
            cache[name] = load_model(resolve_model(name, home))[0]
        return cache[name]

    return get
