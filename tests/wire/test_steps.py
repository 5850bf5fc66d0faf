"""The step ledger on its own: sequence rules, the cached reply, two-phase steps, the window."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.steps import StepConflict, StepLedger, step_id_of


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return {"n": self.calls}


def test_resend_of_the_last_step_is_answered_from_the_cache() -> None:
    led, run = StepLedger(), Counter()
    assert led.run(41, "execute_model", run) == {"n": 1}  # the first numbered step may carry any id
    assert led.run(41, "execute_model", run) == {"n": 1} and run.calls == 1
    assert led.run(42, "execute_model", run) == {"n": 2} and led.last == 42


@pytest.mark.parametrize("step_id", [40, 41, 44, 0])
def test_out_of_sequence_is_a_409_naming_the_last_step(step_id: int) -> None:
    led, run = StepLedger(), Counter()
    led.run(41, "execute_model", run)
    led.run(42, "execute_model", run)
    with pytest.raises(StepConflict) as e:
        led.run(step_id, "execute_model", run)
    assert e.value.status == 409 and e.value.last_step_id == 42 and "last applied step is 42" in e.value.message
    assert e.value.to_wire()["error"]["last_step_id"] == 42 and run.calls == 2


def test_a_failed_step_is_not_recorded_and_v1_steps_end_the_sequence() -> None:
    led, run = StepLedger(), Counter()
    led.run(1, "execute_model", run)

    def bad() -> None:
        raise ProtocolError("rejected")

    with pytest.raises(ProtocolError):
        led.run(2, "execute_model", bad)
    assert led.last == 1
    assert led.run(2, "execute_model", run) == {"n": 2}
    assert led.run(None, "execute_model", run) == {"n": 3} and led.last is None  # unnumbered: always runs
    assert led.run(None, "execute_model", run) == {"n": 4}
    assert led.run(7, "execute_model", run) == {"n": 5}


def test_two_phase_steps_and_a_window_of_two() -> None:
    led, run = StepLedger(window=2), Counter()
    with pytest.raises(StepConflict):
        led.run(1, "sample_tokens", run)  # a step starts with execute_model
    led.run(1, "execute_model", run)
    assert led.run(1, "sample_tokens", run) == {"n": 2}
    assert led.run(1, "sample_tokens", run) == {"n": 2} and led.run(1, "execute_model", run) == {"n": 1}
    led.run(2, "execute_model", run)  # step 2 in flight before step 1's reply was read
    assert led.run(1, "sample_tokens", run) == {"n": 2} and run.calls == 3  # still answerable
    with pytest.raises(StepConflict):
        led.run(3, "sample_tokens", run)  # step 3 has not started
    led.run(3, "execute_model", run)
    with pytest.raises(StepConflict):
        led.run(1, "execute_model", run)  # fell out of the window


def test_step_id_kwarg() -> None:
    kw = {"scheduler_output": {}, "step_id": 5}
    assert step_id_of(kw, "execute_model") == 5 and kw == {"scheduler_output": {}}
    assert step_id_of({"step_id": None}, "execute_model") is None
    assert step_id_of({"step_id": 5}, "check_health") is None  # not a step method: left for the signature check
    for bad in (-1, 1.0, "1", True, 2**63):
        with pytest.raises(ProtocolError) as e:
            step_id_of({"step_id": bad}, "execute_model")
        assert e.value.field == "step_id"


def test_a_resend_must_repeat_the_body() -> None:
    led, run = StepLedger(), Counter()
    led.run(1, "execute_model", run, b"body-1")
    assert led.run(1, "execute_model", run, b"body-1") == {"n": 1}
    with pytest.raises(StepConflict) as e:
        led.run(1, "execute_model", run, b"another body")
    assert "different execute_model body" in e.value.message and e.value.last_step_id == 1 and run.calls == 1


def test_a_resend_is_compared_byte_for_byte() -> None:
    """A big body that differs from the kept one in its last byte only is another body; an equal
    copy (a new bytes object, as a resend reads it) is the same step."""
    led, run = StepLedger(), Counter()
    body = bytes(range(256)) * 4096
    led.run(7, "execute_model", run, body)
    assert led.run(7, "execute_model", run, bytes(bytearray(body))) == {"n": 1} and run.calls == 1
    with pytest.raises(StepConflict):
        led.run(7, "execute_model", run, body[:-1] + b"\x00")
    assert run.calls == 1
