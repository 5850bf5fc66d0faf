"""A lone decode row's compiled forward: mlx-lm's tokens, the uncompiled path's logits, the pool
written in place, other requests' slots never leaking in, and the rows it must leave alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.runner import decode_compiled
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver


def _taken(w) -> list[int]:
    """Counts the rows the compiled forward computed (a wrapper on the worker's instance)."""
    cd = w.runner.compiled_decode
    assert cd is not None
    count = [0]
    call = cd.__call__

    def counted(*a, **k):
        out = call(*a, **k)
        count[0] += out is not None
        return out

    w.runner.compiled_decode = counted
    return count


@pytest.mark.parametrize("model", ["builtin:tiny", "builtin:tiny-qwen3", "builtin:tiny-qwen2"])
def test_compiled_decode_gives_mlx_lm_tokens_and_logprobs(make_worker, oracle_model, model) -> None:
    prompt = [5, 9, 13, 2, 7, 11, 3]
    want, want_lp = mlx_lm_greedy(oracle_model(model), prompt, 40)
    for hooked in (False, True):  # the ahead forward dispatched in the step, and after the reply
        w = make_worker(model, num_blocks=32)
        taken = _taken(w)
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("a", prompt, {"temperature": 0.0, "max_tokens": 40, "logprobs": 0})
        got = d.reqs["a"]
        while len(got.out) < 40:
            d.step()
            if hooked:
                w.after_reply()
        assert got.out[:40] == want, (model, hooked)
        assert np.allclose(got.logprobs[:40], want_lp, atol=1e-4)
        assert taken[0] >= 35, taken  # every decode but the first, crossing blocks included


def test_logits_equal_the_uncompiled_forward(make_worker) -> None:
    """Token by token, the compiled row's logits are the modules' own (a negative control: the
    same comparison across different prompts does differ)."""
    from sidecar.runner.kv_cache import KVPool
    from sidecar.runner.requests import RequestState, Row
    from sidecar.runner.sampler import SamplingParams

    w = make_worker(num_blocks=32)
    r = w.runner
    cd = r.compiled_decode
    prompt = [5, 9, 13, 2, 7]

    def decode(compiled: bool, first: int) -> list[np.ndarray]:
        r.pool = KVPool(r.specs, 32)
        s = RequestState("x", [first, *prompt], SamplingParams(temperature=0.0), list(range(3, 13)))
        last: list = [None]
        r.compiled_decode = None
        r._forward([Row(s, 0, s.prompt_token_ids, s.block_ids, True)], [0], last, {})
        r.compiled_decode = cd if compiled else None
        out, tok = [], int(mx.argmax(last[0][0]).item())
        for p in range(len(s.prompt_token_ids), len(s.prompt_token_ids) + 70):  # past one GRAIN
            r._forward([Row(s, p, [tok], s.block_ids, True)], [0], last, {})
            out.append(np.array(last[0][0]))
            tok = int(np.argmax(out[-1]))
        return out

    plain, compiled = decode(False, 1), decode(True, 1)
    assert all(np.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(plain, compiled))
    assert not np.allclose(plain[0], decode(True, 4)[0], atol=1e-6, rtol=0)


def test_the_pool_is_written_in_place(make_worker) -> None:
    w = make_worker(num_blocks=32)
    taken = _taken(w)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7], {"temperature": 0.0, "max_tokens": 30})
    d.step()
    d.step()
    copied = []
    for i in range(20):  # (step by step: a copy could land back in the buffer an earlier copy freed)
        before = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys + w.runner.pool.values]
        d.step()
        w.after_reply()
        if before != [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys + w.runner.pool.values]:
            copied.append(i)
    assert taken[0] >= 20 and not copied, copied


def test_other_requests_slots_in_the_window_never_leak_in(make_worker) -> None:
    """The window read past a row's context covers slots of other blocks: NaN there changes nothing."""
    prompt = [5, 9, 13, 2, 7]
    outs = []
    for poison in (False, True):
        w = make_worker(num_blocks=32)
        taken = _taken(w)
        bs = w.config.block_size
        if poison:  # every slot from block 1 on (the row's context stays inside block 0)
            for a in w.runner.pool.keys + w.runner.pool.values:
                a[:, :, bs:] = mx.array(float("nan"), a.dtype)
            mx.eval(w.runner.pool.arrays())
        d = Driver(w.execute_model, bs, w.runner.num_blocks)
        got = d.add("a", prompt, {"temperature": 0.0, "max_tokens": bs - len(prompt), "logprobs": 0}, blocks=[0])
        while len(got.out) < bs - len(prompt):
            d.step()
        outs.append(got)
        assert taken[0] >= bs - len(prompt) - 1
    assert outs[0].out == outs[1].out and np.isfinite(outs[1].logprobs).all()
    assert np.allclose(outs[0].logprobs, outs[1].logprobs, atol=1e-6)


def test_rows_it_leaves_to_the_modules(make_worker, oracle_model, monkeypatch) -> None:
    """Scattered blocks, a window past WINDOW_BYTES and prompt logprobs run uncompiled, with mlx-lm's tokens."""
    prompt = [5, 9, 13, 2, 7]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 24)
    w = make_worker(num_blocks=64)
    per_key = w.runner.compiled_decode.bytes_per_key
    monkeypatch.setattr(decode_compiled, "WINDOW_BYTES", 2 * decode_compiled.GRAIN * per_key)
    taken = _taken(w)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("scattered", prompt, {"temperature": 0.0, "max_tokens": 30}, blocks=[40, 7, 3])
    d.add("plp", prompt, {"temperature": 0.0, "max_tokens": 30, "prompt_logprobs": 1}, blocks=[20, 21])
    for rid in ("scattered", "plp"):
        while len(d.reqs[rid].out) < 24:
            d.step(only=[rid])
        assert d.reqs[rid].out[:24] == want, rid
    # Compiled while the scattered row's context fits its first block, never after; never with prompt logprobs.
    assert taken[0] == w.config.block_size - len(prompt)
    taken[0] = 0
    # A run of blocks: compiled while the context is within 2 * GRAIN keys (the window), then not.
    long = d.add("long", prompt, {"temperature": 0.0, "max_tokens": 300}, blocks=list(range(44, 64)))
    while len(long.out) < 3 * decode_compiled.GRAIN:
        d.step(only=["long"])
        if long.known == 2 * decode_compiled.GRAIN:
            assert taken[0] == long.known - len(prompt)  # every decode so far, and the one queued ahead
    assert taken[0] == 2 * decode_compiled.GRAIN - len(prompt)  # (positions 5 to 127)


def test_sleep_drops_the_traces_and_wake_up_rebuilds_them(make_worker, oracle_model) -> None:
    prompt = [5, 9, 13, 2, 7]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 12)
    w = make_worker(num_blocks=32)
    w.sleep(2)
    assert w.runner.compiled_decode is None
    w.wake_up(None)
    taken = _taken(w)
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    got = d.add("a", prompt, {"temperature": 0.0, "max_tokens": 20})
    while len(got.out) < 12:
        d.step()
    assert got.out[:12] == want and taken[0] >= 10


def test_it_can_be_turned_off(make_worker, monkeypatch) -> None:
    """MLX_SIDECAR_COMPILED_DECODE=0 (read at import as `enabled`): no compiled forward at all."""
    monkeypatch.setattr(decode_compiled, "enabled", False)
    assert make_worker(num_blocks=8).runner.compiled_decode is None
    monkeypatch.setattr(decode_compiled, "enabled", True)
    assert make_worker(num_blocks=8).runner.compiled_decode is not None
