"""The scenarios. Each fills flat keys of `Bench.results` (figures) and `Bench.raw` (per-repeat lists).

Sides never run at the same time (2 cores): each scenario alternates them, repeat by repeat, and
takes medians. The sidecar server is idle while mlx-lm runs and vice versa.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from bench.params import BenchParams
from bench.sides import MlxLmSide, RunResult, ServerProcess, SidecarSide, requests_for
from sidecar.scheduler import Scheduler

perf = time.perf_counter


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if xs else float("nan")


def decode_rate(times: list[float]) -> float:
    """Tokens/s after the first token: (n-1) / (t_last - t_first); prefill is excluded."""
    if len(times) < 2 or times[-1] <= times[0]:
        return float("nan")
    return (len(times) - 1) / (times[-1] - times[0])


@dataclass
class Bench:
    params: BenchParams
    sidecar: SidecarSide
    mlx: MlxLmSide
    log: Callable[[str], None]
    results: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra_servers: list[ServerProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)

    def prompt(self, n: int) -> list[int]:
        # Ids 3..499: inside every built-in tokenizer, past the special tokens (0-2). Random, so
        # two prompts share no prefix block and the scheduler's prefix cache never helps by luck.
        return self.rng.integers(3, 500, size=n).tolist()

    def prompts(self, lengths: list[int]) -> list[list[int]]:
        return [self.prompt(n) for n in lengths]


def alternate(i: int) -> tuple[str, str]:
    return ("mlx", "sidecar") if i % 2 == 0 else ("sidecar", "mlx")


def token_match(a: RunResult, b: RunResult) -> float:
    pairs = list(zip(a.tokens.values(), b.tokens.values(), strict=True))
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


# ---------------------------------------------------------------- warm-up


def warm_up(b: Bench) -> None:
    p = b.params
    t0 = perf()
    prompt = b.prompt(8)
    b.mlx.single(prompt, p.warmup_new_tokens)
    b.mlx.batch(b.prompts([4, 6, 8, 5]), p.warmup_new_tokens, 4)
    b.sidecar.run(requests_for([prompt], p.warmup_new_tokens), tag="warmup")
    b.sidecar.run(requests_for(b.prompts([4, 6, 8, 5]), p.warmup_new_tokens), tag="warmup")
    b.sidecar.run(requests_for(b.prompts([4] * 4), p.warmup_new_tokens, mixed_sampling(4)), tag="warmup")
    b.results["warmup_s"] = perf() - t0


# ---------------------------------------------------------------- 1. single stream


def single_stream(b: Bench) -> None:
    p = b.params
    prompt = b.prompt(p.single_prompt_len)
    rates: dict[str, list[float]] = {"mlx": [], "sidecar": []}
    ttft: dict[str, list[float]] = {"mlx": [], "sidecar": []}
    matches, ratios = [], []
    for i in range(p.single_repeats):
        got: dict[str, RunResult] = {}
        for side in alternate(i):
            if side == "mlx":
                got[side] = r = b.mlx.single(prompt, p.single_new_tokens)
            else:
                got[side] = r = b.sidecar.run(requests_for([prompt], p.single_new_tokens), tag="single")[0]
            times = next(iter(r.token_times.values()))
            assert len(times) == p.single_new_tokens, (side, len(times))
            rates[side].append(decode_rate(times))
            ttft[side].append(times[0])
        matches.append(token_match(got["mlx"], got["sidecar"]))
        ratios.append(rates["sidecar"][-1] / rates["mlx"][-1])
        b.log(f"single_stream {i + 1}/{p.single_repeats}: sidecar {rates['sidecar'][-1]:.2f} tok/s, "
              f"mlx-lm {rates['mlx'][-1]:.2f} tok/s")
    side, mlx = median(rates["sidecar"]), median(rates["mlx"])
    # The ratio is the median of the back-to-back pairs' ratios: a slow drift of the machine's
    # speed (common on shared VMs) cancels within a pair.
    b.results.update(
        single_stream_ratio=median(ratios), single_stream_sidecar_tok_s=side, single_stream_mlx_lm_tok_s=mlx,
        single_stream_sidecar_ms_per_token=1e3 / side, single_stream_mlx_lm_ms_per_token=1e3 / mlx,
        single_stream_sidecar_ttft_s=median(ttft["sidecar"]), single_stream_mlx_lm_ttft_s=median(ttft["mlx"]),
        single_stream_tokens_match=min(matches),
    )
    b.raw["single_stream_pair_ratios"] = ratios
    b.raw["single_stream_sidecar_tok_s"] = rates["sidecar"]
    b.raw["single_stream_mlx_lm_tok_s"] = rates["mlx"]
    # Server-side time of the decode steps: what of the per-token gap is HTTP + scheduler.
    steps = [r for r in b.sidecar.worker.records if r.tag == "single" and r.decode and r.rows == 1]
    b.results["single_stream_sidecar_step_client_ms"] = median([r.client_s * 1e3 for r in steps])
    if any(r.server_s is not None for r in steps):
        server = [r.server_s * 1e3 for r in steps if r.server_s is not None]
        b.results["single_stream_sidecar_step_server_ms"] = median(server)


# ---------------------------------------------------------------- 2. batch + the concurrency sweep


def batch_lengths(b: Bench, n: int, lo: int, hi: int) -> list[int]:
    lengths = np.linspace(lo, hi, n).round().astype(int).tolist()
    b.rng.shuffle(lengths)
    return lengths


def batch32(b: Bench) -> None:
    p = b.params
    lengths = batch_lengths(b, p.batch_requests, p.batch_prompt_min, p.batch_prompt_max)
    prompts = b.prompts(lengths)
    tps: dict[str, list[float]] = {"mlx": [], "sidecar": []}
    walls: dict[str, list[float]] = {"mlx": [], "sidecar": []}
    matches, ratios = [], []
    for i in range(p.batch_repeats):
        got = {}
        for side in alternate(i):
            if side == "mlx":
                r = b.mlx.batch(prompts, p.batch_new_tokens, p.batch_requests)
            else:
                r = b.sidecar.run(requests_for(prompts, p.batch_new_tokens), tag="batch",
                                  max_num_seqs=p.batch_requests)[0]
            assert all(len(t) == p.batch_new_tokens for t in r.tokens.values()), side
            got[side] = r
            tps[side].append(r.total_tokens / r.wall_s)
            walls[side].append(r.wall_s)
        matches.append(token_match(got["mlx"], got["sidecar"]))
        ratios.append(tps["sidecar"][-1] / tps["mlx"][-1])
        b.log(f"batch{p.batch_requests} {i + 1}/{p.batch_repeats}: sidecar {tps['sidecar'][-1]:.2f} tok/s "
              f"({walls['sidecar'][-1]:.1f}s), mlx-lm {tps['mlx'][-1]:.2f} tok/s ({walls['mlx'][-1]:.1f}s)")
    side, mlx = median(tps["sidecar"]), median(tps["mlx"])
    b.results.update(batch32_ratio=median(ratios), batch32_sidecar_tok_s=side, batch32_mlx_lm_tok_s=mlx,
                     batch32_sidecar_wall_s=median(walls["sidecar"]), batch32_mlx_lm_wall_s=median(walls["mlx"]),
                     batch32_requests=p.batch_requests, batch32_prompt_tokens=sum(lengths),
                     batch32_tokens_match=min(matches))
    steps = [r for r in b.sidecar.worker.records if r.tag == "batch"]
    b.results["batch32_sidecar_steps"] = len(steps) / max(1, p.batch_repeats)
    b.raw["batch32_sidecar_tok_s"], b.raw["batch32_mlx_lm_tok_s"] = tps["sidecar"], tps["mlx"]


def sweep(b: Bench) -> None:
    p = b.params
    out: dict[str, list[float]] = {"concurrency": list(p.sweep_concurrency), "sidecar_tok_s": [], "mlx_lm_tok_s": []}
    for i, c in enumerate(p.sweep_concurrency):
        prompts = b.prompts([p.sweep_prompt_len] * c)
        got = {}
        for side in alternate(i):
            if side == "mlx":
                r = b.mlx.batch(prompts, p.sweep_new_tokens, c)
            else:
                r = b.sidecar.run(requests_for(prompts, p.sweep_new_tokens), tag=f"sweep{c}", max_num_seqs=c)[0]
            got[side] = r.total_tokens / r.wall_s
        out["sidecar_tok_s"].append(got["sidecar"])
        out["mlx_lm_tok_s"].append(got["mlx"])
        b.results[f"sweep_c{c}_sidecar_tok_s"] = got["sidecar"]
        b.results[f"sweep_c{c}_mlx_lm_tok_s"] = got["mlx"]
        b.log(f"sweep c={c}: sidecar {got['sidecar']:.2f} tok/s, mlx-lm {got['mlx']:.2f} tok/s")
    b.raw["sweep"] = out


# ---------------------------------------------------------------- 3. RPC overhead + msgpack


def rpc_batch1_run(b: Bench) -> None:
    """A dedicated batch-1 decode run with the server's time known for every step; also how long
    the server's MLX thread waited for calls per step (the round trip it did not overlap)."""
    w = b.sidecar.worker
    i0 = w.idle_seconds()
    b.sidecar.run(requests_for([b.prompt(8)], b.params.rpc_b1_steps + 1), tag="rpc_b1", probe=True)
    i1 = w.idle_seconds()
    if i0 is not None and i1 is not None:
        b.results["rpc_b1_mlx_idle_ms_per_step"] = (i1 - i0) / (b.params.rpc_b1_steps + 1) * 1e3


