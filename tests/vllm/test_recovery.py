"""A sidecar restart under vLLM's OpenAI server loses no request (sidecar/vllm/recovery.py): real
processes, `kill -9` of the sidecar mid-decode and a new one started on the same port, as a
service manager would."""

from __future__ import annotations

import random
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server.serverproc import free_port, start_server
from tests.vllm.apiserver import api_server
from tests.vllm.conftest import oracle

MODEL = "builtin:tiny"
LIMITS = ("--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "512", "--max-num-seqs", "16",
          "--max-num-batched-tokens", "64")


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def steps(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^mlx_worker_step_duration_seconds_count(?:\{[^}]*\})? (\S+)", text, re.M))


def wait_for_steps(url: str, more_than: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps(url) <= more_than:
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)


def test_streams_survive_a_kill_9_and_a_prefix_hit_after_it_is_right(home: str, vllm_model_dir, tmp_path) -> None:
    port = free_port()
    flags = ("--model", MODEL, "--port", str(port))
    greedy = prompts(1, 8, 40)
    cached = prompts(2, 1, 48)[0]  # finishes before the kill: its blocks stay in vLLM's prefix cache
    sidecar = start_server(*flags)
    try:
        with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 120}},
                        tmp_path / "api.log", *LIMITS) as api:
            seeded_params = {"temperature": 1.0, "seed": 77}
            undisturbed_seeded = api.completion(greedy[0], 48, **seeded_params)
            api.completion(cached, 4)
            results: dict[int, list[int]] = {}
            errors: list[BaseException] = []

            def run(i: int) -> None:
                try:
                    results[i] = (api.completion(greedy[i], 48) if i < 8 else
                                  api.completion(greedy[0], 48, **seeded_params))
                except BaseException as e:  # noqa: BLE001 (reported below)
                    errors.append(e)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(9)]
            before = steps(sidecar.url)
            for t in threads:
                t.start()
            wait_for_steps(sidecar.url, before + 8)  # the streams are decoding
            sidecar.send_signal(signal.SIGKILL)
            sidecar.wait(30)
            sidecar = start_server(*flags)
            for t in threads:
                t.join(600)
            assert not errors, errors
            assert api.proc.poll() is None
            assert "recovered: new instance" in api.text()
            want = oracle({"model": MODEL, "prompts": greedy, "max_tokens": 48}, home)
            for i in range(8):
                assert results[i] == want[i]["tokens"], f"stream {i}"
            assert results[8] == undisturbed_seeded
            # A prefix-cache hit on blocks written before the restart (refilled, not recomputed).
            hits_before = prefix_hits(api.url)
            hit = cached[:32] + prompts(3, 1, 9)[0]
            got = api.completion(hit, 12)
            assert prefix_hits(api.url) >= hits_before + 32
            assert got == oracle({"model": MODEL, "prompts": [hit], "max_tokens": 12}, home)[0]["tokens"]
    finally:
        sidecar.stop()


def prefix_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M))


def test_a_sidecar_back_with_another_model_fails_the_engine_naming_both(home: str, vllm_model_dir, tmp_path) -> None:
    port = free_port()
    sidecar = start_server("--model", MODEL, "--port", str(port))
    try:
        with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 120}},
                        tmp_path / "api.log", *LIMITS) as api:
            api.completion(prompts(4, 1, 8)[0], 2)
            sidecar.stop(signal.SIGKILL)
            sidecar = start_server("--model", "builtin:tiny-qwen3", "--port", str(port))
            with pytest.raises((RuntimeError, AssertionError, httpx.HTTPError)):
                api.completion(prompts(5, 1, 8)[0], 4)
            log = api.text()
            assert "came back serving another model: builtin:tiny-qwen3" in log and "instead of builtin:tiny" in log
    finally:
        sidecar.stop()


def test_a_sidecar_that_never_comes_back_fails_the_engine_naming_the_url(home: str, vllm_model_dir, tmp_path) -> None:
    sidecar = start_server("--model", MODEL)
    with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 3}},
                    tmp_path / "api.log", *LIMITS) as api:
        api.completion(prompts(6, 1, 8)[0], 2)
        sidecar.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((RuntimeError, AssertionError, httpx.HTTPError)):
            api.completion(prompts(7, 1, 8)[0], 4)
        assert time.monotonic() - t0 >= 3
        assert f"MLX sidecar at {sidecar.url} did not come back within mlx_sidecar.recover_timeout (3s)" in api.text()
