"""bench/vllm_client.py: vLLM's benchmark client reads streams that carry SSE comments (heartbeats)."""

from __future__ import annotations

import json

from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

from bench.vllm_client import add_chunk

# As the client hands them over: one network chunk per write, each stripped of its whitespace.
STREAM = [b": heartbeat", b'data: {"choices": [{"text": "a"}]}', b": heartbeat",
          b'data: {"choices": [{"text": "b"}]}\n\ndata: {"choices": [{"text": "c"}]}', b"data: [DONE]"]


def events(add) -> list[str]:
    handler, out = StreamedResponseHandler(), []
    for chunk in STREAM:
        for message in add(handler, chunk):
            if not message.startswith(":"):  # what the client skips itself
                chunk_ = message.removeprefix("data: ")
                out.append(chunk_ if chunk_ == "[DONE]" else json.loads(chunk_)["choices"][0]["text"])
    return out


def test_comments_are_dropped_and_every_event_read() -> None:
    assert events(add_chunk) == ["a", "b", "c", "[DONE]"]


def test_the_unpatched_client_loses_the_events_after_a_comment() -> None:
    # The negative control: without the fix, the stream yields no event at all (counted as failed).
    assert events(StreamedResponseHandler.add_chunk) != ["a", "b", "c", "[DONE]"]
