"""vLLM's multimodal items and encoder instructions as the sidecar's wire maps (wire/multimodal.py).

Each `MultiModalFeatureSpec` of a new request becomes a map with its placeholder and its processed
tensors (a `MultiModalKwargsItem`: key -> tensor) as typed binary arrays; bfloat16, which numpy
has no type for, travels as float32. Imports vLLM and torch, never MLX.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sidecar.wire.multimodal import encode_tensor


def _array(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(t)


def features(specs: Any) -> list[dict]:
    out = []
    for f in specs or ():
        pos = f.mm_position
        is_embed = None if pos.is_embed is None else [bool(b) for b in _array(pos.is_embed).tolist()]
        data = None if f.data is None else {k: encode_tensor(_array(e.data)) for k, e in f.data.items()
                                             if e.data is not None}
        out.append({"modality": f.modality, "identifier": f.identifier, "mm_hash": f.mm_hash,
                    "mm_position": {"offset": int(pos.offset), "length": int(pos.length), "is_embed": is_embed},
                    "data": data})
    return out


def encoder_instructions(so: Any) -> dict:
    return {"scheduled_encoder_inputs": {rid: [int(i) for i in idx]
                                         for rid, idx in (so.scheduled_encoder_inputs or {}).items()},
            "free_encoder_mm_hashes": list(so.free_encoder_mm_hashes or ())}
