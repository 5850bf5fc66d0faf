"""Exactly-once steps over retries: the scheduler numbers its steps, the worker remembers the last.

A step is one numbered call of a step method (`execute_model`, and `sample_tokens` for a step
whose sampling was deferred: its phases, in order). `StepLedger.run(step_id, method, call)` runs
on the MLX thread, in arrival order:

- no step_id: a v1 call; it runs, and ends the numbered sequence (the next numbered step may
  carry any id);
- the next phase of the last step, or the first phase of step last + 1 (any id when there is no
  last step): runs, and on success its wire reply is kept;
- a phase of a kept step that already ran, with the same body (byte for byte): the kept reply,
  without running anything again (a resend after a lost reply); with another body, 409;
- anything else: 409 `step_out_of_sequence` naming the last applied step.

A rejected or failed call is not recorded (it changed nothing). Calls that drop request state
(`RESETS`) clear the ledger. `window` steps are kept, so a window of 2 lets a scheduler have step
n + 1 in flight before n's reply arrives and still resend n. A kept step holds its body to compare a
resend with: at most `window` bodies, each within the body limit, and no per-step cost (a hash of
every body would cost about 1 ms per MB on the event loop).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from sidecar.wire.codec import wire_type
from sidecar.errors import ProtocolError, SidecarError

STEP_METHODS = ("execute_model", "sample_tokens")  # the phases of one step, in order
RESETS = frozenset({"init_device", "initialize_cache", "initialize_from_config", "sleep", "shutdown"})


class StepConflict(SidecarError):
    status = 409
    type = "step_out_of_sequence"

    def __init__(self, message: str, last_step_id: int | None):
        super().__init__(message, field="step_id")
        self.last_step_id = last_step_id

    def to_wire(self) -> dict:
        wire = super().to_wire()
        wire["error"]["last_step_id"] = self.last_step_id  # machine-readable, for recovery
        return wire


def step_id_of(kwargs: dict, method: str) -> int | None:
    """Take the optional `step_id` kwarg out of a step method's kwargs (null: unnumbered)."""
    if method not in STEP_METHODS or "step_id" not in kwargs:
        return None
    v = kwargs.pop("step_id")
    if v is None:
        return None
    if type(v) is not int or not 0 <= v < 2**63:
        got = str(v)[:40] if type(v) is int else wire_type(v)
        raise ProtocolError(f"step_id must be an integer in [0, 2^63), got {got}", field="step_id")
    return v


class StepLedger:
    def __init__(self, window: int = 1):
        self.window = window
        # step id -> {phase: (body, wire reply)}
        self._steps: OrderedDict[int, dict[str, tuple[bytes, Any]]] = OrderedDict()

    @property
    def last(self) -> int | None:
        return next(reversed(self._steps)) if self._steps else None

    def reset(self) -> None:
        self._steps.clear()

    def run(self, step_id: int | None, method: str, call: Callable[[], Any], body: bytes = b"") -> Any:
        if step_id is None:
            result = call()
            self.reset()
            return result
        kept = self._steps.get(step_id)
        if kept is not None and method in kept:
            if kept[method][0] != body:
                raise StepConflict(f"step {step_id} was applied with a different {method} body; a resend must "
                                   "repeat the step's body exactly", self.last)
            return kept[method][1]
        phase = STEP_METHODS.index(method)
        last = self.last
        if kept is not None:
            done = max(STEP_METHODS.index(m) for m in kept)
            if step_id != last or phase != done + 1:
                raise self._conflict(step_id, method)
        elif phase != 0 or (last is not None and step_id != last + 1):
            raise self._conflict(step_id, method)
        result = call()
        self._steps.setdefault(step_id, {})[method] = (body, result)
        while len(self._steps) > self.window:
            self._steps.popitem(last=False)
        return result

    def _conflict(self, step_id: int, method: str) -> StepConflict:
        last = self.last
        if last is None:
            return StepConflict(f"{method} for step {step_id} is out of sequence: no step is kept (a numbered "
                                f"step starts with {STEP_METHODS[0]})", None)
        phases = ", ".join(self._steps[last])
        return StepConflict(f"{method} for step {step_id} is out of sequence: the last applied step is {last} "
                            f"({phases}); send step {last + 1} next, or resend step {last} for its reply", last)
