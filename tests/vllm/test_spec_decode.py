"""vLLM's speculative decoding (`speculative_config` method "ngram") through the worker class.

vLLM's EngineCore takes the drafts the sidecar's n-gram proposer made (take_draft_token_ids), its
scheduler schedules them (num_scheduled_tokens counts them, blocks cover them) and the sidecar
verifies them: greedy tokens stay mlx-lm's, and both vLLM's and the sidecar's acceptance counters
show drafts were really accepted, through preemption and resume. The negative control is the same run without speculative_config
against the same sidecar: no drafts are verified.
"""

from __future__ import annotations

import random

import httpx
import pytest
from vllm import LLM, SamplingParams

from tests.server.serverproc import start_server
from tests.vllm.conftest import TINY_BLOCK_BYTES, WORKER_CLS, oracle, sidecar_url_config

MODEL = "builtin:tiny"
MAX_TOKENS = 40
K = 3


def prompts() -> list[list[int]]:
    """Repetitive prompts: a random phrase said several times (what n-gram lookup feeds on)."""
    rng = random.Random(12)
    out = []
    for n, reps in ((4, 5), (6, 4), (9, 3), (5, 6)):
        phrase = [rng.randrange(3, 512) for _ in range(n)]
        out.append([rng.randrange(3, 512) for _ in range(3)] + phrase * reps)
    return out


def spec_counters(url: str) -> tuple[float, float]:
    """(draft tokens verified, draft tokens accepted) from the sidecar's /metrics."""
    got = {"mlx_worker_spec_decode_draft_tokens_total": 0.0, "mlx_worker_spec_decode_accepted_tokens_total": 0.0}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in got:
            got[name] = float(value)
    return got["mlx_worker_spec_decode_draft_tokens_total"], got["mlx_worker_spec_decode_accepted_tokens_total"]


def vllm_counter(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def run(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def make_llm(model_dir: str, url: str, **kwargs: object) -> LLM:
    return LLM(model=model_dir, worker_cls=WORKER_CLS, additional_config=sidecar_url_config(url),
               kv_cache_memory_bytes=12 * TINY_BLOCK_BYTES, block_size=16, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64, enable_prefix_caching=True, enforce_eager=True, disable_log_stats=False, seed=0,
               **kwargs)


def test_ngram_drafts_from_the_sidecar_flow_through_vllms_scheduler(home: str, vllm_model_dir) -> None:
    ps = prompts()
    want = [w["tokens"] for w in oracle({"model": MODEL, "prompts": ps, "max_tokens": MAX_TOKENS}, home)]
    model_dir = vllm_model_dir(MODEL)
    # The sidecar starts with n-gram speculation of its own; vLLM's speculative_config governs it.
    with start_server("--model", MODEL, "--speculative-method", "ngram", "--num-speculative-tokens", "5") as server:
        llm = make_llm(model_dir, server.url, speculative_config={
            "method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
        try:
            got = run(llm, ps)
            drafted, accepted = spec_counters(server.url)
            vllm_drafts = vllm_counter(llm, "vllm:spec_decode_num_draft_tokens")
            vllm_accepted = vllm_counter(llm, "vllm:spec_decode_num_accepted_tokens")
            preemptions = vllm_counter(llm, "vllm:num_preemptions")
        finally:
            llm.llm_engine.engine_core.shutdown()
        for i, (g, w) in enumerate(zip(got, want)):
            assert g == w, f"prompt {i}"
        assert accepted > 0 and drafted > accepted  # drafts were accepted, and some rejected
        assert vllm_accepted == accepted and vllm_drafts == drafted  # the same drafts, seen from both sides
        assert preemptions > 0  # 12 blocks for 4 requests of ~5 blocks: rollbacks meet preemption and resume

        # Negative control: the same sidecar driven without speculative_config proposes and verifies no drafts.
        llm = make_llm(model_dir, server.url)
        try:
            assert run(llm, ps) == want
        finally:
            llm.llm_engine.engine_core.shutdown()
        assert spec_counters(server.url) == (drafted, accepted)


def test_draft_model_speculation_runs_the_sidecars_draft_model(home: str, vllm_model_dir) -> None:
    """The target as its own draft: every draft is the target's greedy token, so all are accepted."""
    ps = prompts()[:2]
    want = [w["tokens"] for w in oracle({"model": MODEL, "prompts": ps, "max_tokens": MAX_TOKENS}, home)]
    model_dir = vllm_model_dir(MODEL)
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": K}
    with start_server("--model", MODEL, "--draft-model", MODEL) as server:
        llm = make_llm(model_dir, server.url, speculative_config=spec)
        try:
            got = run(llm, ps)
        finally:
            llm.llm_engine.engine_core.shutdown()
        drafted, accepted = spec_counters(server.url)
    assert got == want
    assert accepted == drafted > 0


def test_draft_model_speculation_without_the_sidecars_draft_model_is_refused(home: str, vllm_model_dir) -> None:
    """vLLM's own config for it (what LLM(...) builds), handed to the worker class as vLLM's executor does."""
    from vllm.engine.arg_utils import EngineArgs

    from sidecar.vllm.convert import Unsupported
    from sidecar.vllm.worker import MLXSidecarWorker

    model_dir = vllm_model_dir(MODEL)
    with start_server("--model", MODEL) as server:
        def worker(spec: dict) -> MLXSidecarWorker:
            cfg = EngineArgs(model=model_dir, worker_cls=WORKER_CLS, additional_config=sidecar_url_config(server.url),
                             max_model_len=128, enforce_eager=True, speculative_config=spec).create_engine_config()
            return MLXSidecarWorker(cfg, 0, 0, "tcp://127.0.0.1:0", True)

        w = worker({"method": "draft_model", "model": model_dir, "num_speculative_tokens": K})
        with pytest.raises(Unsupported, match="this sidecar has none: start it with --draft-model"):
            w.init_device()
        w.shutdown()
        w = worker({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3})  # the control
        w.init_device()
        w.shutdown()
        assert httpx.get(f"{server.url}/info").json()["state"] == "device_ready"
