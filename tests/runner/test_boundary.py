"""Decode ahead across block boundaries: a stream's ahead forward at a boundary runs into the scratch
slot and is landed in the block the next step allocates, so every decode step but the first is
an ahead hit, with mlx-lm's tokens and logprobs through boundaries, quantised K/V, a request
joining, preemption, skipped steps and prefix hits on the landed blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sidecar.runner import ahead, boundary
from sidecar.runner.kv_spec import LayerSpec
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.runner.test_kv_quant import quant_greedy

PROMPT = [5, 9, 13, 2, 7]
GREEDY = {"temperature": 0.0, "max_tokens": 200}
WITH_LP = {**GREEDY, "logprobs": 0}


def stream(w, d: Driver, rid: str, n: int, hooked: bool) -> int:
    """Decode `rid` until it has n tokens (as the server does: after_reply after every step when
    hooked); returns the steps run."""
    steps = 0
    while len(d.reqs[rid].out) < n:
        d.step()
        steps += 1
        if hooked:
            w.after_reply()
    return steps


def add(d: Driver, rid: str, prompt: list[int], sampling: dict, **kw) -> None:
    """A request holding only the blocks its prompt needs: each new block comes with the step
    that first writes it, as a block allocator gives them (Driver.add would give 4 spare)."""
    d.add(rid, prompt, sampling, blocks=kw.pop("blocks", None) or d.alloc(-(-len(prompt) // d.bs)), **kw)


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= 1e-4 for a, b in zip(got, want))


@pytest.mark.parametrize("sampling,hooked", [(GREEDY, True), (WITH_LP, False), (WITH_LP, True)])
def test_a_stream_is_ahead_at_every_boundary_with_mlx_lm_tokens(make_worker, oracle_model, sampling, hooked) -> None:
    want, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 70)  # crosses 16, 32, 48, 64
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, sampling)
    steps = stream(w, d, "a", 70, hooked)
    assert d.reqs["a"].out == want
    if "logprobs" in sampling:
        assert close(d.reqs["a"].logprobs, want_lp)
    # Every decode step took the ahead forward (the old rule missed the 4 crossing steps).
    assert (w.runner.ahead_hits, w.runner.ahead_misses) == (steps - 1, 0)


@pytest.mark.parametrize("sampling", [GREEDY, WITH_LP])
def test_dispatched_before_the_reply_the_stream_crosses_in_place(make_worker, oracle_model, sampling,
                                                                 monkeypatch) -> None:
    """The ahead forward dispatched before each reply (ahead.before_reply, here for every step):
    mlx-lm's tokens across four boundaries, every step ahead, and the pool written in place
    throughout (a landing or a read still queued at a dispatch would have made MLX copy it)."""
    import numpy as np

    monkeypatch.setattr(ahead, "EARLY_MIN_SECONDS", 0.0)
    want, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 70)
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, sampling)
    steps = stream(w, d, "a", 2, True)
    before = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    steps += stream(w, d, "a", 70, True)
    after = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    assert d.reqs["a"].out == want and before == after
    if "logprobs" in sampling:
        assert close(d.reqs["a"].logprobs, want_lp)
    assert (w.runner.ahead_hits, w.runner.ahead_misses) == (steps - 1, 0)


def test_quantised_kv_crosses_boundaries_with_mlx_lm_tokens(make_worker, oracle_model) -> None:
    model = "builtin:tiny-kv64"
    want, want_lp = quant_greedy(oracle_model(model), PROMPT, 40, 8)
    w = make_worker(model, num_blocks=16, kv_dtype="8bit")
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    steps = stream(w, d, "a", 40, True)
    assert d.reqs["a"].out == want and close(d.reqs["a"].logprobs, want_lp)
    assert (w.runner.ahead_hits, w.runner.ahead_misses) == (steps - 1, 0)


def test_without_the_landing_copy_the_stream_departs_from_mlx_lm(make_worker, oracle_model, monkeypatch) -> None:
    """Negative control: the oracle checks above see a crossing token's K/V that never reaches its block."""
    _, want_lp = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 30)
    monkeypatch.setattr(boundary, "land", lambda pool, row, crossing: True)
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    stream(w, d, "a", 30, True)
    lp = d.reqs["a"].logprobs
    # Token 12 comes from position 16's own (crossing) forward; every later one reads its K/V.
    assert close(lp[:13], want_lp[:13]) and not close(lp[13:], want_lp[13:])


def test_old_rule_when_disabled_or_unsupported(make_worker, oracle_model, monkeypatch) -> None:
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 40)
    monkeypatch.setattr(boundary, "enabled", False)
    w = make_worker(num_blocks=16)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    add(d, "a", PROMPT, GREEDY)
    steps = stream(w, d, "a", 40, True)
    assert d.reqs["a"].out == want
    assert w.runner.ahead_hits == steps - 1 - 2  # no ahead forward at the crossings of 16 and 32
    monkeypatch.setattr(boundary, "enabled", True)
    assert boundary.supported(w.runner)
    full, window = LayerSpec(16, 2, 16, 16, "float32"), LayerSpec(16, 2, 16, 16, "float32", sliding_window=32)
    assert not boundary.supported(SimpleNamespace(groups=[[0], [1]], specs=[full, window]))
    assert not boundary.supported(SimpleNamespace(groups=[[0]], specs=[window]))


