"""The served families' adapters over mlx-vlm's own towers, projectors and decoders: what each
encoder takes (`check`, a 400 naming the field otherwise), how it runs (`encode`: the rows its own
`get_input_embeddings` merges), and for the M-RoPE families their positions (`get_rope_index`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from sidecar.errors import ProtocolError
from sidecar.models.vlm_model import VisionLanguageModel, need


class Qwen2VL(VisionLanguageModel):
    """Qwen2-VL, Qwen2.5-VL, GLM-4.1V and GLM-4.5V (GLM-4.6V): the same inputs, merged patches and
    M-RoPE; their towers (Qwen2.5-VL's windowed attention, GLM's downsampling merger) and decoders
    are mlx-vlm's."""

    mrope = True

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_tower = self.tower_of(vlm)
        self.image_token_id = int(vlm.config.image_token_id)
        vc = vlm.config.vision_config
        self.merge = int(vc.spatial_merge_size)
        self.patch_shape = self.patch_shape_of(vc)

    @staticmethod
    def tower_of(vlm: nn.Module) -> nn.Module:
        return vlm.vision_tower

    @staticmethod
    def patch_shape_of(vc: object) -> tuple[int, ...]:
        """One row of pixel_values: a patch of temporal_patch_size frames, flattened."""
        return (int(vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2),)  # type: ignore[attr-defined]

    def tower_dtype(self) -> mx.Dtype:
        return self.vision_tower.patch_embed.proj.weight.dtype

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """pixel_values [t*h*w, *patch_shape] float, image_grid_thw (t, h, w), t*h*w/merge^2 embeddings."""
        (grid,) = need(data, ("image_grid_thw",), self.family, path)
        if grid.dtype.kind not in "iu" or grid.size != 3 or (grid.reshape(-1) < 1).any():
            raise ProtocolError("expected 3 positive integers (t, h, w)", field=f"{path}.data.image_grid_thw")
        t, h, w = (int(x) for x in grid.reshape(-1))
        if h % self.merge or w % self.merge:
            raise ProtocolError(f"h and w must be multiples of the merge size {self.merge}",
                                field=f"{path}.data.image_grid_thw")
        pv = need(data, ("pixel_values",), self.family, path)[0] if tensors else None
        if pv is not None and (pv.dtype.kind != "f" or pv.shape != (t * h * w, *self.patch_shape)):
            raise ProtocolError(f"expected a float array of shape {[t * h * w, *self.patch_shape]} for grid "
                                f"{[t, h, w]}, got {pv.dtype.name} {list(pv.shape)}", field=f"{path}.data.pixel_values")
        if t * h * w // self.merge ** 2 != num_embeds:
            raise ProtocolError(f"grid {[t, h, w]} gives {t * h * w // self.merge ** 2} embeddings, the placeholder "
                                f"takes {num_embeds}", field=f"{path}.mm_position")

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        grid = mx.array(data["image_grid_thw"].reshape(1, 3).astype(np.int32))
        return self.vision_tower(mx.array(data["pixel_values"]).astype(self.tower_dtype()), grid,
                                 output_hidden_states=False)

    def rope_positions(self, prompt: list[int], grids: list[np.ndarray]) -> tuple[np.ndarray, int]:
        """M-RoPE positions of the prompt [3, P] and the offset of every later position
        (position = index + delta), by mlx-vlm's own `get_rope_index`."""
        ids = mx.array([prompt], dtype=mx.int32)
        thw = mx.array(np.stack([g.reshape(3) for g in grids]).astype(np.int32)) if grids else None
        pos, delta = self.language_model.get_rope_index(ids, thw)
        if pos.ndim == 2:  # no image: plain positions
            return np.tile(np.arange(len(prompt), dtype=np.int32), (3, 1)), 0
        return np.array(pos[:, 0, :]).astype(np.int32), int(np.array(delta).reshape(-1)[0])


