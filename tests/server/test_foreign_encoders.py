"""Other languages' msgpack clients against a real server (tests/server/foreign.py writes the same
values the way JS, Go, Rust, Java and C# encoders do): a whole lifecycle in each style gives the
same replies as Python's msgpack, greedy tokens equal to mlx-lm's; what is not a valid value (binary
for a string, a binary map key, a float for an int, an ext type, an int key outside logit_bias) is a
400 naming the field that changes nothing."""

from __future__ import annotations

import copy

import httpx
import msgpack

from tests.conftest import mlx_lm_greedy
from tests.server.foreign import STYLES, Style, pack

MP = "application/msgpack"
GREEDY = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
SAMPLED = [40, 41, 42, 43, 44]
STEPS = 5  # decode steps after the prefill
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 1234, "presence_penalty": 0.5,
            "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {7: 1.5, 9: -2.0}, "logprobs": 2,
            "prompt_logprobs": 1, "stop_token_ids": [2], "min_tokens": 2}
# What a client with optional fields sends for the ones it leaves unset.
NILS_REQ = {"lora_request": None, "prefill_token_ids": None}
NILS_SP = {"max_tokens": None, "bad_words_token_ids": None, "allowed_token_ids": None, "ignore_eos": None,
           "prompt_logprobs_whole": None}
NILS_SO = {"finished_req_ids": None, "preempted_req_ids": None, "kv_cache_block_copies": None,
           "scheduled_spec_decode_tokens": None}


def new_req(rid: str, prompt: list[int], sp: dict, block: int, nils: bool) -> dict:
    r = {"req_id": rid, "prompt_token_ids": prompt, "sampling_params": {**sp, **(NILS_SP if nils else {})},
         "block_ids": [[block]], "num_computed_tokens": 0}
    return {**r, **NILS_REQ} if nils else r


def steps(nils: bool) -> list[dict]:
    """The scheduler outputs of the run: a prefill of both requests, decode steps, the finish."""
    g = {"temperature": 0.0, "seed": None, "logprobs": 1} if nils else {"temperature": 0.0, "logprobs": 1}
    first = {"scheduled_new_reqs": [new_req("g", GREEDY, g, 1, nils), new_req("s", SAMPLED, SAMPLING, 2, nils)],
             "num_scheduled_tokens": {"g": len(GREEDY), "s": len(SAMPLED)},
             "total_num_scheduled_tokens": len(GREEDY) + len(SAMPLED), **(NILS_SO if nils else {})}
    if nils:
        first["scheduled_cached_reqs"] = None
    out = [first]
    for i in range(STEPS):
        cached = {"req_ids": ["g", "s"], "new_token_ids": [], "new_block_ids": [None, None],
                  "num_computed_tokens": [len(GREEDY) + i, len(SAMPLED) + i], "num_output_tokens": [i + 1, i + 1]}
        if nils:
            cached.update(resumed_req_ids=None, all_token_ids=None, new_token_ids=None)
        out.append({"scheduled_new_reqs": [], "scheduled_cached_reqs": cached, "num_scheduled_tokens": {"g": 1, "s": 1},
                    "total_num_scheduled_tokens": 2, **(NILS_SO if nils else {})})
    out.append({"scheduled_new_reqs": [], "num_scheduled_tokens": {}, "total_num_scheduled_tokens": 0,
                "finished_req_ids": ["g", "s"]})
    return out


