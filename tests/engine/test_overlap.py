"""The decode overlap: the next decode forward queued as a step returns, taken row by row where the
next step matches exactly. A stream takes it at every decode step, across block boundaries (the
scratch slot landed in the block the next step allocates), with mlx-lm's tokens and logprobs
through quantised K/V, joins, preemption, skipped steps and prefix hits; anything that differs
(another token, position, block or request, a row finished) computes its row itself."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from sidecar.engine import overlap
from sidecar.kv.spec import LayerSpec
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.kv.test_quant import quant_greedy

PROMPT = [5, 9, 13, 2, 7]
GREEDY = {"temperature": 0.0, "max_tokens": 200}
WITH_LP = {**GREEDY, "logprobs": 0}


def stream(d: Driver, rid: str, n: int) -> int:
    """Decode `rid` until it has n tokens; returns the steps run."""
    steps = 0
    while len(d.reqs[rid].out) < n:
        d.step()
        steps += 1
    return steps


def add(d: Driver, rid: str, prompt: list[int], sampling: dict, **kw) -> None:
    """A request holding only the blocks its prompt needs: each new block comes with the step
    that first writes it, as a block allocator gives them (Driver.add would give 4 spare)."""
    d.add(rid, prompt, sampling, blocks=kw.pop("blocks", None) or d.alloc(-(-len(prompt) // d.bs)), **kw)


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-4 for a, b in zip(got, want))


def buffers(w) -> list[int]:
    return [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]


@pytest.mark.parametrize("sampling", [GREEDY, WITH_LP])
def test_a_stream_takes_the_queued_forward_at_every_step_with_mlx_lm_tokens(make_worker, oracle_model,
                                                                            sampling) -> None:
    """Every decode step but the first takes the queued forward (the 4 crossing steps included),
    and the pool is written in place throughout (a landing or a step's task still holding a pool
    buffer when the forward was queued would have made MLX copy it)."""
    want, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 70)  # crosses 16, 32, 48, 64
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, sampling)
    steps = stream(d, "a", 2)
    before = buffers(w)
    steps += stream(d, "a", 70)
    assert d.reqs["a"].out == want and buffers(w) == before
    if "logprobs" in sampling:
        assert close(d.reqs["a"].logprobs, want_lp)
    assert (w.runner.ahead_hits, w.runner.ahead_misses) == (steps - 1, 0)


def test_quantised_kv_crosses_boundaries_with_mlx_lm_tokens(make_worker, oracle_model) -> None:
    model = "builtin:tiny-kv64"
    want, want_lp = quant_greedy(oracle_model(model), PROMPT, 40, 8)
    w = make_worker(model, num_blocks=16, kv_dtype="8bit")
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    steps = stream(d, "a", 40)
    assert d.reqs["a"].out == want and close(d.reqs["a"].logprobs, want_lp)
    assert (w.runner.ahead_hits, w.runner.ahead_misses) == (steps - 1, 0)


def test_without_the_landing_copy_the_stream_departs_from_mlx_lm(make_worker, oracle_model, monkeypatch) -> None:
    """Negative control: the oracle checks above see a crossing token's K/V that never reaches its block."""
    _, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 30)
    monkeypatch.setattr(overlap, "_land", lambda pool, row, kv: True)
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    stream(d, "a", 30)
    lp = d.reqs["a"].logprobs
    # Token 12 comes from position 16's own (crossing) forward; every later one reads its K/V.
    assert close(lp[:13], want_lp[:13]) and not close(lp[13:], want_lp[13:])


def test_no_crossing_when_disabled_or_unsupported(make_worker, oracle_model, monkeypatch) -> None:
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 40)
    monkeypatch.setattr(overlap, "crossing", False)
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, GREEDY)
    steps = stream(d, "a", 40)
    assert d.reqs["a"].out == want
    assert w.runner.ahead_hits == steps - 1 - 2  # nothing queued at the crossings of 16 and 32
    monkeypatch.setattr(overlap, "crossing", True)
    assert overlap.crossing_supported(w.runner)
    full, window = LayerSpec(16, 2, 16, 16, "float32"), LayerSpec(16, 2, 16, 16, "float32", sliding_window=32)
    assert not overlap.crossing_supported(SimpleNamespace(groups=[[0], [1]], specs=[full, window]))
    assert not overlap.crossing_supported(SimpleNamespace(groups=[[0]], specs=[window]))


def test_only_an_exact_match_takes_the_queued_logits(make_worker) -> None:
    """Negative controls, row by row: another token, position, first block or request computes
    its row itself and counts the queued row as a miss."""
    from sidecar.engine.state import RequestState, Row
    from sidecar.engine.sampler import SamplingParams

    w = make_worker(num_blocks=32)
    st = RequestState("a", [1, 2, 3], SamplingParams(temperature=0.0), [4, 5])
    row = Row(st, 3, [9], [4, 5], True)
    other = Row(RequestState("b", [1, 2, 3], SamplingParams(temperature=0.0), [4, 5]), 3, [9], [4, 5], True)
    logits = mx.arange(16, dtype=mx.float32).reshape(2, 8)
    cases = [(row, True), (replace(row, block_ids=[4, 6]), True),  # (block 6 is not read at position 3)
             (replace(row, token_ids=[8]), False), (replace(row, start=4), False),
             (replace(row, block_ids=[7, 5]), False), (other, False)]
    for r, hit in cases:
        ov = overlap.DecodeOverlap()
        ov.queued = overlap.Queued({"a": (3, 9, overlap.tables(row), 1)}, logits)
        last: list = [None]
        rest, whole = ov.take(w.runner, [r], [0], last)
        assert (rest, ov.hits, ov.misses) == (([], 1, 0) if hit else ([0], 0, 1)), r
        assert (last[0] is not None and last[0].tolist() == logits[1:2].tolist()) if hit else last[0] is None
        assert whole is None  # the row is the queued forward's second: its logits are not all of them
        assert ov.queued is None  # taken once: a later step never sees it
    # Every row taken, each at its own index: the queued logits are the step's, as one array.
    ov = overlap.DecodeOverlap()
    ov.queued = overlap.Queued({"a": (3, 9, overlap.tables(row), 0)}, logits[1:2])
    last = [None]
    rest, whole = ov.take(w.runner, [row], [0], last)
    assert rest == [] and whole is not None and whole.tolist() == logits[1:2].tolist()
    assert last == [None]  # (no slice made per row for a step that takes the array whole)


