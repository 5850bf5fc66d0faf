"""Images through the worker against mlx-vlm's own generate on builtin:tiny-qwen2-vl,
builtin:tiny-qwen2.5-vl, builtin:tiny-qwen3-vl and builtin:tiny-qwen3-vl-moe (fp32, greedy;
Qwen2.5-VL's tower attends in windows of 2x2 merged tokens, Qwen3-VL's adds deepstack features in
the first decoder layers):
chunked prefill splitting the image, batching with text, prefix caching after the image,
preemption, the encoder cache's accounting, and bad inputs (4xx naming the field, nothing changes)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from sidecar.errors import ProtocolError
from sidecar.models import resolve_model
from tests.vision import (GLM4V, GLM4V_MOE, MODEL, PADDLE, QWEN3, QWEN3_MOE, QWEN25, MMDriver, feature, fresh, image, new_step, oracle,
                          prepare, tok)

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out

N = 8


@pytest.fixture(scope="module", params=[MODEL, QWEN25, QWEN3, QWEN3_MOE, GLM4V, GLM4V_MOE, PADDLE])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def path(home, model):
    return resolve_model(model, home)


@pytest.fixture(scope="module")
def worker(make_worker, model):
    return make_worker(model, num_blocks=96)


@pytest.fixture(scope="module")
def sea(path):
    ids, data = prepare(path, "Describe the sea.", image(0))
    return ids, data, oracle(path, "Describe the sea.", image(0), N)


@pytest.mark.parametrize("split", [False, True])
def test_greedy_tokens_equal_mlx_vlm_generate(worker, sea, split):
    """`split`: chunks that cut the image's placeholder positions (Qwen2-VL's 12 over three chunks of 7)."""
    ids, data, want = sea
    off, n = ids.index(tok(worker)), ids.count(tok(worker))
    chunk = next(c for c in (7, 5, 4, 3) if off % c + n > c) if split else 64  # the split really happens
    d = fresh(worker)
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))])
    assert d.run(N, chunk=chunk)["a"] == want
    assert worker.runner.mm.stats.runs >= 1


def test_the_image_and_the_positions_matter(worker, path, sea):
    """Negative controls: another image changes the tokens; plain 1-D positions change the logits."""
    ids, data, want = sea
    other_ids, other, _ = (*prepare(path, "Describe the sea.", image(5)), None)
    assert other_ids == ids
    d = fresh(worker)
    d.add_mm("b", ids, [feature(ids, other, "other", tok(worker))])
    got = d.run(N)["b"]
    assert got == oracle(path, "Describe the sea.", image(5), N) and got != want
    req_positions = worker.runner.mm.requests["b"].positions
    assert (req_positions != np.arange(len(ids))).any()  # M-RoPE is not the identity on this prompt


def test_batched_with_text_and_a_repeated_image_shares_one_encoder_run(worker, sea):
    ids, data, want = sea
    d = fresh(worker)
    before = copy.copy(worker.runner.mm.stats)
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))])
    d.add("text", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    d.add_mm("b", ids, [feature(ids, data, "sea", tok(worker))])
    out = d.run(N, chunk=7)
    assert out["a"] == want and out["b"] == want
    s = worker.runner.mm.stats
    assert s.runs - before.runs == 1 and s.hits - before.hits == 1 and s.misses - before.misses == 1
    # the text request alone gives the same tokens (batching changes nothing)
    d2 = fresh(worker)
    d2.add("text", [5, 6, 7, 8, 9, 10, 11, 12, 13])
    assert d2.run(N)["text"] == out["text"]


def test_two_images_in_one_batch_each_give_their_own_tokens(worker, path, sea):
    """Two requests with different images (of different sizes) prefilled in the same step: each
    row takes its own encoder rows (and, on Qwen3-VL, its own deepstack rows)."""
    ids, data, want = sea
    text = "Describe the sea."
    other_ids, other = prepare(path, text, image(5, (120, 64)))
    assert other_ids != ids  # another grid: another placeholder length
    d = fresh(worker)
    d.add_mm("b", other_ids, [feature(other_ids, other, "other", tok(worker))])
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))])
    out = d.run(N, chunk=64)
    assert out["a"] == want and out["b"] == oracle(path, text, image(5, (120, 64)), N)


def test_prefix_cached_after_the_image(worker, path):
    """A second request reusing the first's whole blocks of the prompt (the image first, inside
    them) computes only the tail: no encoder run, the same tokens; its item comes without pixels."""
    text = "Describe the sea, then the sky."
    ids, data = prepare(path, text, image(0), image_first=True)
    want = oracle(path, text, image(0), N, image_first=True)
    d = fresh(worker)
    a = d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))])
    assert d.run(N)["a"] == want
    bs = worker.config.block_size
    hit = (len(ids) - 1) // bs * bs
    assert hit > ids.index(tok(worker)) + ids.count(tok(worker))  # the image is inside the cached prefix
    shared = a.blocks[: hit // bs]
    stripped = feature(ids, data, "sea", tok(worker))
    del stripped["data"]["pixel_values"]  # as vLLM strips a covered item (an M-RoPE model keeps the grid)
    d.add_mm("b", ids, [stripped], blocks=shared + d.alloc(4), computed=hit)
    runs = worker.runner.mm.stats.runs
    assert d.run(N)["b"] == want
    assert worker.runner.mm.stats.runs == runs


def test_preempted_and_recomputed_after_its_encoder_output_was_freed(worker, sea):
    ids, data, want = sea
    d = fresh(worker)
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(worker))])
    d.add("text", [5, 6, 7, 8, 9])
    for _ in range(4):
        d.step(chunk=16)
    assert 0 < len(d.reqs["a"].out) < N
    d.preempt("a")
    d.free_encoder("sea")
    runs, evictions = worker.runner.mm.stats.runs, worker.runner.mm.stats.evictions
    assert d.run(N, chunk=16)["a"] == want
    assert worker.runner.mm.stats.runs == runs + 1 and worker.runner.mm.stats.evictions == evictions + 1


@pytest.mark.parametrize("change, field", [
    (lambda f: f["data"]["pixel_values"].update(dtype="int32"), "pixel_values"),
    (lambda f: f["data"]["pixel_values"].update(data=b"\0" * 8), "pixel_values.data"),
    (lambda f: f["data"]["pixel_values"].update(shape=[47, 1176], data=b"\0" * 47 * 1176 * 4), "pixel_values"),
    (lambda f: f["data"]["image_grid_thw"].update(data=np.array([1, 6, 10], np.int64).tobytes()), "pixel_values"),
    (lambda f: f["data"]["image_grid_thw"].update(data=np.array([1, 6, 7], np.int64).tobytes()), "image_grid_thw"),
    (lambda f: f["mm_position"].update(length=11), "mm_position"),
    (lambda f: f["mm_position"].update(is_embed=[True] * 11), "is_embed"),
    (lambda f: f["mm_position"].update(offset=30), "mm_position"),
    (lambda f: f["mm_position"].update(offset=5), "mm_position"),
    (lambda f: f.update(modality="audio"), "modality"),
    (lambda f: f.pop("data"), "data"),
])
def test_bad_items_are_refused_naming_the_field_and_change_nothing(worker, sea, change, field):
    ids, data, _ = sea
    d = fresh(worker)
    d.add("keep", [5, 6, 7, 8])
    d.step()
    feat = feature(ids, data, "bad", tok(worker))
    change(feat)
    before = (set(worker.runner.requests), set(worker.runner.mm.cache), set(worker.runner.mm.requests))
    with pytest.raises(ProtocolError) as e:
        worker.execute_model(new_step(worker, ids, feat))
    assert field in e.value.field and e.value.field.startswith("scheduled_new_reqs[0].mm_features[0]")
    assert (set(worker.runner.requests), set(worker.runner.mm.cache), set(worker.runner.mm.requests)) == before
    assert d.run(3)["keep"]  # the other request goes on


def test_scheduled_items_must_exist(worker, sea):
    ids, data, _ = sea
    fresh(worker)
    feat = feature(ids, data, "s", tok(worker))
    for sched, field in [({"x": [1]}, "scheduled_encoder_inputs.x[0]"), ({"nobody": [0]}, "scheduled_encoder_inputs.nobody")]:
        with pytest.raises(ProtocolError) as e:
            worker.execute_model(new_step(worker, ids, feat, sched))
        assert e.value.field == field
        assert not worker.runner.requests
    # never scheduled: the placeholder has no encoder output to take
    with pytest.raises(ProtocolError) as e:
        worker.execute_model(new_step(worker, ids, feat, {}))
    assert e.value.field == "scheduled_encoder_inputs" and not worker.runner.requests


def _mm_state(worker) -> tuple:
    r = worker.runner
    return ({rid: (s.num_computed_tokens, tuple(s.output_token_ids)) for rid, s in r.requests.items()},
            dict(r.mm.cache), dict(r.mm.requests), r.mm.stats.runs)


def test_a_prompt_token_out_of_range_is_refused_before_its_positions_are_computed(worker, sea):
    """The planner checks the prompt first: mlx-vlm's position code never sees the id."""
    ids, data, _ = sea
    fresh(worker)
    for bad in (2**31, -1, worker.runner.vocab_size):
        prompt = [*ids[:-1], bad]
        with pytest.raises(ProtocolError) as e:
            worker.execute_model(new_step(worker, prompt, feature(prompt, data, "s", tok(worker))))
        assert e.value.field.startswith("scheduled_new_reqs[0].prompt_token_ids") and not worker.runner.requests


