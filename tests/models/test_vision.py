"""Which checkpoints take images, and mlx-vlm's model code behind the runner's model interface."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from sidecar.models import resolve_model
from sidecar.models.vision import SERVED, is_served, model_type

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

from tests.vision import MODEL, QWEN3, QWEN3_MOE, QWEN25, image, prepare  # noqa: E402


def test_only_served_vision_families_take_images(home, tmp_path):
    assert is_served(resolve_model(MODEL, home)) and "qwen2_vl" in SERVED
    assert not is_served(resolve_model("builtin:tiny", home)) and model_type(resolve_model("builtin:tiny", home)) is None
    assert is_served(resolve_model("builtin:tiny-gemma3-vl", home)) and is_served(resolve_model(QWEN25, home))
    assert set(SERVED) == {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "idefics3"}
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert model_type(other) == "llava" and not is_served(other)  # its text half serves; images refused by name


@pytest.mark.parametrize("model", [MODEL, QWEN25, QWEN3, QWEN3_MOE])
def test_positions_are_mlx_vlms_and_the_model_matches_its_own_forward(make_worker, home, model):
    """The adapter's logits for a whole prompt with an image equal mlx-vlm's Model.__call__
    (Qwen3-VL's with its deepstack rows; without them they differ: the negative control)."""
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
    want = vlm(mx.array([ids]), mx.array(data["pixel_values"]), image_grid_thw=mx.array(data["image_grid_thw"][None]))
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
    if deep is not None:
        m.bind(flat[None], mx.array(pos[:, None, :]))
        assert np.abs(np.array(m(mx.array([ids]))) - np.array(want.logits)).max() > 1e-2
