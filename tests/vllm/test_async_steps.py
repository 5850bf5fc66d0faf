"""Two steps in flight over the worker class's async transport, against a real sidecar: mlx-lm's
greedy tokens, every step applied once, and a resend of an applied step answered from the replies
the sidecar keeps (the older of two in flight included)."""

from __future__ import annotations

import httpx
import pytest

from sidecar.client.remote import RemoteWorker
from sidecar.vllm.async_steps import AsyncSteps
from tests.server.serverproc import prefill, start_server
from tests.vllm.conftest import oracle

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
    steps._send(older)
    assert steps._read(older) == older.result()
    assert steps_total(server.url) - before == STEPS  # nothing ran again
    steps.close()
    remote.close()
