"""The family built-ins: generated on first use with the trained tokenizer, served token-exact, and
each reports the layer kinds that make it interesting. (Every family generator config is exercised
through the paged cache in tests/engine/test_architectures.py.)"""

from __future__ import annotations

import json

import pytest

from sidecar.models import BUILTIN_MODELS, families, resolve_model
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

KINDS = {
    "tiny-gemma3": {"sliding_window", "full_attention"}, "tiny-gpt-oss": {"sliding_window", "full_attention"},
    "tiny-deepseek-v3": {"mla_attention"}, "tiny-granitemoehybrid": {"mamba", "full_attention"},
    "tiny-mamba2": {"mamba"},
}


def test_every_family_builtin_is_registered() -> None:
    assert set(KINDS) == set(families.BUILTIN_FAMILIES) <= set(BUILTIN_MODELS)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_family_builtin_serves_token_exact(home: str, make_worker, oracle_model, name: str) -> None:
    path = resolve_model(f"builtin:{name}", home)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == families.BUILTIN_FAMILIES[name] and (path / "tokenizer.json").is_file()
    w = make_worker(f"builtin:{name}", num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=32)
    spec = w.get_kv_cache_spec()
    assert {s["type"] for s in spec.values()} == KINDS[name]
    windows = {s["sliding_window"] for s in spec.values()} - {None}
    assert windows <= {8}  # shorter than the 24-token contexts below
    d = Driver(w.execute_model, 4, 64)
    ps = [[(7 * i + 3 * k) % 500 + 3 for i in range(n)] for k, n in enumerate((18, 9))]
    for k, p in enumerate(ps):
        d.add(f"r{k}", p)
    got = d.run(6, chunk=5)
    oracle = oracle_model(f"builtin:{name}")
    assert got == {f"r{k}": mlx_lm_greedy(oracle, p, 6)[0] for k, p in enumerate(ps)}