def post(server, method: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{server.url}/rpc/{method}", content=body, headers={"content-type": MP}, timeout=60)


def run(server, style: Style) -> tuple[list, int]:
    """The lifecycle's calls in this style; the replies, and how many bodies differ from Python's
    msgpack bytes."""
    num_blocks = httpx.get(f"{server.url}/info").json()["num_blocks"]
    other = 0
    replies = []
    calls = [("initialize_cache", {"num_gpu_blocks": num_blocks, "num_cpu_blocks": 0}), ("check_health", {})]
    calls += [("execute_model", {"scheduler_output": so, **({"step_id": None} if style.nils else {})})
              for so in steps(style.nils)]
    for method, kwargs in calls:
        body = pack(kwargs, style)
        other += body != msgpack.packb(kwargs)
        r = post(server, method, body)
        assert r.status_code == 200, (style.name, method, r.content[:300])
        replies.append(msgpack.unpackb(r.content, strict_map_key=False)["result"])
    return replies, other


def test_every_encoders_lifecycle_gives_the_same_replies(shared_server, oracle_model) -> None:
    results = {}
    for style in STYLES:
        results[style.name], other = run(shared_server, style)
        if style.name == "python":
            assert other == 0
        else:
            assert other > 0, style  # (each style really writes other bytes)
    base = results["python"]
    for name, replies in results.items():
        assert replies == base, name
    toks = [r["sampled_token_ids"] for r in base[2:-1]]
    assert [t[0][0] for t in toks] == mlx_lm_greedy(oracle_model("builtin:tiny"), GREEDY, STEPS + 1)[0]
    sampled = [t[1][0] for t in toks]
    assert len(set(sampled)) > 1 and 2 not in sampled[:2], sampled  # sampled (min_tokens masks the stop id)
    assert base[2]["prompt_logprobs_dict"]["s"] is not None and base[2]["logprobs"] is not None


def test_what_is_not_a_valid_value_is_400_naming_the_field(shared_server) -> None:
    so = steps(False)[0]
    cases = []

    def case(field: str, words: str, edit) -> None:
        bad = copy.deepcopy(so)
        edit(bad)
        cases.append((field, words, msgpack.packb({"scheduler_output": bad}, use_bin_type=True)))

    case("scheduled_new_reqs[0].req_id", "got binary", lambda d: d["scheduled_new_reqs"][0].update(req_id=b"g"))
    case("scheduled_new_reqs[1].sampling_params", "map keys must be strings, got binary",
         lambda d: d["scheduled_new_reqs"][1]["sampling_params"].update({b"temperature": 0.5}))
    case("scheduled_new_reqs[0].num_computed_tokens", "got float 0.0",
         lambda d: d["scheduled_new_reqs"][0].update(num_computed_tokens=0.0))
    case("scheduled_new_reqs[0].prompt_token_ids[3]", "got float 10.0",
         lambda d: d["scheduled_new_reqs"][0]["prompt_token_ids"].__setitem__(3, 10.0))
    case("scheduled_new_reqs[1].sampling_params.seed", "timestamp ext",
         lambda d: d["scheduled_new_reqs"][1]["sampling_params"].update(seed=msgpack.Timestamp(1)))
    case("num_scheduled_tokens", "got integer 5", lambda d: d.update(num_scheduled_tokens={5: 10}))
    case("scheduled_new_reqs[1].sampling_params.stop_token_ids", "map keys must be strings, got null",
         lambda d: d["scheduled_new_reqs"][1]["sampling_params"].update(stop_token_ids={None: 1}))
    case("scheduled_new_reqs[1].sampling_params.logit_bias", "got boolean",
         lambda d: d["scheduled_new_reqs"][1]["sampling_params"].update(logit_bias={True: 1.0}))
    bodies = [(f, w, b) for f, w, b in cases] + [
        ("scheduled_new_reqs[0].sampling_params.temperature", "ext type 3",  # an application ext, hand-built
         msgpack.packb({"scheduler_output": so}).replace(msgpack.packb({"temperature": 0.0, "logprobs": 1}),
                                                         b"\x82\xabtemperature\xd4\x03\x00\xa8logprobs\x01"))]
    before = msgpack.unpackb(post(shared_server, "execute_model", msgpack.packb({"scheduler_output": steps(False)[-1]})).content)
    assert before["result"]["req_ids"] == []  # nothing is live
    for field, words, body in bodies:
        r = post(shared_server, "execute_model", body)
        assert r.status_code == 400, (field, r.content)
        e = msgpack.unpackb(r.content)["error"]
        assert words in e["message"] and e["field"] == field, (field, e)
    # nothing changed: no request was taken in (the same ids start afresh), the run matches mlx-lm
    r = post(shared_server, "execute_model", msgpack.packb({"scheduler_output": so}))
    assert r.status_code == 200 and msgpack.unpackb(r.content)["result"]["req_ids"] == ["g", "s"]
    assert post(shared_server, "execute_model", msgpack.packb({"scheduler_output": steps(False)[-1]})).status_code == 200
