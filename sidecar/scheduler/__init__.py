"""A reference scheduler (vLLM v1 policy) for driving the worker: plain Python, no MLX.

blocks.py owns KV block accounting and the prefix cache; scheduler.py owns requests, the step
and the wire `scheduler_output` it sends to `execute_model` (docs/protocol.md, execute_model).
"""

from __future__ import annotations

from sidecar.scheduler.blocks import BlockManager
from sidecar.scheduler.scheduler import Event, Request, Scheduler, Status, run

__all__ = ["BlockManager", "Event", "Request", "Scheduler", "Status", "run"]
