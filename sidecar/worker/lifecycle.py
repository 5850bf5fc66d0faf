"""The worker's lifecycle state machine: its states, which call is allowed in which, and the
decorator that checks it (out of order is a 409 naming what must come first)."""

from __future__ import annotations

import enum
import functools
from typing import Any, Callable

from sidecar.errors import StateError, Unavailable


class State(str, enum.Enum):
    CREATED = "created"
    DEVICE_READY = "device_ready"
    MODEL_LOADED = "model_loaded"
    CACHE_READY = "cache_ready"
    READY = "ready"
    SLEEPING = "sleeping"
    SHUT_DOWN = "shut_down"


S = State
_LOADED = {S.MODEL_LOADED, S.CACHE_READY, S.READY}
INIT_STATES = {S.CREATED, S.DEVICE_READY, S.SHUT_DOWN}
_CACHED = {S.CACHE_READY, S.READY}
# method -> (states it is allowed in, what must come first)
ALLOWED: dict[str, tuple[set[State], str]] = {
    "init_device": (set(State), ""),  # checked in init_device: INIT_STATES, or any state with reset=true (v2)
    "load_model": ({S.DEVICE_READY}, "call init_device first (load_model runs once per init_device)"),
    "determine_available_memory": (_LOADED, "call load_model first"),
    "get_kv_cache_spec": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_kv_cache_groups": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_cache_block_size_bytes": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "get_model": (_LOADED, "call load_model first"),
    "vocab_size": (_LOADED | {S.SLEEPING}, "call load_model first"),
    "initialize_cache": (_LOADED, "call load_model first"),
    "initialize_from_config": (_LOADED, "call load_model first"),
    "compile_or_warm_up_model": (_CACHED, "call initialize_cache first"),
    "execute_model": (_CACHED, "call initialize_cache first"),
    "sample_tokens": (_CACHED, "call execute_model(defer_sampling=True) first"),
    "take_draft_token_ids": (_CACHED, "call initialize_cache first"),
    "sleep": (_CACHED, "call initialize_cache first"),
    "wake_up": ({S.SLEEPING}, "call sleep first"),
    "check_health": (set(State), ""),
    "shutdown": (set(State), ""),
    "add_lora": (_LOADED, "call load_model first"),
    "remove_lora": (_LOADED, "call load_model first"),
    "pin_lora": (_LOADED, "call load_model first"),
    "list_loras": (_LOADED, "call load_model first"),
    "kv_store_lookup": (_LOADED, "call load_model first"),
    "profile": (set(State), ""),
}


class StateMachine:
    """The `state` attribute and the check every lifecycle call makes first."""

    state: State = S.CREATED

    def require(self, method: str, states: set[State] | None = None, hint: str | None = None) -> None:
        if states is None:
            states, hint = ALLOWED[method]
        if self.state not in states:
            if self.state == S.SLEEPING:
                raise Unavailable(f"{method}: the worker is sleeping; call wake_up first", retry_after=1)
            allowed = ", ".join(sorted(s.value for s in states))
            raise StateError(f"{method} is not allowed in state {self.state.value!r} (allowed: {allowed}); {hint}")


def lifecycle(fn: Callable) -> Callable:
    """Check the state machine before the call: out of order is a 409 naming what comes first."""

    @functools.wraps(fn)
    def wrapper(self: StateMachine, *args: Any, **kwargs: Any) -> Any:
        self.require(fn.__name__)
        return fn(self, *args, **kwargs)

    return wrapper
