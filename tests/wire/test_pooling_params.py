"""pooling_params on the wire: vLLM's names, defaults, and each bad value a 400 naming its field."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.pooling_params import PoolingModel, PoolingParams
from sidecar.wire.protocol import SchedulerOutput


def step(pooling: object, sampling: object = None) -> dict:
    req = {"req_id": "a", "prompt_token_ids": [1, 2], "block_ids": [[0]], "num_computed_tokens": 0,
           "pooling_params": pooling, "sampling_params": sampling}
    return {"scheduled_new_reqs": [req], "num_scheduled_tokens": {"a": 2}, "total_num_scheduled_tokens": 2}


def test_defaults_and_vllm_fields() -> None:
    so = SchedulerOutput.from_wire(step({"skip_reading_prefix_cache": False, "requires_token_ids": False}),
                                   vocab_size=10, max_logprobs=5)
    assert so.scheduled_new_reqs[0].pooling_params == PoolingParams("embed", None, None, True)
    assert SchedulerOutput.from_wire(step(None), vocab_size=10, max_logprobs=5).scheduled_new_reqs[0].pooling_params is None


@pytest.mark.parametrize("pooling,sampling,field", [
    ({"task": "score"}, None, "pooling_params.task"),  # removed in vLLM: classify
    ({"pooling_type": "ALL"}, None, "pooling_params.pooling_type"),  # ALL is per token
    ({"task": "token_embed", "pooling_type": "MEAN"}, None, "pooling_params.pooling_type"),
    ({"dimensions": 0}, None, "pooling_params.dimensions"),
    ({"dimensions": True}, None, "pooling_params.dimensions"),
    ({"task": "token_classify", "dimensions": 4}, None, "pooling_params.dimensions"),
    ({"use_activation": 1}, None, "pooling_params.use_activation"),
    ([], None, "pooling_params"),
    ({}, {"temperature": 0.0}, "pooling_params"),
])
def test_bad_values_name_the_field(pooling: object, sampling: object, field: str) -> None:
    with pytest.raises(ProtocolError) as e:
        SchedulerOutput.from_wire(step(pooling, sampling), vocab_size=10, max_logprobs=5)
    assert e.value.field == f"scheduled_new_reqs[0].{field}"


def test_model_resolves_the_default_type_and_checks_its_limits() -> None:
    m = PoolingModel(hidden_size=8, default_type="MEAN")
    assert m.resolve(PoolingParams(), "p").pooling_type == "MEAN"
    assert m.resolve(PoolingParams("token_embed"), "p").pooling_type == "ALL"
    for p, field in ((PoolingParams(dimensions=9), "p.dimensions"), (PoolingParams("classify"), "p.task")):
        with pytest.raises(ProtocolError) as e:
            m.resolve(p, "p")
        assert e.value.field == field
