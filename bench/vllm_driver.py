"""Run by the bench (vllm_engine.py) inside the vLLM venv: vLLM's engine (offline LLM, our worker class)
drives a given sidecar over a given workload; prints the timings as JSON. Imports no MLX.

stdin: {"url", "model_dir", "prompts": [[int]], "max_tokens", "max_num_seqs", "max_num_batched_tokens",
        "kv_cache_memory_bytes", "max_model_len", "repeats"}
stdout (last line): {"walls": [s], "tokens": [[int]], "init_s": s}
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams

    req = json.load(sys.stdin)
    t0 = time.perf_counter()
    llm = LLM(model=req["model_dir"], worker_cls="sidecar.vllm.worker.MLXSidecarWorker",
              additional_config={"mlx_sidecar": {"url": req["url"]}}, kv_cache_memory_bytes=req["kv_cache_memory_bytes"],
              block_size=16, max_model_len=req["max_model_len"], max_num_seqs=req["max_num_seqs"],
              max_num_batched_tokens=req["max_num_batched_tokens"], enforce_eager=True, enable_prefix_caching=False)
    init_s = time.perf_counter() - t0
    greedy = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in req["prompts"]]
    llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    walls, tokens = [], []
    for _ in range(req["repeats"]):
        t = time.perf_counter()
        outs = llm.generate(inputs, greedy, use_tqdm=False)
        walls.append(time.perf_counter() - t)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    print(json.dumps({"walls": walls, "tokens": tokens, "init_s": init_s}))


if __name__ == "__main__":
    main()