def rpc_overhead(b: Bench) -> None:
    p = b.params
    w = b.sidecar.worker
    source = ("Server-Timing header" if w.header_seen else
              "mlx_worker_last_step_duration_seconds gauge from /metrics after each call (no Server-Timing header)")
    b.results["rpc_server_time_source"] = source
    if not w.header_seen:
        b.notes.append("rpc overhead: the server sent no `Server-Timing: exec;dur=` header, so its time is the "
                       "last_step_duration gauge (runner.execute_model only: excludes the SchedulerOutput "
                       "decode/validation and the result's to_wire, which therefore count as overhead here)")
    large = p.sampling_rows
    worst50, worst99 = 0.0, 0.0
    for rows in (1, large):
        recs = [r for r in w.records if r.decode and r.rows == rows and r.server_s is not None]
        over = [(r.client_s - r.server_s) * 1e3 for r in recs]
        p50, p99 = pct(over, 50), pct(over, 99)
        b.results[f"rpc_overhead_ms_p50_b{rows}"] = p50
        b.results[f"rpc_overhead_ms_p99_b{rows}"] = p99
        b.results[f"rpc_overhead_samples_b{rows}"] = len(over)
        b.results[f"rpc_server_step_ms_p50_b{rows}"] = pct([r.server_s * 1e3 for r in recs], 50)
        b.raw[f"rpc_overhead_ms_b{rows}"] = over
        worst50, worst99 = max(worst50, p50), max(worst99, p99)
    # Headline: the worse of the two batch sizes (both must meet the goal).
    b.results["rpc_overhead_ms_p50"] = worst50
    b.results["rpc_overhead_ms_p99"] = worst99
    # A call that does nothing (vocab_size), back to back and after 30 ms of idling: the transport's
    # floor, and what waking the sleeping threads (client, event loop, MLX thread) adds to it. A
    # decode step idles them for the whole forward pass, so its overhead sits near the second.
    for name, gap in (("rpc_null_ms_p50", 0.0), ("rpc_null_after_idle_ms_p50", 0.03)):
        over = []
        for _ in range(p.rpc_null_calls):
            if gap:
                time.sleep(gap)
            t0 = perf()
            w.call("vocab_size")
            if w.last_exec_seconds is not None:
                over.append((perf() - t0 - w.last_exec_seconds) * 1e3)
        b.results[name] = pct(over, 50)
    b.results.update(msgpack_figures(p.msgpack_requests, p.msgpack_repeats, b.sidecar.worker.vocab_size()))


