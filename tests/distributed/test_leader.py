"""Two real ranks on loopback (ring backend, CPU), rank 0 over HTTP: TP=2 and PP=2 give exactly the
single-rank sidecar's and mlx-lm's greedy tokens, logprobs within 1e-4, through batching, chunked
prefill, a prefix hit, a preemption and several decode steps a call; a rejected call never reaches rank 1."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import msgpack
import pytest

from sidecar.client.remote import RemoteWorker
from tests.conftest import mlx_lm_greedy
from tests.distributed.groupproc import Group, start_group
from tests.driver import Driver

pytestmark = pytest.mark.distributed

BS, BLOCKS, STEPS = 16, 128, 10
MODES = {"tensor": "builtin:tiny", "pipeline": "builtin:tiny-qwen2"}
FLAGS = ("--preload", "--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64")
PROMPTS = {"long": [(7 * i) % 500 + 3 for i in range(45)], "short": [11, 12, 13, 14, 15], "mid": list(range(60, 80))}
LOGPROBS = {"temperature": 0.0, "logprobs": 2}


def workload(execute) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Batching (3 requests), chunked prefill (chunks of 16 over a 45-token prompt), a prefix hit
    (a request reusing "long"'s first two blocks) and a preemption ("mid" recomputed from 0)."""
    d = Driver(execute, BS, BLOCKS)
    for rid, p in PROMPTS.items():
        d.add(rid, p, dict(LOGPROBS))
    for _ in range(5):
        d.step(chunk=16)
    shared = PROMPTS["long"][: 2 * BS]
    d.add("hit", shared + [101, 102, 103], dict(LOGPROBS), blocks=d.reqs["long"].blocks[:2] + d.alloc(3), computed=2 * BS)
    d.step(chunk=16)
    d.preempt("mid")
    while any(len(r.out) < STEPS for r in d.reqs.values()):
        d.step(chunk=16, only=[r.rid for r in d.reqs.values() if len(r.out) < STEPS])
    result = ({rid: r.out[:STEPS] for rid, r in d.reqs.items()}, {rid: r.logprobs[:STEPS] for rid, r in d.reqs.items()})
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()  # drops them: the next workload starts from an empty worker
    return result


@pytest.fixture(scope="module", params=sorted(MODES))
def group(request: pytest.FixtureRequest, home: str) -> Group:
    mode = request.param
    g = start_group(f"--{mode}-parallel", "2", "--model", MODES[mode], *FLAGS, "--log-level", "debug")
    g.mode, g.model = mode, MODES[mode]  # type: ignore[attr-defined]
    yield g
    g.stop()
    # Rank 1 exits 75 (restart me to rejoin), never 0, when rank 0 stops cleanly.
    assert g.leader.returncode == 0 and [p.returncode for p in g.followers] == [75], g.leader.stderr()[-3000:]


@pytest.fixture
def remote(group: Group) -> RemoteWorker:
    r = RemoteWorker(group.leader.url)
    yield r
    r.close()


@pytest.fixture(scope="module")
def reference(make_worker) -> dict:
    """The single-rank sidecar (in-process) on the same workload, per model."""
    out = {}
    for model in MODES.values():
        w = make_worker(model, BLOCKS, max_model_len=256)
        out[model] = workload(w.execute_model)
    return out


def test_group_tokens_equal_single_rank_and_mlx_lm(group: Group, remote: RemoteWorker, reference: dict, oracle_model) -> None:
    tokens, logprobs = workload(lambda so: remote.call("execute_model", scheduler_output=so))
    ref_tokens, ref_lps = reference[group.model]
    assert tokens == ref_tokens
    for rid in tokens:
        assert logprobs[rid] == pytest.approx(ref_lps[rid], abs=1e-4), rid
    oracle = oracle_model(group.model)
    for rid in ("long", "short"):
        want, want_lp = mlx_lm_greedy(oracle, PROMPTS[rid], STEPS)
        assert tokens[rid] == want, rid
        assert logprobs[rid] == pytest.approx(want_lp, abs=1e-4)
    hit_prompt = PROMPTS["long"][: 2 * BS] + [101, 102, 103]
    assert tokens["hit"] == mlx_lm_greedy(oracle, hit_prompt, STEPS)[0]
    # Negative control: the other model's tokens differ, so equality above is not an accident.
    other = next(m for m in MODES.values() if m != group.model)
    assert reference[other][0] != ref_tokens


