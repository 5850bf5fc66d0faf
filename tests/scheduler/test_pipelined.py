"""Two steps in flight against a real server: tokens equal mlx-lm's greedy ones with and without
pipelining, placeholders are validated (400 naming the field, nothing changed)."""

from __future__ import annotations

from typing import Iterator

import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.client.pipeline import Pipeline
from sidecar.scheduler import Request, Scheduler, run
from sidecar.scheduler.pipelined import run_pipelined, schedule_ahead
from tests.conftest import mlx_lm_greedy
from tests.server.serverproc import start_server

PROMPTS = [[5, 9, 14, 3, 22, 7, 30], [40, 2, 11], [8, 8, 19, 4, 61, 5, 12, 33, 2, 17, 6, 9, 3, 44, 1, 2, 70]]
NEW = [12, 5, 9]  # different lengths: requests leave the pipelined batch at different steps


def _requests(tag: str) -> list[Request]:
    return [Request(f"{tag}-{i}", p, {"temperature": 0.0}, max_tokens=n, ignore_eos=True)
            for i, (p, n) in enumerate(zip(PROMPTS, NEW))]


def _scheduler(info: dict, tag: str) -> Scheduler:
    sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"], max_num_seqs=4)
    for r in _requests(tag):
        sched.add_request(r)
    return sched


@pytest.fixture(scope="module")
def server(home: str) -> Iterator[tuple[str, RemoteWorker]]:
    with start_server() as s:
        w = RemoteWorker(s.url)
        w.init_device()
        w.load_model()
        w.initialize_cache(num_gpu_blocks=64)
        yield s.url, w
        w.close()


def test_pipelined_steps_give_mlx_lm_greedy_tokens(server: tuple[str, RemoteWorker], oracle_model) -> None:
    want = [mlx_lm_greedy(oracle_model("builtin:tiny"), p, n)[0] for p, n in zip(PROMPTS, NEW)]
    url, w = server
    info = w.info()
    plain = run(_scheduler(info, "plain"), lambda so: w.call("execute_model", scheduler_output=so))
    assert [r.output_token_ids for r in plain.values()] == want
    for connections in (1, 2):  # one pipelined connection; two, numbered and put in order by the server
        pipe = Pipeline(url, connections=connections)
        sent: list[dict] = []

        def submit(so: dict) -> None:
            sent.append(so)
            pipe.submit("execute_model", scheduler_output=so)

        try:
            piped = run_pipelined(_scheduler(info, f"piped{connections}"), submit, pipe.collect)
        finally:
            pipe.close()
        ahead = [so for so in sent if [-1] in so["scheduled_cached_reqs"]["new_token_ids"]]
        assert len(ahead) > len(sent) // 2  # most steps really were sent ahead of the previous reply
        assert [r.output_token_ids for r in piped.values()] == want, connections


def test_a_placeholder_where_no_token_was_sampled_is_a_400_naming_the_field(server: tuple[str, RemoteWorker],
                                                                             oracle_model) -> None:
    url, w = server
    sched = Scheduler(num_blocks=64, block_size=w.info()["block_size"], max_num_seqs=4,
                      max_num_batched_tokens=4)
    sched.add_request(Request("a", PROMPTS[0], {"temperature": 0.0}, max_tokens=4, ignore_eos=True))
    first = sched.schedule()  # a 4-token chunk of a 7-token prompt: samples nothing
    sched.update_from_output(first, w.call("execute_model", scheduler_output=first))
    assert schedule_ahead(sched, first) is None  # the scheduler itself never sends one here
    bad = sched.schedule()
    bad["scheduled_cached_reqs"]["new_token_ids"] = [[-1]]
    with pytest.raises(RemoteError) as e:
        w.call("execute_model", scheduler_output=bad)
    assert e.value.status == 400 and e.value.field == "scheduled_cached_reqs.new_token_ids[0]"
    unknown = dict(bad, scheduled_cached_reqs=dict(bad["scheduled_cached_reqs"], req_ids=["nope"]),
                   num_scheduled_tokens={"nope": 3})
    with pytest.raises(RemoteError) as e:
        w.call("execute_model", scheduler_output=unknown)
    assert e.value.status == 400 and e.value.field == "scheduled_cached_reqs.req_ids[0]"
    # Nothing changed: the same step without the placeholder runs and samples mlx-lm's first token
    # (negative control: the placeholder is what was refused).
    bad["scheduled_cached_reqs"]["new_token_ids"] = [[]]
    reply = w.call("execute_model", scheduler_output=bad)
    nxt = schedule_ahead(sched, bad)  # built before the reply is applied, as when it is still on its way
    events = sched.update_from_output(bad, reply)
    assert [e.new_token_ids for e in events] == [mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 1)[0]]
    # It has sampled now: the next step carries the placeholder and gets mlx-lm's second token.
    assert nxt is not None and nxt["scheduled_cached_reqs"]["new_token_ids"] == [[-1]]
    got = w.call("execute_model", scheduler_output=nxt)["sampled_token_ids"]
    assert got == [mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 2)[0][1:]]
