"""The decode-ahead forward: dispatched in the step, or (once an after-reply hook runs) left to
the hook, with the same tokens as mlx-lm either way."""

from __future__ import annotations

from tests.conftest import mlx_lm_greedy
from tests.driver import Driver


def test_dispatch_after_reply_matches_mlx_lm(make_worker, oracle_model) -> None:
    prompt = [5, 9, 13, 2, 7]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 20)
    for hooked in (False, True):
        w = make_worker(num_blocks=32)
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("a", prompt, {"temperature": 0.0, "max_tokens": 30})
        deferred = 0
        while len(d.reqs["a"].out) < 20:
            d.step()
            deferred += w.runner._dispatch is not None  # built, not yet dispatched
            if hooked:
                w.after_reply()
                assert w.runner._dispatch is None
        assert d.reqs["a"].out[:20] == want, hooked
        assert w.runner.ahead_hits > 10
        # Without the hook every forward is dispatched in its step; with it (from the first call on) after it.
        assert w.runner.dispatch_after_reply is hooked
        assert (deferred >= 15) if hooked else deferred == 0


def test_a_dispatch_never_survives_a_new_pool(make_worker) -> None:
    w = make_worker(num_blocks=32)
    w.after_reply()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7], {"temperature": 0.0, "max_tokens": 10})
    d.step()
    d.step()
    assert w.runner._dispatch is not None
    w.runner.allocate(16)
    assert w.runner._dispatch is None and w.runner._ahead is None
    w.after_reply()  # nothing left to dispatch


def test_an_undispatched_forward_never_costs_a_pool_copy(make_worker) -> None:
    """A hook skipped (a call was already waiting) leaves the forward to the next step, which still
    writes the pool in place (the same buffer after three such steps)."""
    import numpy as np

    w = make_worker(num_blocks=32)
    w.after_reply()  # deferral on; then no hook runs between these steps
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", [5, 6, 7], {"temperature": 0.0, "max_tokens": 20})
    d.step()
    d.step()
    before = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    for _ in range(3):
        d.step()
    after = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
    assert before == after
    assert w.runner.ahead_hits >= 3


def test_after_a_long_step_the_ahead_forward_is_dispatched_before_the_reply(make_worker, oracle_model,
                                                                              monkeypatch) -> None:
    """On the CPU backend, after a step of at least EARLY_MIN_SECONDS (here: any step), the ahead
    forward is dispatched as the step returns though the after-reply hook runs: mlx-lm's tokens,
    and the pool still written in place (MLX donated every layer's buffer to the next write)."""
    import numpy as np

    from sidecar.runner import ahead

    prompt = [5, 9, 13, 2, 7]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 20)
    for threshold in (0.0, float("inf")):  # (inf: the control, every forward left to the hook)
        monkeypatch.setattr(ahead, "EARLY_MIN_SECONDS", threshold)
        w = make_worker(num_blocks=32)
        w.after_reply()
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("a", prompt, {"temperature": 0.0, "max_tokens": 30})
        d.step()
        w.after_reply()
        before = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
        early = 0
        while len(d.reqs["a"].out) < 20:
            d.step()
            early += w.runner._dispatch is None and w.runner._ahead is not None  # dispatched already
            w.after_reply()
        after = [np.asarray(k).__array_interface__["data"][0] for k in w.runner.pool.keys]
        assert d.reqs["a"].out[:20] == want, threshold
        assert w.runner.ahead_hits > 10 and before == after
        assert early >= 15 if threshold == 0.0 else early == 0


def test_after_a_short_step_the_hook_also_builds_the_forward(make_worker, oracle_model, monkeypatch) -> None:
    """After a step shorter than DEFER_MAX_SECONDS (here: any step) the step leaves the ahead
    forward unbuilt and the hook builds and dispatches it: mlx-lm's tokens across block boundaries,
    every decode computed ahead. A step that comes before the hook computes its rows itself."""
    from sidecar.runner import ahead

    prompt = [5, 9, 13, 2, 7]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 40)
    for threshold in (float("inf"), 0.0):  # (0: the control, built in the step)
        monkeypatch.setattr(ahead, "DEFER_MAX_SECONDS", threshold)
        w = make_worker(num_blocks=32)
        w.after_reply()
        d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
        d.add("a", prompt, {"temperature": 0.0, "max_tokens": 50})
        unbuilt = 0
        while len(d.reqs["a"].out) < 40:
            d.step()
            unbuilt += w.runner._ahead is not None and w.runner._ahead.logits is None and w.runner._dispatch is None
            w.after_reply()
            assert w.runner._ahead is None or w.runner._ahead.logits is not None
        assert d.reqs["a"].out[:40] == want, threshold
        assert w.runner.ahead_hits >= 38
        assert unbuilt >= 38 if threshold else unbuilt == 0
    # No hook after a step: the next one finds the forward unbuilt and computes the row itself.
    monkeypatch.setattr(ahead, "DEFER_MAX_SECONDS", float("inf"))
    w = make_worker(num_blocks=32)
    w.after_reply()
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", prompt, {"temperature": 0.0, "max_tokens": 50})
    while len(d.reqs["a"].out) < 12:
        d.step()
    # (one hit: the prefill's forward ahead, built in its step, as no step's time was known yet)
    assert d.reqs["a"].out[:12] == want[:12] and w.runner.ahead_hits == 1
