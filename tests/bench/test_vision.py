"""The bench's images stage on a real server: its figures are there and sane."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest

from bench.report import rows

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")


def test_images_stage_reports_ttft_and_end_to_end(home: str) -> None:
    from bench import vision

    b = SimpleNamespace(params=SimpleNamespace(home=home), results={}, notes=[])
    with tempfile.TemporaryDirectory() as logs:
        vision.images(b, logs, rounds=1)
    r = b.results
    for case in ("follow_up", "identical", "encoder_only"):
        assert r[f"image_ttft_{case}_ratio"] == pytest.approx(r[f"image_ttft_{case}_ms"] / r["image_ttft_first_ms"])
    # the prefix cache covers the image for a new question and all but the last block for the same
    # request; after other text it covers nothing (only the encoder run is saved)
    assert r["image_cached_first_tokens"] == r["image_cached_encoder_only_tokens"] == 0
    assert 256 <= r["image_cached_follow_up_tokens"] < r["image_cached_identical_tokens"]  # image: [4, 260)
    assert 0 < r["image_encoder_share"] < 1
    for key in ("image_e2e", "image_e2e_tiny"):
        assert r[f"{key}_tokens"] >= 1 and r[f"{key}_ratio"] > 0 and r[f"{key}_tokens_match"] == 1
    print(*b.notes, sep="\n")
    shown = {row[0]: row for row in rows(r)}
    assert any(k.startswith("images: end to end") and "not measured" not in v[1] for k, v in shown.items())
