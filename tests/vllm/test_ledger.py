"""The ledger the worker class keeps of the sidecar's state, and the refill steps it turns into
after a restart (sidecar/vllm/ledger.py): plain data, no servers. That the refilled KV gives the
right tokens is tests/vllm/test_recovery.py's (real vLLM, real sidecars)."""

from __future__ import annotations

from sidecar.vllm.ledger import REFILL_PREFIX, Ledger, refill_items, refill_steps

BS = 4
GREEDY = {"temperature": 0.0}


def new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0) -> dict:
    return {"req_id": rid, "prompt_token_ids": prompt, "sampling_params": GREEDY, "block_ids": [blocks],
            "num_computed_tokens": computed, "lora_request": None}


def step(new_reqs=(), cached=None, sched=None, finished=(), preempted=()) -> dict:
    return {"scheduled_new_reqs": list(new_reqs), "scheduled_cached_reqs": cached or {"req_ids": []},
            "num_scheduled_tokens": sched or {}, "finished_req_ids": list(finished),
            "preempted_req_ids": list(preempted)}


def decode(rids: list[str], computed: list[int], new_blocks=None) -> dict:
    return {"req_ids": rids, "resumed_req_ids": [], "new_token_ids": [[] for _ in rids],
            "new_block_ids": new_blocks or [None] * len(rids), "num_computed_tokens": computed,
            "num_output_tokens": [0] * len(rids), "all_token_ids": {}}


def out(sampled: dict[str, list[int]]) -> dict:
    return {"req_ids": list(sampled), "sampled_token_ids": list(sampled.values())}


def run(ledger: Ledger) -> None:
    # a: 10-token prompt in chunks of 6 + 4, then two decodes; b: hits a's first two blocks.
    a = list(range(10, 20))
    ledger.apply(step([new("a", a, [0, 1, 2])], sched={"a": 6}), out({"a": []}))
    ledger.apply(step(cached=decode(["a"], [6]), sched={"a": 4}), out({"a": [100]}))
    ledger.apply(step(cached=decode(["a"], [10]), sched={"a": 1}), out({"a": [101]}))
    ledger.apply(step([new("b", a[:8] + [7, 7], [0, 1, 3], computed=8)], sched={"b": 2}), out({"b": [200]}))
    # c finishes: its full blocks stay in the prefix cache; d is preempted.
    ledger.apply(step([new("c", list(range(30, 39)), [4, 5, 6]), new("d", [1, 2, 3], [7])], sched={"c": 9, "d": 3}),
                 out({"c": [300], "d": [400]}))
    ledger.apply(step(finished=["c"], preempted=["d"]), out({}))


def test_the_ledger_follows_tokens_tables_and_computed_counts() -> None:
    ledger = Ledger(BS)
    run(ledger)
    a, b = ledger.live["a"], ledger.live["b"]
    assert a.tokens == list(range(10, 20)) + [100, 101] and a.computed == 11
    assert b.tokens[-1] == 200 and b.computed == 10
    assert set(ledger.parked) == {"d"} and "c" not in ledger.live
    assert ledger.owner[0] is a and ledger.owner[3] is b and ledger.owner[4].req_id == "c"
    assert [(r.req_id, n) for r, n in ledger.chains()] == [("c", 8), ("d", 0)][:1]  # d has no full block


def test_refill_writes_every_block_without_sampling_within_the_budget() -> None:
    ledger = Ledger(BS)
    run(ledger)
    items = refill_items(ledger, prefix_cache=True, loras=set())
    assert [it.req_id for it in items] == [f"{REFILL_PREFIX}0", "a", "b"]
    assert [it.done for it in items] == [0, 0, 8]  # b's first 8 tokens are a's blocks, refilled by a
    plan = list(refill_steps(items, BS, budget=5, max_seqs=2))
    written: dict[str, int] = {}
    for s in plan:
        assert s["total_num_scheduled_tokens"] == sum(s["num_scheduled_tokens"].values()) <= 5
        assert len(s["num_scheduled_tokens"]) <= 2
        for nr in s["scheduled_new_reqs"]:
            end = nr["num_computed_tokens"] + s["num_scheduled_tokens"][nr["req_id"]]
            assert end < len(nr["prefill_token_ids"])  # stops before the last known token: nothing sampled
            written[nr["req_id"]] = end
        for rid, start in zip(s["scheduled_cached_reqs"]["req_ids"], s["scheduled_cached_reqs"]["num_computed_tokens"]):
            assert written[rid] == start
            written[rid] = start + s["num_scheduled_tokens"][rid]
    assert written == {f"{REFILL_PREFIX}0": 8, "a": 11, "b": 10}
    # b reads a's blocks: it starts only once a is done; the fake chain request is finished.
    first_b = next(i for i, s in enumerate(plan) if "b" in s["num_scheduled_tokens"])
    last_a = max(i for i, s in enumerate(plan) if "a" in s["num_scheduled_tokens"])
    assert first_b > last_a
    assert any(f"{REFILL_PREFIX}0" in s["finished_req_ids"] for s in plan)


