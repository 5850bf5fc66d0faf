"""The reference scheduler with images: mlx-vlm's processor on the scheduler side, the encoder
schedule (one run per image identifier, frees past the bound), prefix-cache hashes that include the
images, and `mlx-sidecar generate --image` against a real server; tokens equal mlx-vlm's generate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.models import resolve_model
from sidecar.scheduler.images import EncoderSchedule, sent, spans
from sidecar.scheduler.scheduler import Request, Scheduler, run
from tests.server.serverproc import start_server

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

from tests.vision import (GEMMA, GLM4V, GLM4V_MOE, IDEFICS, INTERNVL, LFM2, MISTRAL, MODEL, QWEN3, QWEN3_MOE, QWEN25, SMOLVLM,  # noqa: E402
                          image, oracle)

N = 6


def _item(identifier: str, offset: int, length: int) -> dict:
    return {"identifier": identifier, "mm_position": {"offset": offset, "length": length}}


def test_encoder_schedule_runs_each_identifier_once_and_frees_the_unneeded_past_the_bound():
    e = EncoderSchedule(max_items=1)
    a, b = [_item("x", 4, 8)], [_item("x", 2, 8), _item("y", 12, 4)]
    assert e.schedule([("r1", a, 0, 3)]) == {}  # the chunk does not reach the image yet
    assert e.schedule([("r1", a, 3, 4), ("r2", b, 0, 4)]) == {"r1": [0]}  # r2 shares r1's output
    assert e.schedule([("r2", b, 4, 10)]) == {"r2": [1]}
    assert e.evict(needed={"x", "y"}) == []  # both still needed: over the bound, kept
    assert e.evict(needed={"y"}) == ["x"] and list(e.held) == ["y"]
    assert spans([]) == [] and spans(b) == [(2, 8, "x"), (12, 4, "y")]


def test_a_covered_item_goes_without_pixels_only_while_the_worker_holds_its_output():
    f = {**_item("x", 4, 8), "data": {"pixel_values": b"p", "image_grid_thw": b"g"}}
    plain = {**_item("y", 4, 8), "data": {"pixel_values": b"p"}}
    assert sent([f, plain], 12, {"x", "y"}) == [{**f, "data": {"image_grid_thw": b"g"}}, {**plain, "data": None}]
    assert sent([f], 11, {"x"}) == [f] and sent([f], 12, set()) == [f]  # partly covered; not held


def test_the_same_image_under_another_question_reuses_the_kv_past_the_image(make_worker, home, tmp_path):
    """Image before the question: the second request's prefix hit covers the image, its item goes
    without pixels, no encoder run; tokens equal mlx-vlm's on the same prompt."""
    from PIL import Image

    from sidecar.scheduler.images import prepare

    path = resolve_model(MODEL, home)
    w = make_worker(MODEL, num_blocks=64, block_size=6)  # the image ends at 18, where the questions part
    sea = _png(tmp_path, 0)
    sched = Scheduler(num_blocks=64, block_size=w.config.block_size, max_num_batched_tokens=64)
    seen: list[dict] = []

    def step(so: dict) -> dict:
        seen.extend(so["scheduled_new_reqs"])
        return w.execute_model(so).to_wire()

    for rid, text in [("a", "Describe the sea."), ("b", "What colour is it?")]:
        ids, features = prepare(path, text, [sea], images_first=True)
        sched.add_request(Request(rid, ids, {"temperature": 0.0}, max_tokens=N, ignore_eos=True, mm_features=features))
        runs = w.runner.mm.stats.runs
        out = run(sched, step)[rid]
        want = oracle(path, text, Image.open(sea).convert("RGB"), N, image_first=True)
        assert out.output_token_ids == want, rid
    end = features[0]["mm_position"]["offset"] + features[0]["mm_position"]["length"]
    assert out.num_cached_tokens >= end and w.runner.mm.stats.runs == runs
    assert "pixel_values" in seen[0]["mm_features"][0]["data"]
    assert set(seen[1]["mm_features"][0]["data"]) == {"image_grid_thw"}


@pytest.mark.parametrize("model", [MODEL, QWEN25, QWEN3, QWEN3_MOE, GEMMA, IDEFICS, MISTRAL, SMOLVLM, GLM4V,
                                   GLM4V_MOE, LFM2, INTERNVL])
