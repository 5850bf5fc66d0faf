"""Offline `vllm.LLM` (unmodified vLLM 0.32) driving a real sidecar through our worker class.

The KV budget (14 blocks of 16 tokens) and max_num_batched_tokens (32) are small enough that the
run needs chunked prefill, preemption with resume and prefix-cache hits, each shown by a counter.
Each case runs with vLLM's async scheduling (two steps in flight) and without.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
from vllm.sampling_params import StructuredOutputsParams

from tests.server.serverproc import start_server
from tests.vllm.conftest import TINY_BLOCK_BYTES, WORKER_CLS, counter, mixed_prompts, oracle, sidecar_url_config

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=[("builtin:tiny", False), ("builtin:tiny", True), ("builtin:tiny-qwen3", True)],
                ids=["tiny-sync", "tiny-async", "tiny-qwen3-async"])
def engine(request: pytest.FixtureRequest, home: str, vllm_model_dir, tmp_path_factory: pytest.TempPathFactory):
    name, async_scheduling = request.param
    loras = tmp_path_factory.mktemp("loras")
    oracle({"model": name, "make_adapter": str(loras / "one"), "seed": 1}, home)
    with start_server("--model", name, "--lora-dir", str(loras)) as server:
        llm = LLM(model=vllm_model_dir(name), worker_cls=WORKER_CLS, additional_config=sidecar_url_config(server.url),
                  enable_lora=True, max_lora_rank=8, max_loras=1,
                  kv_cache_memory_bytes=14 * TINY_BLOCK_BYTES, block_size=16, max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=32, enable_prefix_caching=True, enforce_eager=True, disable_log_stats=False,
                  seed=0, structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
                  async_scheduling=async_scheduling)
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
        try:
            yield name, llm, server, loras
        finally:
            llm.llm_engine.engine_core.shutdown()


def test_greedy_tokens_are_mlx_lms_through_chunking_preemption_and_prefix_hits(engine, home: str) -> None:
    name, llm, server, _ = engine
    ps = mixed_prompts(1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    want = oracle({"model": name, "prompts": ps, "max_tokens": MAX_TOKENS}, home)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert list(o.outputs[0].token_ids) == w["tokens"], f"prompt {i} (len {len(ps[i])})"
    assert counter(llm, "vllm:num_preemptions") > 0
    assert counter(llm, "vllm:prefix_cache_hits") > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    chunks = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("mlx_worker_prefill_chunks_total")]
    assert chunks and chunks[0] > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(engine) -> None:
    _, llm, _, _ = engine
    p = mixed_prompts(2)[5]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": q} for q in mixed_prompts(3)[:4]]
    batch = llm.generate([*others[:2], {"prompt_token_ids": p}, *others[2:]],
                         [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 2 + [seeded]
                         + [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=12, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": p}], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_and_prompt_logprobs_match_mlx_lm(engine, home: str) -> None:
    name, llm, _, _ = engine
    ps = mixed_prompts(4)[4:7]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2),
                        use_tqdm=False)
    want = oracle({"model": name, "prompts": ps, "max_tokens": 8}, home)
    for p, o, w in zip(ps, outs, want):
        toks = list(o.outputs[0].token_ids)
        assert toks == w["tokens"]
        got = [step[t].logprob for step, t in zip(o.outputs[0].logprobs, toks)]
        assert got == pytest.approx(w["logprobs"], abs=1e-4)
        # greedy: the sampled token is the top-1, so each position holds exactly the top 2
        assert all(len(step) == 2 and step[t].rank == 1 for step, t in zip(o.outputs[0].logprobs, toks))
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        got_prompt = [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], p[1:])]
        assert got_prompt == pytest.approx(w["prompt_logprobs"], abs=1e-4)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_structured_outputs_json_schema_and_choice(engine) -> None:
    _, llm, _, _ = engine
    prompt = "The keeper wrote down the weather:"
    free = SamplingParams(temperature=0.0, max_tokens=48)
    constrained = SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(
        json=SCHEMA))
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["lighthouse", "harbour", "storm"]))
    outs = llm.generate([prompt] * 3, [free, constrained, choice], use_tqdm=False)
    assert not _valid(outs[0].outputs[0].text)  # random weights: only the grammar makes it valid
    assert _valid(outs[1].outputs[0].text), outs[1].outputs[0].text
    assert outs[2].outputs[0].text in ("lighthouse", "harbour", "storm")


def test_lora_adapter_under_the_sidecars_lora_dir_gives_mlx_lms_tokens(engine, home: str) -> None:
    name, llm, _, loras = engine
    p = mixed_prompts(5)[6]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with_lora = llm.generate([{"prompt_token_ids": p}], greedy, lora_request=LoRARequest("one", 1, "one"),
                             use_tqdm=False)[0].outputs[0].token_ids
    base = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    want = oracle({"model": name, "adapter": str(loras / "one"), "prompts": [p], "max_tokens": 12}, home)[0]
    assert list(with_lora) == want["tokens"]
    assert base != with_lora  # the adapter changes the tokens: the comparison is not vacuous
    assert set(llm.llm_engine.list_loras()) == {1}


def test_sleep_and_wake_up_reach_the_sidecar(engine, home: str) -> None:
    name, llm, server, _ = engine
    llm.sleep(level=1)
    assert httpx.get(f"{server.url}/info").json()["state"] == "sleeping"
    llm.wake_up()
    assert httpx.get(f"{server.url}/info").json()["state"] == "ready"
    p = mixed_prompts(6)[2]
    got = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == oracle({"model": name, "prompts": [p], "max_tokens": 8}, home)[0]["tokens"]
