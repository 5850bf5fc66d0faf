"""Vision-language checkpoints through mlx-vlm's own model code: which families are served.

`load_vision` loads a served family with mlx-vlm and wraps it as the runner's model
(models/vlm_model.py: called like an mlx-lm model, the next call's input embeddings and positions
bound beforehand by engine/multimodal.py), with the family's adapter (models/vlm_families.py: what
its encoder takes and how it runs). Checkpoints of other multimodal families keep being served as
text-only models through mlx-lm when mlx-lm has their text half (a request with an image is then
refused naming the family), and are refused by name at load_model when it has not (`unserved`).
"""

from __future__ import annotations

import json
from pathlib import Path

from sidecar.models.vlm_families import (Gemma3, Idefics3, InternVL, Lfm2VL, Mistral3, PaddleOCRVL, Qwen2VL,
                                          Qwen3VL)
from sidecar.models.vlm_model import VisionLanguageModel


def vision_available() -> bool:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return False
    return True


def _config(path: Path) -> dict:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_type(path: Path) -> str | None:
    """The checkpoint's model_type when it is a vision-language one (has a vision_config), else None."""
    config = _config(path)
    return config.get("model_type") if isinstance(config.get("vision_config"), dict) else None


def _other_decoder(path: Path) -> str | None:
    """The decoder of a checkpoint whose family's mlx-vlm module builds another one, else None."""
    want = DECODERS.get(model_type(path) or "")
    text = _config(path).get("text_config")
    got = text.get("model_type") if isinstance(text, dict) else None
    return got if want is not None and got != want else None


def is_served(path: Path) -> bool:
    return model_type(path) in SERVED and _other_decoder(path) is None and vision_available()


def unserved(path: Path) -> str | None:
    """Why a vision-language checkpoint's images are not served (its family named), or None for a
    served one or a text model."""
    family = model_type(path)
    if family is None or is_served(path):
        return None
    if (other := _other_decoder(path)) is not None:
        return f"{family} with a {other} decoder is not served (mlx-vlm's {family} module builds {DECODERS[family]}'s)"
    if family in SERVED:
        return f"images of {family} need the vision extra (mlx-vlm), which is not installed"
    return f"{family} is a vision-language family whose images are not served (served: {', '.join(SERVED)})"


def load_vision(path: Path) -> tuple[VisionLanguageModel, dict]:
    from mlx_vlm.utils import load_model

    config = json.loads((Path(path) / "config.json").read_text())
    return SERVED[config["model_type"]](load_model(Path(path)), config), config



# mlx-vlm families whose images are served (the rest of a multimodal checkpoint: its text half).
SERVED: dict[str, type[VisionLanguageModel]] = {
    "qwen2_vl": Qwen2VL, "qwen2_5_vl": Qwen2VL, "qwen3_vl": Qwen3VL, "qwen3_vl_moe": Qwen3VL, "gemma3": Gemma3,
    "idefics3": Idefics3, "smolvlm": Idefics3, "mistral3": Mistral3, "glm4v": Qwen2VL,
    "glm4v_moe": Qwen2VL, "paddleocr_vl": PaddleOCRVL, "lfm2_vl": Lfm2VL, "internvl": InternVL}
# Families whose mlx-vlm module builds one decoder whatever the checkpoint's text_config names:
# InternVL's builds Qwen3's (InternVL3.5; InternVL3's Qwen2.5 would not load).
DECODERS = {"internvl": "qwen3"}
