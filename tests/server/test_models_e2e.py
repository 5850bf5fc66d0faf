"""End to end over a real server: a model that cannot be served is a 400 at load_model naming why
(and the server keeps serving); a hybrid recurrent model is served token-exact with its groups."""

from __future__ import annotations

import httpx
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.test_architectures import tiny_dir
from tests.server.serverproc import start_server


def test_an_unservable_model_is_400_at_load_and_the_server_keeps_serving(home: str) -> None:
    with start_server("--model", str(tiny_dir(home, "plamo3"))) as s:
        w = RemoteWorker(s.url)
        try:
            w.init_device()
            with pytest.raises(RemoteError) as e:
                w.load_model()
            assert (e.value.status, e.value.field) == (400, "model") and "plamo3" in e.value.message
            assert httpx.get(f"{s.url}/healthz").status_code == 200
            assert httpx.get(f"{s.url}/info").json()["state"] == "device_ready"
        finally:
            w.close()


def test_a_hybrid_recurrent_builtin_serves_token_exact(home: str, oracle_model) -> None:
    with start_server("--model", "builtin:tiny-granitemoehybrid") as s:
        w = RemoteWorker(s.url)
        try:
            w.init_device(config={"block_size": 4})
            w.load_model()
            groups = w.get_kv_cache_groups()
            assert [g["kv_cache_spec"]["type"] for g in groups] == ["mamba", "full_attention"]
            groups[0]["kv_cache_spec"]["block_size"] = 128  # vLLM sizes state groups to its page size
            w.initialize_from_config({"num_blocks": 64, "kv_cache_groups": groups})
            d = Driver(lambda so: w.call("execute_model", scheduler_output=so), 4, 64)
            prompts = [list(range(10, 27)), list(range(40, 49))]
            for i, p in enumerate(prompts):
                d.add(f"h{i}", p)
            got = d.run(6, chunk=5)  # one block list sent for both groups: shared, as v1 clients do
            oracle = oracle_model("builtin:tiny-granitemoehybrid")
            assert got == {f"h{i}": mlx_lm_greedy(oracle, p, 6)[0] for i, p in enumerate(prompts)}
        finally:
            w.close()