def test_group_decodes_several_steps_a_call_as_mlx_lm(group: Group, remote: RemoteWorker, oracle_model) -> None:
    """num_decode_steps reaches every rank: each runs the call's decode steps, and the tokens and
    logprobs are mlx-lm's."""
    d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), BS, BLOCKS)
    for rid, p in PROMPTS.items():
        d.add(rid, p, dict(LOGPROBS))
    d.step(chunk=64)
    d.step(steps=6)
    d.step(steps=6)
    got = {rid: (r.out, r.logprobs) for rid, r in d.reqs.items()}
    for rid in list(d.reqs):
        d.finish(rid)
    d.step()
    oracle = oracle_model(group.model)
    for rid, p in PROMPTS.items():
        want, want_lp = mlx_lm_greedy(oracle, p, 13)
        assert got[rid][0] == want, rid
        assert got[rid][1] == pytest.approx(want_lp, abs=1e-4), rid


def test_group_describes_the_whole_model(group: Group, remote: RemoteWorker, make_worker) -> None:
    single = make_worker(group.model, 8, max_model_len=256)
    assert remote.get_kv_cache_spec() == single.get_kv_cache_spec()  # every layer, every KV head
    assert remote.get_cache_block_size_bytes() == single.get_cache_block_size_bytes()
    groups = remote.call("get_kv_cache_groups")
    assert groups == single.get_kv_cache_groups()
    split = [{"layer_names": [n], "kv_cache_spec": groups[0]["kv_cache_spec"]} for n in groups[0]["layer_names"]]
    r = httpx.post(f"{group.leader.url}/rpc/initialize_from_config",
                   json={"kv_cache_config": {"num_blocks": BLOCKS, "kv_cache_groups": split}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "kv_cache_config.kv_cache_groups", r.text
    remote.call("initialize_from_config", kv_cache_config={"num_blocks": BLOCKS, "kv_cache_groups": groups})
    info = httpx.get(f"{group.leader.url}/info").json()
    assert info["kv_cache_spec"] == single.get_kv_cache_spec()
    text0 = httpx.get(f"{group.leader.url}/metrics").text
    assert f"mlx_worker_kv_cache_block_size_bytes {float(single.get_cache_block_size_bytes())}" in text0
    model = remote.get_model()
    assert model["num_layers"] == 2 and model["num_kv_heads"] == 2
    assert model["parallel"] == {"mode": group.mode, "world_size": 2, "tensor_parallel": 2 if group.mode == "tensor" else 1,
                                 "pipeline_parallel": 2 if group.mode == "pipeline" else 1}
    # Memory in whole-group blocks: a multiple of the group's block size.
    free = remote.determine_available_memory()
    assert free > 0 and free % remote.get_cache_block_size_bytes() == 0
    ready = httpx.get(f"{group.leader.url}/readyz").json()
    assert ready["ready"] and ready["group"]["ranks"] == {"0": True, "1": True}
    text = httpx.get(f"{group.leader.url}/metrics").text
    assert 'mlx_worker_rank_up{rank="1"} 1.0' in text and "mlx_worker_group_size 2.0" in text
    assert re.search(r"^mlx_worker_healthy 1\.0$", text, re.M)
    alerts = (Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml").read_text()
    for name in ("mlx_worker_rank_up", "mlx_worker_group_size"):  # what the lost-rank alerts query
        assert name in alerts and re.search(rf"^{name}[{{ ]", text, re.M), name


def _follower_calls(group: Group, method: str) -> int:
    return group.follower_log().count(f"rank 1: {method}\n")


def test_rejected_step_never_reaches_rank_1(group: Group, remote: RemoteWorker, reference: dict) -> None:
    calls = {"n": 0}

    def execute(so: dict) -> dict:
        calls["n"] += 1
        if so["scheduled_new_reqs"] and calls["n"] > 1:  # the prefix-hit step: a corrupt copy of it first
            bad = msgpack.unpackb(msgpack.packb(so))
            bad["scheduled_new_reqs"][0]["block_ids"][0][0] = BLOCKS + 5
            r = httpx.post(f"{group.leader.url}/rpc/execute_model", content=msgpack.packb({"scheduler_output": bad}),
                           headers={"content-type": "application/msgpack"}, timeout=30)
            assert r.status_code == 400, r.content
            err = msgpack.unpackb(r.content)["error"]
            assert err["field"] == "scheduled_new_reqs[0].block_ids[0][0]"
            # several decode steps with a disk-tier save: refused on rank 0 by name (multistep.check)
            bad = {**msgpack.unpackb(msgpack.packb(so)), "num_decode_steps": 4,
                   "kv_store_save": {so["scheduled_new_reqs"][0]["req_id"]: {"block_hashes": [], "block_ids": []}}}
            r = httpx.post(f"{group.leader.url}/rpc/execute_model", content=msgpack.packb({"scheduler_output": bad}),
                           headers={"content-type": "application/msgpack"}, timeout=30)
            assert r.status_code == 400 and msgpack.unpackb(r.content)["error"]["field"] == "num_decode_steps", r.content
            bad_lifecycle = httpx.post(f"{group.leader.url}/rpc/initialize_cache", json={"num_gpu_blocks": 0}, timeout=30)
            assert bad_lifecycle.status_code == 400 and bad_lifecycle.json()["error"]["field"] == "num_gpu_blocks"
        return remote.call("execute_model", scheduler_output=so)

    steps, inits = _follower_calls(group, "execute_model"), _follower_calls(group, "initialize_cache")
    tokens, _ = workload(execute)
    assert tokens == reference[group.model][0]  # the next steps' tokens are exact on both ranks
    remote.check_health()  # a collective: rank 1 has taken every earlier message once it returns
    assert _follower_calls(group, "execute_model") - steps == calls["n"]  # rank 1 ran exactly the valid steps
    assert _follower_calls(group, "initialize_cache") == inits


def test_sleep_and_wake_reshards_and_keeps_exact_tokens(group: Group, remote: RemoteWorker, reference: dict) -> None:
    remote.call("sleep", level=2)  # frees the weights on every rank; wake_up reloads and shards again
    assert httpx.get(f"{group.leader.url}/readyz").status_code == 503
    for tags in (["weights", ["x"]], "kv_cache", ["gpu"]):  # rejected on rank 0, rank 1 still asleep
        r = httpx.post(f"{group.leader.url}/rpc/wake_up", json={"tags": tags}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["field"] == "tags", r.text
    remote.call("wake_up")
    assert remote.get_kv_cache_spec() and httpx.get(f"{group.leader.url}/readyz").status_code == 200
    tokens, _ = workload(lambda so: remote.call("execute_model", scheduler_output=so))
    assert tokens == reference[group.model][0]


def test_group_refuses_lora_and_group_changes(group: Group, remote: RemoteWorker) -> None:
    r = httpx.post(f"{group.leader.url}/rpc/add_lora", json={"lora_request": {"lora_int_id": 1, "lora_path": "a"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "lora_request"
    r = httpx.post(f"{group.leader.url}/rpc/init_device", json={"config": {"tensor_parallel": 4}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "config.tensor_parallel"
    step = {"scheduled_new_reqs": [{"req_id": "d", "prompt_token_ids": [5, 6, 7], "sampling_params": {},
                                    "block_ids": [[0]], "num_computed_tokens": 0}],
            "num_scheduled_tokens": {"d": 3}, "total_num_scheduled_tokens": 3, "scheduled_spec_decode_tokens": {"d": [9]}}
    r = httpx.post(f"{group.leader.url}/rpc/execute_model", json={"scheduler_output": step}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "scheduled_spec_decode_tokens", r.text
    assert remote.check_health() is None  # the group is still whole
