from __future__ import annotations

import numpy as np

from sidecar.runner.ngram import ngram_drafts


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


def test_may_match_is_exactly_whether_some_next_token_gives_drafts() -> None:
    """ngram_may_match (the runner's cue to sample lazily with a proposer) against brute force:
    true iff some next token makes ngram_drafts find a match, on random short histories."""
    from sidecar.runner.ngram import ngram_may_match

    rng = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for _ in range(400):
        n = int(rng.integers(0, 12))
        hist = rng.integers(0, 4, size=n).tolist()
        split = int(rng.integers(0, n + 1))
        n_min, n_max = int(rng.integers(1, 4)), 4
        want = any(ngram_drafts(np.asarray(hist + [t], np.int32), n_min, n_max, 2) for t in range(4))
        got = ngram_may_match(hist[:split], hist[split:], n_min)
        assert got == want, (hist, n_min)
        seen[got] += 1
    assert min(seen.values()) > 50  # both answers exercised