class Qwen3VL(Qwen2VL):
    """Qwen3-VL and Qwen3-VL-MoE: Qwen2-VL's inputs (patches of 16) and interleaved M-RoPE; the
    tower also gives one "deepstack" feature per listed block, added to the hidden states at the
    image positions after the first decoder layers. The encoder output keeps them as extra columns
    of each row, so the cache, the chunk slicing and the merge treat them as one."""

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        grid = mx.array(data["image_grid_thw"].reshape(1, 3).astype(np.int32))
        features, deep = self.vision_tower(mx.array(data["pixel_values"]).astype(self.tower_dtype()), grid)
        return mx.concatenate([features, *deep], axis=-1)

    def deepstack(self, visual: tuple[np.ndarray, mx.array] | None, shape: tuple[int, int]) -> dict:
        if visual is None:
            return {}
        at, rows = visual
        order = np.argsort(at, kind="stable")  # mlx-vlm takes the rows in the mask's order
        mask = np.zeros(shape[0] * shape[1], bool)
        mask[at] = True
        rows = rows[mx.array(order)]
        K = len(self.vision_tower.deepstack_visual_indexes)
        D = rows.shape[-1] // K
        return {"visual_pos_masks": mx.array(mask.reshape(shape)),
                "deepstack_visual_embeds": [rows[:, k * D:(k + 1) * D] for k in range(K)]}


class PaddleOCRVL(Qwen2VL):
    """PaddleOCR-VL: Qwen2-VL's grid and M-RoPE; patches of one frame as [t*h*w, C, p, p] into its
    NaViT tower, whose projector merges them 2x2 into ERNIE-4.5's width."""

    @staticmethod
    def tower_of(vlm: nn.Module) -> nn.Module:
        return vlm.visual

    @staticmethod
    def patch_shape_of(vc: object) -> tuple[int, ...]:
        return (int(vc.num_channels), int(vc.patch_size), int(vc.patch_size))  # type: ignore[attr-defined]

    def tower_dtype(self) -> mx.Dtype:
        return self.vision_tower.embeddings.patch_embedding.weight.dtype

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        grid = mx.array(data["image_grid_thw"].reshape(1, 3).astype(np.int32))
        pv = mx.array(data["pixel_values"])[None].astype(self.tower_dtype())  # (its tower takes a batch of one)
        return self.vision_tower(pv, grid, output_hidden_states=False)


class Gemma3(VisionLanguageModel):
    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_tower = vlm.vision_tower
        self.projector = vlm.multi_modal_projector
        self.image_token_id = int(vlm.config.image_token_index)
        self.hidden_size = int(vlm.config.hidden_size)
        self.tokens = int(vlm.config.text_config.mm_tokens_per_image)
        vc = vlm.config.vision_config
        self.pixels = (int(vc.num_channels), int(vc.image_size), int(vc.image_size))

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """pixel_values [1, C, S, S] float (one crop: pan-and-scan crops are separate images), mm_tokens_per_image embeddings."""
        (pv,) = need(data, ("pixel_values",), self.family, path)
        if pv.dtype.kind != "f" or pv.shape not in ((1, *self.pixels), self.pixels):
            raise ProtocolError(f"expected a float array of shape [1, {', '.join(map(str, self.pixels))}], got "
                                f"{pv.dtype.name} {list(pv.shape)}", field=f"{path}.data.pixel_values")
        if num_embeds != self.tokens:
            raise ProtocolError(f"an image gives {self.tokens} embeddings, the placeholder takes {num_embeds}",
                                field=f"{path}.mm_position")

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        """As Gemma3's get_input_embeddings: projected features over sqrt(hidden) (the language model
        scales every input embedding by it)."""
        pv = mx.array(data["pixel_values"].reshape(1, *self.pixels)).transpose(0, 2, 3, 1)
        hidden, _, _ = self.vision_tower(pv.astype(self.projector.mm_input_projection_weight.dtype),
                                         output_hidden_states=True)
        return self.projector(hidden)[0] / (self.hidden_size ** 0.5)


