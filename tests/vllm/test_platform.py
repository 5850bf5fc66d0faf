"""The sidecar's vLLM platform (active in this suite, conftest.py): what it changes from vLLM's CPU
platform with the sidecar's worker class, and that it changes nothing with another worker class."""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.platforms import current_platform

from sidecar.vllm.platform import MLXSidecarPlatform
from tests.server.serverproc import start_server
from tests.vllm.conftest import WORKER_CLS, sidecar_url_config


@pytest.fixture(scope="module")
def config(vllm_model_dir):
    path = vllm_model_dir("builtin:tiny")

    def make(**kw):
        return EngineArgs(model=path, max_model_len=128, enforce_eager=True, **kw).create_engine_config()

    return make


def test_the_suite_runs_on_the_sidecar_platform() -> None:
    assert type(current_platform) is MLXSidecarPlatform
    assert current_platform.is_cpu()  # torch stays on the CPU: vLLM's CPU process setup is kept


def test_defaults_with_the_sidecar_worker(config) -> None:
    c = config()  # no --worker-cls: the platform picks the sidecar's
    assert c.parallel_config.worker_cls == WORKER_CLS
    assert c.scheduler_config.async_scheduling is True  # vLLM's own default; the CPU platform forces False
    assert c.cache_config.block_size == 16  # the CPU platform's is 128
    assert c.parallel_config.distributed_executor_backend == "uni"  # no worker process of its own
    assert c.cache_config.kv_cache_memory_bytes is None  # the sidecar's determine_available_memory decides


def test_the_command_line_defaults_to_a_warm_up_shape_that_fits_a_cpu() -> None:
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())  # what vllm serve / the api_server parse with
    args = parser.parse_args([])
    assert (args.max_num_batched_tokens, args.max_num_seqs) == (256, 32)  # vLLM's CPU defaults: 2048, 128
    args = parser.parse_args(["--max-num-batched-tokens", "2048", "--max-num-seqs", "128"])
    assert (args.max_num_batched_tokens, args.max_num_seqs) == (2048, 128)  # a given flag wins


def test_what_is_given_is_kept(config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the CPU platform's KV knob: this host's memory, not the sidecar's
    c = config(worker_cls=WORKER_CLS, block_size=32, async_scheduling=False, distributed_executor_backend="mp")
    assert (c.cache_config.block_size, c.scheduler_config.async_scheduling) == (32, False)
    assert c.parallel_config.distributed_executor_backend == "mp"
    assert c.cache_config.kv_cache_memory_bytes is None


def test_speculative_decoding_runs_one_step_at_a_time(config, vllm_model_dir) -> None:
    # draft_model is one vLLM would run with async scheduling; the sidecar's drafts come between steps
    draft = {"method": "draft_model", "model": vllm_model_dir("builtin:tiny"), "num_speculative_tokens": 2}
    c = config(async_scheduling=True, speculative_config=draft)
    assert c.speculative_config is not None and c.scheduler_config.async_scheduling is False


def test_another_worker_class_gets_the_cpu_platform_unchanged(config) -> None:
    c = config(worker_cls="vllm.v1.worker.cpu_worker.CPUWorker")
    assert c.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert (c.cache_config.block_size, c.scheduler_config.async_scheduling) == (128, False)


def test_the_kv_pool_defaults_to_what_max_num_seqs_requests_can_hold(vllm_model_dir) -> None:
    from vllm import LLM

    with start_server("--model", "builtin:tiny") as server:  # it would offer most of this host's free memory
        llm = LLM(model=vllm_model_dir("builtin:tiny"), additional_config=sidecar_url_config(server.url),
                  max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, enforce_eager=True)
        try:
            assert llm.llm_engine.vllm_config.cache_config.num_gpu_blocks == 2 * (128 // 16) + 1  # + vLLM's null block
        finally:
            llm.llm_engine.engine_core.shutdown()
