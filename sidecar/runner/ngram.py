"""N-gram prompt lookup (vLLM's speculative method "ngram"): numpy only, no MLX, so the
reference scheduler can propose the same drafts itself."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the continuation of the latest earlier occurrence of the longest suffix
    (n_max down to n_min tokens). A continuation that runs into the suffix itself goes on copying
    with the same period, as repeated lookups after each accepted draft would."""
    N = len(tokens)
    for n in range(min(n_max, N - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: N - 1], n)  # start i: tokens[i : i + n], i + n < N
        hits = np.flatnonzero((windows == tokens[N - n:]).all(axis=1))
        if hits.size:
            period = N - n - int(hits[-1])
            out: list[int] = []
            for j in range(k):
                at = N + j - period
                out.append(int(tokens[at]) if at < N else out[at - N])
            return out
    return []


def ngram_may_match(prompt: list[int], output: list[int], n_min: int) -> bool:
    """Whether `ngram_drafts` could find a match once one more token follows prompt + output,
    whatever that token is: a match of n >= n_min tokens ends with the last n_min - 1 of them,
    which must then occur earlier, followed by a token."""
    m = n_min - 1
    N = len(prompt) + len(output)
    if m <= 0:
        return N > 0
    if N <= m:
        return False
    tokens = np.asarray(prompt + output, np.int32)
    windows = sliding_window_view(tokens[: N - 1], m)  # start i: tokens[i : i + m], i + m < N
    return bool((windows == tokens[N - m:]).all(axis=1).any())