class Tiles(VisionLanguageModel):
    """An image as tiles of one size (its splits and a global view or thumbnail), each encoded into
    `tile_tokens` embeddings."""

    pixels: tuple[int, int, int]  # a tile's [C, S, S]
    tile_tokens: int

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """pixel_values [tiles, C, S, S] float."""
        (pv,) = need(data, ("pixel_values",), self.family, path)
        if pv.dtype.kind != "f" or pv.ndim != 4 or pv.shape[1:] != self.pixels or pv.shape[0] < 1:
            raise ProtocolError(f"expected a float array of shape [tiles, {', '.join(map(str, self.pixels))}], got "
                                f"{pv.dtype.name} {list(pv.shape)}", field=f"{path}.data.pixel_values")
        if num_embeds != pv.shape[0] * self.tile_tokens:
            raise ProtocolError(f"{pv.shape[0]} tiles give {pv.shape[0] * self.tile_tokens} embeddings, the "
                                f"placeholder takes {num_embeds}", field=f"{path}.mm_position")


class Idefics3(Tiles):
    """Idefics3, and SmolVLM (SmolVLM2: Idefics3's model under its own name): each tile encoded and
    pixel-shuffled into `image_seq_len` embeddings."""

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_model = vlm.vision_model
        self.connector = vlm.connector
        self.image_token_id = int(vlm.config.image_token_index)
        vc = vlm.config.vision_config
        self.patch = int(vc.patch_size)
        self.pixels = (int(vc.num_channels), int(vc.image_size), int(vc.image_size))
        self.tile_tokens = (int(vc.image_size) // self.patch) ** 2 // int(vlm.config.scale_factor) ** 2

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """Also an optional pixel_attention_mask [tiles, S, S]."""
        super().check(data, num_embeds, path, tensors)
        pv, mask = data["pixel_values"], data.get("pixel_attention_mask")
        if mask is not None and mask.shape != (pv.shape[0], *self.pixels[1:]):
            raise ProtocolError(f"expected shape {[pv.shape[0], *self.pixels[1:]]}, got {list(mask.shape)}",
                                field=f"{path}.data.pixel_attention_mask")

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        """As Idefics3's get_input_embeddings: patches with any unmasked pixel attend, then the connector."""
        pv = mx.array(data["pixel_values"])
        n, _, S, _ = pv.shape
        mask = data.get("pixel_attention_mask")
        mask = np.ones((n, S, S), bool) if mask is None else mask.astype(bool)
        p = S // self.patch
        patches = mask[:, : p * self.patch, : p * self.patch].reshape(n, p, self.patch, p, self.patch).sum(axis=(2, 4)) > 0
        hidden, *_ = self.vision_model(pv.transpose(0, 2, 3, 1), patch_attention_mask=mx.array(patches),
                                       output_hidden_states=True)
        out = self.connector(hidden.astype(pv.dtype))
        return out.reshape(-1, out.shape[-1])


class InternVL(Tiles):
    """InternVL (Hugging Face format, InternVL3.5): InternViT over each tile, its class token dropped,
    pixel-shuffled into a quarter of the patches (`downsample_ratio` 0.5) and projected."""

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_tower = vlm.vision_tower
        self.projector = vlm.multi_modal_projector
        self.image_token_id = int(vlm.config.image_token_id)
        self.ratio = float(vlm.config.downsample_ratio)
        vc = vlm.config.vision_config
        self.pixels = (int(vc.num_channels), int(vc.image_size), int(vc.image_size))
        self.tile_tokens = round((int(vc.image_size) // int(vc.patch_size)) ** 2 * self.ratio ** 2)

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        """As InternVL's get_input_embeddings."""
        from mlx_vlm.models.base import pixel_shuffle

        pv = mx.array(data["pixel_values"]).transpose(0, 2, 3, 1)
        hidden, _ = self.vision_tower(pv.astype(self.vision_tower.embeddings.patch_embeddings.projection.weight.dtype))
        out = self.projector(pixel_shuffle(hidden[:, 1:], self.ratio))
        return out.reshape(-1, out.shape[-1])


class Mistral3(VisionLanguageModel):
    """Mistral 3 (Mistral Small 3.x, Ministral 3): Pixtral's tower over the image at its own aspect
    ratio, a patch merger, and rows of [IMG] tokens each closed by [IMG_BREAK] ([IMG_END] after the
    last): the breaks are placeholder positions that are not embeddings (`is_embed`)."""

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_tower = vlm.vision_tower
        self.projector = vlm.multi_modal_projector
        self.feature_layer = int(vlm.vision_feature_layer)
        self.image_token_id = int(vlm.config.image_token_index)
        vc = vlm.config.vision_config
        self.unit = int(vc.patch_size) * int(vlm.config.spatial_merge_size)  # pixels a side of one embedding
        self.channels, self.max_side = int(vc.num_channels), int(vc.image_size)
        # mlx-vlm's Ministral 3 decoder scales attention past the original context by the first
        # row's positions, for every row of a batch: exact while no row is past it.
        rope = getattr(vlm.language_model.config, "rope_parameters", None) or {}
        if rope.get("llama_4_scaling_beta") and vlm.language_model.model_type != "mistral":
            self.rows_apart_past = int(rope["original_max_position_embeddings"])

    def _size(self, data: dict[str, np.ndarray], path: str) -> tuple[int, int]:
        """(H, W) of the image: `image_sizes` when sent (the unpadded part of pixel_values), else its shape."""
        pv = data["pixel_values"]
        H, W = (int(x) for x in pv.shape[-2:])
        sizes = data.get("image_sizes")
        if sizes is None:
            return H, W
        if sizes.dtype.kind not in "iu" or sizes.size != 2:
            raise ProtocolError("expected 2 integers (height, width)", field=f"{path}.data.image_sizes")
        h, w = (int(x) for x in sizes.reshape(-1))
        if not (0 < h <= H and 0 < w <= W):
            raise ProtocolError(f"{[h, w]} is not inside pixel_values' {[H, W]}", field=f"{path}.data.image_sizes")
        return h, w

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """pixel_values [1, C, H, W] or [C, H, W] float (vLLM's: cropped to the image); optional
        image_sizes (h, w), the image's part of padded pixels; h and w multiples of patch x merge up
        to the tower's image size; (h/unit) x (w/unit) embeddings."""
        (pv,) = need(data, ("pixel_values",), self.family, path)
        if (pv.dtype.kind != "f" or pv.ndim not in (3, 4) or pv.shape[-3] != self.channels
                or (pv.ndim == 4 and pv.shape[0] != 1)):
            raise ProtocolError(f"expected a float array of shape [1, {self.channels}, H, W], got {pv.dtype.name} "
                                f"{list(pv.shape)}", field=f"{path}.data.pixel_values")
        h, w = self._size(data, path)
        if h % self.unit or w % self.unit or max(h, w) > self.max_side:
            raise ProtocolError(f"height and width must be multiples of {self.unit} up to {self.max_side}, got "
                                f"{[h, w]}", field=f"{path}.data.pixel_values")
        if (h // self.unit) * (w // self.unit) != num_embeds:
            raise ProtocolError(f"an image of {[h, w]} gives {(h // self.unit) * (w // self.unit)} embeddings, the "
                                f"placeholder takes {num_embeds}", field=f"{path}.mm_position")

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        """As Mistral3's get_input_embeddings: the chosen layer's patches, merged and projected."""
        h, w = self._size(data, "")
        pv = mx.array(data["pixel_values"].reshape(1, self.channels, *data["pixel_values"].shape[-2:]))[:, :, :h, :w]
        *_, hidden = self.vision_tower(pv.transpose(0, 2, 3, 1), output_hidden_states=True, image_sizes=[(h, w)])
        out = self.projector(hidden[self.feature_layer], [(h, w)])
        return out.reshape(-1, out.shape[-1])


class Lfm2VL(VisionLanguageModel):
    """LFM2-VL: SigLIP2's NaFlex tower over packed patches of each view (the image, or its tiles
    and a thumbnail), each view's patches pixel-unshuffled and projected (mlx-vlm's `encode_images`);
    LFM2's hybrid decoder (short convolutions, whose state the paged state cache keeps)."""

    def __init__(self, vlm: nn.Module, config: dict):
        super().__init__(vlm, config)
        self.vision_tower, self.projector = vlm.vision_tower, vlm.multi_modal_projector  # (their weights counted)
        object.__setattr__(self, "_encode_images", vlm.encode_images)
        self.image_token_id = int(vlm.config.image_token_index)
        self.factor = int(vlm.config.downsample_factor)
        vc = vlm.config.vision_config
        self.patch_width = int(vc.num_channels) * int(vc.patch_size) ** 2

    def check(self, data: dict[str, np.ndarray], num_embeds: int, path: str, tensors: bool = True) -> None:
        """pixel_values [views, P, C*p*p] float, spatial_shapes [views, 2] (each view's patch rows
        and columns, multiples of the unshuffle factor, the first h*w of its P patches real), and
        optionally pixel_attention_mask [views, P] saying the same (vLLM sends none): sum of
        (h/f)*(w/f) embeddings."""
        pv, shapes = need(data, ("pixel_values", "spatial_shapes"), self.family, path)
        if pv.dtype.kind != "f" or pv.ndim != 3 or pv.shape[-1] != self.patch_width or 0 in pv.shape:
            raise ProtocolError(f"expected a float array of shape [views, patches, {self.patch_width}], got "
                                f"{pv.dtype.name} {list(pv.shape)}", field=f"{path}.data.pixel_values")
        # (each side bounded first: a product of unbounded sides could wrap around in int64)
        if shapes.dtype.kind not in "iu" or shapes.shape != (pv.shape[0], 2) or (shapes < 1).any() \
                or (shapes > pv.shape[1]).any() or (shapes % self.factor).any() \
                or (shapes.prod(axis=1) > pv.shape[1]).any():
            raise ProtocolError(f"expected {pv.shape[0]} (rows, columns) of patches, multiples of {self.factor}, "
                                f"each at most {pv.shape[1]} patches", field=f"{path}.data.spatial_shapes")
        mask = data.get("pixel_attention_mask")
        if mask is not None and (mask.shape != pv.shape[:2] or mask.dtype.kind not in "biu"
                                 or (mask.astype(bool) != self._mask(shapes, pv.shape[1])).any()):
            raise ProtocolError(f"expected {list(pv.shape[:2])} flags, each view's first rows x columns set",
                                field=f"{path}.data.pixel_attention_mask")
        n = int((shapes // self.factor).prod(axis=1).sum())
        if n != num_embeds:
            raise ProtocolError(f"the views give {n} embeddings, the placeholder takes {num_embeds}",
                                field=f"{path}.mm_position")

    @staticmethod
    def _mask(shapes: np.ndarray, patches: int) -> np.ndarray:
        """Each view's first h*w patches are real, the rest padding."""
        return np.arange(patches)[None] < shapes.prod(axis=1)[:, None]

    def encode(self, data: dict[str, np.ndarray]) -> mx.array:
        shapes, pv = data["spatial_shapes"], data["pixel_values"]
        views = self._encode_images(mx.array(pv), spatial_shapes=mx.array(shapes),
                                    pixel_attention_mask=mx.array(self._mask(shapes, pv.shape[1])))
        return mx.concatenate(views, axis=0)
