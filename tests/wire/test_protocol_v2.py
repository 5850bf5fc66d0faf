"""Protocol v2, on the raw wire (no vLLM): each change vLLM needs, through MLXWorker's wire entry
points with hand-built msgpack-shaped maps; the two-phase step also over a real server."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.errors import ProtocolError, StateError
from tests.conftest import mlx_lm_greedy
from tests.engine.test_model_runner import prompts
from tests.server.serverproc import start_server

BS = 16
# Profile and warm-up shapes small enough to be quick: these tests do not depend on them.
SMALL = ("--max-num-batched-tokens", "64", "--max-num-seqs", "4")


def new(rid: str, prompt: list[int], blocks: list[int], n: int, sp: dict | None = None, computed: int = 0,
        **extra: object) -> dict:
    return {"req_id": rid, "prompt_token_ids": prompt, "sampling_params": sp or {"temperature": 0.0},
            "block_ids": [blocks], "num_computed_tokens": computed, "lora_request": None, **extra}


def step(new_reqs: list[dict] = (), cached: dict | None = None, nst: dict | None = None, **extra: object) -> dict:
    nst = nst if nst is not None else {r["req_id"]: len(r.get("prefill_token_ids") or r["prompt_token_ids"])
                                       - r["num_computed_tokens"] for r in new_reqs}
    return {"scheduled_new_reqs": list(new_reqs), "scheduled_cached_reqs": cached or {}, "num_scheduled_tokens": nst,
            "total_num_scheduled_tokens": sum(nst.values()), **extra}


def decode(rids: list[str], computed: list[int]) -> dict:
    """A decode step as vLLM sends it: `new_token_ids` is [] (not one list per request)."""
    cached = {"req_ids": rids, "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [None] * len(rids),
              "num_computed_tokens": computed, "num_output_tokens": [0] * len(rids)}
    return step(cached=cached, nst={r: 1 for r in rids})


def tokens(out: object, rid: str) -> list[int]:
    w = out.to_wire() if hasattr(out, "to_wire") else out
    return w["sampled_token_ids"][w["req_id_to_index"][rid]]


def test_empty_new_token_ids_and_v2_resume_with_prefill_token_ids(make_worker, oracle_model) -> None:
    w = make_worker()
    prompt = prompts(w.vocab_size(), [20], seed=21)[0]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 8)
    got = tokens(w.execute_model(step([new("r", prompt, [0, 1], len(prompt))])), "r")
    for i in range(3):
        got += tokens(w.execute_model(decode(["r"], [len(prompt) + i])), "r")
    assert got == want[:4]
    # Preempted: then the V2 runner resends it as a NEW request with every known token, fresh blocks.
    w.execute_model(step(preempted_req_ids=["r"], nst={}))
    known = prompt + got
    got += tokens(w.execute_model(step([new("r", prompt, [5, 6], len(known), prefill_token_ids=known)])), "r")
    assert w.runner.requests["r"].block_ids == [5, 6]
    for i in range(3):
        got += tokens(w.execute_model(decode(["r"], [len(known) + i])), "r")
    assert got == want


def test_a_live_id_is_only_reused_after_preemption_or_with_prefill_token_ids(make_worker) -> None:
    w = make_worker()
    w.execute_model(step([new("a", [5, 6, 7], [0], 3)]))
    with pytest.raises(ProtocolError, match="already exists") as e:
        w.execute_model(step([new("a", [5, 6, 7], [1], 3)]))
    assert e.value.field == "scheduled_new_reqs[0].req_id"
    with pytest.raises(ProtocolError, match="must start with") as e:
        w.execute_model(step([new("a", [5, 6, 7], [1], 4, prefill_token_ids=[5, 6, 8, 9])]))
    assert e.value.field == "scheduled_new_reqs[0].prefill_token_ids"
    assert w.runner.requests["a"].block_ids == [0]  # rejected: nothing changed


def _copy_run(w, prompt: list[int], copies: list) -> tuple[list[int], float]:
    """Request A fills blocks 0-2; request B gets blocks 10, 11 (+12) computed by A's first 32 tokens,
    through kv_cache_block_copies in B's own step (copy-on-write), and only computes the rest."""
    w.execute_model(step([new("A", prompt, [0, 1, 2], len(prompt))]))
    sp = {"temperature": 0.0, "logprobs": 0}
    out = w.execute_model(step([new("B", prompt, [10, 11, 12], len(prompt) - 32, sp, computed=32)],
                               kv_cache_block_copies=copies)).to_wire()
    toks = tokens(out, "B")
    w.execute_model(step(finished_req_ids=["A", "B"], nst={}))
    return toks, out["logprobs"]["logprobs"][0][0]


