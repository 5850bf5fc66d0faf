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


def model_type(path: Path) -> str | None:
    """The checkpoint's model_type when it is a vision-language one (has a vision_config), else None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config.get("vision_config"), dict) else None


def is_served(path: Path) -> bool:
    return model_type(path) in SERVED and vision_available()


def unserved(path: Path) -> str | None:
    """Why a vision-language checkpoint's images are not served (its family named), or None for a
    served one or a text model."""
    family = model_type(path)
    if family is None or is_served(path):
        return None
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
