"""The mlx-lm oracle for the vLLM suite, run in the main .venv (MLX) as a subprocess:
JSON on stdin -> JSON on stdout.

{"model": "builtin:tiny", "prompts": [[int]], "max_tokens": n}
  -> [{"tokens": [int], "logprobs": [float], "prompt_logprobs": [float]}] (greedy, each prompt alone)
{"model": ..., "chat": [messages], "max_tokens": n} -> {"prompt": [int], "tokens": [int], "text": str}
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx_lm

from sidecar.models import resolve_model
from tests.conftest import mlx_lm_greedy


def main() -> None:
    req = json.load(sys.stdin)
    model, tokenizer = mlx_lm.load(str(resolve_model(req["model"])))
    n = req["max_tokens"]
    if "chat" in req:
        prompt = tokenizer.apply_chat_template(req["chat"], add_generation_prompt=True)
        tokens, _ = mlx_lm_greedy(model, prompt, n)
        json.dump({"prompt": prompt, "tokens": tokens, "text": tokenizer.decode(tokens)}, sys.stdout)
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
