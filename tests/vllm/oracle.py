"""The mlx-lm oracle for the vLLM suite, run in the main .venv (MLX) as a subprocess:
JSON on stdin -> JSON on stdout.

{"model": "builtin:tiny", "prompts": [[int]], "max_tokens": n}
  -> [{"tokens": [int], "logprobs": [float], "prompt_logprobs": [float]}] (greedy, each prompt alone)
{"model": ..., "prompts": [[int]], "max_tokens": n, "kv_bits": 8|4} -> [{"tokens", "logprobs"}] (mlx-lm with its
  QuantizedKVCache from the first token: tests/kv/test_quant.py's oracle)
{"model": ..., "chat": [messages], "max_tokens": n} -> {"prompt": [int], "tokens": [int], "text": str}
{"model": ..., "prompts": [[int]], "pool": kind, "score": bool} -> pooled hidden states (see `pool`)
{"vlm": ..., "text": str, "image_seed": s, "size": [h, w], "max_tokens": n, "image_first": bool} -> {"prompt": [int], "tokens": [int],
  "png": base64, "pixel_values": [...]} (mlx-vlm's processor and generate on the image tests/vision.py makes)
"adapter": <dir> applies an mlx-lm LoRA adapter; {"model": ..., "make_adapter": <dir>, "seed": s} makes one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten

from sidecar.models import resolve_model
from tests.conftest import mlx_lm_greedy


def make_adapter(name: str, dest: Path, seed: int, rank: int = 4) -> None:
    """An mlx-lm LoRA adapter (mlx-lm's own tuner layers, non-zero B) for built-in `name`."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model = load_model(resolve_model(name))[0]
    params = {"rank": rank, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, len(model.layers), params)
    rng = np.random.default_rng(seed)
    lora = {k: mx.array(rng.normal(0, 0.05, v.shape).astype(np.float32))
            for k, v in tree_flatten(model.parameters()) if k.endswith((".lora_a", ".lora_b"))}
    dest.mkdir(parents=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), lora)
    (dest / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": len(model.layers),
                                                          "lora_parameters": params}))


def pool(req: dict) -> None:
    """{"model", "prompts", "pool": "LAST"|"MEAN"|"CLS"|"ALL", "score": bool} -> per prompt mlx-lm's final hidden
    states pooled by hand, unnormalised (with "score": through the checkpoint's score weights: raw logits)."""
    from mlx_lm.utils import load_model

    from tests.engine.test_pooling import hidden, pooled_by_hand

    path = resolve_model(req["model"])
    model = load_model(path, strict=False)[0]  # the decoder (a classifier's head by hand below)
    out = [pooled_by_hand(hidden(model, p), req["pool"]) for p in req["prompts"]]
    if req.get("score"):
        w = np.array(mx.load(str(path / "model.safetensors"))["score.weight"])
        out = [o @ w.T for o in out]
    json.dump([o.tolist() for o in out], sys.stdout)
def vlm(req: dict) -> dict:
    import base64
    import io

    from tests.vision import image, oracle, prepare

    path = resolve_model(req["vlm"])
    img = image(req["image_seed"], tuple(req["size"]))
    first = bool(req.get("image_first"))
    ids, data = prepare(path, req["text"], img, first)
    png = io.BytesIO()
    img.save(png, format="PNG")
    return {"prompt": ids, "tokens": oracle(path, req["text"], img, req["max_tokens"], first),
            "png": base64.b64encode(png.getvalue()).decode(), "pixel_values": data["pixel_values"].tolist()}


def main() -> None:
    req = json.load(sys.stdin)
    if "vlm" in req:
        json.dump(vlm(req), sys.stdout)
        return
    if "make_adapter" in req:
        make_adapter(req["model"], Path(req["make_adapter"]), req["seed"])
        json.dump(None, sys.stdout)
        return
    if "pool" in req:
        pool(req)
        return
    model, tokenizer = mlx_lm.load(str(resolve_model(req["model"])), adapter_path=req.get("adapter"))
    n = req["max_tokens"]
    if "chat" in req:
        prompt = tokenizer.apply_chat_template(req["chat"], add_generation_prompt=True)
        tokens, _ = mlx_lm_greedy(model, prompt, n)
        json.dump({"prompt": prompt, "tokens": tokens, "text": tokenizer.decode(tokens)}, sys.stdout)
        return
    if req.get("kv_bits"):
        from tests.kv.test_quant import quant_greedy

        runs = [quant_greedy(model, p, n, req["kv_bits"]) for p in req["prompts"]]
        json.dump([{"tokens": t, "logprobs": lp} for t, lp in runs], sys.stdout)
        return
    out = []
    for p in req["prompts"]:
        tokens, logprobs = mlx_lm_greedy(model, p, n)
        logits = model(mx.array([p]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out.append({"tokens": tokens, "logprobs": logprobs,
                    "prompt_logprobs": [lp[i, p[i + 1]].item() for i in range(len(p) - 1)]})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
