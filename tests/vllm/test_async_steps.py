"""Two steps in flight over the worker class's async transport, against a real sidecar: mlx-lm's
greedy tokens, every step applied once, a resend of an applied step answered from the replies
the sidecar keeps (the older of two in flight included), and a sidecar killed with two steps in
flight: a new instance rebuilt, the steps in flight sent again, the tokens of an undisturbed run."""

from __future__ import annotations

import json
import logging
import select
import signal

import httpx
import pytest

from sidecar.client.remote import RemoteWorker
from sidecar.vllm.async_steps import AsyncSteps, Reply
from sidecar.vllm.recovery import Recovering
from tests.server.serverproc import finish, free_port, prefill, start_server
from tests.vllm.conftest import generated, oracle

PROMPT_LEN, STEPS = 7, 8


def decode(rid: str, position: int) -> dict:
    """Step n + 1 as vLLM's async scheduler sends it: the request without its new token (the sidecar's own)."""
    return {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
        "req_ids": [rid], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [None],
        "num_computed_tokens": [position], "num_output_tokens": [position - PROMPT_LEN + 1]},
        "num_scheduled_tokens": {rid: 1}, "total_num_scheduled_tokens": 1, "finished_req_ids": []}


def steps_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("mlx_worker_steps_total"))


@pytest.fixture(scope="module")
def server():
    with start_server("--preload", "--model", "builtin:tiny", "--max-num-batched-tokens", "64", "--max-num-seqs", "4",
                      "--max-model-len", "128") as s:
        yield s


def test_two_steps_in_flight_give_mlx_lms_tokens_once_each(server, home: str) -> None:
    remote = RemoteWorker(server.url, pin_instance=True)
    remote.call("check_health")  # the instance every step then names
    steps = AsyncSteps(remote)
    before = steps_total(server.url)
    first = steps.submit(prefill("a", PROMPT_LEN, token=11), step_id=1)
    assert first._done  # the first step after a reset is waited for: the sidecar's order is settled
    replies = [first]
    for n in range(1, STEPS):
        replies.append(steps.submit(decode("a", PROMPT_LEN + n - 1), step_id=1 + n))
        assert not replies[-1]._done  # in flight: sent before its reply (or the previous one's) is read
    tokens = [r.result()["sampled_token_ids"][0][0] for r in replies]
    assert steps_total(server.url) - before == STEPS
    want = oracle({"model": "builtin:tiny", "prompts": [[11] * PROMPT_LEN], "max_tokens": STEPS}, home)[0]["tokens"]
    assert tokens == want

    # A lost reply is re-read by resending the same numbered step: the older of the last two is still kept.
    older = replies[-2]
    kept, older.out = older.out, None
    steps._drop(older.slot)
    steps._send(older)
    assert steps._read(older) == kept
    assert steps_total(server.url) - before == STEPS  # nothing ran again
    steps.close()
    remote.close()


def test_a_step_that_overtook_the_one_before_it_is_sent_again_once_that_one_is_answered(server, home: str) -> None:
    remote = RemoteWorker(server.url, pin_instance=True)
    remote.call("execute_model", scheduler_output=finish())  # unnumbered: a new numbered sequence may start at 1
    steps = AsyncSteps(remote)
    first = steps.submit(prefill("o", PROMPT_LEN, token=11), step_id=1)
    second = Reply(steps, 1, decode("o", PROMPT_LEN), 2)
    third = Reply(steps, 0, decode("o", PROMPT_LEN + 1), 3)
    steps._inflight.extend([second, third])
    before = steps_total(server.url)
    steps._send(third)  # step 3 first (its connection was faster): the sidecar waits for step 2, then gives up
    select.select([steps._conns[0].sock], [], [], 60)  # its answer is there: the 409 (nothing ran)
    steps._send(second)
    tokens = [first.result()["sampled_token_ids"][0][0], second.result()["sampled_token_ids"][0][0]]
    assert steps_total(server.url) - before == 1
    tokens.append(third.result()["sampled_token_ids"][0][0])  # read: the 409, then sent again, in sequence
    assert steps_total(server.url) - before == 2
    want = oracle({"model": "builtin:tiny", "prompts": [[11] * PROMPT_LEN], "max_tokens": 3}, home)[0]["tokens"]
    assert tokens == want
    steps.close()
    remote.close()


# --- a sidecar lost with steps in flight (the worker class's recovery, sidecar/vllm/recovery.py) ---

MODEL, DECODES = "builtin:tiny", 10
SAMPLING = {"a": {"temperature": 0.0}, "b": {"temperature": 1.0, "seed": 5}}