def test_an_output_no_chunk_may_take_is_refused_before_the_encoder_runs(worker, sea, path):
    """b's chunk reaches its image, which is neither cached nor scheduled; a's is scheduled."""
    ids, data, _ = sea
    ids_b, data_b = prepare(path, "Another picture.", image(1))
    d = fresh(worker)
    d.add_mm("a", ids, [feature(ids, data, "ia", tok(worker))])
    d.add_mm("b", ids_b, [feature(ids_b, data_b, "ib", tok(worker))])
    so = d.build(chunk=64)
    so["scheduled_encoder_inputs"] = {"a": [0]}
    before = _mm_state(worker)
    with pytest.raises(ProtocolError) as e:
        worker.execute_model(so)
    assert e.value.field == "scheduled_encoder_inputs" and "'b'" in e.value.message
    assert _mm_state(worker) == before  # no request, no output, no encoder run


def test_a_step_failing_after_its_encoder_run_leaves_the_image_state_as_it_was(worker, sea, monkeypatch):
    ids, data, want = sea
    d = fresh(worker)
    d.add("keep", [5, 6, 7, 8])
    d.step()
    d.add_mm("a", ids, [feature(ids, data, "ia", tok(worker))])
    so = d.build(chunk=64)
    before = _mm_state(worker)
    with monkeypatch.context() as m:
        m.setattr(type(worker.runner), "_logits", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
        with pytest.raises(RuntimeError, match="injected"):
            worker.execute_model(so)
    after = _mm_state(worker)
    assert after[:3] == before[:3] and after[3] == before[3] + 1  # the encoder ran; nothing of it stayed
    d.commit(so, worker.execute_model(so).to_wire())  # the same step, now whole
    assert d.run(N)["a"] == want


def test_corrupted_image_steps_are_accepted_or_refused_naming_a_field_and_change_nothing(worker, path):
    """Random corruptions (tests/engine/test_fuzz.py's) of steps bringing two images and text,
    in chunks that split the images: each one runs, or is a 400 naming a field with nothing changed."""
    import random

    from tests.engine.test_fuzz import _mutate

    rng = random.Random(7)
    items = [prepare(path, f"Picture {k}.", image(k)) for k in range(2)]

    def new_driver() -> MMDriver:
        d = fresh(worker)
        for k, (ids, data) in enumerate(items):
            d.add_mm(f"i{k}", ids, [feature(ids, data, f"h{k}", tok(worker))])
        d.add("t", [5, 6, 7, 8, 9])
        return d

    d, accepted, refused = new_driver(), 0, 0
    for it in range(160):
        if it % 8 == 0:
            d = new_driver()
        so = d.build(chunk=rng.choice([5, 7, 16, 64]))
        bad = _mutate(_mutate(so, rng), rng) if rng.random() < 0.3 else _mutate(so, rng)
        before = _mm_state(worker)
        try:
            worker.execute_model(bad)
        except ProtocolError as e:
            assert e.status == 400 and e.field and _mm_state(worker) == before, (e.field, e.message)
            refused += 1
            d.commit(so, worker.execute_model(so).to_wire())
            continue
        accepted += 1  # (an ignored field, or another valid value)
        d = new_driver()
    assert refused > 100 and accepted > 0


def test_a_text_model_refuses_images_by_name(make_worker, sea):
    ids, data, _ = sea
    w = make_worker("builtin:tiny", num_blocks=96)
    feat = feature([7] * 12, data, "s", 7)
    with pytest.raises(ProtocolError) as e:
        w.execute_model(new_step(w, [7] * 12, feat))
    assert e.value.field == "scheduled_new_reqs[0].mm_features" and "llama" in str(e.value)


def test_sleep_level_2_and_wake_up_serve_images_again(make_worker, model, sea):
    ids, data, want = sea
    w = make_worker(model, num_blocks=96)
    d = MMDriver(w.execute_model, w.config.block_size, 96)
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(w))])
    assert d.run(2)["a"] == want[:2]
    w.sleep(level=2)
    assert w.runner.mm.model is None and not w.runner.mm.cache  # no reference to the weights left
    w.wake_up()
    d = MMDriver(w.execute_model, w.config.block_size, 96)
    d.add_mm("b", ids, [feature(ids, data, "sea", tok(w))])
    assert d.run(N)["b"] == want


