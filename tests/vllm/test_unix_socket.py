"""vLLM driving a sidecar that listens on a Unix socket only (`serve --uds`, the URL
`unix:///path`): the setup for vLLM and the sidecar on one machine. Both of the worker class's
transports go over it: one call at a time, and two numbered steps in flight on two connections
(vLLM's async scheduling)."""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import pytest
from vllm import LLM, SamplingParams

from tests.server.serverproc import start_server
from tests.vllm.conftest import TINY_BLOCK_BYTES, WORKER_CLS, generated, oracle, sidecar_url_config

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def socket_server():
    where = Path(tempfile.mkdtemp(prefix="sc-", dir="/tmp"))  # (a socket path has ~100 bytes at most)
    try:
        with start_server("--model", MODEL, "--uds", str(where / "sidecar.sock")) as server:
            yield server
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_over_a_unix_socket_are_mlx_lms(socket_server, async_scheduling: bool, home: str,
                                                        vllm_model_dir) -> None:
    assert socket_server.url.startswith("unix://")
    rng = random.Random(7)
    ps = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 19, 40)]
    before = generated(socket_server)
    llm = LLM(model=vllm_model_dir(MODEL), worker_cls=WORKER_CLS, additional_config=sidecar_url_config(socket_server.url),
              kv_cache_memory_bytes=32 * TINY_BLOCK_BYTES, block_size=16, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, seed=0, async_scheduling=async_scheduling)
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is async_scheduling
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    want = oracle({"model": MODEL, "prompts": ps, "max_tokens": 16}, home)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert list(o.outputs[0].token_ids) == w["tokens"], f"prompt {i}"
    # The tokens were sampled by this sidecar, over its socket (it has no TCP listener).
    assert generated(socket_server) - before >= len(ps) * 16
