"""Unmodified vLLM 0.32 over a real sidecar started with `--kv-dtype 8bit|4bit`: vLLM counts its
blocks by the sidecar's exact quantised page size (not the larger fp one), allocates what the
sidecar's pool holds for that memory, and its greedy tokens and logprobs are mlx-lm's with the
same KV quantisation, through chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import httpx
import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.v1.kv_cache_interface import FullAttentionSpec

from sidecar.vllm import convert
from tests.server.serverproc import start_server
from tests.vllm.conftest import WORKER_CLS, counter, mixed_prompts, oracle, sidecar_url_config

MODEL = "builtin:tiny-kv64"  # llama, 2 layers, 2 KV heads of 64, float32
LAYERS, HEADS, HEAD, BS = 2, 2, 64, 16
MAX_TOKENS = 16


def page(bits: int) -> int:
    """The protocol's formula (docs/protocol.md, Quantised KV cache): data + float32 scale and bias per 64."""
    q = HEAD * bits // 8 + 2 * (HEAD // 64) * 4
    return BS * HEADS * 2 * q


def memory(bits: int) -> int:
    return 14 * LAYERS * page(bits) + 100  # 14 quantised blocks (+ a remainder no block fits in)


@pytest.fixture(scope="module", params=[8, 4])
def engine(request: pytest.FixtureRequest, home: str, vllm_model_dir):
    bits = request.param
    with start_server("--model", MODEL, "--kv-dtype", f"{bits}bit") as server:
        llm = LLM(model=vllm_model_dir(MODEL), worker_cls=WORKER_CLS, additional_config=sidecar_url_config(server.url),
                  kv_cache_memory_bytes=memory(bits), block_size=BS, max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=32, enable_prefix_caching=True, enforce_eager=True, disable_log_stats=False,
                  seed=0)
        try:
            yield bits, llm, server
        finally:
            llm.llm_engine.engine_core.shutdown()


def test_vllm_counts_blocks_by_the_quantised_page_size(engine) -> None:
    bits, llm, server = engine
    wire = httpx.get(f"{server.url}/info").json()["kv_cache_spec"]
    assert all(s["kv_quantization"] == {"bits": bits, "group_size": 64} for s in wire.values())
    assert {s["page_size_bytes"] for s in wire.values()} == {page(bits)}
    specs = convert.kv_cache_spec(wire)
    assert all(isinstance(s, FullAttentionSpec) and s.page_size_bytes == page(bits) for s in specs.values())
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    assert blocks == memory(bits) // (LAYERS * page(bits)) == 14
    info = httpx.get(f"{server.url}/info").json()
    assert info["num_blocks"] == blocks  # the pool the sidecar allocated for vLLM's KVCacheConfig
    # Negative control: the unquantised spec (what the adapter gave before) counts 3.6x / 6.4x fewer,
    # too few for one request of max_model_len (8 blocks): vLLM would not even start.
    fp = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, head_size_v=HEAD, dtype=torch.float32)
    fp_blocks = memory(bits) // (LAYERS * fp.page_size_bytes)
    assert fp_blocks == {8: 3, 4: 2}[bits] < 128 // BS


def test_greedy_tokens_and_logprobs_are_mlx_lms_quantised(engine, home: str) -> None:
    bits, llm, _ = engine
    ps = mixed_prompts(1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    want = oracle({"model": MODEL, "prompts": ps, "max_tokens": MAX_TOKENS, "kv_bits": bits}, home)
    unquantised = oracle({"model": MODEL, "prompts": ps, "max_tokens": MAX_TOKENS}, home)
    apart = 0.0
    for i, (o, w, u) in enumerate(zip(outs, want, unquantised)):
        toks = list(o.outputs[0].token_ids)
        assert toks == w["tokens"], f"prompt {i} (len {len(ps[i])})"
        got = [step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)]
        assert got == pytest.approx(w["logprobs"], abs=1e-4), f"prompt {i}"
        same = next((j for j, (a, b) in enumerate(zip(toks, u["tokens"])) if a != b), len(toks))
        apart = max([apart, *(abs(a - b) for a, b in zip(got[:same], u["logprobs"][:same]))])
    assert apart > 1e-3  # negative control: the unquantised oracle is measurably different
    assert counter(llm, "vllm:num_preemptions") > 0  # 14 blocks for 8 requests of up to 66 tokens
    assert counter(llm, "vllm:prefix_cache_hits") > 0
