"""kv_dtype 8bit / 4bit across a real 2-rank group (ring backend, loopback): with --tensor-parallel 2 each
rank quantises its own KV heads, with --pipeline-parallel 2 its own layers; either way the group's
greedy tokens equal the single-rank sidecar's with the same kv_dtype (logprobs within 1e-4) and mlx-lm's with the same
KV quantisation, through batching, chunked prefill, a prefix hit and a preemption, and the group
describes the whole model's quantised KV cache."""

from __future__ import annotations

import pytest

from sidecar.client.remote import RemoteWorker
from tests.distributed.groupproc import start_group
from tests.distributed.test_leader import BLOCKS, BS, FLAGS, PROMPTS, STEPS, workload
from tests.kv.test_quant import quant_greedy

pytestmark = pytest.mark.distributed

MODES = {"tensor": "builtin:tiny-kv64", "pipeline": "builtin:tiny-qwen2-kv64"}  # heads of 64: quantised


@pytest.fixture(scope="module", params=[(m, b) for m in sorted(MODES) for b in (8, 4)], ids=str)
def group(request: pytest.FixtureRequest, home: str):
    mode, bits = request.param
    g = start_group(f"--{mode}-parallel", "2", "--model", MODES[mode], "--kv-dtype", f"{bits}bit", *FLAGS)
    remote = RemoteWorker(g.leader.url)
    yield MODES[mode], bits, remote
    remote.close()
    g.stop()
    assert g.leader.returncode == 0 and [p.returncode for p in g.followers] == [75], g.leader.stderr()[-3000:]


def test_group_tokens_equal_single_rank_and_mlx_lm_quantised(group, make_worker, oracle_model) -> None:
    model, bits, remote = group
    single = make_worker(model, BLOCKS, max_model_len=256, kv_dtype=f"{bits}bit")
    assert remote.get_kv_cache_spec() == single.get_kv_cache_spec()  # every layer, every KV head, quantised
    assert all(s["kv_quantization"] == {"bits": bits, "group_size": 64} for s in single.get_kv_cache_spec().values())
    assert remote.get_cache_block_size_bytes() == single.get_cache_block_size_bytes()
    free = remote.determine_available_memory()
    assert free > 0 and free % single.get_cache_block_size_bytes() == 0  # whole quantised group blocks
    remote.initialize_cache(BLOCKS, 0)
    tokens, logprobs = workload(lambda so: remote.call("execute_model", scheduler_output=so))
    ref_tokens, ref_lps = workload(single.execute_model)
    assert tokens == ref_tokens
    for rid in tokens:
        assert logprobs[rid] == pytest.approx(ref_lps[rid], abs=1e-4), rid
    oracle = oracle_model(model)
    hit = PROMPTS["long"][: 2 * BS] + [101, 102, 103]
    for rid, prompt in (("long", PROMPTS["long"]), ("short", PROMPTS["short"]), ("hit", hit)):
        want, want_lp = quant_greedy(oracle, prompt, STEPS, bits)
        assert tokens[rid] == want, rid
        assert logprobs[rid] == pytest.approx(want_lp, abs=1e-4), rid
    # Negative control: the unquantised cache's logprobs are measurably different.
    fp_tokens, fp_lps = workload(make_worker(model, BLOCKS, max_model_len=256).execute_model)
    apart = [abs(a - b) for rid in ("long", "short") for a, b, _ in
             zip(logprobs[rid], fp_lps[rid], _common_prefix(tokens[rid], fp_tokens[rid]))]
    assert max(apart) > 1e-3


def _common_prefix(a: list[int], b: list[int]) -> list[int]:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]
