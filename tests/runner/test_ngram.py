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
