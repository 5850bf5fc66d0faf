"""Shared by the vision tests: images, mlx-vlm's processor and generate (the oracle), and a driver
that schedules encoder inputs as vLLM's scheduler does (an item when a chunk first reaches its
placeholder and its output is not cached; a free when the test says so)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from sidecar.wire.multimodal import encode_tensor
from tests.driver import Driver

pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

MODEL = "builtin:tiny-qwen2-vl"
QWEN25 = "builtin:tiny-qwen2.5-vl"
QWEN3 = "builtin:tiny-qwen3-vl"
QWEN3_MOE = "builtin:tiny-qwen3-vl-moe"
GEMMA = "builtin:tiny-gemma3-vl"
IDEFICS = "builtin:tiny-idefics3"
MISTRAL = "builtin:tiny-mistral3"
SMOLVLM = "builtin:tiny-smolvlm"
GLM4V = "builtin:tiny-glm4v"
GLM4V_MOE = "builtin:tiny-glm4v-moe"
PADDLE = "builtin:tiny-paddleocr-vl"
LFM2 = "builtin:tiny-lfm2-vl"
INTERNVL = "builtin:tiny-internvl"
# Each family's prompt around a user turn ({}: its content) and its image marker.
PROMPTS = {"qwen2_vl": "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n",
           "gemma3": "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
           "idefics3": "<|begin_of_text|>User:{}<end_of_utterance>\nAssistant:", "mistral3": "<s>[INST]{}[/INST]",
           "smolvlm": "<|im_start|>User:{}<end_of_utterance>\nAssistant:",
           "glm4v": "[gMASK]<sop><|user|>\n{}<|assistant|>\n", "paddleocr_vl": "<s>User: {}\nAssistant: ",
           "lfm2_vl": "<|startoftext|><|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"}
IMAGES = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "gemma3": "<start_of_image>", "idefics3": "<image>",
          "mistral3": "[IMG]", "smolvlm": "<image>", "glm4v": "<|begin_of_image|><|image|><|end_of_image|>",
          "paddleocr_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>", "lfm2_vl": "<image>"}
for _qwen in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
    PROMPTS[_qwen], IMAGES[_qwen] = PROMPTS["qwen2_vl"], IMAGES["qwen2_vl"]
PROMPTS["glm4v_moe"], IMAGES["glm4v_moe"] = PROMPTS["glm4v"], IMAGES["glm4v"]
PROMPTS["internvl"], IMAGES["internvl"] = PROMPTS["qwen2_vl"], "<IMG_CONTEXT>\n"


def _prompt(path: Path, text: str, image_first: bool = False) -> str:
    """The text then the image, or (image_first) the image then the text: a question about an
    image seen before then shares the prefix up to and past the image."""
    import json

    family = json.loads((Path(path) / "config.json").read_text())["model_type"]
    return PROMPTS[family].format(IMAGES[family] + text if image_first else text + IMAGES[family])


def image(seed: int = 0, size: tuple[int, int] = (80, 100)):
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@lru_cache(maxsize=None)
def _processor(path: str):
    import json

    from mlx_vlm.utils import get_model_and_args, load_processor

    get_model_and_args(json.loads((Path(path) / "config.json").read_text()))  # registers mlx-vlm's processor
    return load_processor(Path(path))


@lru_cache(maxsize=None)
def _model(path: str):
    from mlx_vlm.utils import load_model

    return load_model(Path(path))


def prepare(path: Path, text: str, img, image_first: bool = False) -> tuple[list[int], dict]:
    """mlx-vlm's processor on one image: the prompt's token ids and the item's tensors."""
    inputs = _processor(str(path))(text=[_prompt(path, text, image_first)], images=[img])
    ids = np.array(inputs["input_ids"])[0].tolist()
    data = {"pixel_values": np.array(inputs["pixel_values"], np.float32)}
    if "spatial_shapes" in inputs:  # lfm2_vl: [views, patches, C*p*p] with its mask and each view's shape
        data.update(pixel_attention_mask=np.array(inputs["pixel_attention_mask"], np.int64),
                    spatial_shapes=np.array(inputs["spatial_shapes"], np.int64))
    elif "pixel_attention_mask" in inputs:  # idefics3: [1, tiles, ...] for the one image
        data = {"pixel_values": data["pixel_values"][0],
                "pixel_attention_mask": np.array(inputs["pixel_attention_mask"], np.int64)[0]}
    elif data["pixel_values"].ndim == 5:  # paddleocr_vl: [1, patches, C, p, p]; internvl: [1, tiles, C, S, S]
        data["pixel_values"] = data["pixel_values"][0]
    if "image_sizes" in inputs:  # mistral3: the image's (height, width)
        data["image_sizes"] = np.array(inputs["image_sizes"], np.int64).reshape(-1)
    if "image_grid_thw" in inputs:
        data["image_grid_thw"] = np.array(inputs["image_grid_thw"], np.int64).reshape(-1)
    return ids, data


