"""The reference scheduler with images: mlx-vlm's processor on the scheduler side, the encoder
schedule (one run per image identifier, frees past the bound), prefix-cache hashes that include the
images, and `mlx-sidecar generate --image` against a real server; tokens equal mlx-vlm's generate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sidecar.models import resolve_model
from sidecar.scheduler.images import EncoderSchedule, spans
from sidecar.scheduler.scheduler import Request, Scheduler, run
from tests.server.serverproc import start_server

pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")

from tests.vision import MODEL, image, oracle  # noqa: E402

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


def _png(tmp_path, seed: int, size=(80, 100)):
    p = tmp_path / f"img{seed}.png"
    image(seed, size).save(p)
    return p


def test_scheduler_and_worker_equal_mlx_vlm_through_chunks_shared_images_and_preemption(make_worker, home, tmp_path):
    """Chunks of 7 split the images; 4 blocks for three requests of 3 preempt; the same image
    under other text shares one encoder run; the same text with another image gets no prefix hit."""
    from sidecar.scheduler.images import prepare

    path = resolve_model(MODEL, home)
    w = make_worker(MODEL, num_blocks=12)
    sea, storm = _png(tmp_path, 0), _png(tmp_path, 1, (100, 60))
    cases = [("Describe the sea.", sea), ("Look at it.", sea), ("Describe the sea.", storm)]
    sched = Scheduler(num_blocks=4, block_size=w.config.block_size, max_num_batched_tokens=7, max_num_seqs=3)
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