def scheduler_outputs(n: int, prompt_len: int) -> tuple[dict, dict, dict]:
    """Real reference-scheduler outputs for n requests: the admitting step (n new requests), a
    decode step (n cached requests, some with a new block) and the worker's n-row result."""
    rng = np.random.default_rng(1)
    bs = 16
    sched = Scheduler(num_blocks=n * (prompt_len // bs + 4), block_size=bs, max_num_seqs=n,
                      max_num_batched_tokens=n * prompt_len)
    for r in requests_for([rng.integers(3, 500, prompt_len).tolist() for _ in range(n)], 64,
                          mixed_sampling(n), prefix="m"):
        sched.add_request(r)
    new = sched.schedule()
    ids = [r["req_id"] for r in new["scheduled_new_reqs"]]
    result = {"req_ids": ids, "req_id_to_index": {rid: i for i, rid in enumerate(ids)},
              "sampled_token_ids": [[int(t)] for t in rng.integers(3, 500, n)], "logprobs": None,
              "prompt_logprobs_dict": {}, "num_nans_in_logits": None}
    sched.update_from_output(new, result)
    decode = sched.schedule()
    return new, decode, result


def msgpack_figures(n: int, repeats: int, vocab_size: int) -> dict[str, float]:
    """Client encode + server decode (the server's strict decode_body) of an n-request
    SchedulerOutput, the server's validation of it, and the n-row result's way back."""
    import msgpack

    from sidecar.wire.codec import MSGPACK_TYPES, decode_body, encode_body
    from sidecar.wire.protocol import SchedulerOutput

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        ts = []
        for _ in range(repeats):
            t0 = perf()
            fn()
            ts.append(perf() - t0)
        return median(ts) * 1e3

    out: dict[str, float] = {}
    new, decode, result = scheduler_outputs(n, 128)
    for name, so in (("", decode), ("_new", new)):
        kwargs = {"scheduler_output": so}
        body = msgpack.packb(kwargs, use_bin_type=True)
        enc = timed(lambda kwargs=kwargs: msgpack.packb(kwargs, use_bin_type=True))
        dec = timed(lambda body=body: decode_body(body, MSGPACK_TYPES[0]))
        out[f"msgpack_{n}{name}_encode_ms"] = enc
        out[f"msgpack_{n}{name}_decode_ms"] = dec
        out[f"msgpack_{n}{name}_ms"] = enc + dec
        out[f"msgpack_{n}{name}_bytes"] = float(len(body))
        out[f"from_wire_{n}{name}_ms"] = timed(lambda so=so: SchedulerOutput.from_wire(
            so, vocab_size=vocab_size, max_logprobs=20))
    payload = {"result": result}
    reply = encode_body(payload, True)
    out[f"msgpack_{n}_output_ms"] = (timed(lambda: encode_body(payload, True))
                                     + timed(lambda: msgpack.unpackb(reply, raw=False, strict_map_key=False)))
    return out


# ---------------------------------------------------------------- 4. prefix caching


def prefix_ttft(b: Bench) -> None:
    p = b.params
    prefix = b.prompt(p.prefix_len)
    cold, warm, cached = [], [], []
    for i in range(p.prefix_cold_repeats):
        res, sched = b.sidecar.run(requests_for([prefix + b.prompt(p.prefix_suffix_len)], 1), tag="prefix_cold")
        cold.append(next(iter(res.first_token_s.values())))
        for _ in range(p.prefix_warm_repeats):
            reqs = requests_for([prefix + b.prompt(p.prefix_suffix_len)], 1)
            res, _ = b.sidecar.run(reqs, tag="prefix_warm", scheduler=sched)
            warm.append(next(iter(res.first_token_s.values())))
            cached.append(reqs[0].num_cached_tokens)
        b.log(f"prefix {i + 1}/{p.prefix_cold_repeats}: cold TTFT {cold[-1]:.3f}s, warm {warm[-1]:.3f}s "
              f"({cached[-1]} of {p.prefix_len + p.prefix_suffix_len} tokens cached)")
    if min(cached) < p.prefix_len - b.sidecar.block_size:
        b.notes.append(f"prefix: only {min(cached)} of the {p.prefix_len} prefix tokens were cache hits")
    b.results.update(prefix_ttft_ratio=median(warm) / median(cold), prefix_cold_ttft_s=median(cold),
                     prefix_warm_ttft_s=median(warm), prefix_cached_tokens=min(cached),
                     prefix_len=p.prefix_len, prefix_suffix_len=p.prefix_suffix_len)
    b.raw["prefix_cold_ttft_s"], b.raw["prefix_warm_ttft_s"] = cold, warm
    if p.prefix_mlx_lm_reference:
        r = b.mlx.single(prefix + b.prompt(p.prefix_suffix_len), 1)
        b.results["prefix_mlx_lm_cold_ttft_s"] = next(iter(r.first_token_s.values()))
        b.log(f"prefix: mlx-lm cold TTFT {b.results['prefix_mlx_lm_cold_ttft_s']:.3f}s")


def mixed_sampling(n: int) -> list[dict]:
    """n rows, each its own combination: temperature, top_k, top_p, min_p, the three penalties, seed."""
    temps = (0.3, 0.6, 0.8, 1.0, 1.2, 1.5, 0.7, 0.9)
    top_k = (0, 5, 20, 50, 100, -1, 200)
    top_p = (1.0, 0.9, 0.8, 0.95, 0.5)
    min_p = (0.0, 0.05, 0.1)
    pres = (0.0, 0.5, -0.3, 1.0)
    freq = (0.0, 0.2, -0.1)
    rep = (1.0, 1.1, 1.3, 0.9, 1.05)
    return [{"temperature": temps[i % 8], "top_k": top_k[i % 7], "top_p": top_p[i % 5], "min_p": min_p[i % 3],
             "presence_penalty": pres[i % 4], "frequency_penalty": freq[i % 3],
             "repetition_penalty": rep[i % 5], "seed": 1000 + i} for i in range(n)]


def log_to_stderr(t0: float) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[bench {perf() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    return log
