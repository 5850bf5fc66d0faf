"""Placeholders for tokens the scheduler has not seen yet (protocol v2, pipelined steps).

A scheduler with two steps in flight sends step n + 1 before step n's reply arrives. For a
request step n samples, it sends `new_token_ids[i] = [-1]`: "the token you sampled for it last,
at position `num_computed_tokens`". The worker fills it from its own state (it ran step n
first: steps run in arrival order), so nothing waits on the network. Plain Python, no MLX.
"""

from __future__ import annotations

from sidecar.errors import ProtocolError
from sidecar.engine.state import RequestState

PLACEHOLDER = [-1]  # vLLM's async scheduler uses -1 for a token not sampled yet


def check_placeholder(state: RequestState, start: int, path: str) -> None:
    """A placeholder stands for the request's last sampled token, which must be the one computed now."""
    if not state.output_token_ids:
        raise ProtocolError(f"a placeholder token for {state.req_id!r}, which has sampled no token yet", field=path)
    if start != state.num_tokens - 1:
        raise ProtocolError(f"a placeholder token for {state.req_id!r} stands for its last sampled token, at "
                            f"position {state.num_tokens - 1}; num_computed_tokens is {start}", field=path)
