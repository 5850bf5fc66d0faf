"""The platform plugin's entry point is active only when asked for; without it, plain vLLM (its CPU
platform) with `--worker-cls` alone drives the sidecar as before. Each case runs in a fresh process:
vLLM picks its platform once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sidecar.vllm.plugin import asked
from tests.server.serverproc import ROOT, start_server
from tests.vllm.conftest import WORKER_CLS, oracle

PROBE = "from vllm.platforms import current_platform; print('RESULT', type(current_platform).__name__)"


def run(code: str, **env: str | None) -> str:
    full = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **env}.items() if v is not None}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if line.startswith("RESULT ")][-1].removeprefix("RESULT ")


def test_asked_only_by_the_environment() -> None:
    assert not asked({}) and not asked({"MLX_SIDECAR_PLATFORM": "0"}) and not asked({"VLLM_PLUGINS": "other"})
    assert asked({"MLX_SIDECAR_PLATFORM": "1"}) and asked({"VLLM_PLUGINS": "other, mlx_sidecar"})


@pytest.mark.parametrize("env,want", [({"MLX_SIDECAR_PLATFORM": None}, "CpuPlatform"),
                                      ({"MLX_SIDECAR_PLATFORM": "1"}, "MLXSidecarPlatform"),
                                      ({"MLX_SIDECAR_PLATFORM": None, "VLLM_PLUGINS": "mlx_sidecar"}, "MLXSidecarPlatform")])
def test_vllm_picks_the_platform_only_when_asked(env: dict, want: str) -> None:
    assert run(PROBE, **env) == want


GENERATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], worker_cls=sys.argv[2], additional_config={"mlx_sidecar": {"url": sys.argv[3]}},
          kv_cache_memory_bytes=64 << 20, block_size=16, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
          enforce_eager=True, seed=0)
c = llm.llm_engine.vllm_config
out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[4])],
                   SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print("RESULT", json.dumps({"platform": type(__import__("vllm.platforms").platforms.current_platform).__name__,
                  "async": c.scheduler_config.async_scheduling, "tokens": [list(o.outputs[0].token_ids) for o in out]}))
llm.llm_engine.engine_core.shutdown()
"""


def test_worker_cls_alone_on_plain_vllm(home: str, vllm_model_dir) -> None:
    prompts = [[5, 9, 33, 7, 100, 2, 41], [300, 12, 8]]
    with start_server("--model", "builtin:tiny") as server:
        code = GENERATE.replace("sys.argv[1]", repr(vllm_model_dir("builtin:tiny"))).replace(
            "sys.argv[2]", repr(WORKER_CLS)).replace("sys.argv[3]", repr(server.url)).replace(
            "sys.argv[4]", repr(json.dumps(prompts)))
        got = json.loads(run(code, MLX_SIDECAR_PLATFORM=None))
    assert got["platform"] == "CpuPlatform" and got["async"] is False
    want = oracle({"model": "builtin:tiny", "prompts": prompts, "max_tokens": 10}, home)
    assert got["tokens"] == [w["tokens"] for w in want]
