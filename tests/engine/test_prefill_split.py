"""mlx-lm's prefill split (every model): a sampling chunk forwards its head, then its last
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


def test_a_full_precision_model_prefills_its_head_then_its_last_token(make_worker) -> None:
    """builtin:tiny is float32: its sampling chunk still runs head first (only its K/V is read:
    the head's last layer is never computed past it), its last token apart; a chunk that does not
    reach the prompt's end (no sample) runs whole."""
    from tests.driver import Driver

    w = make_worker("builtin:tiny")
    forwarded: list[list[int]] = []
    forward = w.runner.forward
    w.runner.forward = lambda rows, *a, **k: (forwarded.append([len(r.token_ids) for r in rows]), forward(rows, *a, **k))[1]
    d = Driver(w.execute_model, w.config.block_size, w.runner.num_blocks)
    d.add("a", list(range(5, 25)))
    d.step(chunk=12)  # 12 of 20 tokens: no sample
    assert forwarded[0] == [12]
    forwarded.clear()
    d.step(chunk=12)  # the last 8: sampled
    assert forwarded[:2] == [[7], [1]]
