"""The vLLM scenario: the batch workload driven by vLLM's engine through our worker class vs by the
reference scheduler, over the same sidecar server (throughput ratio, goal >= 0.9). Runs only when
the vLLM venv exists (`make install-vllm`: .venv-vllm, or $MLX_SIDECAR_VLLM_PYTHON)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

from bench.blas import without_preload  # the driver runs no MLX: torch keeps its own BLAS
from bench.scenarios import Bench, batch_lengths, median
from bench.sides import SidecarSide, requests_for
from sidecar.models.export import model_dir

ROOT = Path(__file__).resolve().parents[1]


def vllm_python() -> Path | None:
    path = Path(os.environ.get("MLX_SIDECAR_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    return path if path.exists() else None


def vllm_engine(b: Bench, make_side: Callable[[dict[str, Any]], SidecarSide]) -> None:
    p = b.params
    py = vllm_python()
    b.results["vllm_engine_ratio"] = math.nan  # until measured
    if not p.vllm or py is None:
        b.notes.append("vllm engine: not run (" + ("off in this profile" if not p.vllm else
                                                    "no .venv-vllm: `make install-vllm`") + ")")
        return
    prompts = b.prompts(batch_lengths(b, p.batch_requests, p.batch_prompt_min, p.batch_prompt_max))
    side = make_side({})  # its own server: vLLM re-initialises it
    side.run(requests_for(prompts[:2], 2), tag="vllm-warmup", max_num_seqs=p.batch_requests)
    ours = [side.run(requests_for(prompts, p.batch_new_tokens), tag="vllm-ref", max_num_seqs=p.batch_requests)[0]
            for _ in range(p.batch_repeats)]
    kv_bytes = side.num_blocks * side.block_bytes()
    side.close()
    with tempfile.TemporaryDirectory(prefix="sidecar-bench-vllm-") as tmp:
        req = {"url": side.server.url, "model_dir": str(model_dir(p.model, p.home, dest=tmp)), "prompts": prompts,
               "max_tokens": p.batch_new_tokens, "max_num_seqs": p.batch_requests,
               "max_num_batched_tokens": p.max_num_batched_tokens, "kv_cache_memory_bytes": kv_bytes,
               "max_model_len": p.batch_prompt_max + p.batch_new_tokens + 16, "repeats": p.batch_repeats}
        b.log(f"vllm engine: starting vLLM ({py}) against {side.server.url}")
        r = subprocess.run([str(py), "-m", "bench.vllm_driver"], input=json.dumps(req), capture_output=True,
                           text=True, cwd=ROOT, timeout=1800, env={**without_preload(os.environ), "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        b.notes.append(f"vllm engine: vLLM failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
        return
    got = json.loads(r.stdout.strip().splitlines()[-1])
    total = len(prompts) * p.batch_new_tokens
    ref_tok_s = median([o.total_tokens / o.wall_s for o in ours])
    vllm_tok_s = median([total / w for w in got["walls"]])
    want = list(ours[-1].tokens.values())
    b.results.update(vllm_engine_ratio=vllm_tok_s / ref_tok_s, vllm_engine_tok_s=vllm_tok_s,
                     vllm_ref_scheduler_tok_s=ref_tok_s, vllm_engine_init_s=got["init_s"],
                     vllm_engine_tokens_match=sum(a == w for a, w in zip(got["tokens"], want)) / len(want))
    b.log(f"vllm engine: {vllm_tok_s:.2f} tok/s vs reference scheduler {ref_tok_s:.2f} tok/s")
