"""Server instance ids: every start of the server gets a fresh id, so a scheduler can see a restart.

The id is in `/info` and `/readyz`, in the `X-Sidecar-Instance` header of every reply, and in the
`mlx_worker_start_time_seconds{instance_id}` gauge. A caller that sends
`X-Sidecar-Expect-Instance: <id>` on an RPC gets 409 `instance_mismatch` from any other instance,
before the call is decoded or run: a restarted worker holds none of the caller's request state.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from sidecar.errors import SidecarError

INSTANCE_HEADER = "x-sidecar-instance"
EXPECT_HEADER = "x-sidecar-expect-instance"


class InstanceMismatch(SidecarError):
    status = 409
    type = "instance_mismatch"


@dataclass(frozen=True)
class Instance:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)

    def check(self, expected: str | None) -> None:
        if expected is not None and expected.strip() != self.id:
            shown = expected.strip()[:64]
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at))
            raise InstanceMismatch(
                f"this is server instance {self.id} (started {started}), "
                f"not the expected {shown!r}: the worker restarted and holds none of the caller's state; "
                "re-run the lifecycle and reschedule the running requests")


class InstanceHeader:
    """ASGI middleware: the instance id on every HTTP reply (RPCs, probes, metrics, errors)."""

    def __init__(self, app: Callable[..., Awaitable[None]], instance: Instance):
        self.app = app
        self._header = (INSTANCE_HEADER.encode(), instance.id.encode())

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self._header]
            await send(message)

        await self.app(scope, receive, send_with_id)
