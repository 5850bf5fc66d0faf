"""Unmodified vLLM 0.32 with the sidecar's KV connector (sidecar.vllm.kv_connector): a restarted
sidecar (and a restarted vLLM) serves a repeated long prompt from the sidecar's disk KV tier,
vLLM counts external prefix-cache hits, and greedy tokens are mlx-lm's; a corrupted store entry
comes back as invalid_block_ids, vLLM recomputes, and the tokens are still exact."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
from vllm import LLM, SamplingParams

from tests.server.serverproc import start_server
from tests.vllm.conftest import WORKER_CLS, oracle, sidecar_url_config

CONNECTOR = {"kv_connector": "MLXSidecarStoreConnector", "kv_connector_module_path": "sidecar.vllm.kv_connector",
             "kv_role": "kv_both"}
MAX_TOKENS = 8


def _llm(model_dir: str, url: str) -> LLM:
    return LLM(model=model_dir, worker_cls=WORKER_CLS, additional_config=sidecar_url_config(url),
               kv_transfer_config=CONNECTOR, kv_cache_memory_bytes=64 * 16 * 2 * 32 * 4 * 2, block_size=16,
               max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True,
               enforce_eager=True, disable_log_stats=False, seed=0)


def _counter(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _generate(llm: LLM, prompt: list[int]) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _store(url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(f"{url}/info").json()["kv_store"]
        if info["write_queue_depth"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def test_a_restarted_sidecar_serves_a_repeated_prompt_from_the_store(home: str, vllm_model_dir, tmp_path: Path):
    rng = random.Random(7)
    prompt = [rng.randrange(3, 512) for _ in range(200)]
    want = oracle({"model": "builtin:tiny", "prompts": [prompt], "max_tokens": MAX_TOKENS}, home)[0]["tokens"]
    model_dir, store = vllm_model_dir("builtin:tiny"), str(tmp_path / "kv")
    flags = ("--model", "builtin:tiny", "--kv-store-dir", store)
    with start_server(*flags) as server:
        llm = _llm(model_dir, server.url)
        try:
            assert _generate(llm, prompt) == want
            assert _counter(llm, "vllm:external_prefix_cache_hits") == 0
        finally:
            llm.llm_engine.engine_core.shutdown()
        first = _store(server.url)
    assert first["saved_blocks"] == 200 // 16 and first["size_bytes"] > 0
    with start_server(*flags) as server:  # a new sidecar process (and a new vLLM) on the same store
        llm = _llm(model_dir, server.url)
        try:
            assert _generate(llm, prompt) == want
            hits = _counter(llm, "vllm:external_prefix_cache_hits")
            assert hits == (200 - 1) // 16 * 16
            assert _store(server.url)["loaded_blocks"] == (200 - 1) // 16
            # Corrupt one entry and drop vLLM's in-memory hit: the load fails, vLLM recomputes.
            victim = sorted(Path(store).glob("segments/*.kvs"))[0]
            raw = bytearray(victim.read_bytes())
            raw[len(raw) // 2] ^= 0x55
            victim.write_bytes(bytes(raw))
            assert llm.reset_prefix_cache()
            assert _generate(llm, prompt) == want
            info = _store(server.url)
            assert info["corrupt_entries"] == 1 and info["failed_loads"] >= 1
        finally:
            llm.llm_engine.engine_core.shutdown()


def test_the_connector_refuses_groups_it_cannot_name_every_block_of():
    import pytest
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    from sidecar.vllm.kv_connector import _check_groups

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=8)
    _check_groups([KVCacheGroupSpec(["a"], full)])
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        _check_groups([KVCacheGroupSpec(["a"], window)])
    with pytest.raises(ValueError, match="has 2"):
        _check_groups([KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)])


def test_store_keys_take_the_images_inside_each_block():
    """The same placeholder tokens with another image are another key (its K/V differs); the
    blocks before the image, and a text prompt's blocks, are keyed as the reference scheduler's."""
    from types import SimpleNamespace

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from sidecar.scheduler.blocks import chain_hashes
    from sidecar.vllm.kv_connector import MLXSidecarStoreConnector, _Tracked

    tokens = list(range(100, 116)) + [7] * 16 + list(range(200, 216))

    def keys(identifier: str | None) -> list[bytes]:
        feats = [] if identifier is None else [MultiModalFeatureSpec(
            data=None, modality="image", identifier=identifier, mm_hash=identifier,
            mm_position=PlaceholderRange(offset=16, length=16))]
        t = _Tracked(SimpleNamespace(all_token_ids=tokens, mm_features=feats))
        return MLXSidecarStoreConnector._hashes(SimpleNamespace(block_size=16), t, 3)

    sea, storm, text = keys("sea"), keys("storm"), keys(None)
    assert sea[0] == storm[0] == text[0] and len({sea[1], storm[1], text[1]}) == 3 and sea[2] != storm[2]
    assert sea == chain_hashes([], tokens, 3, 16, [(16, 16, "sea")]) and text == chain_hashes([], tokens, 3, 16)
