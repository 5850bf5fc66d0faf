"""A lone decode row's whole forward as one compiled MLX graph (CPU backend, small windows).

On a small model the forward of one decode token is cheap and building it is not: ~100 graph
nodes made op by op in Python (~0.15 ms on this CPU, about a third of builtin:tiny's step), every
step again. Compiled (`mx.compile`), the graph is traced once per read size and each step only
replays it (a new read size's first call, its trace, costs ~1 ms), with the step's numbers
(token, position, write slot, read start) as array inputs and the pool's K/V arrays as inputs
and outputs.

What changes inside is only how K/V are addressed (`TraceCache`): the new K/V are written at an
array slot (a dynamic slice update: MLX still donates the pool buffer, so it is written in place)
and the row's run of slots is read from an array start, GRAIN-rounded so one trace serves GRAIN
positions. The keys past the context are masked as the model's mask would, and their values
zeroed (they are other requests' slots: a NaN there must not reach this row through 0 * NaN).
The read is a copy (a dynamic slice cannot be a view), so the path is taken only while the
window is at most WINDOW_BYTES over all layers: there the copy costs a small share of the graph
building it saves; past it (long contexts, models of real size, where building is a small share
of a step anyway) the row runs the model's own modules as before. The layers' arithmetic is the
same modules' (decode_attention.py, fused_ops.py) traced: logits equal the uncompiled path's
(tests/runner/test_decode_compiled.py).

Taken for models whose attention decode_attention.py serves (mlx-lm llama, qwen2, qwen3) with
every layer plain full attention in one KV cache group, K/V not quantised, on the CPU backend, for
a row of one token whose blocks so far are one run, without LoRA adapters or prompt logprobs.
The traces capture the weights: the runner makes a new `CompiledDecode` per model (set_model)
and drops it with the weights (sleep level 2).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from sidecar.runner import shared_rope
from sidecar.runner.kv_spec import ATTENTION, LayerSpec
from sidecar.runner.layouts import _is_run
from sidecar.runner.requests import Row

log = logging.getLogger(__name__)

# MLX_SIDECAR_COMPILED_DECODE=0 in the server's environment turns the path off (the modules decode every row).
enabled = os.environ.get("MLX_SIDECAR_COMPILED_DECODE", "1") != "0"

GRAIN = 64  # keys read: the context rounded up to a multiple of this (one trace per size)
WINDOW_BYTES = 256 << 10  # the most K/V one step's reads copy, over all layers


class TraceCache:
    """The mlx-lm cache contract for one layer of the compiled forward (positions as arrays)."""

    def __init__(self, pools: list[mx.array], layer: int, step: StepArrays, keys: int):
        self.pools, self.k, self.step, self.keys_read = pools, 2 * layer, step, keys
        self.offset = step.pos

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        P, k, s = self.pools, self.k, self.step
        P[k] = mx.slice_update(P[k], keys.astype(P[k].dtype), s.write_slot, (2,))
        P[k + 1] = mx.slice_update(P[k + 1], values.astype(P[k + 1].dtype), s.write_slot, (2,))
        kr = mx.slice(P[k], s.read_start, (2,), (1, P[k].shape[1], self.keys_read, P[k].shape[3]))
        vr = mx.slice(P[k + 1], s.read_start, (2,), (1, P[k + 1].shape[1], self.keys_read, P[k + 1].shape[3]))
        vr = mx.where(s.valid[:, :, :, None], vr, mx.array(0, vr.dtype))
        return kr.astype(keys.dtype), vr.astype(values.dtype)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        return self.step.valid[:, :, None, :]  # [1, 1, 1, K]


class StepArrays:
    """The step's numbers inside the trace: position, write slot, read start ([1] int32 each) and
    which of the `keys` slots read are context ([1, 1, K] bool)."""

    def __init__(self, pos: mx.array, write_slot: mx.array, read_start: mx.array, keys: int):
        self.pos, self.write_slot, self.read_start = pos, write_slot, read_start
        self.valid = (mx.arange(keys, dtype=mx.int32) <= pos)[None, None, :]


def compiled_decode(model: nn.Module, selection: Any, specs: list[LayerSpec], groups: list,
                    vocab_size: int) -> CompiledDecode | None:
    """The model's compiled decode forward, or None where its decode rows cannot take one."""
    return CompiledDecode(model, selection, specs, vocab_size) if serves(model, specs, groups) else None


