"""vLLM data parallelism over two real sidecars (sidecar/vllm/dp.py): `--data-parallel-size 2` behind
one OpenAI server (vLLM's internal load balancing), each rank driving its own sidecar."""

from __future__ import annotations

import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sidecar.vllm import dp
from sidecar.vllm.convert import Unsupported
from tests.server.serverproc import start_server
from tests.vllm.apiserver import api_server, assert_scheduling
from tests.vllm.conftest import oracle

MODEL = "builtin:tiny"
ARGS = ("--data-parallel-size", "2", "--kv-cache-memory-bytes", str(1 << 20), "--max-model-len", "256")


@pytest.mark.parametrize("cfg, env, rank, says", [
    ({"url": "http://mac1:8000"}, None, 1, "data parallel rank 1 needs its own sidecar"),
    ({}, None, 1, "mlx_sidecar.urls or MLX_SIDECAR_URLS"),
    ({"urls": ["http://mac1:8000"]}, None, 1, "mlx_sidecar.urls lists 1 sidecar URL(s), but data parallel rank 1"),
    ({"urls": ["http://mac1:8000", "http://MAC1:8000/"]}, None, 0, "mlx_sidecar.urls names http://MAC1:8000/ twice"),
    ({}, "http://mac1:8000,http://mac1:8000", 0, "MLX_SIDECAR_URLS names http://mac1:8000 twice"),
    ({}, "http://mac1:8000", 1, "MLX_SIDECAR_URLS lists 1 sidecar URL(s)"),
    ({"urls": []}, None, 0, "must be a non-empty list"),
    ({"urls": ["http://a:1"], "url": "http://a:1"}, None, 0, "either url"),
])
def test_misconfigurations_are_refused_naming_the_setting(cfg, env, rank, says, monkeypatch) -> None:
    monkeypatch.delenv("MLX_SIDECAR_URL", raising=False)
    monkeypatch.delenv("MLX_SIDECAR_URLS", raising=False)
    if env:
        monkeypatch.setenv("MLX_SIDECAR_URLS", env)
    with pytest.raises(Unsupported, match=re.escape(says)):
        dp.rank_url(cfg, rank, "http://127.0.0.1:8000")


def test_each_rank_takes_its_own_url(monkeypatch) -> None:
    monkeypatch.setenv("MLX_SIDECAR_URLS", "http://mac1:8000, http://mac2:8000")
    assert [dp.rank_url({}, r, "d") for r in (0, 1)] == ["http://mac1:8000", "http://mac2:8000"]
    urls = {"urls": ["http://a:1", "http://b:1"]}
    assert dp.rank_url(urls, 1, "d") == "http://b:1"  # the config wins over the environment
    monkeypatch.delenv("MLX_SIDECAR_URLS")
    assert dp.rank_url({"url": "http://a:1"}, 0, "d") == "http://a:1"  # DP 1: the single-sidecar setting


def test_expert_parallel_is_refused_by_name() -> None:
    class PC:
        enable_expert_parallel = True
    with pytest.raises(Unsupported, match="--enable-expert-parallel"):
        dp.check_parallel(PC())


def steps(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(m) for m in re.findall(r"^mlx_worker_step_duration_seconds_count(?:\{[^}]*\})? (\S+)", text, re.M))


def test_dp2_over_two_sidecars_spreads_the_load_and_gives_mlx_lms_tokens(home: str, vllm_model_dir, tmp_path,
                                                                          scheduling: str) -> None:
    rng = random.Random(3)
    ps = [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))] for _ in range(16)]
    with start_server("--model", MODEL) as s1, start_server("--model", MODEL) as s2:
        cfg = {"mlx_sidecar": {"urls": [s1.url, s2.url], "recover_timeout": 2}}
        with api_server(vllm_model_dir(MODEL), cfg, tmp_path / "api.log", *ARGS, scheduling) as api:
            assert_scheduling(api, scheduling)
            with ThreadPoolExecutor(16) as pool:
                got = list(pool.map(lambda p: api.completion(p, 12), ps))
            want = oracle({"model": MODEL, "prompts": ps, "max_tokens": 12}, home)
            for i, (g, w) in enumerate(zip(got, want)):
                assert g == w["tokens"], f"prompt {i}"
            assert steps(s1.url) > 0 and steps(s2.url) > 0  # both replicas served
            # A lost replica: after recover_timeout the engine fails, naming the rank and the URL.
            s2.stop(signal.SIGKILL)
            deadline = time.monotonic() + 120
            while f"MLX sidecar at {s2.url} (data parallel rank 1) did not come back" not in api.text():
                if time.monotonic() > deadline:
                    pytest.fail(api.text()[-3000:])
                with ThreadPoolExecutor(4) as pool:  # some reach rank 1
                    list(pool.map(lambda p: _try(api, p), ps[:4]))
                time.sleep(0.5)


def test_one_url_for_two_ranks_fails_at_start_up_naming_the_setting(home: str, vllm_model_dir, tmp_path) -> None:
    with start_server("--model", MODEL) as s1:
        with pytest.raises(RuntimeError, match="api_server exited"):
            with api_server(vllm_model_dir(MODEL), {"mlx_sidecar": {"url": s1.url}}, tmp_path / "api.log", *ARGS):
                pass
    log = (tmp_path / "api.log").read_text()
    assert f"data parallel rank 1 needs its own sidecar, but one URL ({s1.url}" in log
    assert "mlx_sidecar.urls or MLX_SIDECAR_URLS" in log


def _try(api, p: list[int]) -> None:
    try:
        api.completion(p, 2)
    except Exception:  # noqa: BLE001 (the engine is failing: the log is what the test reads)
        pass