def test_without_prefix_caching_only_live_requests_are_refilled() -> None:
    ledger = Ledger(BS)
    run(ledger)
    assert [it.req_id for it in refill_items(ledger, prefix_cache=False, loras=set())] == ["a", "b"]


def test_a_block_written_again_ends_with_its_last_writers_content() -> None:
    ledger = Ledger(BS)
    ledger.apply(step([new("x", list(range(8)) + [9], [0, 1, 2])], sched={"x": 9}), out({"x": [5]}))
    ledger.apply(step(finished=["x"]), out({}))
    ledger.apply(step([new("y", list(range(50, 59)), [1, 3, 4])], sched={"y": 9}), out({"y": [6]}))
    ledger.apply(step(finished=["y"]), out({}))
    chains = [(r.req_id, n) for r, n in ledger.chains()]
    assert chains == [("x", 4), ("y", 8)]  # x keeps block 0 only (block 1 is y's now), y refills last


IMG = 77  # the image placeholder token


def image(ident: str, offset: int, length: int, pixels: bool = True) -> dict:
    grid = {"dtype": "int64", "shape": [1, 3], "data": b"\0" * 24}
    data = {"pixel_values": {"dtype": "float32", "shape": [4, 2], "data": ident.encode() * 8}} if pixels else {}
    return {"modality": "image", "identifier": ident, "mm_hash": ident,
            "mm_position": {"offset": offset, "length": length, "is_embed": None}, "data": {**data, "image_grid_thw": grid}}


def test_images_go_with_their_requests_into_the_refill() -> None:
    """vLLM sends an image's tensors once: the ledger keeps them by identifier while a request that
    may be refilled holds it, the refill registers each request's items (tensors for the positions
    still to compute, the grid alone before), encodes them in the item's first step, and frees
    those no live request computes past the refill."""
    ledger = Ledger(BS)
    p = [1, 2] + [IMG] * 4 + [3, 4, 5, 6]  # the image at [2, 6)
    # c: the image, finished (its blocks stay in the prefix cache); a: the same image (sent without
    # its tensors), a 6-token prefix hit on c's blocks, then a chunk that stops inside a second image.
    ledger.apply(step([{**new("c", p, [0, 1, 2]), "mm_features": [image("img1", 2, 4)]}], sched={"c": 10}),
                 out({"c": [9]}))
    ledger.apply(step(finished=["c"]), out({}))
    q = p[:8] + [IMG] * 4 + [8]  # a second image at [8, 12)
    ledger.apply(step([{**new("a", q, [0, 1, 3, 4], computed=8), "mm_features": [image("img1", 2, 4, pixels=False),
                                                                               image("img2", 8, 4)]}], sched={"a": 2}),
                 out({"a": []}))
    assert sorted(ledger.tensors) == ["img1", "img2"]
    assert all("pixel_values" not in (f["data"] or {}) for r in ledger.live.values() for f in r.mm_features)
    items = refill_items(ledger, prefix_cache=True, loras=set())
    assert [(it.req_id, it.done, it.total) for it in items] == [(f"{REFILL_PREFIX}0", 0, 8), ("a", 8, 10)]
    chain, a = items
    assert [f["identifier"] for f in chain.mm_features] == ["img1"] and chain.images() == [0]
    assert chain.mm_features[0]["data"]["pixel_values"]["data"] == b"img1" * 8
    assert "pixel_values" not in a.mm_features[0]["data"]  # before its hit: the grid alone
    assert a.mm_features[1]["data"]["pixel_values"]["data"] == b"img2" * 8 and a.images() == [1]
    plan = list(refill_steps(items, BS, budget=16, max_seqs=4))
    first = {nr["req_id"]: (i, nr) for i, s in enumerate(plan) for nr in s["scheduled_new_reqs"]}
    for rid, (i, nr) in first.items():
        assert plan[i]["scheduled_encoder_inputs"][rid] == [j for j, f in enumerate(nr["mm_features"])
                                                            if f["identifier"] in {"img1", "img2"} and
                                                            (rid != "a" or f["identifier"] == "img2")]
    # img2 is still needed (a computes past the refill into it); img1 is not: freed at the end.
    assert plan[-1]["free_encoder_mm_hashes"] == ["img1"] and not plan[-1]["num_scheduled_tokens"]
    # Once nothing that may be refilled holds an image, its tensors go.
    ledger.apply(step(finished=["a"]), out({}))
    ledger.apply(step([new("z", list(range(40, 56)), [0, 1, 3, 4])], sched={"z": 16}), out({"z": [1]}))
    ledger.apply(step(finished=["z"]), out({}))
    assert sorted(ledger.tensors) == ["img1"]  # z wrote over a's blocks, not over c's block 2
    ledger.apply(step([new("y", list(range(60, 64)), [2])], sched={"y": 4}), out({"y": [1]}))
    ledger.apply(step(finished=["y"]), out({}))
    assert ledger.tensors == {}
