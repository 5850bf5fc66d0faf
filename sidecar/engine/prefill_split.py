"""mlx-lm's prefill split: a prompt's tokens but the last, then the last one alone.

mlx-lm's `generate_step` (and mlx-vlm's) prefills all of a prompt but its last token, then runs
that token as its first one-token step; a sampling chunk (one that ends at its row's known tokens)
is forwarded the same way: its head first, then its last token, with the step's decode rows
(one-token rows already run apart from prefill), so the split costs no extra forward when the
step decodes too. Two reasons, for every model:

- The head's outputs are never read, only the K/V (and recurrent state) it writes: its last
  layer's attention output and MLP run for the last token only, where a whole chunk computes
  them for every position before the logits pick one (on a model of four layers, about a fifth
  of the chunk's work).
- The same sums as the oracle: several layers compute a one-token call another way than a longer
  one (MLA's absorbed decode path, a recurrent layer's step against its chunked scan, a one-query
  attention), which in bf16/fp16 (and in recurrent state at all) moves the logits by rounding
  steps, enough to flip a near-tie.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from sidecar.kv.batch_caches import step_batches
from sidecar.engine.state import Row


def split(rows: Sequence[Row]) -> tuple[list[Row], list[Row], list[int]]:
    """(rows to forward in place of `rows`, heads to forward first, indices of the split rows).
    A row that asks for prompt logprobs (every position's logits) or verifies drafts stays whole."""
    heads: list[Row] = []
    out: list[Row] = []
    tails: list[int] = []
    for i, r in enumerate(rows):
        if len(r.token_ids) > 1 and r.sample and not r.num_draft and r.state.sampling_params.prompt_logprobs is None:
            heads.append(replace(r, token_ids=r.token_ids[:-1], sample=False))
            out.append(replace(r, start=r.end - 1, token_ids=r.token_ids[-1:]))
            tails.append(i)
        else:
            out.append(r)
    return out, heads, tails


def forward_heads(runner: Any, rows: Sequence[Row]) -> tuple[list[Row], list[int]]:
    """Forward the heads of the rows `split` splits (recurrent states stored); returns the rows the
    step's own forward then runs, in `rows`' order, and which of them are now one-token tails."""
    rows, heads, tails = split(rows)
    stores: list = []
    for group in filter(None, step_batches(heads, [], list(range(len(heads))), runner.caches)):
        runner.forward([heads[i] for i in group], group, None, {}, stores=stores)
    for store in stores:
        store()
    return rows, tails
