"""Which checkpoints take images, mlx-vlm's model code behind the runner's model interface, and each
family's adapter through the worker against mlx-vlm's own generate: Gemma 3, Idefics3, SmolVLM,
Mistral 3, LFM2-VL and InternVL (the M-RoPE families run the whole engine suite,
tests/engine/test_multimodal.py), Qwen3-VL's deepstack rows."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from sidecar.config import Config
from sidecar.models import resolve_model
from sidecar.models.vision import SERVED, is_served, model_type, unserved
from sidecar.worker.mlx_worker import MLXWorker

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

from sidecar.errors import ProtocolError  # noqa: E402
from tests.vision import (GEMMA, GLM4V, GLM4V_MOE, IDEFICS, INTERNVL, LFM2, MISTRAL, MODEL, PADDLE, QWEN3, QWEN3_MOE,  # noqa: E402
                          QWEN25, SMOLVLM, MMDriver, feature, fresh, image, new_step, oracle, prepare, tok)

N = 8


def test_only_served_vision_families_take_images(home, tmp_path):
    assert is_served(resolve_model(MODEL, home)) and "qwen2_vl" in SERVED
    assert not is_served(resolve_model("builtin:tiny", home)) and model_type(resolve_model("builtin:tiny", home)) is None
    assert is_served(resolve_model("builtin:tiny-gemma3-vl", home)) and is_served(resolve_model(QWEN25, home))
    assert set(SERVED) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "idefics3", "smolvlm",
                           "mistral3", "glm4v", "glm4v_moe", "paddleocr_vl", "lfm2_vl", "internvl"}
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert model_type(other) == "llava" and not is_served(other)  # its text half serves; images refused by name
    internvl3 = tmp_path / "internvl3"  # InternVL3's Qwen2.5 decoder: mlx-vlm's internvl module builds Qwen3's
    internvl3.mkdir()
    config = json.loads((resolve_model(INTERNVL, home) / "config.json").read_text())
    assert is_served(resolve_model(INTERNVL, home)) and unserved(resolve_model(INTERNVL, home)) is None
    (internvl3 / "config.json").write_text(json.dumps({**config, "text_config": {**config["text_config"], "model_type": "qwen2"}}))
    assert not is_served(internvl3) and "internvl with a qwen2 decoder is not served" in unserved(internvl3)
    shutil.copy(resolve_model(INTERNVL, home) / "model.safetensors", internvl3)
    with pytest.raises(ProtocolError) as e:  # load_model names why rather than mlx-vlm's missing weights
        w = MLXWorker(Config(model=str(internvl3), home=home))
        w.init_device()
        w.load_model()
    assert e.value.field == "config.model" and "internvl with a qwen2 decoder is not served" in str(e.value)


@pytest.mark.parametrize("model", [MODEL, QWEN25, QWEN3, QWEN3_MOE, GLM4V, GLM4V_MOE, PADDLE])
def test_positions_are_mlx_vlms_and_the_model_matches_its_own_forward(make_worker, home, model):
    """The adapter's logits for a whole prompt with an image equal mlx-vlm's Model.__call__
    (Qwen3-VL's with its deepstack rows; without them, or with plain positions, they differ: the
    negative controls). GLM-4.1V: the same inputs, its own tower, positions and decoder."""
    from mlx_vlm.utils import load_model

    path = resolve_model(model, home)
    ids, data = prepare(path, "Look.", image(2))
    w = make_worker(model, num_blocks=16)
    m = w.runner.mm.model
    pos, delta = m.rope_positions(ids, [data["image_grid_thw"]])
    ref, ref_delta = load_model(path).language_model.get_rope_index(
        mx.array([ids]), mx.array(data["image_grid_thw"].reshape(1, 3)))
    assert (pos == np.array(ref[:, 0])).all() and delta == int(np.array(ref_delta).reshape(-1)[0]) and delta < 0
    vlm = load_model(path)
    pv = mx.array(data["pixel_values"])
    want = vlm(mx.array([ids]), pv[None] if model == PADDLE else pv, image_grid_thw=mx.array(data["image_grid_thw"][None]))
    enc = m.encode(data)
    emb = m.embed(mx.array([ids]))
    mask = np.array(ids) == m.image_token_id
    flat = emb.reshape(len(ids), -1)
    D, at = flat.shape[-1], np.nonzero(mask)[0]
    flat[mx.array(at)] = enc[:, :D]
    deep = (at, enc[:, D:]) if enc.shape[-1] > D else None
    assert (deep is not None) == (model in (QWEN3, QWEN3_MOE))
    m.bind(flat[None], mx.array(pos[:, None, :]), deep)
    got = m(mx.array([ids]))
    assert np.abs(np.array(got) - np.array(want.logits)).max() < 1e-4
    plain = np.tile(np.arange(len(ids)), (3, 1))  # negative control: the positions matter
    m.bind(flat[None], mx.array(plain[:, None, :]), deep)
    assert np.abs(np.array(m(mx.array([ids]))) - np.array(want.logits)).max() > 1e-3
    if deep is not None:
        m.bind(flat[None], mx.array(pos[:, None, :]))
        assert np.abs(np.array(m(mx.array([ids]))) - np.array(want.logits)).max() > 1e-2


def test_mistral3_runs_rows_apart_past_ministral3s_original_context(make_worker, home, tmp_path):
    """mlx-vlm's Ministral 3 decoder scales a batch's attention by its first row's positions past
    the original context (16 positions in the built-in): batches below it (exact: every scale is 1),
    rows one at a time past it. A plain Mistral decoder (no such scaling) batches throughout."""
    import shutil

    w = make_worker(MISTRAL, num_blocks=96)
    assert w.runner.caches.rows_apart_past == 16 and w.runner.decode_ahead
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11, 12, 13, 14]}  # decoding from positions 4 and 6 up to 20
    alone = {}
    for rid, p in prompts.items():
        d = MMDriver(w.execute_model, w.config.block_size, 96)
        w.initialize_cache(96, 0)
        d.add(rid, p, {"temperature": 0.0, "logprobs": 0})
        alone[rid] = (d.run(14)[rid], d.reqs[rid].logprobs)
    w.initialize_cache(96, 0)
    d = MMDriver(w.execute_model, w.config.block_size, 96)
    for rid, p in prompts.items():
        d.add(rid, p, {"temperature": 0.0, "logprobs": 0})
    out = d.run(14)
    for rid in prompts:
        assert out[rid] == alone[rid][0]
        assert np.abs(np.array(d.reqs[rid].logprobs) - np.array(alone[rid][1])).max() < 1e-5
    plain = tmp_path / "mistral3-plain"
    shutil.copytree(resolve_model(MISTRAL, home), plain)
    config = json.loads((plain / "config.json").read_text())
    config["text_config"]["model_type"] = "mistral"
    (plain / "config.json").write_text(json.dumps(config))
    assert make_worker(str(plain), num_blocks=16).runner.caches.rows_apart_past is None


@pytest.fixture(scope="module", params=[GEMMA, IDEFICS, MISTRAL, SMOLVLM, LFM2, INTERNVL])
def family(request, make_worker, home):
    path = resolve_model(request.param, home)
    w = make_worker(request.param, num_blocks=96)
    return w, path


@pytest.mark.parametrize("chunk", [64, 7])
def test_families_tokens_equal_mlx_vlm_generate_batched_with_text_and_a_repeated_image(family, chunk):
    """Gemma 3: sliding-window layers (window 8, shorter than the prompt), features scaled as its
    get_input_embeddings does. Idefics3: 5 tiles of 4 embeddings inside a placeholder of 64
    positions, is_embed marking them. Mistral 3: 3 rows of 4 embeddings, each row closed by a
    break token (not an embedding). InternVL: 3 tiles of 4 embeddings between <img> and </img>.
    Chunk 7 splits the images."""
    w, path = family
    ids, data = prepare(path, "Describe the sea.", image(0))
    want = oracle(path, "Describe the sea.", image(0), N)
    other_ids, other = prepare(path, "Describe the sea.", image(3))
    d = fresh(w)
    runs = w.runner.mm.stats.runs
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(w))])
    d.add("text", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    d.add_mm("b", ids, [feature(ids, data, "sea", tok(w))])
    d.add_mm("c", other_ids, [feature(other_ids, other, "sea3", tok(w))])
    out = d.run(N, chunk=chunk)
    assert out["a"] == want and out["b"] == want
    assert out["c"] == oracle(path, "Describe the sea.", image(3), N) != want
    assert w.runner.mm.stats.runs == runs + 2
    d2 = fresh(w)  # the text request alone gives the same tokens (batching changes nothing)
    d2.add("text", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert d2.run(N)["text"] == out["text"]


def test_families_prefix_cached_item_without_its_pixels(family):
    """An item the prefix-cache hit covers whole comes without its pixels, keeping the family's
    other tensors (Idefics3's pixel mask, Mistral 3's image size) or none: no encoder run, the
    same tokens. LFM2-VL's decoder keeps a recurrent state, so a prefix hit is refused for it as
    for any such model (a 400 naming num_computed_tokens, nothing changed)."""
    w, path = family
    text = "Describe the sea, then the sky, and then the ships on it."
    ids, data = prepare(path, text, image(0), image_first=True)
    d = fresh(w)
    a = d.add_mm("a", ids, [feature(ids, data, "sea", tok(w))])
    want = d.run(N)["a"]
    assert want == oracle(path, text, image(0), N, image_first=True)
    bs = w.config.block_size
    hit = (len(ids) - 1) // bs * bs
    item = feature(ids, {k: v for k, v in data.items() if k != "pixel_values"}, "sea", tok(w))
    assert hit >= item["mm_position"]["offset"] + item["mm_position"]["length"]  # the image is inside the hit
    item["data"] = item["data"] or None
    runs = w.runner.mm.stats.runs
    d.add_mm("b", ids, [item], blocks=a.blocks[: hit // bs] + d.alloc(4), computed=hit)
    if w.runner.caches.has_state:
        with pytest.raises(ProtocolError) as e:
            d.run(N)
        assert e.value.field == "scheduled_new_reqs[0].num_computed_tokens" and "b" not in w.runner.requests
        return
    assert d.run(N)["b"] == want and w.runner.mm.stats.runs == runs


def test_families_refuse_pixels_of_another_size(family):
    w, path = family
    ids, data = prepare(path, "Describe the sea.", image(0))
    fresh(w)
    others = {k: v for k, v in data.items() if k != "image_sizes"}  # (LFM2-VL's are required; Mistral 3's optional)
    feat = feature(ids, {**others, "pixel_values": np.zeros((1, 3, 30, 30), np.float32)}, "small", tok(w))
    with pytest.raises(ProtocolError) as e:
        w.execute_model(new_step(w, ids, feat))
    assert e.value.field == "scheduled_new_reqs[0].mm_features[0].data.pixel_values" and not w.runner.requests


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(image_sizes=np.array([84, 100])), "data.pixel_values"),  # not a multiple of 28
    (lambda d: d.update(image_sizes=np.array([84, 140])), "data.image_sizes"),  # wider than the pixels
    (lambda d: d.update(image_sizes=np.array([84.0, 112.0])), "data.image_sizes"),
    (lambda d: d.update(image_sizes=np.array([84, 112, 1])), "data.image_sizes"),
    (lambda d: d.update(image_sizes=np.array([56, 112])), "mm_position"),  # 8 embeddings for a placeholder of 12
    (lambda d: d.update(pixel_values=np.zeros((1, 3, 84, 140), np.float32), image_sizes=np.array([84, 140])),
     "data.pixel_values"),  # wider than the tower's 112
    (lambda d: d.update(pixel_values=np.zeros((2, 3, 84, 112), np.float32)), "data.pixel_values"),
])
def test_mistral3_bad_image_sizes_are_refused_naming_the_field(make_worker, home, change, field):
    w = make_worker(MISTRAL, num_blocks=96)
    ids, data = prepare(resolve_model(MISTRAL, home), "Describe the sea.", image(0))
    assert data["image_sizes"].tolist() == [84, 112]
    fresh(w)
    change(data)
    with pytest.raises(ProtocolError) as e:
        w.execute_model(new_step(w, ids, feature(ids, data, "bad", tok(w))))
    assert e.value.field == f"scheduled_new_reqs[0].mm_features[0].{field}" and not w.runner.requests


def test_lfm2_vl_tiles_a_large_image_and_keeps_its_convolution_state_across_chunks(make_worker, home):
    """A 300x500 image is 6 tiles and a thumbnail (7 views, row and column markers between them)
    into LFM2's hybrid decoder, prefilled in chunks of 7 beside a text request: mlx-vlm's tokens."""
    path = resolve_model(LFM2, home)
    w = make_worker(LFM2, num_blocks=96)
    ids, data = prepare(path, "Describe the sea.", image(2, (300, 500)))
    assert data["spatial_shapes"].shape == (7, 2) and w.runner.caches.has_state
    d = fresh(w)
    d.add_mm("a", ids, [feature(ids, data, "big", tok(w))])
    d.add("text", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert d.run(N, chunk=7)["a"] == oracle(path, "Describe the sea.", image(2, (300, 500)), N)


def test_lfm2_vl_views_as_vllm_sends_them_give_the_same_tokens(make_worker, home):
    """vLLM's item has no pixel_attention_mask (the views' shapes say which patches are real) and
    adds num_patches: the same tokens as with the processor's own tensors."""
    path = resolve_model(LFM2, home)
    w = make_worker(LFM2, num_blocks=96)
    ids, data = prepare(path, "Describe the sea.", image(2, (300, 500)))
    vllm = {"pixel_values": data["pixel_values"], "spatial_shapes": data["spatial_shapes"],
            "num_patches": np.array(len(data["spatial_shapes"]))}
    d = fresh(w)
    d.add_mm("a", ids, [feature(ids, vllm, "big", tok(w))])
    assert d.run(N)["a"] == oracle(path, "Describe the sea.", image(2, (300, 500)), N)


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(spatial_shapes=d["spatial_shapes"] + 1), "data.spatial_shapes"),  # odd: not unshuffled 2x2
    (lambda d: d.update(spatial_shapes=d["spatial_shapes"].astype(np.float32)), "data.spatial_shapes"),
    (lambda d: d.update(spatial_shapes=d["spatial_shapes"] * 4), "data.spatial_shapes"),  # more patches than sent
    (lambda d: d.update(spatial_shapes=np.array([[8, 10, 1]])), "data.spatial_shapes"),
    # sides whose product wraps around in int64 to 4 x the 20 embeddings (and (h/2)*(w/2) to 20)
    (lambda d: d.update(spatial_shapes=np.array([[12, 2 * 3074457345618258606]])), "data.spatial_shapes"),
    (lambda d: d["pixel_attention_mask"].__setitem__((0, 0), 0), "data.pixel_attention_mask"),
    (lambda d: d.update(pixel_attention_mask=d["pixel_attention_mask"][:, :-1]), "data.pixel_attention_mask"),
    (lambda d: d.update(pixel_values=d["pixel_values"][..., :-1]), "data.pixel_values"),
    (lambda d: d.update(spatial_shapes=d["spatial_shapes"] - [0, 2],
                        pixel_attention_mask=(np.arange(d["pixel_attention_mask"].shape[1]) < 64)[None].astype(np.int64)),
     "mm_position"),  # 8x8 patches: 16 embeddings for a placeholder of 20
    (lambda d: d.pop("spatial_shapes"), "data"),
    (lambda d: d["pixel_attention_mask"].__setitem__((0, 100), 1), "data.pixel_attention_mask"),  # a padding patch
])
def test_lfm2_vl_bad_views_are_refused_naming_the_field(make_worker, home, change, field):
    w = make_worker(LFM2, num_blocks=96)
    ids, data = prepare(resolve_model(LFM2, home), "Describe the sea.", image(0))
    assert data["spatial_shapes"].tolist() == [[8, 10]]
    fresh(w)
    change(data)
    with pytest.raises(ProtocolError) as e:
        w.execute_model(new_step(w, ids, feature(ids, data, "bad", tok(w))))
    assert e.value.field == f"scheduled_new_reqs[0].mm_features[0].{field}" and not w.runner.requests


