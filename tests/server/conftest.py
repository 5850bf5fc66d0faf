"""Fixtures shared by the server tests (issue 9: hardening, exactly-once steps, fuzzing)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.server.serverproc import start_server

LIMITS = ["--max-live-requests", "4", "--max-req-id-len", "64", "--max-model-len", "256", "--max-num-seqs", "8",
          "--max-num-batched-tokens", "64"]


@pytest.fixture(scope="session")
def shared_lora_root(home: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.test_lora import make_adapter

    base = tmp_path_factory.mktemp("hardening")
    root = base / "loras"
    make_adapter(home, root / "good", seed=1)
    make_adapter(home, base / "outside", seed=2)  # a valid adapter, but not under --lora-dir
    for name, link in (("linked_weights", "adapters.safetensors"), ("linked_config", "adapter_config.json")):
        shutil.copytree(root / "good", root / name)
        (root / name / link).unlink()
        (root / name / link).symlink_to(base / "outside" / link)
    shutil.copytree(root / "good", root / "badjson")
    (root / "badjson" / "adapter_config.json").write_text('{"fine_tune_type": "lora", "lora_parameters": ')
    shutil.copytree(root / "good", root / "notamap")
    (root / "notamap" / "adapter_config.json").write_text('[1, 2]')
    shutil.copytree(root / "good", root / "garbage")
    (root / "garbage" / "adapters.safetensors").write_bytes(b"\xff" * 64 + b"not safetensors at all")
    # Files that are no adapter's, whatever their name: a 2 GiB (sparse) config, a FIFO, a symlink loop.
    shutil.copytree(root / "good", root / "hugeconfig")
    os.truncate(root / "hugeconfig" / "adapter_config.json", 2 << 30)
    shutil.copytree(root / "good", root / "fifo")
    (root / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "fifo" / "adapter_config.json")
    shutil.copytree(root / "good", root / "loop")
    (root / "loop" / "adapters.safetensors").unlink()
    (root / "loop" / "adapters.safetensors").symlink_to("adapters.safetensors")
    return root


@pytest.fixture(scope="session")
def shared_server(home: str, shared_lora_root: Path):
    """One preloaded server for the hardening, exactly-once and fuzz tests (small shapes, so the
    preload is quick; tight limits, so the bounds are reachable). Each test leaves no request."""
    with start_server("--preload", "--lora-dir", str(shared_lora_root), "--max-body-bytes", "8000000", *LIMITS) as s:
        yield s
