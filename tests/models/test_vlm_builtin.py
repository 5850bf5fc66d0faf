"""builtin:tiny-qwen2-vl: a checkpoint laid out as the family's real ones (processor config,
tokenizer with the image tokens, chat template), deterministic, loaded by mlx-vlm."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sidecar.models import resolve_model
from sidecar.models.builtin import train_tokenizer
from sidecar.models.vlm_builtin import QWEN_TOKENS, VLM_MODELS, vlm_files

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

from tests.vision import (GEMMA, GLM4V, GLM4V_MOE, IDEFICS, INTERNVL, LFM2, MISTRAL, MODEL, QWEN3, QWEN3_MOE, QWEN25,  # noqa: E402
                          SMOLVLM, _processor, image, prepare)


def test_resolves_and_is_deterministic(home, tmp_path):
    path = resolve_model(MODEL, home)
    assert {"config.json", "preprocessor_config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in path.iterdir()}
    assert json.loads((path / "tokenizer.json").read_text()) == vlm_files("tiny-qwen2-vl", train_tokenizer)["tokenizer.json"]
    assert list(VLM_MODELS) == ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-gemma3-vl",
                                "tiny-idefics3", "tiny-mistral3", "tiny-smolvlm", "tiny-glm4v", "tiny-glm4v-moe",
                                "tiny-paddleocr-vl", "tiny-lfm2-vl", "tiny-internvl", "small-qwen2.5-vl"]


@pytest.mark.parametrize("model", [MODEL, QWEN25])
def test_the_processor_expands_the_image_token_by_the_grid(home, model):
    path = resolve_model(model, home)
    config = json.loads((path / "config.json").read_text())
    for size, grid in [((80, 100), [1, 6, 8]), ((40, 40), [1, 4, 4]), ((300, 300), [1, 6, 6])]:
        ids, data = prepare(path, "Hi", image(1, size))
        assert data["image_grid_thw"].tolist() == grid  # at most 112*112 pixels: at most 16 tokens
        assert ids.count(config["image_token_id"]) == np.prod(grid) // 4
        assert data["pixel_values"].shape == (np.prod(grid), 3 * 2 * 14 * 14)
    tok = vlm_files("tiny-qwen2-vl", train_tokenizer)["tokenizer.json"]
    assert {t["content"] for t in tok["added_tokens"]} >= set(QWEN_TOKENS)


@pytest.mark.parametrize("model", [QWEN3, QWEN3_MOE])
def test_qwen3_vl_takes_patches_of_16_into_a_deepstack_tower(home, model):
    """mlx-vlm's own Qwen3-VL processor and model: 64 to 128 pixels a side in patches of 16 (4 to
    16 tokens after merging), a tower giving deepstack features for the blocks listed; the MoE
    variant is its own family, with experts in its decoder."""
    from mlx_vlm.utils import load_model

    path = resolve_model(model, home)
    config = json.loads((path / "config.json").read_text())
    for size in [(80, 100), (40, 40), (300, 300)]:
        ids, data = prepare(path, "Hi", image(1, size))
        t, h, w = data["image_grid_thw"].tolist()
        assert t == 1 and 4 <= h <= 8 and 4 <= w <= 8 and h % 2 == w % 2 == 0
        assert ids.count(config["image_token_id"]) == h * w // 4
        assert data["pixel_values"].shape == (h * w, 3 * 2 * 16 * 16)
    vlm = load_model(path)
    family = config["model_type"]
    assert family == ("qwen3_vl_moe" if model == QWEN3_MOE else "qwen3_vl")
    assert type(vlm.vision_tower).__module__.endswith(f"{family}.vision") and vlm.vision_tower.deepstack_visual_indexes == [0, 1]
    assert ("SparseMoe" in type(vlm.language_model.model.layers[0].mlp).__name__) == (model == QWEN3_MOE)


@pytest.mark.parametrize("model", [GLM4V, GLM4V_MOE])
def test_glm4v_takes_qwen2_vls_patches_into_its_own_tower(home, model):
    """GLM-4.1V (and GLM-4.5V, experts in its decoder) through mlx-vlm's own processor (its image
    tokens between begin/end markers, expanded by the grid) and model (its tower and decoder)."""
    from mlx_vlm.utils import load_model

    path = resolve_model(model, home)
    config = json.loads((path / "config.json").read_text())
    family = config["model_type"]
    assert type(_processor(str(path))).__name__ == ("Glm46VMoEProcessor" if model == GLM4V_MOE else "Glm46VProcessor")
    vlm = load_model(path)
    assert type(vlm).__module__.endswith(f"{family}.{family}")
    assert ("MoE" in type(vlm.language_model.model.layers[1].mlp).__name__) == (model == GLM4V_MOE)
    grids = set()
    for size in [(80, 100), (40, 120)]:
        ids, data = prepare(path, "Hi", image(1, size))
        grid = data["image_grid_thw"].tolist()
        assert data["pixel_values"].shape == (np.prod(grid), 3 * 2 * 14 * 14)
        at = ids.index(config["image_token_id"])
        n = ids.count(config["image_token_id"])
        assert n == np.prod(grid) // 4 and ids[at - 1] == config["image_start_token_id"]
        assert ids[at + n] == config["image_end_token_id"]
        grids.add(tuple(grid))
    assert len(grids) == 2


def test_lfm2_vl_views_are_packed_patches_unshuffled_into_a_hybrid_decoder(home):
    """LFM2-VL through transformers' processor with mlx-vlm's NumPy image processor (no torch):
    packed patches of 16 per view, (h/2)*(w/2) image tokens per view; a decoder of short
    convolutions and attention."""
    from mlx_vlm.utils import load_model

    path = resolve_model(LFM2, home)
    config = json.loads((path / "config.json").read_text())
    proc = _processor(str(path))
    assert type(proc).__name__ == "Lfm2VlProcessor" and type(proc.image_processor).__name__ == "Lfm2VlNumpyImageProcessor"
    assert [type(lyr).__name__ for lyr in load_model(path).language_model.model.layers] == ["Lfm2DecoderLayer"] * 2
    for size in [(80, 100), (300, 500)]:
        ids, data = prepare(path, "Hi", image(1, size))
        shapes = data["spatial_shapes"]
        assert data["pixel_values"].shape == (len(shapes), 256, 3 * 16 * 16)
        assert ids.count(config["image_token_id"]) == int((shapes // 2).prod(axis=1).sum())
        assert (data["pixel_attention_mask"].sum(axis=1) == shapes.prod(axis=1)).all()


def test_gemma3_images_are_four_soft_tokens_between_markers(home):
    path = resolve_model(GEMMA, home)
    config = json.loads((path / "config.json").read_text())
    for size in [(80, 100), (300, 40)]:
        ids, data = prepare(path, "Hi", image(1, size))
        assert data["pixel_values"].shape == (1, 3, 56, 56)  # resized, no pan-and-scan crops
        at = ids.index(config["image_token_index"])
        assert ids[at - 1] == config["boi_token_index"] and ids[at + 4] == config["eoi_token_index"]
        assert ids.count(config["image_token_index"]) == 4


@pytest.mark.parametrize("model", [IDEFICS, SMOLVLM])
def test_idefics3_images_are_tiles_of_four_tokens(home, model):
    """SmolVLM is Idefics3's model and layout under its own name: its own processor (mlx-vlm's) and
    mlx-vlm's smolvlm module, the same tiles."""
    from mlx_vlm.utils import load_model

    path = resolve_model(model, home)
    family = model.split("-")[-1]
    assert type(_processor(str(path))).__name__ == ("SmolVLMProcessor" if model == SMOLVLM else "Idefics3Processor")
    assert type(load_model(path)).__module__.endswith(f"{family}.{family}")
    image_token = json.loads((path / "config.json").read_text())["image_token_id"]
    seen = set()
    for size in [(80, 100), (50, 200)]:
        ids, data = prepare(path, "Hi", image(1, size))
        tiles = data["pixel_values"].shape[0]  # splits of 56 (the longest edge resized to 112) plus the global view
        assert data["pixel_values"].shape == (tiles, 3, 56, 56) and tiles > 1
        assert ids.count(image_token) == 4 * tiles
        seen.add(tiles)
    assert len(seen) == 2