def test_kv_cache_block_copies_apply_before_the_forward(make_worker, oracle_model) -> None:
    w = make_worker()
    prompt = prompts(w.vocab_size(), [40], seed=22)[0]
    model = oracle_model("builtin:tiny")
    want, want_lp = mlx_lm_greedy(model, prompt, 1)
    toks, lp = _copy_run(w, prompt, [[0, 10], {"src_block_id": 1, "dst_block_id": 11}])
    assert toks == want and abs(lp - want_lp[0]) < 1e-4
    # Negative control: the same step without the copies reads blocks 10, 11 as they were (other data).
    w.runner.pool.copy_blocks([(5, 10), (5, 11)])
    _, lp_without = _copy_run(w, prompt, [])
    assert abs(lp_without - want_lp[0]) > 1e-3
    with pytest.raises(ProtocolError, match="outside") as e:
        w.execute_model(step([new("C", [5, 6], [0], 2)], kv_cache_block_copies=[[0, w.runner.num_blocks]]))
    assert e.value.field == "kv_cache_block_copies[0][1]"
    assert "C" not in w.runner.requests


def _bitmask(vocab: int, allowed: list[int]) -> np.ndarray:
    words = np.zeros(-(-vocab // 32), np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


def test_two_phase_step_applies_the_grammar_bitmask_per_row(make_worker) -> None:
    w = make_worker()
    V = w.vocab_size()
    p1, p2 = prompts(V, [9, 11], seed=23)
    greedy = tokens(w.execute_model(step([new("g", p1, [0], 9)])), "g")[0]
    w.execute_model(step(finished_req_ids=["g"], nst={}))
    forced = (greedy + 7) % V  # not what greedy picks: only the mask can make it win
    with pytest.raises(StateError, match="no step is pending"):
        w.sample_tokens(None)
    assert w.execute_model(step([new("x", p1, [0], 9), new("y", p2, [1], 11)]), defer_sampling=True) is None
    with pytest.raises(StateError, match="sample_tokens first"):
        w.execute_model(decode(["x"], [9]))
    with pytest.raises(ProtocolError) as e:
        w.sample_tokens({"structured_output_request_ids": ["x"], "grammar_bitmask": b"\0" * 4})
    assert e.value.field == "grammar_output.grammar_bitmask"
    with pytest.raises(ProtocolError) as e:
        w.sample_tokens({"structured_output_request_ids": ["nope"], "grammar_bitmask": b""})
    assert e.value.field == "grammar_output.structured_output_request_ids[0]"
    mask = _bitmask(V, [forced]).tobytes()  # the rejections left the step pending
    out = w.sample_tokens({"structured_output_request_ids": ["x"], "grammar_bitmask": mask}).to_wire()
    assert tokens(out, "x") == [forced]
    y_alone = tokens(w.execute_model(step([new("y2", p2, [2], 11)])), "y2")
    assert tokens(out, "y") == y_alone  # the unconstrained row is untouched
    # JSON-style rows of uint32 words work too, and several tokens are allowed.
    allowed = [forced, (forced + 1) % V, 3]
    w.execute_model(decode(["x"], [9]), defer_sampling=True)
    out = w.sample_tokens({"structured_output_request_ids": ["x"],
                           "grammar_bitmask": [_bitmask(V, allowed).view(np.uint32).tolist()]})
    assert tokens(out, "x")[0] in allowed


@pytest.fixture(scope="module")
def server(home):
    """One server for the real-server tests here; each starts from init_device(reset=true), which
    any state allows."""
    with start_server(*SMALL) as s:
        yield s


def test_two_phase_step_over_a_real_server(server) -> None:
    r = RemoteWorker(server.url)
    r.call("init_device", config={"block_size": BS}, reset=True)
    r.load_model()
    r.initialize_cache(num_gpu_blocks=64)
    V = r.vocab_size()
    assert r.call("execute_model", scheduler_output=step([new("a", [5, 6, 7], [0], 3)]), defer_sampling=True) is None
    bm = _bitmask(V, [42]).tobytes()
    out = r.call("sample_tokens", grammar_output={"structured_output_request_ids": ["a"], "grammar_bitmask": bm})
    assert out["sampled_token_ids"] == [[42]]
    assert r.compile_or_warm_up_model() > 0  # v1 form unchanged
    times = r.call("compile_or_warm_up_model", compilation_times=True)
    assert times["language_model"] > 0 and times["encoder"] == 0.0
    with pytest.raises(RemoteError) as e:
        r.call("sample_tokens", grammar_output=None)
    assert e.value.status == 409
    # A restarted scheduler re-initialises the running worker from `ready` with reset=true
    # (without it, as v1: 409, nothing changes).
    with pytest.raises(RemoteError) as e:
        r.init_device({"block_size": 32})
    assert e.value.status == 409 and r.info()["state"] == "ready"
    r.call("init_device", config={"block_size": 32}, reset=True)
    assert r.info()["state"] == "device_ready"
    r.load_model()
    assert r.get_kv_cache_spec()["model.layers.0.self_attn"]["block_size"] == 32
    r.close()


def test_a_two_phase_step_samples_its_own_forward(make_worker) -> None:
    w = make_worker()
    p1 = prompts(w.vocab_size(), [9], seed=5)[0]
    plain = tokens(w.execute_model(step([new("p", p1, [0], 4)])), "p")
    w.execute_model(step(finished_req_ids=["p"], nst={}))
    assert w.execute_model(step([new("a", p1, [1], 4)]), defer_sampling=True) is None
    assert tokens(w.sample_tokens(None), "a") == plain


def test_two_phase_steps_mixed_with_plain_ones_keep_mlx_lms_tokens_over_a_real_server(server, oracle_model) -> None:
    # A two-phase step's forward is queued as its (empty) reply leaves, as the decode overlap is:
    # whichever way steps alternate, each samples the forward of its own tokens.
    prompt = prompts(200, [6], seed=11)[0]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 10)  # (one block of 16)
    r = RemoteWorker(server.url)
    r.call("init_device", config={"block_size": BS}, reset=True)
    r.load_model()
    r.initialize_cache(num_gpu_blocks=8)
    got = []
    for i in range(10):
        out = step([new("a", prompt, [0], 10)]) if i == 0 else decode(["a"], [len(prompt) + i - 1])
        if i % 3 == 1:  # a plain step now and then (it queues a decode ahead)
            got += tokens(r.call("execute_model", scheduler_output=out), "a")
            continue
        assert r.call("execute_model", scheduler_output=out, defer_sampling=True) is None
        got += tokens(r.call("sample_tokens", grammar_output=None), "a")
    r.close()
    assert got == want


def test_min_tokens_masks_eos_only_when_the_scheduler_says_so(make_worker) -> None:
    w = make_worker()
    eos = w.get_model()["eos_token_ids"][0]
    other = (eos + 5) % w.vocab_size()

    def first(sp: dict) -> int:
        sp = {"temperature": 0.0, "min_tokens": 2, "logit_bias": {str(eos): 100.0, str(other): 50.0}, **sp}
        t = tokens(w.execute_model(step([new("m", [5, 6, 7], [0], 3, sp)])), "m")[0]
        w.execute_model(step(finished_req_ids=["m"], nst={}))
        return t

    assert first({}) == other  # v1: eos is added to the stop ids
    assert first({"ignore_eos": True}) == eos  # vLLM's ignore_eos: eos is not a stop token
    assert first({"all_stop_token_ids": [other]}) == eos  # vLLM's complete stop set: used as sent
    assert first({"all_stop_token_ids": [other, eos]}) not in (eos, other)
    with pytest.raises(ProtocolError) as e:
        first({"ignore_eos": 1})
    assert e.value.field == "scheduled_new_reqs[0].sampling_params.ignore_eos"


def test_whole_prompt_logprobs_arrive_with_the_first_token(make_worker, oracle_model) -> None:
    w = make_worker()
    prompt = prompts(w.vocab_size(), [40], seed=24)[0]
    sp = {"temperature": 0.0, "prompt_logprobs": 2, "prompt_logprobs_whole": True}
    outs = [w.execute_model(step([new("p", prompt, [0, 1, 2], 16, sp)], nst={"p": 16})).to_wire()]
    cached = {"req_ids": ["p"], "new_token_ids": [], "new_block_ids": [None], "num_computed_tokens": [16]}
    outs.append(w.execute_model(step(cached=cached, nst={"p": 16})).to_wire())
    cached["num_computed_tokens"] = [32]
    outs.append(w.execute_model(step(cached=cached, nst={"p": 8})).to_wire())
    assert [o["prompt_logprobs_dict"] for o in outs[:2]] == [{}, {}]  # chunks: nothing yet
    assert tokens(outs[2], "p") != []
    plp = outs[2]["prompt_logprobs_dict"]["p"]
    assert set(plp) == {"logprob_token_ids", "logprobs", "selected_token_ranks"}
    logits = oracle_model("builtin:tiny")(mx.array([prompt]))[0].astype(mx.float32)
    ref = np.asarray(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert [r[0] for r in plp["logprob_token_ids"]] == prompt[1:]
    np.testing.assert_allclose([r[0] for r in plp["logprobs"]], [ref[i, prompt[i + 1]] for i in range(39)], atol=1e-4)
    ranks = [int((ref[i] >= ref[i, prompt[i + 1]]).sum()) for i in range(39)]
    assert plp["selected_token_ranks"] == ranks


def test_determine_available_memory_honours_vllm_settings(make_worker) -> None:
    w = make_worker(max_num_batched_tokens=64, max_num_seqs=4)  # a quick profile run
    assert w.determine_available_memory(kv_cache_memory_bytes=12345) == 12345
    full = w.determine_available_memory()
    assert w.determine_available_memory(gpu_memory_utilization=0.05) < full
    for kw, field in [({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
                      ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")]:
        with pytest.raises(ProtocolError) as e:
            w.determine_available_memory(**kw)
        assert e.value.field == field