def oracle(path: Path, text: str, img, n: int, image_first: bool = False) -> list[int]:
    """mlx-vlm's own generate, greedy."""
    from mlx_vlm import generate

    res = generate(_model(str(path)), _processor(str(path)), _prompt(path, text, image_first), image=[img], max_tokens=n,
                   temperature=0.0, verbose=False)
    return list(res.token_ids)[:n]


def feature(ids: list[int], data: dict, identifier: str, image_token: int) -> dict:
    """The item as vLLM places it: from the first to the last image token, is_embed on the image tokens."""
    at = [i for i, t in enumerate(ids) if t == image_token]
    embed = [t == image_token for t in ids[at[0]: at[-1] + 1]]
    return {"modality": "image", "identifier": identifier, "mm_hash": identifier,
            "mm_position": {"offset": at[0], "length": len(embed), "is_embed": None if all(embed) else embed},
            "data": {k: encode_tensor(v) for k, v in data.items()}}


class MMDriver(Driver):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.features: dict[str, list[dict]] = {}
        self.encoded: set[str] = set()  # what the scheduler believes the worker's encoder cache holds
        self.to_free: list[str] = []

    def add_mm(self, rid: str, prompt: list[int], features: list[dict], **kw):
        self.features[rid] = features
        return self.add(rid, prompt, **kw)

    def free_encoder(self, identifier: str) -> None:
        self.encoded.discard(identifier)
        self.to_free.append(identifier)

    def build(self, chunk: int, only: list[str] | None = None) -> dict:
        so = super().build(chunk, only)
        for nr in so["scheduled_new_reqs"]:
            nr["mm_features"] = self.features.get(nr["req_id"], [])
        sched: dict[str, list[int]] = {}
        for rid, n in so["num_scheduled_tokens"].items():
            start = self.reqs[rid].computed
            for j, f in enumerate(self.features.get(rid, [])):
                # As vLLM: an item is encoded in the first chunk that reaches one of its embeddings
                # (a chunk of only the placeholder's other positions, such as Idefics3's row and
                # column tokens, needs no encoder output).
                p, lo, hi = f["mm_position"], max(start, f["mm_position"]["offset"]), start + n
                embed = p["is_embed"] or [True] * p["length"]
                if any(embed[lo - p["offset"]: hi - p["offset"]]) and f["identifier"] not in self.encoded:
                    self.encoded.add(f["identifier"])
                    sched.setdefault(rid, []).append(j)
        so["scheduled_encoder_inputs"], so["free_encoder_mm_hashes"], self.to_free = sched, self.to_free, []
        return so


def fresh(worker) -> MMDriver:
    """A driver over a new pool of 96 blocks for a worker made with num_blocks=96."""
    worker.initialize_cache(96, 0)  # a new pool: no request, no block, no encoder output from a previous test
    assert not worker.runner.mm.cache and not worker.runner.mm.requests
    return MMDriver(worker.execute_model, worker.config.block_size, 96)


def tok(worker) -> int:
    """The served model's image token."""
    return worker.runner.mm.model.image_token_id


def new_step(worker, ids, feat, sched=None, rid="x"):
    """A new request's step, valid but for what a test changes (the last blocks of the pool of 96)."""
    blocks = list(range(96 - -(-len(ids) // worker.config.block_size), 96))
    return {"scheduled_new_reqs": [{"req_id": rid, "prompt_token_ids": ids, "sampling_params": {"temperature": 0.0},
                                    "block_ids": [blocks], "num_computed_tokens": 0, "mm_features": [feat]}],
            "num_scheduled_tokens": {rid: len(ids)}, "total_num_scheduled_tokens": len(ids),
            "scheduled_encoder_inputs": {rid: [0]} if sched is None else sched}
