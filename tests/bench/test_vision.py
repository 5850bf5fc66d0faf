"""The bench's images stage on a real server: its figures are there and sane."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vision  # make test-vision runs these; make test leaves them out
pytest.importorskip("mlx_vlm", reason="the vision extra (make test-vision) is not installed")


def test_images_stage_reports_ttft_and_end_to_end(home: str) -> None:
    from bench import vision

    b = SimpleNamespace(params=SimpleNamespace(home=home), results={}, notes=[])
    with tempfile.TemporaryDirectory() as logs:
        vision.images(b, logs)
    r = b.results
    assert 0 < r["image_ttft_repeat_ms"] and 0 < r["image_ttft_first_ms"]
    assert r["image_ttft_repeat_ratio"] == pytest.approx(r["image_ttft_repeat_ms"] / r["image_ttft_first_ms"])
    assert r["image_e2e_tokens"] >= 1 and r["image_e2e_vs_mlx_vlm"] > 0
    assert any(n.startswith("images (builtin:tiny-qwen2-vl)") for n in b.notes)
