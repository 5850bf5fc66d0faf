"""SamplingParams from the wire: vLLM's fields parsed, the rest ignored, bad values a ProtocolError
naming the field."""

from __future__ import annotations

import pytest

from sidecar.errors import ProtocolError
from sidecar.wire.sampling_params import SamplingParams

PATH = "scheduled_new_reqs[2].sampling_params"


def wire(d, vocab=100, max_logprobs=20):
    return SamplingParams.from_wire(d, vocab_size=vocab, max_logprobs=max_logprobs, path=PATH)


def test_from_wire_parses_vllm_fields_and_ignores_the_rest():
    p = wire({
        "temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.1, "seed": 42, "presence_penalty": -2,
        "frequency_penalty": 2, "repetition_penalty": 1.1, "logit_bias": {"17": -5, 3: 1.5},
        "allowed_token_ids": [1, 2, 3], "bad_words_token_ids": [[4], [5, 6]], "min_tokens": 2,
        "stop_token_ids": [7], "logprobs": 20, "prompt_logprobs": 0, "max_tokens": 16,
        "n": 1, "best_of": None, "stop": ["x"], "ignore_eos": False, "skip_special_tokens": True, "detokenize": True,
        "output_kind": 0, "include_stop_str_in_output": False, "spaces_between_special_tokens": True,
        "truncate_prompt_tokens": None, "structured_outputs": None, "guided_decoding": None, "extra_args": {"a": 1},
        "bad_words": ["foo"],
    })
    assert p == SamplingParams(0.5, 0.9, -1, 0.1, 42, -2.0, 2.0, 1.1, {17: -5.0, 3: 1.5}, (1, 2, 3), ((4,), (5, 6)),
                               2, (7,), 20, 0, 16)
    assert wire(None) == SamplingParams() == wire({"temperature": None})
    assert wire({"logprobs": -1}, max_logprobs=-1).logprobs == -1
    assert wire({"temperature": 0}).greedy and not wire({"temperature": 1e-5}).greedy


@pytest.mark.parametrize("d, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 5.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": "7"}, "seed"),
    ({"logit_bias": {"100": 1.0}}, "logit_bias[100]"),
    ({"logit_bias": {"-1": 1.0}}, "logit_bias[-1]"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias[abc]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias[5]"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),  # the whole vocabulary (100) is above max_logprobs
    ({"prompt_logprobs": 50}, "prompt_logprobs"),
    ({"logprobs": -2}, "logprobs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 100]}, "allowed_token_ids[1]"),
    ({"allowed_token_ids": 5}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids[1]"),
    ({"bad_words_token_ids": [[1], [2, -3]]}, "bad_words_token_ids[1][1]"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_from_wire_rejects(d, field):
    with pytest.raises(ProtocolError) as e:
        wire(d)
    assert e.value.field == f"{PATH}.{field}"
    with pytest.raises(ProtocolError) as e:
        SamplingParams.from_wire([1], vocab_size=100, max_logprobs=20, path=PATH)
    assert e.value.field == PATH
