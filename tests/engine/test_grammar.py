from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from sidecar.errors import ProtocolError
from sidecar.engine.grammar import apply_grammar, decode_grammar

V = 70  # three 32-bit words, the last one partly past the vocabulary


def _mask(allowed: list[int]) -> np.ndarray:
    words = np.zeros(3, np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words


def test_bits_map_to_tokens_per_row_in_both_encodings() -> None:
    allowed = [0, 31, 32, 63, 69]  # word edges, bit 31 (the int32 sign bit), the last token
    m = _mask(allowed)
    for raw in (m.view(np.int32).astype("<i4").tobytes(), [m.tolist()]):
        g = decode_grammar({"structured_output_request_ids": ["b"], "grammar_bitmask": raw}, ["a", "b"], V)
        out = np.array(apply_grammar(mx.zeros((2, V)), g))
        assert np.flatnonzero(np.isfinite(out[1])).tolist() == allowed
        assert np.isfinite(out[0]).all()  # the row without a grammar is untouched
    assert apply_grammar(mx.ones((1, V)), None).tolist() == [[1.0] * V]


@pytest.mark.parametrize("bad, field", [
    ({"structured_output_request_ids": ["a", "a"], "grammar_bitmask": b"\0" * 24}, "grammar_output.structured_output_request_ids"),
    ({"structured_output_request_ids": ["a"], "grammar_bitmask": [[1, 2]]}, "grammar_output.grammar_bitmask[0]"),
    ({"structured_output_request_ids": ["a"], "grammar_bitmask": [[1, 2, 1 << 32]]}, "grammar_output.grammar_bitmask[0][2]"),
    ({"structured_output_request_ids": ["a"]}, "grammar_output.grammar_bitmask"),
    ([], "grammar_output"),
])
def test_bad_grammar_output_names_the_field(bad: object, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_grammar(bad, ["a"], V)
    assert e.value.field == field
