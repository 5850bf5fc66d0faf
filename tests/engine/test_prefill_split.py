"""mlx-lm's prefill split (recurrent or half-precision models): a sampling chunk forwards its head, then its last
token; rows that need every position (prompt logprobs) or verify drafts are left whole."""

from __future__ import annotations

from sidecar.engine.state import RequestState, Row
from sidecar.engine.sampler import SamplingParams
from sidecar.engine.prefill_split import split


def _row(tokens: list[int], start: int = 0, sample: bool = True, num_draft: int = 0, **params: object) -> Row:
    state = RequestState("r", list(range(1, 20)), SamplingParams(temperature=0.0, **params), [0, 1, 2, 3, 4])
    return Row(state, start, tokens, state.block_ids, sample, num_draft)


def test_a_sampling_chunk_is_split_before_its_last_token() -> None:
    r = _row([5, 6, 7, 8], start=3)
    rows, heads, tails = split([r])
    assert tails == [0]
    assert [(h.start, h.token_ids, h.sample) for h in heads] == [(3, [5, 6, 7], False)]
    assert [(x.start, x.token_ids, x.sample, x.end) for x in rows] == [(6, [8], True, r.end)]
    assert r.token_ids == [5, 6, 7, 8]  # the step's own rows are not changed


def test_rows_left_whole() -> None:
    keep = [_row([5]), _row([5, 6, 7], sample=False), _row([5, 6, 7], num_draft=2),
            _row([5, 6, 7], prompt_logprobs=1)]
    rows, heads, tails = split(keep)
    assert heads == [] and tails == [] and rows == keep
