"""Structured outputs (protocol v2): vLLM's grammar bitmask, decoded and applied to a step's logits.

vLLM computes the bitmask in its own process (xgrammar) while the forward runs and sends it with
`sample_tokens`: one row per structured-output request, `ceil(vocab/32)` int32 words per row, bit
`v % 32` of word `v // 32` set when token v is allowed. Rows are applied in one vectorised where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import check, get, list_of

PATH = "grammar_output"


@dataclass
class GrammarMask:
    rows: list[int]  # row index in the step's batch, one per bitmask row
    bitmask: np.ndarray  # [len(rows), words] int32


def decode_grammar(d: Any, req_ids: Sequence[str], vocab_size: int) -> GrammarMask | None:
    """Validate `grammar_output` against the pending step's request ids (400 naming the field)."""
    if d is None:
        return None
    check(d, dict, PATH)
    ids = list_of(get(d, "structured_output_request_ids", list, PATH), f"{PATH}.structured_output_request_ids",
                  lambda v, p: check(v, str, p))
    index = {rid: i for i, rid in enumerate(req_ids)}
    rows = []
    for i, rid in enumerate(ids):
        if rid not in index:
            raise ProtocolError(f"request {rid!r} is not in the pending step",
                                field=f"{PATH}.structured_output_request_ids[{i}]")
        rows.append(index[rid])
    if len(set(rows)) != len(rows):
        raise ProtocolError("a request is listed twice", field=f"{PATH}.structured_output_request_ids")
    words = -(-vocab_size // 32)
    raw = get(d, "grammar_bitmask", (bytes, list), PATH)
    field = f"{PATH}.grammar_bitmask"
    if isinstance(raw, bytes):  # msgpack bin: little-endian int32, row-major
        if len(raw) != 4 * words * len(ids):
            raise ProtocolError(f"expected {len(ids)} rows x {words} int32 words ({4 * words * len(ids)} bytes), "
                                f"got {len(raw)} bytes", field=field)
        mask = np.frombuffer(raw, "<i4").reshape(len(ids), words).astype(np.int32)
    else:  # JSON: a list of rows of ints (int32 or uint32 values)
        if len(raw) != len(ids):
            raise ProtocolError(f"expected {len(ids)} rows, got {len(raw)}", field=field)
        mask = np.zeros((len(ids), words), np.int64)
        for i, row in enumerate(raw):
            if not isinstance(row, list) or len(row) != words:
                raise ProtocolError(f"expected a list of {words} ints", field=f"{field}[{i}]")
            for j, w in enumerate(row):
                if isinstance(w, bool) or not isinstance(w, int) or not -(1 << 31) <= w < (1 << 32):
                    raise ProtocolError("expected a 32-bit int", field=f"{field}[{i}][{j}]")
            mask[i] = row
        mask = mask.astype(np.uint32).view(np.int32)
    return GrammarMask(rows, mask)


def apply_grammar(logits: mx.array, g: GrammarMask | None) -> mx.array:
    """Disallowed tokens of the masked rows -> -inf; other rows unchanged."""
    if g is None or not g.rows:
        return logits
    R, V = logits.shape
    full = np.full((R, g.bitmask.shape[1]), -1, np.int32)  # all bits set: no constraint
    full[g.rows] = g.bitmask
    v = mx.arange(V, dtype=mx.int32)
    bits = (mx.array(full)[:, v // 32] >> (v % 32)) & 1
    return mx.where(bits.astype(mx.bool_), logits, -mx.inf)
