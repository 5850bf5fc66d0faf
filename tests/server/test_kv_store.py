"""The disk KV tier end to end: a real server on a real socket, the reference scheduler and
RemoteWorker; a restarted server serves a long prompt's prefix from the store with mlx-lm's
tokens, a corrupted entry is recomputed (tokens still exact), and /info and /metrics count it."""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx

from sidecar.client.remote import RemoteWorker
from sidecar.scheduler import Request, Scheduler, run
from tests.conftest import mlx_lm_greedy
from tests.server.serverproc import start_server

FLAGS = ("--preload", "--max-num-batched-tokens", "64", "--max-num-seqs", "4", "--max-model-len", "1024")


def _generate(url: str, prompt: list[int], n: int) -> list[int]:
    rw = RemoteWorker(url)
    info = httpx.get(f"{url}/info").json()
    sched = Scheduler(num_blocks=info["num_blocks"], block_size=info["block_size"], max_num_batched_tokens=64,
                      kv_store_lookup=rw.kv_store_lookup)
    sched.add_request(Request(f"r{random.random()}", prompt, {"temperature": 0.0}, max_tokens=n, ignore_eos=True))
    done = run(sched, lambda out: rw.execute_model(out).to_wire())
    rw.close()
    return next(iter(done.values())).output_token_ids


def _store_info(url: str) -> dict:
    deadline = time.monotonic() + 30
    while True:  # the writer drains asynchronously
        info = httpx.get(f"{url}/info").json()["kv_store"]
        if info["write_queue_depth"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def test_a_restarted_server_serves_the_prefix_from_the_store(home, oracle_model, tmp_path: Path):
    rng = random.Random(1)
    prompt = [rng.randrange(1, 250) for _ in range(300)]
    want, _ = mlx_lm_greedy(oracle_model("builtin:tiny"), prompt, 8)
    store = str(tmp_path / "kv")
    with start_server(*FLAGS, "--kv-store-dir", store, "--kv-store-max-gb", "1") as s:
        assert _generate(s.url, prompt, 8) == want
        first = _store_info(s.url)
    assert first["saved_blocks"] == (300 + 7) // 16 and first["loaded_blocks"] == 0 and first["size_bytes"] > 0
    with start_server(*FLAGS, "--kv-store-dir", store, "--kv-store-max-gb", "1") as s:  # a new process
        assert _generate(s.url, prompt, 8) == want
        second = _store_info(s.url)
        assert second["loaded_blocks"] == (300 - 1) // 16 and second["failed_loads"] == 0
        metrics = httpx.get(f"{s.url}/metrics").text
        assert f"mlx_worker_kv_store_loaded_blocks_total {float((300 - 1) // 16)}" in metrics
        # Damage one entry: its load fails, the scheduler recomputes from there, tokens stay exact.
        # The largest segment holds a prefill step's prompt blocks (the block holding output tokens,
        # which a lookup of the prompt never loads, is saved alone by a decode step); segment names
        # are random, so the first by name could be that one.
        victim = max(Path(store).glob("segments/*.kvs"), key=lambda p: p.stat().st_size)
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x55
        victim.write_bytes(bytes(raw))
        assert _generate(s.url, prompt, 8) == want
        third = _store_info(s.url)
        assert third["corrupt_entries"] == 1
        assert third["failed_loads"] >= 1 or third["loaded_blocks"] < 2 * second["loaded_blocks"]