@pytest.mark.parametrize("form", ["padded", "vllm"])
def test_mistral3_pixels_as_batch_processors_and_vllm_send_them_give_the_same_tokens(make_worker, home, form):
    """padded: a batch processor pads every image to the largest, `image_sizes` says which part is
    the image. vllm: vLLM sends each image cropped to its size, [3, h, w], without image_sizes."""
    path = resolve_model(MISTRAL, home)
    w = make_worker(MISTRAL, num_blocks=96)
    ids, data = prepare(path, "Describe the sea.", image(0))
    if form == "padded":
        data = {**data, "pixel_values": np.pad(data["pixel_values"], ((0, 0), (0, 0), (0, 28), (0, 0)), constant_values=7.0)}
    else:
        data = {"pixel_values": data["pixel_values"][0]}
    d = fresh(w)
    d.add_mm("a", ids, [feature(ids, data, form, tok(w))])
    assert d.run(N)["a"] == oracle(path, "Describe the sea.", image(0), N)


def test_qwen3_vl_deepstack_features_matter(home, make_worker, monkeypatch):
    """Negative control: Qwen3-VL without its deepstack features (the image's rows merged into the
    input embeddings only) gives other log-probabilities than with them, which give mlx-vlm's tokens."""
    from sidecar.models.vlm_families import Qwen3VL

    path = resolve_model(QWEN3, home)
    worker = make_worker(QWEN3, num_blocks=96)
    ids, data = prepare(path, "Describe the sea.", image(0))
    want = oracle(path, "Describe the sea.", image(0), N)

    def run():
        d = fresh(worker)
        d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))], sampling={"temperature": 0.0, "logprobs": 0})
        return d.run(N)["a"], d.reqs["a"].logprobs

    tokens, with_deep = run()
    assert tokens == want
    monkeypatch.setattr(Qwen3VL, "deepstack", lambda self, visual, shape: {})
    _, without = run()
    assert np.abs(np.array(with_deep) - np.array(without)).max() > 1e-3
