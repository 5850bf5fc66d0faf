from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.engine.placeholders import check_placeholder
from sidecar.engine.state import RequestState
from sidecar.wire.sampling_params import SamplingParams


def _state(outputs: list[int]) -> RequestState:
    return RequestState("r", [4, 5, 6], SamplingParams(), [0], num_computed_tokens=3, output_token_ids=outputs)


def test_a_placeholder_stands_for_the_last_sampled_token_only() -> None:
    check_placeholder(_state([9]), 3, "p")  # prompt of 3 + 1 sampled: the placeholder sits at 3
    check_placeholder(_state([9, 8]), 4, "p")
    with pytest.raises(ProtocolError) as e:
        check_placeholder(_state([]), 2, "scheduled_cached_reqs.new_token_ids[0]")  # nothing sampled yet
    assert e.value.field == "scheduled_cached_reqs.new_token_ids[0]" and "sampled no token" in str(e.value)
    with pytest.raises(ProtocolError) as e:
        check_placeholder(_state([9, 8]), 3, "p")  # not the last token's position
    assert e.value.field == "p" and "position 4" in str(e.value)
