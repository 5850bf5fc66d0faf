"""mlx-sidecar: an MLX LLM worker served over msgpack RPC for an external scheduler."""

from __future__ import annotations

__version__ = "0.1.0"
PROTOCOL_VERSION = 4