def test_mistral3_images_are_rows_of_tokens_at_their_own_aspect_ratio(home):
    """Pixtral's processor keeps the aspect ratio (the longest edge at most 112, both multiples of
    28): h/28 rows of w/28 [IMG] tokens, a break after each row but the last, [IMG_END] after it."""
    path = resolve_model(MISTRAL, home)
    config = json.loads((path / "config.json").read_text())
    tokens = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    brk, end = ({t["content"]: t["id"] for t in tokens}[n] for n in ("[IMG_BREAK]", "[IMG_END]"))
    shapes = set()
    for size in [(80, 100), (50, 200), (112, 56)]:
        ids, data = prepare(path, "Hi", image(1, size))
        _, _, h, w = data["pixel_values"].shape
        assert h % 28 == w % 28 == 0 and max(h, w) <= 112 and data["image_sizes"].tolist() == [h, w]
        first = ids.index(config["image_token_index"])
        rows = [[config["image_token_index"]] * (w // 28)] * (h // 28)
        want = [t for r in rows for t in r + [brk]][:-1] + [end]
        assert ids[first: first + len(want)] == want
        shapes.add((h, w))
    assert len(shapes) == 3


def test_qwen2_5_vl_is_its_own_family_with_a_windowed_tower(home):
    """mlx-vlm loads Qwen2.5-VL's model (not Qwen2-VL's) and its tower attends in windows: an image
    of 3x4 merged tokens spans four windows of 2x2."""
    from mlx_vlm.utils import load_model

    path = resolve_model(QWEN25, home)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == config["vision_config"]["model_type"] == "qwen2_5_vl"
    tower = load_model(path).vision_tower
    assert type(tower).__module__.endswith("qwen2_5_vl.vision") and tower.fullatt_block_indexes == [1]
    import mlx.core as mx

    index, bounds = tower.get_window_index(mx.array([[1, 6, 8]]))
    assert len(set(np.array(bounds).tolist())) - 1 == 4


def test_internvl_images_are_square_tiles_and_a_thumbnail_of_four_tokens(home):
    """InternVL's processor (mlx-vlm's) tiles an image on the grid closest to its aspect ratio (up to
    4 tiles of 56, plus a thumbnail when there are several), each 4 context tokens between <img>
    and </img>; mlx-vlm loads its InternViT tower and Qwen3 decoder."""
    from mlx_vlm.utils import load_model

    path = resolve_model(INTERNVL, home)
    config = json.loads((path / "config.json").read_text())
    tokens = {t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    assert type(_processor(str(path))).__name__ == "InternVLProcessor"
    vlm = load_model(path)
    assert type(vlm.language_model).__module__.endswith("qwen3.language") and hasattr(vlm.vision_tower, "embeddings")
    seen = set()
    for size in [(56, 56), (80, 150), (200, 50)]:
        ids, data = prepare(path, "Hi", image(1, size))
        tiles = data["pixel_values"].shape[0]
        assert data["pixel_values"].shape == (tiles, 3, 56, 56) and (tiles == 1 or tiles > 2)
        first = ids.index(config["image_token_id"])
        assert ids[first - 1] == tokens["<img>"] and ids[first + 4 * tiles] == tokens["</img>"]
        assert ids.count(config["image_token_id"]) == 4 * tiles
        seen.add(tiles)
    assert len(seen) == 3
