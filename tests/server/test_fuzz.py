"""Seeded byte-level mutation fuzzing of real bodies against a real server, over one raw keep-alive
HTTP connection: every mutant (bit flips, byte sets, inserts, deletes, truncations, splices of
other bodies) is answered 200 or 4xx, with no 5xx and no dropped connection; afterwards a valid
step still gives mlx-lm's tokens.

MLX_SIDECAR_FUZZ_N sets the number of mutants (default 5,000 in `make test`; `make fuzz` runs
200,000), MLX_SIDECAR_FUZZ_SEED the seed (default 9); a failure names the seed, the index and the
mutant's bytes so it can be replayed.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket

import httpx
import msgpack
import pytest

from tests.conftest import mlx_lm_greedy
from tests.server.serverproc import finish, prefill

N = int(os.environ.get("MLX_SIDECAR_FUZZ_N", "5000"))
SEED = int(os.environ.get("MLX_SIDECAR_FUZZ_SEED", "9"))
MP, JS = "application/msgpack", "application/json"
PROMPT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


class Http:
    """HTTP/1.1 over one kept-alive socket, parsed by hand: the least client time per call."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.sock = socket.create_connection(self.addr)
        self.buf = b""

    def post(self, method: str, body: bytes, ctype: str) -> tuple[int, bytes]:
        self.sock.sendall(b"POST /rpc/%s HTTP/1.1\r\nhost: f\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                          % (method.encode(), ctype.encode(), len(body)) + body)
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(int(v) for k, _, v in (ln.partition(b":") for ln in lines[1:]) if k.lower() == b"content-length")
        while len(self.buf) < length:
            self._more()
        reply, self.buf = self.buf[:length], self.buf[length:]
        if any(ln.lower() == b"connection: close" for ln in lines[1:]):
            raise ConnectionError("the server closed the connection")
        return status, reply

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server dropped the connection")
        self.buf += data

    def close(self) -> None:
        self.sock.close()


def seed_bodies() -> list[tuple[str, str, bytes]]:
    new = prefill("fz-new", 6, first_block=10)
    new["scheduled_new_reqs"][0]["sampling_params"] = {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "logit_bias": {5: -1.0, 6: 2.0},
        "logprobs": 2, "prompt_logprobs": 1, "stop_token_ids": [2], "min_tokens": 1, "repetition_penalty": 1.1}
    cached = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
        "req_ids": ["fz-live"], "resumed_req_ids": [], "new_token_ids": [[]], "new_block_ids": [[[3]]],
        "num_computed_tokens": [len(PROMPT)], "num_output_tokens": [1]},
        "num_scheduled_tokens": {"fz-live": 1}, "total_num_scheduled_tokens": 1,
        "finished_req_ids": ["gone"], "preempted_req_ids": [], "scheduled_spec_decode_tokens": {},
        "num_common_prefix_blocks": [0]}
    mp = lambda **kw: msgpack.packb(kw)  # noqa: E731
    js = lambda **kw: json.dumps(kw).encode()  # noqa: E731
    lora = {"lora_int_id": 3, "lora_name": "x", "lora_path": "one/two"}
    return [
        ("execute_model", MP, mp(scheduler_output=new)),
        ("execute_model", MP, mp(scheduler_output=cached, step_id=None)),
        ("execute_model", JS, js(scheduler_output=new)),
        ("execute_model", JS, js(scheduler_output=cached)),
        ("check_health", MP, mp()),
        ("check_health", JS, b"{}"),
        ("add_lora", MP, mp(lora_request=lora)),
        ("add_lora", JS, js(lora_request=lora)),
        ("init_device", JS, js(config={"block_size": 16, "seed": 1})),
        ("wake_up", MP, mp(tags=["weights", "kv_cache"])),
        ("remove_lora", MP, mp(lora_id=1)),
        ("get_kv_cache_spec", MP, mp()),
    ]


