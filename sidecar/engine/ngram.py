"""N-gram prompt lookup (vLLM's speculative method "ngram"): numpy only, no MLX, so the
reference scheduler can propose the same drafts itself."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the continuation of the latest earlier occurrence of the longest suffix
    (n_max down to n_min tokens). A continuation that runs into the suffix itself goes on copying
    with the same period, as repeated lookups after each accepted draft would.

    Cost O(N * n_min + matches * n_max): the n_min-token matches are found in one pass, then each
    is extended backwards while it keeps matching (trying every n from n_max down, each a pass over
    the history, was O(N * n_max**2): minutes a step for a long prompt and a large n_max)."""
    N = len(tokens)
    n_hi = min(n_max, N - 1)
    if n_hi < n_min:
        return []
    # e: where an earlier n_min-token match of the suffix ends (exclusive), e < N.
    windows = sliding_window_view(tokens[: N - 1], n_min)
    ends = np.flatnonzero((windows == tokens[N - n_min:]).all(axis=1)) + n_min
    if not ends.size:
        return []
    length = np.full(ends.size, n_min)
    alive = np.ones(ends.size, bool)
    for n in range(n_min, n_hi):  # does the match ending at e extend to n + 1 tokens?
        at = ends - n - 1
        alive &= at >= 0
        alive[alive] = tokens[at[alive]] == tokens[N - n - 1]
        if not alive.any():
            break
        length[alive] = n + 1
    n = int(length.max())
    period = N - int(ends[length == n][-1])  # the latest match of the longest length
    out: list[int] = []
    for j in range(k):
        at = N + j - period
        out.append(int(tokens[at]) if at < N else out[at - N])
    return out

