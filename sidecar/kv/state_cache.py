"""Recurrent-state adapters: a batch's rows' states gathered from the state pool into the model's
own cache class (ArraysCache, MambaCache, ...), and written back in place after the forward.

A row's state slot is its block in its state group (vLLM's layout). A row starting at position 0
(a new request, or one resumed after preemption: recompute from the start) gets empty entries,
so the model initialises the state itself exactly as mlx-lm does; other rows get their slot's state,
which carries the state across chunked prefill and decode. Rows of one batch have equal lengths
(the runner groups them), so no padding token ever enters a state.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from sidecar.kv.pool import KVPool


def gather_state(template: Any, size: int, used: tuple[int, ...], pool: KVPool, leaf: int,
                 slots: mx.array | None) -> Any:
    c = copy.copy(template)
    c.cache = [None] * size
    c.left_padding = c.lengths = None  # no padding: make_mask answers None
    if slots is not None:
        for arr, e in zip(pool.states[leaf], used):  # type: ignore[arg-type]
            c.cache[e] = arr[slots]
    return c


def store_state(c: Any, used: tuple[int, ...], pool: KVPool, leaf: int, slots: mx.array) -> None:
    arrays = pool.states[leaf]
    assert arrays is not None
    for k, e in enumerate(used):
        new = c.cache[e]
        if new is None:
            continue
        a = arrays[k]
        a[slots] = new.astype(a.dtype)
        arrays[k] = a
