"""Several KV cache groups as vLLM's hybrid allocator sends them: a sliding-window group whose
out-of-window blocks the scheduler frees (and reuses) while the request decodes on."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.errors import ProtocolError
from tests.conftest import mlx_lm_greedy
from tests.engine.test_architectures import BLOCK, served, tiny_dir

NUM_BLOCKS = 48


def _scribble(pool, block: int, rng: np.random.Generator) -> None:
    """What another request would leave in a reused block: anything (here: loud noise)."""
    sl = slice(block * BLOCK, (block + 1) * BLOCK)
    for arrays in (pool.keys, pool.values):
        for i, a in enumerate(arrays):
            if a is not None:
                noise = rng.standard_normal((*a.shape[:2], BLOCK, a.shape[3])).astype(np.float32)  # [1, H, slots, D]
                a[:, :, sl] = mx.array(noise * 30)
                arrays[i] = a
    mx.eval(pool.arrays())


def run_windowed(w, prompt: list[int], new: int, early: int = 0) -> tuple[list[int], int]:
    """One request, one block list per group; after every step the window group's blocks that
    left the window of the next query are freed (null block 0 on the scheduler's side, as vLLM),
    scribbled over and reused. `early` frees that many blocks too soon. Returns (tokens, peak
    window-group blocks held)."""
    groups = w.get_kv_cache_groups()
    win = next(i for i, g in enumerate(groups) if g["kv_cache_spec"]["type"] == "sliding_window")
    W = groups[win]["kv_cache_spec"]["sliding_window"]
    free = list(range(1, NUM_BLOCKS))  # block 0 is the null block
    tables: list[list[int]] = [[] for _ in groups]
    rng = np.random.default_rng(0)
    computed, out, peak = 0, [], 0
    while len(out) < new:
        end = computed + min(6, len(prompt) + len(out) - computed)
        added: list[list[int]] = [[] for _ in groups]
        for g, t in enumerate(tables):
            while len(t) * BLOCK < end:
                b = free.pop(0)
                t.append(b)
                added[g].append(b)
        cached = {"req_ids": [], "resumed_req_ids": [], "new_token_ids": [], "new_block_ids": [],
                  "num_computed_tokens": [], "num_output_tokens": []}
        new_reqs = []
        if computed == 0:
            new_reqs = [{"req_id": "r", "prompt_token_ids": prompt, "sampling_params": {"temperature": 0.0},
                         "block_ids": [list(t) for t in tables], "num_computed_tokens": 0, "lora_request": None}]
        else:
            cached = {"req_ids": ["r"], "resumed_req_ids": [], "new_token_ids": [[]], "new_block_ids": [added],
                      "num_computed_tokens": [computed], "num_output_tokens": [len(out)]}
        res = w.execute_model({"scheduled_new_reqs": new_reqs, "scheduled_cached_reqs": cached,
                               "num_scheduled_tokens": {"r": end - computed},
                               "total_num_scheduled_tokens": end - computed, "finished_req_ids": []}).to_wire()
        computed = end
        out += res["sampled_token_ids"][0]
        for j, b in enumerate(tables[win]):
            if b and (j + 1 - early) * BLOCK <= computed - W + 1:
                tables[win][j] = 0
                free.append(b)
                _scribble(w.runner.pool, b, rng)
        peak = max(peak, sum(1 for b in tables[win] if b))
    return out, peak


def test_window_group_decodes_past_twice_its_window_on_window_sized_memory(home: str, oracle_model) -> None:
    w = served(home, "gemma3_text", num_blocks=NUM_BLOCKS)
    groups = w.get_kv_cache_groups()
    assert [g["kv_cache_spec"]["type"] for g in groups] == ["sliding_window", "full_attention"]
    w.initialize_from_config({"num_blocks": NUM_BLOCKS, "kv_cache_groups": groups})
    prompt = list(range(20, 30))
    new = 20  # context 30 > 2 x window 8
    want = mlx_lm_greedy(oracle_model(str(tiny_dir(home, "gemma3_text"))), prompt, new)[0]
    got, peak = run_windowed(w, prompt, new)
    assert got == want
    assert peak <= 8 // BLOCK + 2  # the window's blocks plus the partial ones, not the context's 8

    # Negative control: a block freed while still inside the window IS read, and its reuse shows.
    w.initialize_from_config({"num_blocks": NUM_BLOCKS, "kv_cache_groups": groups})
    bad, _ = run_windowed(w, prompt, new, early=1)
    assert bad != want


def test_group_lists_are_validated(home: str) -> None:
    w = served(home, "gemma3_text", num_blocks=NUM_BLOCKS)
    step = {"scheduled_new_reqs": [{"req_id": "r", "prompt_token_ids": [5, 6, 7], "sampling_params": {},
                                    "block_ids": [[1], [2], [3]], "num_computed_tokens": 0}],
            "num_scheduled_tokens": {"r": 3}, "total_num_scheduled_tokens": 3}
    with pytest.raises(ProtocolError, match="1 \\(shared by all groups\\) or 2") as e:
        w.execute_model(step)
    assert e.value.field == "scheduled_new_reqs[0].block_ids"
    step["scheduled_new_reqs"][0]["block_ids"] = [[1], [NUM_BLOCKS]]
    with pytest.raises(ProtocolError) as e:
        w.execute_model(step)
    assert e.value.field == "scheduled_new_reqs[0].block_ids[1][0]"
    assert not w.runner.requests
    groups = w.get_kv_cache_groups()
    mixed = [{"layer_names": groups[0]["layer_names"] + ["model.layers.9.self_attn"]}]
    with pytest.raises(ProtocolError, match="unknown layer") as e:
        w.initialize_from_config({"num_blocks": NUM_BLOCKS, "kv_cache_groups": mixed})


def _view():
    """Two attention layers (a window and full) and a recurrent state, grouped by kind."""
    from types import SimpleNamespace

    from sidecar.kv.spec import STATE, LayerSpec

    specs = [LayerSpec(BLOCK, 1, 8, 8, "float32", 4, name="w"), LayerSpec(BLOCK, 1, 8, 8, "float32", name="f"),
             LayerSpec(BLOCK, 0, 0, 0, "float32", kind=STATE, state_shapes=((2,),), state_dtypes=("float32",),
                       name="s")]
    return SimpleNamespace(specs=specs, groups=[[0], [1], [2]])


def _group(*names, block_size=BLOCK) -> dict:
    return {"layer_names": list(names), "kv_cache_spec": {"block_size": block_size}}


@pytest.mark.parametrize("groups, field", [
    ([_group("w", "f"), _group("nope")], "c.kv_cache_groups[1].layer_names[0]"),
    ([_group("w", "f"), {"layer_names": [3]}], "c.kv_cache_groups[1].layer_names[0]"),
    ([_group("w", "f"), "s"], "c.kv_cache_groups[1]"),
    ([_group("w", "f"), _group()], "c.kv_cache_groups[1].layer_names"),
    ([_group("w", "f", "s")], "c.kv_cache_groups[0].layer_names"),  # state and attention mixed
    ([_group("w", "f", block_size=2 * BLOCK), _group("s")], "c.kv_cache_groups[0].kv_cache_spec.block_size"),
    ([_group("w", "f")], "c.kv_cache_groups"),  # "s" in no group
])
def test_scheduler_groups_name_the_offending_field(groups: list, field: str) -> None:
    from sidecar.worker.kv_groups import scheduler_groups

    with pytest.raises(ProtocolError) as e:
        scheduler_groups(_view(), groups, "c", BLOCK)
    assert e.value.field == field, e.value.message


def test_scheduler_groups_accepts_regroupings_unless_only_its_own() -> None:
    from sidecar.worker.kv_groups import scheduler_groups

    view = _view()
    assert scheduler_groups(view, [], "c", BLOCK) == view.groups
    # All attention layers in one group; a state group's block size is not ours to check.
    shared = [_group("f", "w"), _group("s", block_size=7 * BLOCK)]
    assert scheduler_groups(view, shared, "c", BLOCK) == [[1, 0], [2]]
    with pytest.raises(ProtocolError, match="only ours") as e:
        scheduler_groups(view, shared, "c", BLOCK, only_own="only ours")
    assert e.value.field == "c.kv_cache_groups"
    own = [_group("s"), _group("f"), _group("w")]  # the worker's groups, in another order
    assert scheduler_groups(view, own, "c", BLOCK, only_own="only ours") == [[2], [1], [0]]