def serves(model: nn.Module, specs: list[LayerSpec], groups: list) -> bool:
    """Whether this model's decode rows can take the compiled forward at all (its attention swapped
    by fused_ops.fuse_decode_ops: the CPU backend, whose compiler works)."""
    from sidecar.runner.decode_attention import ATTENTION_SWAPS

    swapped = set(ATTENTION_SWAPS.values())
    attention = [m for _, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    return (enabled and mx.default_device() == mx.cpu and len(groups) == 1
            and bool(attention) and all(type(m) in swapped for m in attention)
            and all(s.kind == ATTENTION and not s.sliding_window and not s.attention_chunk_size and not s.kv_bits
                    for s in specs))


class CompiledDecode:
    """The compiled forwards of one model, by read size."""

    def __init__(self, model: nn.Module, selection: Any, specs: list[LayerSpec], vocab_size: int):
        self.model, self.selection, self.vocab_size = model, selection, vocab_size
        self.num_layers = len(specs)
        self.bytes_per_key = sum(s.page_size_bytes // s.block_size for s in specs)
        self.failed = False
        self._fns: dict[int, Callable[..., list[mx.array]]] = {}

    def _trace(self, keys: int) -> Callable[..., list[mx.array]]:
        def forward(tokens: mx.array, pos: mx.array, write_slot: mx.array, read_start: mx.array,
                    *pools: mx.array) -> list[mx.array]:
            P = list(pools)
            step = StepArrays(pos, write_slot, read_start, keys)
            logits = self.model(tokens, cache=[TraceCache(P, i, step, keys) for i in range(self.num_layers)])
            hidden = self.selection.hidden if self.selection is not None else None
            shared_rope.forget()  # (its memo would keep the trace's arrays)
            return [logits.reshape(1, self.vocab_size), *([] if hidden is None else [hidden]), *P]

        return mx.compile(forward)

    def __call__(self, pool: Any, row: Row, tokens: mx.array | None) -> mx.array | None:
        """Row `row`'s logits [1, V] (lazy), its K/V written to the pool; None where the path is
        not taken (the caller runs the modules)."""
        bs, pos, table = pool.block_size, row.start, row.block_ids
        n = pos // bs + 1
        keys = -(-(pos + 1) // GRAIN) * GRAIN
        start = table[0] * bs if table else 0
        if (self.failed or row.num_draft or row.state.lora_id or row.state.sampling_params.prompt_logprobs is not None
                or len(table) < n or keys * self.bytes_per_key > WINDOW_BYTES
                or start + keys > pool.keys[0].shape[2] or not _is_run(table, n)):
            return None
        fn = self._fns.get(keys)
        fresh = fn is None
        if fresh:
            fn = self._fns[keys] = self._trace(keys)
        if tokens is None:
            tokens = mx.array([row.token_ids], dtype=mx.int32)
        i32 = mx.int32
        try:  # (the old pool arrays are then held by the graph alone: MLX donates their buffers)
            out = fn(tokens, mx.array([pos], i32), mx.array([table[n - 1] * bs + pos % bs], i32),
                     mx.array([start], i32), *[a for i in range(self.num_layers) for a in (pool.keys[i], pool.values[i])])
        except Exception:
            if not fresh:
                raise
            # A model this path cannot trace runs its modules from now on.
            log.warning("the compiled decode forward failed to trace; decoding uncompiled", exc_info=True)
            self.failed = True
            return None
        kv = out[-2 * self.num_layers :]
        for i in range(self.num_layers):
            pool.keys[i], pool.values[i] = kv[2 * i], kv[2 * i + 1]
        if self.selection is not None:
            self.selection.hidden = out[1] if len(out) > 1 + 2 * self.num_layers else None
        return out[0]
