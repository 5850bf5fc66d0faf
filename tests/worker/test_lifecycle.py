from __future__ import annotations

import inspect

import pytest

from sidecar.errors import StateError, Unavailable
from sidecar.worker.lifecycle import ALLOWED, State, StateMachine, lifecycle
from sidecar.worker.mlx_worker import MLXWorker


class _Machine(StateMachine):
    @lifecycle
    def load_model(self) -> str:
        return "loaded"


def test_a_call_out_of_order_names_the_state_and_what_comes_first() -> None:
    m = _Machine()
    with pytest.raises(StateError, match=r"load_model is not allowed in state 'created' .*call init_device first"):
        m.load_model()
    m.state = State.DEVICE_READY
    assert m.load_model() == "loaded"  # negative control: in order it runs
    m.state = State.SLEEPING
    with pytest.raises(Unavailable, match="sleeping; call wake_up first"):
        m.load_model()


def test_every_allowed_method_is_a_checked_worker_method() -> None:
    for name in ALLOWED:
        fn = getattr(MLXWorker, name)
        assert callable(fn) and inspect.signature(fn).parameters["self"]
    assert set(ALLOWED) >= {"init_device", "execute_model", "sleep", "wake_up", "add_lora", "profile"}
