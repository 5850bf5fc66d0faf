from __future__ import annotations

import numpy as np

from sidecar.engine.ngram import ngram_drafts


def test_ngram_longest_match_and_its_continuation() -> None:
    t = lambda xs: np.asarray(xs, np.int32)  # noqa: E731
    # Suffix [1, 2] occurred at 0 (followed by 7, 8) and [9, 1, 2] at 4 (followed by 5, 6): longest wins.
    assert ngram_drafts(t([1, 2, 7, 8, 9, 1, 2, 5, 6, 0, 9, 1, 2]), 2, 3, 2) == [5, 6]
    assert ngram_drafts(t([1, 2, 7, 8, 9, 1, 2, 5, 6, 0, 9, 1, 2]), 2, 2, 2) == [5, 6]  # latest 2-gram match
    assert ngram_drafts(t([1, 2, 3, 4, 5]), 1, 3, 3) == []  # nothing repeats
    assert ngram_drafts(t([4, 1, 2, 3]), 2, 3, 3) == []  # below prompt_lookup_min
    # A loop of period 2 goes on copying past the end of the match.
    assert ngram_drafts(t([5, 6, 5, 6, 5, 6]), 2, 4, 3) == [5, 6, 5]
    assert ngram_drafts(t([9, 4, 4]), 1, 4, 3) == [4, 4, 4]
    assert ngram_drafts(t([3]), 1, 4, 3) == []


def _drafts_by_every_length(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """The definition, one pass over the history per length (the earlier implementation)."""
    from numpy.lib.stride_tricks import sliding_window_view

    N = len(tokens)
    for n in range(min(n_max, N - 1), n_min - 1, -1):
        hits = np.flatnonzero((sliding_window_view(tokens[: N - 1], n) == tokens[N - n:]).all(axis=1))
        if hits.size:
            period = N - n - int(hits[-1])
            out: list[int] = []
            for j in range(k):
                at = N + j - period
                out.append(int(tokens[at]) if at < N else out[at - N])
            return out
    return []


def test_drafts_equal_the_definition_and_cost_no_pass_per_length() -> None:
    rng = np.random.default_rng(3)
    found = 0
    for _ in range(1500):
        toks = rng.integers(0, int(rng.integers(1, 5)), size=int(rng.integers(0, 40))).astype(np.int32)
        n_min = int(rng.integers(1, 5))
        n_max = n_min + int(rng.integers(0, 6))
        k = int(rng.integers(1, 5))
        want = _drafts_by_every_length(toks, n_min, n_max, k)
        assert ngram_drafts(toks, n_min, n_max, k) == want, (toks.tolist(), n_min, n_max, k)
        found += bool(want)
    assert found > 500  # matches of many lengths were compared, not only misses
    # A long history of one repeated token with a large n_max: one extension step per length
    # over the matches (the definition's one pass per length is O(N * n_max**2)).
    same = np.full(20000, 7, np.int32)
    assert ngram_drafts(same, 2, 128, 3) == [7, 7, 7]
