"""Images for the reference scheduler: requests with multimodal items, and the encoder schedule.

`prepare` turns a prompt and image files into token ids and wire items with mlx-vlm's processor
(what vLLM's processor does on its side); `EncoderSchedule` decides, as vLLM's encoder cache
manager does, which items the worker encodes in a step (the first chunk that reaches an item whose
output the worker does not hold) and which outputs it frees (the least recently used ones no
unfinished request needs, past `max_items`).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import Any, Container, Iterable

import numpy as np

from sidecar.wire.multimodal import encode_tensor


def spans(features: list[dict]) -> list[tuple[int, int, str]]:
    """(offset, length, identifier) of each item's placeholder: what a block's hash takes besides
    its tokens (blocks.py), so a prefix-cache hit needs the same images, not only the same
    placeholder tokens, while text before the first image is shared with any request."""
    return [(f["mm_position"]["offset"], f["mm_position"]["length"], f["identifier"]) for f in features]


def sent(features: list[dict], num_computed: int, held: Container[str]) -> list[dict]:
    """A new request's items as the worker gets them: an item the prefix-cache hit covers whole and
    whose encoder output the worker holds goes without its pixels, keeping only the grid M-RoPE
    positions need (as vLLM sends a covered item). Held outputs a request needs are never freed
    (`EncoderSchedule.evict`), so even recomputed after a preemption it never needs the pixels."""
    out = []
    for f in features:
        p = f["mm_position"]
        if p["offset"] + p["length"] <= num_computed and f.get("data") and f["identifier"] in held:
            grid = {k: v for k, v in f["data"].items() if k == "image_grid_thw"}
            f = {**f, "data": grid or None}
        out.append(f)
    return out


class EncoderSchedule:
    def __init__(self, max_items: int = 64):
        self.max_items = max_items
        self.held: OrderedDict[str, None] = OrderedDict()  # identifiers the worker holds, LRU first
        self.to_free: list[str] = []

    def schedule(self, spans: Iterable[tuple[str, list[dict], int, int]]) -> dict[str, list[int]]:
        """spans: (req_id, items, first computed position, tokens scheduled) of this step's rows."""
        out: dict[str, list[int]] = {}
        for rid, items, start, n in spans:
            for j, f in enumerate(items):
                p = f["mm_position"]
                if p["offset"] < start + n and p["offset"] + p["length"] > start:
                    if f["identifier"] in self.held:
                        self.held.move_to_end(f["identifier"])
                    else:
                        self.held[f["identifier"]] = None
                        out.setdefault(rid, []).append(j)
        return out

    def evict(self, needed: set[str]) -> list[str]:
        """Free least recently used outputs past max_items that no unfinished request needs; the
        frees go out with the next step."""
        for h in list(self.held):
            if len(self.held) <= self.max_items:
                break
            if h not in needed:
                del self.held[h]
                self.to_free.append(h)
        out, self.to_free = self.to_free, []
        return out


def prepare(model_path: str | Path, prompt: str, images: list[str | Path],
            images_first: bool = False) -> tuple[list[int], list[dict]]:
    """Token ids and wire items for `prompt` with `images` (after the text, in order; before it
    with `images_first`), by mlx-vlm's processor and the model's chat template. Each item's
    identifier is a hash of its file's bytes."""
    from PIL import Image

    proc, image_token = _processor(str(model_path))
    pics = [Image.open(p).convert("RGB") for p in images]

    def text(n: int) -> str:
        marks, words = [{"type": "image"}] * n, [{"type": "text", "text": prompt}]
        content = marks + words if images_first else words + marks
        return proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                  tokenize=False)

    inputs = proc(text=[text(len(pics))], images=pics or None)
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    at = [i for i, t in enumerate(ids) if t == image_token]
    features = []
    for k, (img, file) in enumerate(zip(pics, images)):
        # this image alone: its tensors and embedding count (one image: the prompt's own)
        one = inputs if len(pics) == 1 else proc(text=[text(1)], images=[img])
        n = int((np.asarray(one["input_ids"]) == image_token).sum())
        mine, at = at[:n], at[n:]
        span = ids[mine[0]: mine[-1] + 1]
        embed = [t == image_token for t in span]
        # (a plain number is the processor's own bookkeeping, no tensor: InternVL's image_token_index)
        data = {key: _item(one[key]) for key in one
                if key not in ("input_ids", "attention_mask", "token_type_ids") and not isinstance(one[key], int)}
        digest = hashlib.sha256(Path(file).read_bytes()).hexdigest()
        features.append({"modality": "image", "identifier": digest, "mm_hash": digest,
                         "mm_position": {"offset": mine[0], "length": len(span),
                                         "is_embed": None if all(embed) else embed},
                         "data": {key: encode_tensor(v) for key, v in data.items()}})
    return ids, features


@lru_cache(maxsize=4)
def _processor(path: str) -> tuple[Any, int]:
    """mlx-vlm's processor for the checkpoint and its image token, loaded once per process."""
    from mlx_vlm.utils import get_model_and_args, load_processor

    config = json.loads((Path(path) / "config.json").read_text())
    get_model_and_args(dict(config))  # imports the family, which registers mlx-vlm's processor for it
    return load_processor(Path(path)), config.get("image_token_id", config.get("image_token_index"))


def _item(value: Any) -> np.ndarray:
    """One image's tensor from a processor output of one image (a leading batch of 1 dropped
    where the family batches per prompt: [1, tiles, ...])."""
    a = np.asarray(value)
    if a.dtype.kind in "fiub":  # (no copy where it has the dtype already)
        a = a.astype(np.float32 if a.dtype.kind == "f" else np.int64, copy=False)
    if a.ndim == 5 or (a.ndim == 4 and a.shape[0] == 1 and a.dtype == np.int64):  # idefics3: [1, tiles, ...]
        a = a[0]
    if a.ndim == 2 and a.shape == (1, 3) and a.dtype == np.int64:  # a grid [[t, h, w]]
        a = a[0]
    return a