def test_joins_preemption_skipped_steps_and_prefix_hits_keep_mlx_lm_tokens(make_worker, oracle_model) -> None:
    model = oracle_model("builtin:tiny")
    w = make_worker(num_blocks=48)
    bs = w.config.block_size
    d = Driver(w.execute_model, bs, w.runner.num_blocks)
    add(d, "a", PROMPT, WITH_LP)
    a = d.reqs["a"]
    stream(w, d, "a", 12, True)  # the ahead forward of position 16 has crossed into the scratch slot
    assert (a.computed, len(a.blocks)) == (16, 1)
    # b joins in the step that lands it, sharing a's just-filled first block (a prefix hit).
    b_prompt = PROMPT + a.out[:11] + [3, 4, 8]
    add(d, "b", b_prompt, WITH_LP, blocks=a.blocks[:1] + d.alloc(1), computed=bs)
    d.step()
    w.after_reply()
    assert (a.computed, w.runner.ahead_misses) == (17, 0)
    stream(w, d, "a", 28, True)  # a's second block is full; its slot 0 came from the scratch slot
    # c shares both of a's blocks (the landed slot included), in a step without a: a's ahead misses.
    c_prompt = PROMPT + a.out[:27] + [11]
    add(d, "c", c_prompt, WITH_LP, blocks=a.blocks[:2] + d.alloc(1), computed=2 * bs)
    misses = w.runner.ahead_misses
    d.step(only=["c"])
    w.after_reply()
    assert w.runner.ahead_misses > misses
    # a crosses again at 48 and is preempted right after: the crossing ahead misses, nothing leaks.
    stream(w, d, "a", 44, True)
    assert a.computed == 48 and w.runner._ahead is not None and w.runner._ahead.crossing is not None
    misses = w.runner.ahead_misses
    d.preempt("a")
    d.step(only=["b", "c"])
    assert w.runner.ahead_misses > misses
    for rid in ("a", "b", "c"):
        stream(w, d, rid, 50 if rid == "a" else 24, True)
    for rid, prompt, n in (("a", PROMPT, 50), ("b", b_prompt, 24), ("c", c_prompt, 24)):
        want, want_lp = mlx_lm_greedy(model, prompt, n)
        r = d.reqs[rid]
        assert r.out[:n] == want and close(r.logprobs[:n], want_lp), rid


def _ahead_per_step(flag: str, steps: int = 100) -> tuple[list[int], list[int]]:
    """A real server's decode-ahead hits (/info decode_ahead) per decode step of one greedy stream,
    split into the steps that decode a block's first position (the crossings) and the others."""
    from sidecar.client import RemoteWorker
    from tests.server.serverproc import start_server

    env = {"MLX_SIDECAR_BOUNDARY_AHEAD": flag, "MLX_SIDECAR_AUTH_TOKEN": None}
    with start_server("--preload", "--max-model-len", "1024", env=env) as s, s.client() as http:
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


def test_a_real_server_computes_the_crossing_steps_ahead(home) -> None:
    """Over a real server, a crossing step's forward is computed ahead (during the round trip) like
    any other decode step's; with the boundary ahead off (negative control) it never is. (How much
    idle time that hides is a bench figure: tiny_single_stream_mlx_idle_ms_per_token.)"""
    on, on_other = _ahead_per_step("1")
    off, off_other = _ahead_per_step("0")
    assert len(on) == len(off) == 6 and len(on_other) == len(off_other) == 92
    assert on == [1] * 6 and on_other == off_other == [1] * 92
    assert off == [0] * 6


def test_a_lone_in_place_row_crosses_only_while_its_gather_is_cheap(make_worker, monkeypatch) -> None:
    """Crossing turns a lone row's in-place read into a gather of its K/V: past MAX_GATHER_BYTES it
    keeps the old rule; a scattered row (gathered anyway) or a row beside others still crosses."""
    from sidecar.runner.state import RequestState, Row
    from sidecar.runner.sampler import SamplingParams

    w = make_worker(num_blocks=64)
    r, bs = w.runner, w.config.block_size
    per_token = sum(s.page_size_bytes for s in r.specs) // bs
    monkeypatch.setattr(boundary, "MAX_GATHER_BYTES", 20 * bs * per_token)  # 20 blocks' worth
    st = RequestState("x", [1], SamplingParams(temperature=0.0), [])

    def crossing(*tables: list[int], inside: int = 0) -> tuple[list[int], int | None]:
        """Rows next at their blocks' end (the last `inside` of them: one slot before it)."""
        at = [len(t) * bs - (i >= len(tables) - inside) for i, t in enumerate(tables)]
        rows = [Row(st, p - 1, [1], t, True) for p, t in zip(at, tables)]
        return boundary.admit(r, rows, list(range(len(rows))), at)

    assert crossing(list(range(20))) == ([0], 0) and crossing(list(range(21))) == ([], None)
    assert crossing([*range(20), 40]) == ([0], 0)  # not one run: a gather either way
    assert crossing(list(range(21)), list(range(30, 33)), inside=1) == ([0, 1], 0)  # beside another row: the same
    assert crossing([30, 31], [0, 1]) == ([0], 0)  # one crossing row per ahead forward (one scratch slot)
