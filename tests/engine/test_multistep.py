"""Several decode steps in one call (`num_decode_steps`): mlx-lm's tokens and logprobs, each row
stopping where the scheduler would (stop ids, eos, max_tokens, its blocks, max_model_len), seeded
sampling as one step at a time, refusals that change nothing, and a failure inside the call rolled
back as a whole."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.scheduler import Request, Scheduler, run
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.test_architectures import BLOCK, served, tiny_dir

PROMPTS = [[5, 9, 14, 3, 22, 7, 30], [40, 2, 11], list(range(3, 40))]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-4 for a, b in zip(got, want))


def decode(w, sampling: dict, steps: int, n: int = 20, prompts: list[list[int]] = PROMPTS) -> Driver:
    """Every prompt in one step (its first token), then calls of `steps` decode steps until each
    request has `n` tokens or stopped early; returns the driver (tokens, logprobs)."""
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    for i, p in enumerate(prompts):
        d.add(f"r{i}", p, dict(sampling))
    d.step(chunk=64)
    while live := [r.rid for r in d.reqs.values() if len(r.out) < n]:
        d.step(only=live, steps=steps)
    return d


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.0, "logprobs": 1}])
def test_decode_steps_give_mlx_lm_tokens_and_logprobs(make_worker, oracle_model, sampling: dict) -> None:
    w = make_worker()
    d = decode(w, sampling, steps=8)
    oracle = oracle_model("builtin:tiny")
    for i, p in enumerate(PROMPTS):
        r = d.reqs[f"r{i}"]
        want, want_lp = mlx_lm_greedy(oracle, p, len(r.out))
        assert len(r.out) >= 20 and r.out == want
        if "logprobs" in sampling:
            assert close(r.logprobs, want_lp)
    # the calls returned 8 tokens a request (the first step: one), and the K/V they wrote is what
    # the next call reads: a request that continues one step at a time keeps mlx-lm's tokens
    assert len(d.reqs["r0"].out) == 1 + 8 * 3
    d.step()
    assert d.reqs["r1"].out == mlx_lm_greedy(oracle, PROMPTS[1], 26)[0]


def test_seeded_sampling_is_the_same_one_step_at_a_time(make_worker) -> None:
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "presence_penalty": 0.5}
    got = {steps: [r.out[:20] for r in decode(make_worker(), sampling, steps).reqs.values()] for steps in (1, 6)}
    assert got[1] == got[6]
    sampling["seed"] = 99  # negative control: another seed, other tokens
    assert [r.out[:20] for r in decode(make_worker(), sampling, 6).reqs.values()] != got[1]


def test_a_row_stops_where_the_scheduler_would(make_worker, oracle_model) -> None:
    """A stop id and max_tokens end a row inside the call; the others go on (min_tokens holds the
    stop off). The stop id is a token mlx-lm's greedy run first reaches at its 5th token or later."""
    want = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 30)[0]
    stop = next(t for t in want[4:] if t not in want[:4])
    at = want.index(stop)
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("stop", PROMPTS[0], {"temperature": 0.0, "stop_token_ids": [stop]})
    d.add("min", PROMPTS[0], {"temperature": 0.0, "stop_token_ids": [stop], "min_tokens": at + 2})
    d.add("len", PROMPTS[1], {"temperature": 0.0, "max_tokens": 5})
    d.step(chunk=64)
    res = d.step(steps=32)
    got = {rid: res["sampled_token_ids"][i] for rid, i in res["req_id_to_index"].items()}
    assert d.reqs["stop"].out == want[: at + 1] and got["stop"][-1] == stop
    assert len(d.reqs["len"].out) == 5
    # min_tokens masks the stop id (vLLM's rule) until it is reached: that row decodes on
    assert d.reqs["min"].out[:at] == want[:at] and d.reqs["min"].out[at] != stop and len(d.reqs["min"].out) > at + 1
    # the worker's state agrees: each stopped row continues from its last token
    assert {rid: s.num_computed_tokens for rid, s in w.runner.requests.items()} == {
        rid: r.known - 1 for rid, r in d.reqs.items()}


def test_a_row_stops_where_its_blocks_end(make_worker, oracle_model) -> None:
    """The scheduler gives each row blocks for the positions it wants decoded: a row with 3 free
    positions left in its table gets 3 tokens from a call of 16 steps, and nothing is written past them."""
    w = make_worker()
    bs = w.config.block_size
    prompt = list(range(3, 3 + 2 * bs - 3))  # fills 2 blocks but 3 positions
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", prompt, blocks=d.alloc(2))
    d.step(chunk=64)  # position 2 * bs - 3 is the first token's: it and 2 more are computed in the call
    d.step(steps=16)
    assert len(d.reqs["a"].out) == 1 + 3
    d.step(steps=16)  # the driver now grows the table by one block for the next position: 16 more
    assert d.reqs["a"].out == mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 4 + bs)[0]


