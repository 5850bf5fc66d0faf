"""vLLM's platform-plugin entry point (`vllm.platform_plugins`: `mlx_sidecar`), active only when asked.

vLLM calls `activate()` in each of its processes while it picks a platform. It answers the
platform's class only when the environment asks for it, so installing this package never changes
what a plain vLLM does:

- `MLX_SIDECAR_PLATFORM=1`, or
- `VLLM_PLUGINS` naming `mlx_sidecar` (vLLM's own plugin allow-list).

Imports nothing: vLLM loads this module on every start, plugin wanted or not.
"""

from __future__ import annotations

import os

NAME = "mlx_sidecar"
PLATFORM = "sidecar.vllm.platform.MLXSidecarPlatform"


def asked(environ: dict | None = None) -> bool:
    env = os.environ if environ is None else environ
    if env.get("MLX_SIDECAR_PLATFORM", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    return NAME in [p.strip() for p in (env.get("VLLM_PLUGINS") or "").split(",")]


def activate() -> str | None:
    return PLATFORM if asked() else None