def test_a_finished_row_and_a_new_pool_drop_the_queued_forward(make_worker, oracle_model) -> None:
    w = make_worker(num_blocks=32)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, GREEDY)
    add(d, "b", PROMPT[::-1], GREEDY)
    d.run(4)
    hits, misses = w.runner.ahead_hits, w.runner.ahead_misses
    d.finish("a")
    d.step()  # b alone: its row is taken, a's queued row was for nothing
    assert (w.runner.ahead_hits - hits, w.runner.ahead_misses - misses) == (1, 1)
    d.run(8)
    assert d.reqs["b"].out[:8] == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT[::-1], 8)[0]
    assert w.runner.overlap.deferred is not None  # queued once the reply has left (the MLX thread flushes)
    w.runner.overlap.flush()
    assert w.runner.overlap.queued is not None and w.runner.overlap.deferred is None
    w.runner.allocate(16)
    assert w.runner.overlap.queued is None


def test_joins_preemption_skipped_steps_and_prefix_hits_keep_mlx_lm_tokens(make_worker, oracle_model) -> None:
    model = oracle_model("builtin:tiny")
    w = make_worker(num_blocks=48)
    bs = w.config.block_size
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    a = d.reqs["a"]
    stream(d, "a", 12)  # the queued forward of position 16 has crossed into the scratch slot
    assert (a.computed, len(a.blocks)) == (16, 1)
    # b joins in the step that lands it, sharing a's just-filled first block (a prefix hit).
    b_prompt = PROMPT + a.out[:11] + [3, 4, 8]
    add(d, "b", b_prompt, WITH_LP, blocks=a.blocks[:1] + d.alloc(1), computed=bs)
    d.step()
    assert (a.computed, w.runner.ahead_misses) == (17, 0)
    stream(d, "a", 28)  # a's second block is full; its slot 0 came from the scratch slot
    # c shares both of a's blocks (the landed slot included), in a step without a: a's row misses.
    c_prompt = PROMPT + a.out[:27] + [11]
    add(d, "c", c_prompt, WITH_LP, blocks=a.blocks[:2] + d.alloc(1), computed=2 * bs)
    misses = w.runner.ahead_misses
    d.step(only=["c"])
    assert w.runner.ahead_misses > misses
    # a crosses again at 48 and is preempted right after: the crossing row misses, nothing leaks.
    stream(d, "a", 44)
    w.runner.overlap.flush()  # (as the server's MLX thread does once the reply has left)
    q = w.runner.overlap.queued
    assert a.computed == 48 and q is not None and q.crossing_id == "a"
    misses = w.runner.ahead_misses
    d.preempt("a")
    d.step(only=["b", "c"])
    assert w.runner.ahead_misses > misses
    for rid in ("a", "b", "c"):
        stream(d, rid, 50 if rid == "a" else 24)
    for rid, prompt, n in (("a", PROMPT, 50), ("b", b_prompt, 24), ("c", c_prompt, 24)):
        want, want_lp = mlx_lm_greedy(model, prompt, n)
        r = d.reqs[rid]
        assert r.out[:n] == want and close(r.logprobs[:n], want_lp), rid


def _hits_per_step(flag: str, steps: int = 100) -> tuple[list[int], list[int]]:
    """A real server's overlap hits (/info decode_ahead) per decode step of one greedy stream,
    split into the steps that decode a block's first position (the crossings) and the others."""
    from sidecar.client.remote import RemoteWorker
    from tests.server.serverproc import start_server

    env = {"MLX_SIDECAR_BOUNDARY_AHEAD": flag, "MLX_SIDECAR_AUTH_TOKEN": None}
    small = ("--max-model-len", "1024", "--max-num-batched-tokens", "64", "--max-num-seqs", "2")
    with start_server("--preload", *small, env=env) as s, s.client() as http:
        remote = RemoteWorker(s.url)
        d = Driver(lambda so: remote.call("execute_model", scheduler_output=so), 16, http.get("/info").json()["num_blocks"])
        add(d, "a", PROMPT, GREEDY | {"max_tokens": steps + 8})
        cross: list[int] = []
        other: list[int] = []
        last = http.get("/info").json()["decode_ahead"]["hits"]
        for i in range(steps):
            d.step()
            now = http.get("/info").json()["decode_ahead"]["hits"]
            if i >= 2:  # (decodes)
                (cross if d.reqs["a"].computed % 16 == 1 else other).append(now - last)
            last = now
        remote.close()
    return cross, other


def test_a_real_server_takes_the_queued_forward_at_the_crossing_steps(home) -> None:
    """Over a real server, a crossing step's forward is queued like any other decode step's; with
    crossing off (negative control) it never is."""
    on, on_other = _hits_per_step("1")
    off, off_other = _hits_per_step("0")
    assert len(on) == len(off) == 6 and len(on_other) == len(off_other) == 92
    assert on == [1] * 6 and on_other == off_other == [1] * 92
    assert off == [0] * 6
