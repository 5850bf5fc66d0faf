"""Other checkpoints of one model directory, made with mlx-lm's own conversion steps: a dtype cast
(bf16/fp16, mlx-lm's `cast_predicate` kept) or a quantization (`quantize_model`: uniform affine
bits/group, or one of mlx-lm's mixed per-layer recipes, written as per-module overrides in the
config's `quantization`). What `mlx_lm.convert` does, minus the tokenizer (the tiny families have
none). Used by the architecture tests and scripts/dtype_sweep.py.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

# name -> (dtype or None, bits or None, group size or None, mixed recipe or None)
VARIANTS: dict[str, tuple[str | None, int | None, int | None, str | None]] = {
    "bf16": ("bfloat16", None, None, None),
    "fp16": ("float16", None, None, None),
    "q4g32": (None, 4, 32, None),
    "q8g64": (None, 8, 64, None),
    "mixed_3_6": (None, None, 32, "mixed_3_6"),
    "bf16_q4g64": ("bfloat16", 4, 64, None),  # what most published mlx-lm 4-bit checkpoints are
}


def write_variant(src: Path, dest: Path, variant: str) -> Path:
    """`src` converted to `variant` at `dest` (kept if already complete)."""
    if (dest / "config.json").is_file():
        return dest
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    dtype, bits, group, recipe = VARIANTS[variant]
    model, config = load_model(Path(src), lazy=False)
    if dtype is not None:
        target = getattr(mx, dtype)
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(target) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
        config = {**config, "torch_dtype": dtype}
    if bits or recipe:
        predicate = mixed_quant_predicate_builder(recipe, model, group) if recipe else None
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the bits per weight
            model, config = quantize_model(model, config, group, bits or 4, quant_predicate=predicate)
    dest.mkdir(parents=True, exist_ok=True)
    save_model(dest, model)
    save_config(config, config_path=dest / "config.json.tmp")
    (dest / "config.json.tmp").rename(dest / "config.json")  # last: marks it complete
    return dest


def quantized_layers(path: Path) -> int:
    """How many modules the checkpoint at `path` holds quantized (a check that it really is)."""
    import mlx.core as mx

    return sum(k.endswith(".scales") for f in Path(path).glob("model*.safetensors") for k in mx.load(str(f)))


def config_of(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
