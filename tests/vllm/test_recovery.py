"""A sidecar restart under vLLM's OpenAI server loses no request (sidecar/vllm/recovery.py): real
processes, `kill -9` (a crash) or SIGTERM (a service manager's restart: the running step finishes,
queued ones get 503) of the sidecar mid-decode and a new one started on the same port, as a
service manager would. Each server case runs with vLLM's async scheduling (two steps in flight:
the unread ones are sent again to the new instance) and without."""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import pytest

from sidecar.client.remote import RemoteWorker
from sidecar.vllm.recovery import Recovering
from tests.server.serverproc import free_port, start_server
from tests.vllm.apiserver import api_server, assert_scheduling, prefix_hits, recovery_lines, steps
from tests.vllm.conftest import generated, oracle
from tests.vllm.proxy import CuttingProxy

MODEL = "builtin:tiny"
LIMITS = ("--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "512", "--max-num-seqs", "16",
          "--max-num-batched-tokens", "64")


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(length)] for _ in range(n)]


def wait_for_steps(url: str, more_than: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps(url) <= more_than:
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_streams_survive_a_restart_and_a_prefix_hit_after_it_is_right(home: str, vllm_model_dir, tmp_path,
                                                                      scheduling: str, sig: signal.Signals) -> None:
    port = free_port()
    flags = ("--model", MODEL, "--port", str(port))
    greedy = prompts(1, 8, 40)
    cached = prompts(2, 1, 48)[0]  # finishes before the kill: its blocks stay in vLLM's prefix cache
    sidecar = start_server(*flags)
    try:
        with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 120}},
                        tmp_path / "api.log", *LIMITS, scheduling) as api:
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
            sidecar.send_signal(sig)
            rc = sidecar.wait(30)
            assert rc == (0 if sig == signal.SIGTERM else -signal.SIGKILL), sidecar.stderr()[-2000:]  # drained cleanly
            sidecar = start_server(*flags)
            for t in threads:
                t.join(600)
            assert not errors, errors
            assert api.proc.poll() is None
            assert "recovered: new instance" in api.text()
            assert_scheduling(api, scheduling)
            (line,) = recovery_lines(api)
            assert line["recoveries_total"] == 1 and line["refilled_tokens"] > 0 and line["duration_s"] > 0
            # async: vLLM was waiting for a step whose reply was lost; it was sent again to the new instance
            assert (line["replayed_steps"] >= 1) is (scheduling == "--async-scheduling")
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


def test_a_sidecar_back_with_another_model_fails_the_engine_naming_both(home: str, vllm_model_dir, tmp_path,
                                                                         scheduling: str) -> None:
    port = free_port()
    sidecar = start_server("--model", MODEL, "--port", str(port))
    try:
        with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 120}},
                        tmp_path / "api.log", *LIMITS, scheduling) as api:
            api.completion(prompts(4, 1, 8)[0], 2)
            sidecar.stop(signal.SIGKILL)
            sidecar = start_server("--model", "builtin:tiny-qwen3", "--port", str(port))
            with pytest.raises((RuntimeError, AssertionError, httpx.HTTPError)):
                api.completion(prompts(5, 1, 8)[0], 4)
            log = api.text()
            assert "came back serving another model: builtin:tiny-qwen3" in log and "instead of builtin:tiny" in log
    finally:
        sidecar.stop()


def test_a_sidecar_that_never_comes_back_fails_the_engine_naming_the_url(home: str, vllm_model_dir, tmp_path,
                                                                          scheduling: str) -> None:
    sidecar = start_server("--model", MODEL)
    with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": sidecar.url, "recover_timeout": 3}},
                    tmp_path / "api.log", *LIMITS, scheduling) as api:
        api.completion(prompts(6, 1, 8)[0], 2)
        sidecar.stop(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((RuntimeError, AssertionError, httpx.HTTPError)):
            api.completion(prompts(7, 1, 8)[0], 4)
        assert time.monotonic() - t0 >= 3
        assert f"MLX sidecar at {sidecar.url} did not come back within mlx_sidecar.recover_timeout (3s)" in api.text()


def test_replies_cut_mid_way_lose_no_token_and_apply_no_step_twice(home: str, vllm_model_dir, tmp_path,
                                                                   scheduling: str) -> None:
    ps = prompts(8, 8, 20)
    with start_server("--model", MODEL) as sidecar:
        proxy = CuttingProxy(int(sidecar.url.rsplit(":", 1)[1]), share=0.05, seed=1)
        try:
            with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": proxy.url}}, tmp_path / "api.log",
                            *LIMITS, scheduling) as api:
                before = generated(sidecar)
                results: dict[int, list[int]] = {}
                threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, api.completion(ps[i], 32)))
                           for i in range(8)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(600)
                want = oracle({"model": MODEL, "prompts": ps, "max_tokens": 32}, home)
                assert [results.get(i) for i in range(8)] == [w["tokens"] for w in want]
                assert proxy.cuts > 0  # replies really were lost on the way
                # Every step ran once: the sidecar sampled exactly the tokens vLLM received.
                assert generated(sidecar) - before == 8 * 32
                assert "recovered" not in api.text()
                assert_scheduling(api, scheduling)
        finally:
            proxy.close()


# --- the recovery itself, driven with wire steps (no vLLM): what vLLM's runs above may not reach ---

BS = 16
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 1.0, "seed": 5}


def _rec(url: str) -> Recovering:
    return Recovering(RemoteWorker(url, pin_instance=True), where=f"MLX sidecar at {url}", recover_timeout=120,
                      block_size=BS, budget=64, max_seqs=8, prefix_cache=True)