def cached(positions: dict[str, int]) -> dict:
    """Step n + 1 for every request, as vLLM's async scheduler sends it (no token: the sidecar's own)."""
    rids = sorted(positions)
    return {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
        "req_ids": rids, "resumed_req_ids": [], "new_token_ids": [[] for _ in rids], "new_block_ids": [None] * len(rids),
        "num_computed_tokens": [positions[r] for r in rids], "num_output_tokens": [positions[r] - PROMPT_LEN + 1 for r in rids]},
        "num_scheduled_tokens": {r: 1 for r in rids}, "total_num_scheduled_tokens": len(rids), "finished_req_ids": []}


def run_async(port: int, kill: str | None, at: int = 4) -> tuple[dict[str, list[int]], dict]:
    """Two requests (greedy, seeded) decoding with two steps in flight, driven as vLLM's EngineCore
    drives the worker class (send step n + 1, then read step n). `kill`: the sidecar is killed
    (-9) and a new one started on the same port, either with steps `at` and `at + 1` both in flight
    ("two_in_flight") or after step `at` was read, so that step `at + 2` is sent to no one ("send_fails")."""
    server = start_server("--model", MODEL, "--port", str(port))
    rec = Recovering(RemoteWorker(server.url, pin_instance=True), where=f"MLX sidecar at {server.url}",
                     recover_timeout=120, block_size=16, budget=64, max_seqs=4, prefix_cache=True)
    steps = AsyncSteps(rec.remote, recovering=rec)
    try:
        rec.call("init_device", config={"block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": 4}, reset=True)
        rec.call("load_model")
        rec.call("initialize_cache", num_gpu_blocks=8, num_cpu_blocks=0)
        first = {"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "finished_req_ids": []}
        for i, rid in enumerate(SAMPLING):
            new = prefill(rid, PROMPT_LEN, first_block=2 * i, token=11 + i)["scheduled_new_reqs"][0]
            first["scheduled_new_reqs"].append({**new, "sampling_params": SAMPLING[rid], "block_ids": [[2 * i, 2 * i + 1]]})
            first["num_scheduled_tokens"][rid] = PROMPT_LEN
        first["total_num_scheduled_tokens"] = 2 * PROMPT_LEN
        tokens: dict[str, list[int]] = {rid: [] for rid in SAMPLING}
        after: dict = {}
        queue = [steps.submit(first, step_id=1)]
        for n in range(1, DECODES + 1):
            if kill == "send_fails" and n == at + 2:
                server.stop(signal.SIGKILL)
                server = start_server("--model", MODEL, "--port", str(port))
                after["generated_before"] = generated(server)
            queue.append(steps.submit(cached({rid: PROMPT_LEN + n - 1 for rid in SAMPLING}), step_id=1 + n))
            if kill == "two_in_flight" and n == at + 1:
                server.stop(signal.SIGKILL)
                server = start_server("--model", MODEL, "--port", str(port))
                after["generated_before"] = generated(server)
            out = queue.pop(0).result()
            for rid, t in zip(out["req_ids"], out["sampled_token_ids"]):
                tokens[rid] += t
        for reply in queue:
            out = reply.result()
            for rid, t in zip(out["req_ids"], out["sampled_token_ids"]):
                tokens[rid] += t
        after.update(recoveries=rec.recoveries, replayed=steps.replayed, last=rec.last)
        if kill:
            after["generated"] = generated(server) - after["generated_before"]
        return tokens, after
    finally:
        steps.close()
        rec.remote.close()
        server.stop()


@pytest.mark.parametrize("kill", ["two_in_flight", "send_fails"])
def test_a_sidecar_killed_with_steps_in_flight_is_rebuilt_and_they_are_answered_once(
        home: str, kill: str, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    want, quiet = run_async(port, None)
    assert quiet["recoveries"] == 0 and all(len(t) == DECODES + 1 for t in want.values())
    with caplog.at_level(logging.WARNING, logger="sidecar.vllm.recovery"):
        got, after = run_async(port, kill)
    assert after["recoveries"] == 1
    assert got == want  # the greedy stream and the seeded one's stream position
    # The steps vLLM had not read were sent again, each applied once by the new instance, and the
    # refill sampled nothing: the new instance generated exactly the tokens of the steps it answered.
    read_before = 4 if kill == "two_in_flight" else 5  # step ids: the prefill is 1, decode n is n + 1
    assert after["replayed"] == 2
    assert after["generated"] == 2 * (DECODES + 1 - read_before)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mlx_sidecar_recovery ")]
    assert len(line) == 1
    fields = json.loads(line[0].split(" ", 1)[1])
    assert fields["recoveries_total"] == 1 and fields["replayed_steps"] == 2 and fields["refilled_tokens"] > 0
    assert fields["new_instance"] != fields["old_instance"] and fields["duration_s"] >= fields["rebuild_s"] > 0
