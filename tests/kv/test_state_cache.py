"""Recurrent state: per-request slots in the state pool, reset on preemption, no prefix caching."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.scheduler.scheduler import Request, Scheduler, prefix_caching_offered, run
from tests.conftest import mlx_lm_greedy
from tests.driver import Driver
from tests.engine.test_architectures import BLOCK, prompts, served, tiny_dir

NEW = 8


@pytest.mark.parametrize("family", ["granitemoehybrid", "mamba2"])
def test_preempted_recurrent_request_resumes_with_the_same_tokens(home: str, oracle_model, family: str) -> None:
    w = served(home, family)
    pa, pb = prompts(family, w.vocab_size())[:2]
    d = Driver(w.execute_model, BLOCK, 96)
    d.add("a", pa)
    d.add("b", pb)
    d.run(3, chunk=5)
    # "a" loses its blocks and is resumed on the same ones: its state block still holds the state
    # it had when preempted, which must not be carried into the recompute from position 0.
    old = d.reqs["a"].blocks
    d.preempt("a")
    d.free = old + d.free
    got = d.run(NEW, chunk=5)
    oracle = oracle_model(str(tiny_dir(home, family)))
    assert got == {"a": mlx_lm_greedy(oracle, pa, NEW)[0], "b": mlx_lm_greedy(oracle, pb, NEW)[0]}


def test_prefix_caching_is_refused_and_not_offered(home: str, oracle_model) -> None:
    w = served(home, "mamba2")
    spec = w.get_kv_cache_spec()
    assert not prefix_caching_offered(spec) and prefix_caching_offered(served(home, "llama").get_kv_cache_spec())
    d = Driver(w.execute_model, BLOCK, 96)
    d.add("hit", list(range(3, 15)), computed=8)  # a prefix-cache hit: the state of 8 tokens is nowhere
    with pytest.raises(ProtocolError, match="prefix caching is not offered") as e:
        d.step(chunk=4)
    assert e.value.field == "scheduled_new_reqs[0].num_computed_tokens" and not w.runner.requests

    # The reference scheduler reads the spec and never sends a hit, even for a shared prefix.
    w.initialize_cache(96, 0)
    sched = Scheduler(num_blocks=96, block_size=BLOCK, max_num_batched_tokens=16,
                      enable_prefix_caching=prefix_caching_offered(spec))
    shared = list(range(3, 19))
    for i in range(2):
        sched.add_request(Request(f"s{i}", shared + [20 + i], {"temperature": 0.0}, max_tokens=4, ignore_eos=True))
    done = run(sched, lambda so: w.execute_model(so).to_wire())
    oracle = oracle_model(str(tiny_dir(home, "mamba2")))
    for i in range(2):
        assert done[f"s{i}"].output_token_ids == mlx_lm_greedy(oracle, shared + [20 + i], 4)[0]


def test_speculative_decoding_is_refused_for_recurrent_models(home: str) -> None:
    w = served(home, "mamba2")
    step = {"scheduled_new_reqs": [{"req_id": "r", "prompt_token_ids": list(range(3, 11)), "sampling_params": {},
                                    "block_ids": [[1, 2, 3]], "num_computed_tokens": 0}],
            "num_scheduled_tokens": {"r": 10}, "total_num_scheduled_tokens": 10,
            "scheduled_spec_decode_tokens": {"r": [5, 6]}}
    with pytest.raises(ProtocolError, match="recurrent state") as e:
        w.execute_model(step)
    assert e.value.field == "scheduled_spec_decode_tokens.r" and not w.runner.requests
    with pytest.raises(ProtocolError, match="recurrent state") as e:
        served(home, "mamba2", speculative_method="ngram")
    assert e.value.field == "config.speculative_method"
