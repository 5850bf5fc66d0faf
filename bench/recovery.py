"""`python -m bench --recovery`: how long a sidecar restart costs the vLLM worker class's recovery
(sidecar/vllm/recovery.py, driven here directly with wire steps, as the worker class sends them).

8 streams with 1k-token contexts on builtin:small are prefilled and decode a few tokens; the
sidecar is killed (SIGKILL) and a new one started on the same port. Measured: from the new
sidecar's first /healthz answer to the reply of the interrupted decode step (wait + rebuild +
refill + the step), and the refill alone, against the cold prefill of the same 8 contexts that
the same run did on its first sidecar minutes before (what vLLM would pay to recompute them; the
undisturbed run's cold prefill is reported too). The tokens after recovery must equal an
undisturbed run's.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

from bench.report import write_json
from bench.sides import ServerProcess
from sidecar.client.remote import RemoteWorker
from sidecar.vllm.recovery import Recovering

BS, BUDGET, SEQS = 16, 1024, 8


def _lifecycle(rec: Recovering, blocks: int) -> None:
    rec.call("init_device", config={"block_size": BS, "max_model_len": 4096, "max_num_seqs": SEQS,
                                    "max_num_batched_tokens": BUDGET}, reset=True)
    rec.call("load_model")
    rec.call("determine_available_memory", kv_cache_memory_bytes=1 << 30)
    rec.call("initialize_cache", num_gpu_blocks=blocks, num_cpu_blocks=0)


def _prefill_steps(ctxs: list[list[int]]) -> list[dict]:
    """Each context in its own blocks, chunked within the budget; the last chunk samples."""
    steps, per = [], -(-max(map(len, ctxs)) // BS) + 8
    for i, ctx in enumerate(ctxs):
        table = list(range(i * per, (i + 1) * per))
        for start in range(0, len(ctx), BUDGET):
            n = min(BUDGET, len(ctx) - start)
            if start == 0:
                step = {"scheduled_new_reqs": [{"req_id": f"r{i}", "prompt_token_ids": ctx, "sampling_params":
                        {"temperature": 0.0}, "block_ids": [table], "num_computed_tokens": 0, "lora_request": None}],
                        "scheduled_cached_reqs": {"req_ids": []}}
            else:
                step = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
                    "req_ids": [f"r{i}"], "new_token_ids": [[]], "new_block_ids": [None], "num_computed_tokens": [start],
                    "num_output_tokens": [0], "resumed_req_ids": []}}
            steps.append({**step, "num_scheduled_tokens": {f"r{i}": n}, "total_num_scheduled_tokens": n})
    return steps


def _decode(computed: dict[str, int], step_id: int) -> dict:
    rids = sorted(computed)
    so = {"scheduled_new_reqs": [], "scheduled_cached_reqs": {
        "req_ids": rids, "new_token_ids": [[] for _ in rids], "new_block_ids": [None] * len(rids),
        "num_computed_tokens": [computed[r] for r in rids], "num_output_tokens": [0] * len(rids), "resumed_req_ids": []},
        "num_scheduled_tokens": {r: 1 for r in rids}, "total_num_scheduled_tokens": len(rids)}
    return {"scheduler_output": so, "step_id": step_id}


def _run(server: ServerProcess, ctxs: list[list[int]], decodes: int, kill_at: int | None) -> dict[str, Any]:
    remote = RemoteWorker(server.url, pin_instance=True)
    rec = Recovering(remote, where=f"MLX sidecar at {server.url}", recover_timeout=300, block_size=BS,
                     budget=BUDGET, max_seqs=SEQS, prefix_cache=True)
    per = -(-max(map(len, ctxs)) // BS) + 8
    _lifecycle(rec, per * len(ctxs))
    t0 = time.perf_counter()
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ctxs))}
    step_id = 1
    for so in _prefill_steps(ctxs):
        out = rec.call("execute_model", scheduler_output=so, step_id=step_id)
        step_id += 1
        for rid, t in zip(out["req_ids"], out["sampled_token_ids"]):
            tokens[rid] += t
    cold = time.perf_counter() - t0
    result: dict[str, Any] = {"cold_prefill_s": cold}
    for d in range(decodes):
        computed = {rid: len(ctxs[int(rid[1:])]) + len(t) - 1 for rid, t in tokens.items()}
        if d == kill_at:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(30)
            server.start()
            healthy = time.perf_counter()
        out = rec.call("execute_model", **_decode(computed, step_id))
        step_id += 1
        if d == kill_at:
            result["healthz_to_token_s"] = time.perf_counter() - healthy
            result["recoveries"] = rec.recoveries
            result["phases"] = {k: v for k, v in rec.last.items() if k.endswith("_s")}
            result["refill_s"] = rec.last.get("refill_s")
            result["refilled_tokens"] = rec.last.get("tokens")
        for rid, t in zip(out["req_ids"], out["sampled_token_ids"]):
            tokens[rid] += t
    result["tokens"] = tokens
    remote.close()
    return result


def run_recovery_bench(home: str | None = None, *, quick: bool = False, model: str = "builtin:small") -> dict[str, Any]:
    n, ctx = (4, 256) if quick else (8, 1000)
    rng = random.Random(0)
    ctxs = [[rng.randrange(3, 500) for _ in range(ctx)] for _ in range(n)]
    extra = {"max_num_batched_tokens": BUDGET, "max_num_seqs": SEQS, "max_model_len": 4096}
    base = ServerProcess(model, home, extra=extra).start(timeout=600)
    try:
        undisturbed = _run(base, ctxs, 4, None)
    finally:
        base.stop()
    server = ServerProcess(model, home, extra=extra).start(timeout=600)
    try:
        disturbed = _run(server, ctxs, 4, 2)
    finally:
        server.stop()
    cold = disturbed["cold_prefill_s"]  # the same run's own cold prefill: the nearest in time (load varies)
    return {"model": model, "streams": n, "context_tokens": ctx, "load_average": os.getloadavg(),
            "cold_prefill_s": cold, "undisturbed_cold_prefill_s": undisturbed["cold_prefill_s"],
            "healthz_to_token_s": disturbed["healthz_to_token_s"], "ratio": disturbed["healthz_to_token_s"] / cold,
            "phases": disturbed["phases"], "refill_s": disturbed["refill_s"],
            "refilled_tokens": disturbed["refilled_tokens"], "refill_ratio": disturbed["refill_s"] / cold,
            "tokens_equal": disturbed["tokens"] == undisturbed["tokens"], "recoveries": disturbed["recoveries"]}


def recovery_bench_cli(home: str | None, quick: bool, json_path: str) -> int:
    doc = run_recovery_bench(home, quick=quick)
    write_json(json_path.replace("bench.json", "recovery.json"), doc)
    print(f"sidecar restart under the vLLM worker class's recovery: {doc['streams']} streams x "
          f"{doc['context_tokens']} tokens of context on {doc['model']} (load average "
          + " ".join(f"{x:.1f}" for x in doc["load_average"]) + ")")
    print(f"  new sidecar's /healthz -> first token after recovery: {doc['healthz_to_token_s']:.2f} s, "
          f"{doc['ratio']:.2f}x the cold prefill of the same contexts ({doc['cold_prefill_s']:.2f} s; an "
          f"undisturbed run's: {doc['undisturbed_cold_prefill_s']:.2f} s)")
    p = doc["phases"]
    print(f"  of which: wait {p['waited_s']:.2f} s, start-up (init_device, load_model, memory check, cache) "
          f"{p['start_up_s']:.2f} s, refill of {doc['refilled_tokens']} tokens {p['refill_s']:.2f} s "
          f"({doc['refill_ratio']:.2f}x), the interrupted step {p['replay_s'] + doc['healthz_to_token_s'] - p['waited_s'] - p['rebuild_s']:.2f} s")
    print(f"  tokens after recovery equal the undisturbed run's: {doc['tokens_equal']}")
    return 0 if doc["tokens_equal"] and doc["recoveries"] == 1 else 1