def mutate(body: bytes, others: list[bytes], rng: random.Random) -> bytes:
    b = bytearray(body)
    for _ in range(rng.choice((1, 1, 2, 3))):
        op = rng.random()
        pos = rng.randrange(len(b) + 1)
        if op < 0.3 and b:
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op < 0.45 and b:
            b[min(pos, len(b) - 1)] = rng.choice((0x00, 0x7F, 0x80, 0xC0, 0xC1, 0xC7, 0xD4, 0xD6, 0xDC, 0xDE, 0xFF,
                                                   rng.randrange(256)))
        elif op < 0.6:
            b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        elif op < 0.75 and b:
            del b[pos:pos + rng.randint(1, 8)]
        elif op < 0.85:
            del b[pos:]
        else:
            src = rng.choice(others)
            i = rng.randrange(len(src))
            chunk = src[i:i + rng.randint(1, 32)]
            b[pos:pos + rng.randint(0, 8)] = chunk
    return bytes(b)


@pytest.fixture
def server(shared_server):
    return shared_server  # --max-live-requests 4: mutants that create requests soon meet the limit


def test_mutated_bodies_get_200_or_4xx_and_the_worker_still_matches_mlx_lm(server, oracle_model) -> None:
    http = Http(server.url)
    num_blocks = httpx.get(f"{server.url}/info").json()["num_blocks"]
    live = prefill("fz-live", len(PROMPT))
    live["scheduled_new_reqs"][0]["prompt_token_ids"] = PROMPT
    assert http.post("execute_model", msgpack.packb({"scheduler_output": live}), MP)[0] == 200
    bodies = seed_bodies()
    for method, ctype, body in bodies:  # the seeds themselves are answered (200 or 4xx) too
        assert http.post(method, body, ctype)[0] < 500
    rng = random.Random(SEED)
    raw = [b for _, _, b in bodies]
    counts: collections.Counter[int] = collections.Counter()
    for i in range(N):
        method, ctype, body = rng.choice(bodies)
        mutant = mutate(body, raw, rng)
        try:
            status, reply = http.post(method, mutant, ctype)
        except ConnectionError as e:
            raise AssertionError(f"seed {SEED} mutant {i} ({method}, {ctype}): {e}; body {mutant!r}") from None
        assert 200 <= status < 500 and status not in (404, 405, 415), (
            f"seed {SEED} mutant {i} ({method}, {ctype}): {status} {reply[:300]!r}; body {mutant!r}")
        counts[status] += 1
    assert counts[400] > N // 2 and counts[200] > 0, counts  # the mutants reached the decoder and past it
    # The worker is intact: a fresh cache, then a clean request gives mlx-lm's greedy tokens.
    assert http.post("initialize_cache", msgpack.packb({"num_gpu_blocks": num_blocks}), MP)[0] == 200
    so = prefill("clean", len(PROMPT))
    so["scheduled_new_reqs"][0]["prompt_token_ids"] = PROMPT
    tokens = []
    status, reply = http.post("execute_model", msgpack.packb({"scheduler_output": so}), MP)
    assert status == 200, reply
    tokens += msgpack.unpackb(reply)["result"]["sampled_token_ids"][0]
    for n in range(5):
        pos = len(PROMPT) + n
        step = {"scheduled_cached_reqs": {"req_ids": ["clean"], "new_token_ids": [[]], "new_block_ids": [None],
                                          "num_computed_tokens": [pos]},
                "num_scheduled_tokens": {"clean": 1}, "total_num_scheduled_tokens": 1}
        status, reply = http.post("execute_model", msgpack.packb({"scheduler_output": step}), MP)
        assert status == 200, reply
        tokens += msgpack.unpackb(reply)["result"]["sampled_token_ids"][0]
    assert tokens == mlx_lm_greedy(oracle_model("builtin:tiny"), PROMPT, 6)[0]
    assert http.post("execute_model", msgpack.packb({"scheduler_output": finish("clean")}), MP)[0] == 200
    http.close()
