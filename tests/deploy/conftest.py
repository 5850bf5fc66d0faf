"""Fixtures the deploy tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_program(tmp_path: Path) -> Path:
    prog = tmp_path / "venv bin" / "mlx-sidecar"  # a space in the path on purpose
    prog.parent.mkdir()
    prog.write_text("#!/bin/sh\nexit 0\n")
    prog.chmod(0o755)
    return prog
