"""The on-disk model store that the built-ins (builtin.py, families.py, gguf.py) share.

Each generated model is a directory ``<home>/models/<name>-v<version>``, written into a temporary
directory under a file lock and renamed into place; MARKER, written last, tells a complete one
from a half-written one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
MARKER = ".complete"  # written last: a directory without it is half-written


class ModelNotFound(ValueError):
    """The model name is neither a known built-in nor an mlx-lm model directory."""


def cache_home(home: str | None = None) -> Path:
    """Where built-ins live: ``home``, else $MLX_SIDECAR_HOME, else the platform cache dir."""
    if home or (home := os.environ.get("MLX_SIDECAR_HOME")):
        return Path(home).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-sidecar"
    xdg = os.environ.get("XDG_CACHE_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mlx-sidecar"


def generated_dir(name: str, version: int, home: str | None = None) -> Path:
    return cache_home(home) / "models" / f"{name}-v{version}"


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def ensure_generated(name: str, version: int, write: Callable[[str, Path], None],
                     home: str | None = None) -> Path:
    """Return the complete directory of generated model ``name``, generating it once if needed.

    ``write`` fills the (existing, empty) temporary directory, MARKER last."""
    target = generated_dir(name, version, home)
    if is_complete(target):
        return target
    models = target.parent
    models.mkdir(parents=True, exist_ok=True)
    with _locked(models / ".lock"):
        if is_complete(target):  # another process generated it while we waited
            return target
        # Generators hold the lock, so holding it ourselves, anything half-written is debris of
        # a crashed one. (mkdtemp suffixes have no "-": ".tmp-tiny-*" must not match tiny-qwen3.)
        prefix = f".tmp-{name}-"
        debris = [p for p in models.glob(prefix + "*") if "-" not in p.name.removeprefix(prefix)]
        for path in [target, *debris]:
            if path.exists():
                log.info("removing incomplete built-in model directory %s", path)
                shutil.rmtree(path, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=models))
        try:
            log.info("generating builtin:%s (first use) in %s", name, target)
            t0 = time.perf_counter()
            write(name, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                # Someone made it without our lock (another host sharing the home, a copy by
                # hand): use theirs.
                if not is_complete(target):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            log.info("generated builtin:%s in %s (%.2fs)", name, target, time.perf_counter() - t0)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def init_tensor(name: str, shape: tuple[int, ...], config: dict, seed: int) -> np.ndarray:
    """Deterministic float32 init of one tensor.

    Each tensor has its own numpy stream keyed by (seed, name), so it does not depend on the
    order or presence of the others, nor on mlx's RNG.
    """
    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    h = config["hidden_size"]
    if "embed_tokens" in name or "lm_head" in name:
        # Logits = RMS-normed hidden (rms 1) @ lm_head: std 2/sqrt(h) gives logits of std ~2,
        # peaked enough that greedy ties are negligible, far from saturating softmax.
        std = 2.0 / h**0.5
    else:
        std = 1.0 / shape[-1] ** 0.5  # fan-in scaling: each projection keeps activations O(1)
    out = rng.standard_normal(shape, dtype=np.float32)
    out *= np.float32(std)
    return out