def test_two_images_of_different_sizes_in_one_request_equal_mlx_vlm_generate(make_worker, home, tmp_path, model):
    """Both images' items in one prompt (M-RoPE positions past two grids, Qwen3-VL's deepstack rows
    of two items in one row; two placeholder lengths where the family's depend on the size),
    prefilled in chunks of 16 that split them. (Not PaddleOCR-VL: mlx-vlm's processor takes one
    image size per call.)"""
    from mlx_vlm import generate
    from PIL import Image

    from sidecar.scheduler.images import _processor, prepare
    from tests.vision import _model

    path = resolve_model(model, home)
    files = [_png(tmp_path, 1), _png(tmp_path, 2, (120, 64))]
    text = "Compare the two pictures."
    ids, features = prepare(path, text, files)
    assert len(features) == 2 and features[0]["identifier"] != features[1]["identifier"]
    w = make_worker(model, num_blocks=128)
    sched = Scheduler(num_blocks=128, block_size=w.config.block_size, max_num_batched_tokens=16)
    sched.add_request(Request("a", ids, {"temperature": 0.0}, max_tokens=N, ignore_eos=True, mm_features=features))
    got = run(sched, lambda so: w.execute_model(so).to_wire())["a"].output_token_ids
    proc, _ = _processor(str(path))
    content = [{"type": "text", "text": text}, {"type": "image"}, {"type": "image"}]
    prompt = proc.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)
    want = generate(_model(str(path)), proc, prompt, image=[Image.open(f).convert("RGB") for f in files], max_tokens=N,
                    temperature=0.0, verbose=False)
    assert got == list(want.token_ids)[:N] and w.runner.mm.stats.runs == 2


def _png(tmp_path, seed: int, size=(80, 100)):
    p = tmp_path / f"img{seed}.png"
    image(seed, size).save(p)
    return p


@pytest.mark.parametrize("model", [MODEL, LFM2])
def test_scheduler_and_worker_equal_mlx_vlm_through_chunks_shared_images_and_preemption(make_worker, home, tmp_path,
                                                                                         model):
    """Chunks of 7 split the images; 4 blocks for three requests of 3 preempt; the same image
    under other text shares one encoder run; the same text with another image gets no prefix hit.
    (LFM2-VL: its convolution states restart with a preempted request; no prefix caching.)"""
    from sidecar.scheduler.images import prepare

    path = resolve_model(model, home)
    w = make_worker(model, num_blocks=12)
    sea, storm = _png(tmp_path, 0), _png(tmp_path, 1, (100, 60))
    cases = [("Describe the sea.", sea), ("Look at it.", sea), ("Describe the sea.", storm)]
    sched = Scheduler(num_blocks=4, block_size=w.config.block_size, max_num_batched_tokens=7, max_num_seqs=3,
                      enable_prefix_caching=model != LFM2)
    for i, (text, img) in enumerate(cases):
        ids, features = prepare(path, text, [img])
        sched.add_request(Request(f"r{i}", ids, {"temperature": 0.0}, max_tokens=N, ignore_eos=True,
                                  mm_features=features))
    runs = w.runner.mm.stats.runs
    done = run(sched, lambda so: w.execute_model(so).to_wire())
    for i, (text, img) in enumerate(cases):
        from PIL import Image

        assert done[f"r{i}"].output_token_ids == oracle(path, text, Image.open(img).convert("RGB"), N), i
    assert w.runner.mm.stats.runs - runs == 2
    assert sum(r.num_preemptions for r in done.values()) > 0


@pytest.mark.parametrize("model", [QWEN3, GEMMA, IDEFICS, GLM4V])
def test_speculative_decoding_on_image_requests_keeps_mlx_vlms_tokens(make_worker, home, tmp_path, model):
    """The worker's n-gram drafts verified in rows after an image (Qwen3-VL: M-RoPE positions past
    the grid for each draft; Gemma 3: sliding windows), batched with a text request: the same greedy
    tokens as mlx-vlm's generate, and drafts were accepted (the verify path ran)."""
    from PIL import Image

    from sidecar.scheduler.images import prepare

    n, path, sea = 32, resolve_model(model, home), _png(tmp_path, 0)
    w = make_worker(model, num_blocks=64, speculative_method="ngram", prompt_lookup_min=1)
    sched = Scheduler(num_blocks=64, block_size=w.config.block_size, max_num_batched_tokens=64)
    ids, features = prepare(path, "Describe the sea.", [sea])
    sched.add_request(Request("a", ids, {"temperature": 0.0}, max_tokens=n, ignore_eos=True, mm_features=features))
    sched.add_request(Request("t", list(range(5, 30)), {"temperature": 0.0}, max_tokens=n, ignore_eos=True))
    done = run(sched, lambda so: w.execute_model(so).to_wire(), take_draft_token_ids=w.take_draft_token_ids)
    assert done["a"].output_token_ids == oracle(path, "Describe the sea.", Image.open(sea).convert("RGB"), n)
    assert sched.num_accepted_tokens > 0


def test_generate_cli_with_an_image(home, tmp_path):
    from PIL import Image

    from sidecar.scheduler.generate import load_tokenizer

    path = resolve_model(MODEL, home)
    img = _png(tmp_path, 2)
    want = load_tokenizer(str(path)).decode(oracle(path, "Describe the sea.", Image.open(img).convert("RGB"), N),
                                            skip_special_tokens=True)
    with start_server("--model", MODEL, "--max-num-batched-tokens", "64", "--max-num-seqs", "4") as s:
        out = subprocess.run([sys.executable, "-m", "sidecar", "generate", "--url", s.url, "--max-tokens", str(N),
                              "--image", str(img), "Describe the sea."], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