def test_a_chunk_of_only_non_embedding_placeholder_positions_needs_no_encoder_output(worker, sea):
    """A placeholder can start with positions that take no embedding (Idefics3's row and column
    tokens): vLLM schedules the item's encoder input only with the first chunk that reaches an
    embedding, so a chunk of only those positions runs before the item is encoded."""
    ids, data, want = sea
    off = ids.index(tok(worker))
    feat = feature(ids, data, "lead", tok(worker))
    n = feat["mm_position"]["length"]
    feat["mm_position"].update(offset=off - 3, length=n + 3, is_embed=[False] * 3 + [True] * n)
    d = fresh(worker)
    d.add_mm("a", ids, [feat])
    so = d.build(chunk=off)  # [0, off): the placeholder's three leading positions, none an embedding
    assert so["scheduled_encoder_inputs"] == {}
    d.commit(so, worker.execute_model(so).to_wire())
    assert d.run(N, chunk=off)["a"] == want


def test_encoder_outputs_past_the_bound_are_refused_until_some_are_freed(make_worker, model, path, sea):
    """A scheduler that never frees cannot grow the encoder cache past --max-encoder-cache-bytes:
    the step is a 400 naming scheduled_encoder_inputs and changes nothing; freeing makes room."""
    ids, data, _ = sea
    one = make_worker(model, num_blocks=96).runner.mm.model.encode(data).nbytes
    w = make_worker(model, num_blocks=96, max_encoder_cache_bytes=one * 3 // 2)
    d = fresh(w)
    d.add_mm("a", ids, [feature(ids, data, "sea", tok(w))])
    d.step(chunk=64)
    assert set(w.runner.mm.cache) == {"sea"}
    other_ids, other = prepare(path, "Describe the sea.", image(5))
    step = new_step(w, other_ids, feature(other_ids, other, "other", tok(w)), rid="b")
    before = (dict(w.runner.mm.cache), dict(w.runner.mm.requests), set(w.runner.requests))
    with pytest.raises(ProtocolError) as e:
        w.execute_model(step)
    assert e.value.field == "scheduled_encoder_inputs" and "--max-encoder-cache-bytes" in e.value.message
    assert (dict(w.runner.mm.cache), dict(w.runner.mm.requests), set(w.runner.requests)) == before
    out = w.execute_model({**step, "free_encoder_mm_hashes": ["sea"]}).to_wire()
    assert set(w.runner.mm.cache) == {"other"} and out["req_ids"] == ["b"]
