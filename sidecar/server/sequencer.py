"""Numbered steps reach the MLX thread in step order, even over two connections.

A scheduler with two steps in flight may send step n over one connection and n + 1 over another;
the event loop can read n + 1 first. Step n + 1 then waits (on the event loop, bounded) until
step n has been handed to the MLX thread, instead of meeting the step ledger's 409. Only the
exact case "one ahead of a step not seen yet" waits; everything else goes straight on (the
ledger judges it), so a stale or restarted numbering costs at most `wait` once.
"""

from __future__ import annotations

import asyncio


class StepSequencer:
    def __init__(self, wait: float = 1.0):
        self.wait = wait
        self.last: int | None = None  # the last step id handed to the MLX thread
        self._moved: asyncio.Event | None = None

    async def turn(self, step_id: object) -> None:
        """Await step_id's turn; call `handed(step_id)` right after queueing it."""
        if type(step_id) is not int or self.last is None or step_id != self.last + 2:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while self.last is not None and step_id == self.last + 2 and (left := deadline - loop.time()) > 0:
            self._moved = self._moved or asyncio.Event()
            try:
                await asyncio.wait_for(self._moved.wait(), left)
            except asyncio.TimeoutError:
                return

    def handed(self, step_id: object) -> None:
        if type(step_id) is int:
            self.last = step_id
            if self._moved is not None:
                self._moved.set()
                self._moved = None