def test_max_model_len_ends_a_row(make_worker) -> None:
    """A request holds at most max_model_len tokens (vLLM's "length"): the last one sampled is at
    position max_model_len - 1 and never computed."""
    w = make_worker(max_model_len=40)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", list(range(3, 30)))
    d.step(chunk=64)
    d.step(steps=64)
    assert len(d.reqs["a"].out) == 40 - 27 and w.runner.requests["a"].num_computed_tokens == 39


def test_a_model_with_recurrent_state_decodes_several_steps(home: str, oracle_model) -> None:
    w = served(home, "mamba2")
    sched = Scheduler(num_blocks=96, block_size=BLOCK, num_decode_steps=5, enable_prefix_caching=False)
    for i, p in enumerate(PROMPTS):
        sched.add_request(Request(f"m{i}", p, {"temperature": 0.0}, max_tokens=12, ignore_eos=True))
    calls: list[dict] = []
    done = run(sched, lambda so: calls.append(so) or w.execute_model(so).to_wire())
    oracle = oracle_model(str(tiny_dir(home, "mamba2")))
    assert [r.output_token_ids for r in done.values()] == [mlx_lm_greedy(oracle, p, 12)[0] for p in PROMPTS]
    assert sum(c.get("num_decode_steps", 1) > 1 for c in calls) >= 2


@pytest.mark.parametrize("case", ["drafts", "defer_sampling", "zero", "too_many", "not_an_int"])
def test_refusals_name_the_field_and_change_nothing(make_worker, oracle_model, case: str) -> None:
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", PROMPTS[0])
    d.step(chunk=64)
    before = {rid: (s.num_computed_tokens, list(s.output_token_ids), list(s.block_ids))
              for rid, s in w.runner.requests.items()}
    so = d.build(chunk=16)
    so["num_decode_steps"] = {"zero": 0, "too_many": 65, "not_an_int": "4"}.get(case, 4)
    if case == "drafts":
        so["scheduled_spec_decode_tokens"] = {"a": [7]}
        so["num_scheduled_tokens"]["a"] = so["total_num_scheduled_tokens"] = 2
    with pytest.raises(ProtocolError) as e:
        w.execute_model(so, defer_sampling=case == "defer_sampling")
    assert e.value.field == "num_decode_steps"
    assert {rid: (s.num_computed_tokens, list(s.output_token_ids), list(s.block_ids))
            for rid, s in w.runner.requests.items()} == before
    so = d.build(chunk=16)
    d.commit(so, w.execute_model(so).to_wire())  # one step, as if the refused call never came
    assert d.reqs["a"].out == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 2)[0]


def test_a_failure_inside_the_call_rolls_the_whole_call_back(make_worker, oracle_model, monkeypatch) -> None:
    w = make_worker()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", PROMPTS[0])
    d.step(chunk=64)
    before = {rid: (s.num_computed_tokens, list(s.output_token_ids)) for rid, s in w.runner.requests.items()}
    real, calls = w.runner.decode_rows, []

    def third_fails(rows, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(rows, **kw)

    monkeypatch.setattr(w.runner, "decode_rows", third_fails)
    so = d.build(chunk=16)
    so["num_decode_steps"] = 6
    with pytest.raises(RuntimeError, match="injected"):
        w.execute_model(so)
    assert {rid: (s.num_computed_tokens, list(s.output_token_ids)) for rid, s in w.runner.requests.items()} == before
    monkeypatch.setattr(w.runner, "decode_rows", real)
    d.commit(so, w.execute_model(so).to_wire())  # the same call now succeeds
    assert d.reqs["a"].out == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 7)[0]


def test_each_further_step_is_built_before_the_sync_and_taken(make_worker, oracle_model, monkeypatch) -> None:
    """Inside a call, the next decode is built on the step's still-lazy tokens (before the step's
    sync) and then taken by the next step: every token after a call's first comes from such a
    forward, and the tokens stay mlx-lm's. The last step of a call builds nothing ahead (its
    decode-ahead waits for the reply), nor does a one-step call (negative control)."""
    import mlx.core as mx

    from sidecar.engine import overlap

    w = make_worker()
    lazy: list[bool] = []
    real = overlap.DecodeOverlap.prepare

    def spy(self, runner, rows, tokens, *args):
        lazy.append(isinstance(tokens, mx.array))
        return real(self, runner, rows, tokens, *args)

    monkeypatch.setattr(overlap.DecodeOverlap, "prepare", spy)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", PROMPTS[0])
    d.step(chunk=64)
    d.step()
    lazy.clear()
    hits = w.runner.overlap.hits
    d.step(steps=6)
    assert lazy.count(True) == 5  # steps 1..5 of the call build the next; step 6 does not
    assert w.runner.overlap.hits - hits == 6  # the call's first step takes the decode-ahead, the rest these
    d.step(steps=1)
    assert lazy.count(True) == 5
    assert d.reqs["a"].out == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPTS[0], 9)[0]
