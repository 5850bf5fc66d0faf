"""The reference scheduler's side of the disk KV tier, against a fake store: lookups after the
in-memory hit, the step's load and save maps, and the rewind on invalid_block_ids."""

from __future__ import annotations

from sidecar.scheduler import Request, Scheduler
from sidecar.scheduler.kv_store import full_block_hashes

BS = 4


def test_loads_saves_and_a_failed_load_rewinds():
    held: set[bytes] = set()
    asked: list[list[bytes]] = []

    def lookup(hashes: list[bytes]) -> int:
        asked.append(list(hashes))
        n = 0
        while n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks before the last token
    held.update(full_block_hashes(Request("x", prompt, {}, 1), 3, BS))  # the store has blocks 0..2
    s = Scheduler(num_blocks=32, block_size=BS, max_num_batched_tokens=64, kv_store_lookup=lookup)
    s.add_request(Request("a", prompt, {"temperature": 0}, max_tokens=3, ignore_eos=True))
    out = s.schedule()
    assert len(asked[0]) == 4  # blocks 0..3: full blocks before the last known token ((18 - 1) // 4)
    new = out["scheduled_new_reqs"][0]
    assert new["num_computed_tokens"] == 12 and out["num_scheduled_tokens"] == {"a": 6}
    table = new["block_ids"][0]
    assert out["kv_store_load"] == {"a": {"block_hashes": sorted(held, key=asked[0].index), "block_ids": table[:3]}}
    assert out["kv_store_save"]["a"]["block_ids"] == table[3:4]  # block 3 fills in this step (positions 12..15)
    # The worker reports block 1's load failed: the request rewinds to position 4, its output is dropped.
    reply = {"req_ids": ["a"], "req_id_to_index": {"a": 0}, "sampled_token_ids": [[7]],
             "kv_connector_output": {"invalid_block_ids": [table[1]]}}
    assert s.update_from_output(out, reply) == []
    req = s.requests["a"]
    assert req.num_computed_tokens == 4 and req.output_token_ids == []
    out2 = s.schedule()
    assert out2["scheduled_cached_reqs"]["num_computed_tokens"] == [4] and out2["num_scheduled_tokens"] == {"a": 14}
    assert "a" not in out2["kv_store_load"]
    assert out2["kv_store_save"]["a"]["block_ids"] == table[1:4]  # blocks 1..3 full after it (4..15)


def test_without_a_lookup_nothing_changes():
    s = Scheduler(num_blocks=8, block_size=BS)
    s.add_request(Request("a", [1, 2, 3, 4, 5], {"temperature": 0}, max_tokens=1))
    assert "kv_store_load" not in s.schedule()