def _new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0, sp: dict = GREEDY) -> dict:
    return {"req_id": rid, "prompt_token_ids": prompt, "sampling_params": sp, "block_ids": [blocks],
            "num_computed_tokens": computed, "lora_request": None}


def _step(new=(), cached=(), finished=(), preempted=()) -> dict:
    """cached: (rid, num_computed, n, new_blocks | None, resumed_tokens | None)."""
    c = {"req_ids": [x[0] for x in cached], "new_token_ids": [[] for _ in cached],
         "new_block_ids": [None if x[3] is None else [x[3]] for x in cached],
         "num_computed_tokens": [x[1] for x in cached], "num_output_tokens": [0] * len(cached),
         "resumed_req_ids": [x[0] for x in cached if x[4] is not None],
         "all_token_ids": {x[0]: x[4] for x in cached if x[4] is not None}}
    sched = {r["req_id"]: len(r["prompt_token_ids"]) - r["num_computed_tokens"] for r in new}
    sched.update({x[0]: x[2] for x in cached})
    return {"scheduled_new_reqs": list(new), "scheduled_cached_reqs": c, "num_scheduled_tokens": sched,
            "total_num_scheduled_tokens": sum(sched.values()), "finished_req_ids": list(finished),
            "preempted_req_ids": list(preempted)}


def _scenario(server, restart_before: int | None, port: int) -> dict[str, list[int]]:
    """Chunked prefill, a preemption and its resume, prefix hits on a live request's and a finished
    request's blocks, a seeded request: the sidecar restarted (kill -9) before step `restart_before`."""
    rng = random.Random(11)
    pa, pb, pe = ([rng.randrange(3, 512) for _ in range(n)] for n in (40, 20, 36))
    pc, pf = pa[:32] + [7, 8, 9], pe[:32] + [4, 5, 6, 7]
    rec = _rec(server.url)
    rec.call("init_device", config={"block_size": BS, "max_num_batched_tokens": 128, "max_num_seqs": 8}, reset=True)
    rec.call("load_model")
    rec.call("initialize_cache", num_gpu_blocks=16, num_cpu_blocks=0)
    out: dict[str, list[int]] = {"A": [], "B": [], "C": [], "E": [], "F": []}
    plan = [
        lambda: _step([_new("A", pa, [0, 1, 2]), _new("E", pe, [8, 9, 10])]),
        lambda: _step([_new("B", pb, [3, 4], sp=SEEDED)], [("A", 40, 1, None, None)], finished=["E"]),
        lambda: _step(cached=[("A", 41, 1, None, None), ("B", 20, 1, None, None)]),
        lambda: _step(cached=[("A", 42, 1, None, None)], preempted=["B"]),
        lambda: _step(cached=[("A", 43, 1, None, None)]),
        lambda: _step([_new("C", pc, [0, 1, 7], 32), _new("F", pf, [8, 9, 11], 32)],
                      [("A", 44, 1, None, None), ("B", 0, 22, [5, 6], pb + out["B"])]),
        lambda: _step(cached=[("A", 45, 1, None, None), ("B", 22, 1, None, None), ("C", 35, 1, None, None),
                              ("F", 36, 1, None, None)]),
    ]
    for i, make in enumerate(plan):
        if i == restart_before:
            server.stop(signal.SIGKILL)
            server = start_server("--model", MODEL, "--port", str(port))
        r = rec.call("execute_model", scheduler_output=make(), step_id=i + 1)
        for rid, toks in zip(r["req_ids"], r["sampled_token_ids"]):
            out[rid] += toks
    assert rec.recoveries == (restart_before is not None)
    rec.remote.close()
    server.stop()
    return out


@pytest.mark.parametrize("restart_before", [3, 5])
def test_recovery_restores_chunks_preemption_prefix_hits_and_seeded_streams(home: str, restart_before: int) -> None:
    port = free_port()
    want = _scenario(start_server("--model", MODEL, "--port", str(port)), None, port)
    assert all(want.values())
    got = _scenario(start_server("--model", MODEL, "--port", str(port)), restart_before, port)
    assert got == want


def test_loras_and_sleep_come_back_with_the_new_instance(home: str, tmp_path) -> None:
    loras = tmp_path / "loras"
    oracle({"model": MODEL, "make_adapter": str(loras / "one"), "seed": 1}, home)
    port = free_port()
    flags = ("--model", MODEL, "--port", str(port), "--lora-dir", str(loras))
    server = start_server(*flags)
    rec = _rec(server.url)
    rec.call("init_device", config={"block_size": BS}, reset=True)
    rec.call("load_model")
    measured = rec.call("determine_available_memory", gpu_memory_utilization=0.5)
    # the new instance is held to the measured bytes: no activation profile runs again in a recovery
    assert rec.start_up["determine_available_memory"] == {"kv_cache_memory_bytes": measured} and measured > 0
    rec.call("initialize_cache", num_gpu_blocks=16, num_cpu_blocks=0)
    rec.call("add_lora", lora_request={"lora_int_id": 1, "lora_name": "one", "lora_path": "one"})
    rec.call("sleep", level=1)
    server.stop(signal.SIGKILL)
    server = start_server(*flags)
    try:
        assert httpx.get(f"{server.url}/info").json()["state"] == "created"
        rec.call("wake_up", tags=None)  # lost, rebuilt asleep, then woken as asked
        assert rec.recoveries == 1
        assert httpx.get(f"{server.url}/info").json()["state"] == "cache_ready"
        assert rec.call("list_loras") == [1]
    finally:
        rec.remote.close()
        server.stop()
