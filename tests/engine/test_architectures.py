"""Every mlx-lm family the generator builds tiny, served through the paged cache with batching and
chunked prefill, gives each prompt exactly mlx-lm's own greedy tokens for that prompt alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sidecar.config import Config
from sidecar.errors import ProtocolError
from sidecar.models import families
from sidecar.worker.mlx_worker import MLXWorker
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

BLOCK = 4
NEW = 5


def tiny_dir(home: str, family: str) -> Path:
    return families.write(family, Path(home) / "arch" / family)


def served(home: str, family: str | Path, num_blocks: int = 96, **overrides: object) -> MLXWorker:
    """A loaded worker of the family's tiny model (or of the model directory `family`)."""
    model = family if isinstance(family, Path) else tiny_dir(home, family)
    cfg = dict(block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
    w = MLXWorker(Config(model=str(model), home=home, **{**cfg, **overrides}))  # type: ignore[arg-type]
    w.init_device()
    w.load_model()
    w.determine_available_memory()  # the profile run: every layer kind at the batch limits
    w.initialize_cache(num_blocks, 0)
    return w


def prompts(family: str, vocab: int, lengths: tuple[int, ...] = (11, 19, 6)) -> list[list[int]]:
    rng = np.random.default_rng(sum(map(ord, family)))
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def serve(w: MLXWorker, ps: list[list[int]], chunk: int = 7, new: int = NEW,
          logprobs: dict[str, list[float]] | None = None) -> dict[str, list[int]]:
    """Each prompt's `new` greedy tokens from the loaded worker `w`, served together: by default in
    chunks shorter than the prompts, all rows in every step. `logprobs`, if given, gets the sampled
    tokens' logprobs."""
    d = Driver(w.execute_model, BLOCK, 96)
    sampling = {"temperature": 0.0, "logprobs": 0} if logprobs is not None else None
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, sampling)
    out = d.run(new, chunk=chunk)
    if logprobs is not None:
        logprobs.update({rid: r.logprobs[:new] for rid, r in d.reqs.items()})
    return out


# Built tiny, but refused at load_model with a 400 naming why (never a 500, never inexact).
REFUSED = {"plamo3": "window one wider", "phi3small": "crashes MLX",
           "longcat_flash_ngram": "recurrent state whose shape grows",
           "deepseek_v41": "layer 0: cache kind LayerCache is not supported",
           # mlx-lm itself cannot run these on this backend: its own forward calls a Metal kernel
           "bitnet": "No Metal back-end", "muse_spark": "No Metal back-end",
           "olmo": "olmo module cannot be imported here: it needs ai2-olmo"}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unservable_families_are_refused_at_load(home: str, family: str) -> None:
    w = MLXWorker(Config(model=str(tiny_dir(home, family)), home=home, block_size=BLOCK))
    w.init_device()
    with pytest.raises(ProtocolError, match=REFUSED[family]) as e:
        w.load_model()
    assert e.value.status == 400 and e.value.field == "model"
    assert w.state.value == "device_ready" and w.runner is None


# The longest prompt passes the tiny configs' windows (8), chunks (8) and sparse-attention blocks
# (3 of 4 tokens) in three chunks of 5; the middle one ends with a one-token chunk next to a decode
# row; the shortest decodes from the first step on.
LENGTHS, CHUNK, FAMILY_NEW = (14, 6, 3), 5, 3


@pytest.mark.parametrize("family", sorted(set(families.FAMILIES) - set(REFUSED)))
def test_greedy_tokens_equal_mlx_lm(home: str, oracle_model, family: str) -> None:
    ps = prompts(family, 256, LENGTHS)
    got = serve(served(home, family), ps, chunk=CHUNK, new=FAMILY_NEW)
    oracle = oracle_model(str(tiny_dir(home, family)))
    want = {f"r{i}": mlx_lm_greedy(oracle, p, FAMILY_NEW)[0] for i, p in enumerate(ps)}
    assert got == want
