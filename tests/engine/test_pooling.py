"""Pooling requests against the oracle: mlx-lm's own model run over the whole prompt, its final
hidden states pooled by hand (fp32 models: within 1e-5), through chunked prefill, batches with
generating requests, preemption and prefix caching; bad input refused naming the field."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from sidecar.errors import ProtocolError
from sidecar.models import resolve_model
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver

EMBED, CLASSIFY = "builtin:tiny-embed", "builtin:tiny-classify"


def prompt(n: int, seed: int = 0, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def hidden(model, toks: list[int]) -> np.ndarray:
    """mlx-lm's decoder (final norm included) over the whole prompt, one sequence: [T, D]."""
    return np.array(model.model(mx.array(toks)[None])[0].astype(mx.float32))


def pooled_by_hand(h: np.ndarray, kind: str) -> np.ndarray:
    return {"LAST": h[-1], "CLS": h[0], "MEAN": h.mean(axis=0), "ALL": h}[kind]


def normalise(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def run(d: Driver, chunk: int) -> None:
    while any(r.pooled is None if r.pooling is not None else len(r.out) < 4 for r in d.reqs.values()):
        d.step(chunk)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS", "ALL"])
def test_embeddings_match_mlx_lm_pooled_by_hand(make_worker, oracle_model, kind: str, chunk: int) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = [prompt(n, seed=n) for n in (23, 5, 40)]
    task = "token_embed" if kind == "ALL" else "embed"
    for i, p in enumerate(ps):
        d.add(f"p{i}", p, pooling={"task": task, "pooling_type": kind})
    d.add("gen", prompt(9, seed=99))  # a generating request in the same batches
    run(d, chunk)
    model = oracle_model(EMBED)
    for i, p in enumerate(ps):
        want = normalise(pooled_by_hand(hidden(model, p), kind))
        np.testing.assert_allclose(np.array(d.reqs[f"p{i}"].pooled), want, atol=1e-5, err_msg=f"prompt {i}")
    assert d.reqs["gen"].out[:4] == mlx_lm_greedy(model, prompt(9, seed=99), 4)[0]


def test_default_pooling_is_the_models_and_negative_control(make_worker, oracle_model) -> None:
    """No pooling_type: the sentence-transformers config's (last token). The MEAN vector differs,
    so the comparisons above can fail."""
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompt(30, seed=3)
    d.add("a", p, pooling={})
    run(d, 16)
    h = hidden(oracle_model(EMBED), p)
    np.testing.assert_allclose(d.reqs["a"].pooled, normalise(h[-1]), atol=1e-5)
    assert np.abs(np.array(d.reqs["a"].pooled) - normalise(h.mean(axis=0))).max() > 1e-2


def test_dimensions_and_activation(make_worker, oracle_model) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompt(12, seed=4)
    d.add("dims", p, pooling={"dimensions": 16})
    d.add("raw", p, pooling={"use_activation": False, "pooling_type": "MEAN"})
    run(d, 5)
    h = hidden(oracle_model(EMBED), p)
    got = np.array(d.reqs["dims"].pooled)
    assert got.shape == (16,)
    np.testing.assert_allclose(got, normalise(h[-1][:16]), atol=1e-5)  # truncated, then re-normalised
    np.testing.assert_allclose(d.reqs["raw"].pooled, h.mean(axis=0), atol=1e-5)


def test_embedding_is_independent_of_the_batch(make_worker) -> None:
    w = make_worker(EMBED)
    bs = w.config.block_size
    p = prompt(37, seed=5)
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    d.add("alone", p, pooling={"pooling_type": "MEAN"})
    run(d, 64)
    d2 = Driver(w.execute_model, bs, w.runner.num_blocks)
    for i in range(15):
        d2.add(f"o{i}", prompt(10 + 3 * i, seed=50 + i), pooling={"pooling_type": "MEAN"} if i % 2 else None)
    d2.add("x", p, pooling={"pooling_type": "MEAN"})
    run(d2, 64)
    np.testing.assert_allclose(d2.reqs["x"].pooled, d.reqs["alone"].pooled, atol=1e-6)


def test_preempted_pooling_request_starts_over(make_worker, oracle_model) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompt(30, seed=6)
    d.add("m", p, pooling={"pooling_type": "MEAN"})
    d.step(7)
    d.step(7)
    d.preempt("m")
    run(d, 7)
    want = normalise(hidden(oracle_model(EMBED), p).mean(axis=0))
    np.testing.assert_allclose(d.reqs["m"].pooled, want, atol=1e-5)


def test_last_token_pooling_reads_a_cached_prefix(make_worker, oracle_model) -> None:
    """LAST pools only the last position, which is always computed: a prefix-cache hit is exact."""
    w = make_worker(EMBED)
    bs = w.config.block_size
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    shared = prompt(2 * bs, seed=7)
    a = d.add("A", shared + [9, 10, 11])
    d.run(1)
    p = shared + [40, 41, 42]
    d.add("B", p, blocks=a.blocks[:2] + d.alloc(2), computed=2 * bs, pooling={})
    run(d, 16)
    np.testing.assert_allclose(d.reqs["B"].pooled, normalise(hidden(oracle_model(EMBED), p)[-1]), atol=1e-5)


def _classifier_oracle(path: Path):
    from mlx_lm.utils import load_model

    model = load_model(path, strict=False)[0]  # the decoder; the score head by hand below
    return model, np.array(mx.load(str(path / "model.safetensors"))["score.weight"])


def test_classification_matches_the_score_head_by_hand(make_worker, home) -> None:
    w = make_worker(CLASSIFY)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    ps = [prompt(n, seed=n) for n in (17, 4)]
    d.add("c0", ps[0], pooling={"task": "classify"})
    d.add("c1", ps[1], pooling={"task": "classify", "use_activation": False})
    d.add("t", ps[0], pooling={"task": "token_classify"})
    run(d, 7)
    model, score = _classifier_oracle(resolve_model(CLASSIFY, home))
    logits = [hidden(model, p)[-1] @ score.T for p in ps]
    np.testing.assert_allclose(d.reqs["c0"].pooled, 1 / (1 + np.exp(-logits[0])), atol=1e-5)
    np.testing.assert_allclose(d.reqs["c1"].pooled, logits[1], atol=1e-5)
    np.testing.assert_allclose(d.reqs["t"].pooled, 1 / (1 + np.exp(-(hidden(model, ps[0]) @ score.T))), atol=1e-5)


def test_three_labels_use_softmax(make_worker, home, tmp_path: Path) -> None:
    src = resolve_model(CLASSIFY, home)
    dst = tmp_path / "cls3"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(num_labels=3, id2label={str(i): f"L{i}" for i in range(3)})
    (dst / "config.json").write_text(json.dumps(config))
    weights = dict(mx.load(str(dst / "model.safetensors")))
    weights["score.weight"] = mx.random.normal((3, config["hidden_size"]), key=mx.random.key(0))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    w = make_worker(str(dst))
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompt(11, seed=8)
    d.add("c", p, pooling={"task": "classify", "pooling_type": "MEAN"})
    run(d, 4)
    model, score = _classifier_oracle(dst)
    z = hidden(model, p).mean(axis=0) @ score.T
    np.testing.assert_allclose(d.reqs["c"].pooled, np.exp(z) / np.exp(z).sum(), atol=1e-5)


def _refused(w, d: Driver, field: str, chunk: int = 16) -> None:
    before = dict(w.runner.requests)
    with pytest.raises(ProtocolError) as e:
        d.step(chunk)
    assert e.value.field == field, e.value.message
    assert w.runner.requests.keys() == before.keys()


@pytest.mark.parametrize("pooling,field", [
    ({"pooling_type": "MAX"}, "pooling_params.pooling_type"),
    ({"task": "generate"}, "pooling_params.task"),
    ({"dimensions": 65}, "pooling_params.dimensions"),
    ({"dimensions": 8, "task": "classify"}, "pooling_params.dimensions"),
    ({"task": "classify"}, "pooling_params.task"),  # no score head on this model
    ({"use_activation": "yes"}, "pooling_params.use_activation"),
])
def test_bad_pooling_params_are_refused_naming_the_field(make_worker, oracle_model, pooling: dict, field: str) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    g = d.add("gen", prompt(9, seed=99))
    d.step()
    d.add("bad", prompt(8), pooling=pooling)
    bad = d.build(16)
    d.reqs.pop("bad")
    with pytest.raises(ProtocolError) as e:
        w.execute_model(bad)
    assert e.value.field == f"scheduled_new_reqs[0].{field}", e.value.message
    assert set(w.runner.requests) == {"gen"}
    d.run(4)  # the other request is unaffected
    assert g.out[:4] == mlx_lm_greedy(oracle_model(EMBED), prompt(9, seed=99), 4)[0]


def test_pooling_and_sampling_params_together_are_refused(make_worker) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("both", prompt(8), pooling={})
    so = d.build(16)
    so["scheduled_new_reqs"][0]["sampling_params"] = {"temperature": 0.0}
    with pytest.raises(ProtocolError) as e:
        w.execute_model(so)
    assert e.value.field == "scheduled_new_reqs[0].pooling_params"
    assert not w.runner.requests


def test_generative_only_model_refuses_pooling(make_worker) -> None:
    w = make_worker("builtin:tiny")
    assert w.runner.pooling is None
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("e", prompt(8), pooling={})
    _refused(w, d, "scheduled_new_reqs[0].pooling_params")


def test_runner_pooling_embeds_with_any_decoder_and_generate_refuses(make_worker, oracle_model) -> None:
    w = make_worker("builtin:tiny", runner="pooling")
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    p = prompt(10, seed=9)
    d.add("e", p, pooling={})
    run(d, 16)
    np.testing.assert_allclose(d.reqs["e"].pooled, normalise(hidden(oracle_model("builtin:tiny"), p)[-1]), atol=1e-5)
    assert make_worker(EMBED, runner="generate").runner.pooling is None


def test_mean_pooling_refuses_a_cached_prefix_and_a_classifier_refuses_sampling(make_worker) -> None:
    w = make_worker(EMBED)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("m", prompt(40), pooling={"pooling_type": "MEAN"}, computed=16)
    _refused(w, d, "scheduled_new_reqs[0].num_computed_tokens")
    c = make_worker(CLASSIFY)
    d = Driver(c.execute_model, c.config.block_size, c.runner.num_blocks)
    d.add("g", prompt(8))
    _refused(c, d, "scheduled_new_reqs[0].sampling_params")


def test_sentence_transformers_config_sets_the_default_and_a_dense_projection_is_refused(
        make_worker, home, tmp_path: Path) -> None:
    dst = tmp_path / "mean-embed"
    shutil.copytree(resolve_model(EMBED, home), dst)
    flags = json.loads((dst / "1_Pooling" / "config.json").read_text())
    flags.update(pooling_mode_lasttoken=False, pooling_mode_mean_tokens=True)
    (dst / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    assert make_worker(str(dst)).runner.pooling.default_type == "MEAN"
    modules = json.loads((dst / "modules.json").read_text())
    (dst / "modules.json").write_text(json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                              "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ProtocolError) as e:
        make_worker(str(dst))
    assert e.value.field == "config.model" and "Dense" in e.value.message


def test_an_encoder_only_model_is_refused_by_name(make_worker, home, tmp_path: Path) -> None:
    dst = tmp_path / "bert"
    shutil.copytree(resolve_model(EMBED, home), dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(model_type="bert", architectures=["BertModel"])
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ProtocolError) as e:
        make_worker(str(dst))
    assert e.value.field == "config.model" and "bert is an encoder-only" in e.value.message
