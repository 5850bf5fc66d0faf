"""Two single-stream workloads where per-step costs and KV traffic show (issue 11).

- `tiny_single_stream`: greedy decode on builtin:tiny, whose forward is ~1 ms, so the fixed cost
  of a step (HTTP, msgpack, validation, layout, sampling) is what the ratio measures.
- `long_context`: one stream decoding after N tokens of context (1k/4k/16k) on builtin:longctx,
  whose KV at 4k (16 MiB) outweighs its weights (10 MiB): the ratio measures how each side reads
  its KV. Each length is prefilled once per side and every repeat starts from that state (the
  sidecar from a copy of the reference scheduler taken right after the prefill, its prompt
  blocks cached; mlx-lm with its prompt cache trimmed back), so repeats cost decode only and
  each sees the same block tables (reusing one scheduler instead would leave the previous
  repeat's generated blocks cached right behind the prompt's, and the tail lands elsewhere).

At `long_kv8_context` the same runs on a server with `--kv-dtype 8bit` against mlx-lm with a
QuantizedKVCache of 8 bits (`long_ctx_<n>_kv8_*`; `*_vs_fp_*`: each side's 8-bit / full-precision rate).

The tiny stream is also run with two steps in flight (`*_pipelined_*`: one pipelined connection;
`*_pipelined_2conn_*`: two connections) and with up to DECODE_STEPS decode steps per call
(`*_steps_*`, docs/protocol.md "Several decode steps in one call").

Both report `decode_rate` (prefill excluded) ratios of back-to-back pairs, sides alternating,
and the CPU each side burns per generated token (`*_cpu_ratio` = mlx-lm's / the sidecar's, the
sidecar counted as server process + the bench process driving it): on a shared machine the wall
figures swing with the load, the CPU per token hardly does.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from bench.cpu import _own_seconds
from bench.scenarios import Bench, alternate, decode_rate, median
from bench.sides import MlxLmSide, RunResult, SidecarSide, requests_for

PairFor = Callable[..., tuple[SidecarSide, MlxLmSide]]  # (model, blocks[, kv_dtype])
DECODE_STEPS = 16


def _pairs(b: Bench, label: str, repeats: int, sidecar: SidecarSide, sidecar_run: Callable[[], RunResult],
           mlx_run: Callable[[], RunResult], new_tokens: int) -> dict[str, Any]:
    rates: dict[str, list[float]] = {"mlx": [], "sidecar": []}
    cpu = {"mlx": 0.0, "sidecar": 0.0}
    pid = sidecar.server.proc.pid if sidecar.server.proc is not None else None
    ratios, matches = [], []
    for i in range(repeats):
        got: dict[str, list[int]] = {}
        for side in alternate(i):
            c0 = _own_seconds([pid] if pid else [])
            r = mlx_run() if side == "mlx" else sidecar_run()
            cpu[side] += _own_seconds([pid] if pid else []) - c0
            times, toks = next(iter(r.token_times.values())), next(iter(r.tokens.values()))
            assert len(toks) == new_tokens, (label, side, len(toks))
            rates[side].append(decode_rate(times))
            got[side] = toks
        matches.append(float(got["mlx"] == got["sidecar"]))
        ratios.append(rates["sidecar"][-1] / rates["mlx"][-1])
        b.log(f"{label} {i + 1}/{repeats}: sidecar {rates['sidecar'][-1]:.1f} tok/s, mlx-lm {rates['mlx'][-1]:.1f} tok/s")
    per_token = {k: v / (repeats * new_tokens) * 1e3 for k, v in cpu.items()}
    return {"ratio": median(ratios), "sidecar_tok_s": median(rates["sidecar"]), "mlx_lm_tok_s": median(rates["mlx"]),
            "tokens_match": min(matches), "pair_ratios": ratios, "sidecar_cpu_ms_per_token": per_token["sidecar"],
            "mlx_lm_cpu_ms_per_token": per_token["mlx"],
            "cpu_ratio": per_token["mlx"] / per_token["sidecar"] if per_token["sidecar"] > 0 else float("nan")}


def tiny_single_stream(b: Bench, pair_for: PairFor) -> None:
    p = b.params
    sidecar, mlx = pair_for(p.tiny_model, p.server_blocks)
    prompt = b.prompt(p.tiny_prompt_len)
    # Warm both sides on this model first (a fresh server compiles nothing, but its first steps
    # allocate; mlx-lm likewise).
    mlx.single(prompt, 4)
    sidecar.run(requests_for([prompt], 4), tag="warmup")
    n0 = len(sidecar.worker.records)
    idle: list[float] = []  # the server's MLX thread waiting for a call, per run: the round trips not overlapped

    def sidecar_run() -> RunResult:
        i0 = sidecar.worker.idle_seconds()
        r = sidecar.run(requests_for([prompt], p.tiny_new_tokens), tag="tiny_single")[0]
        i1 = sidecar.worker.idle_seconds()
        if i0 is not None and i1 is not None:
            idle.append(i1 - i0)
        return r

    got = _pairs(b, "tiny_single_stream", p.tiny_repeats, sidecar, sidecar_run,
                 lambda: mlx.single(prompt, p.tiny_new_tokens), p.tiny_new_tokens)
    if idle:
        b.results["tiny_single_stream_mlx_idle_ms_per_token"] = median(idle) / p.tiny_new_tokens * 1e3
    steps = [r for r in sidecar.worker.records[n0:] if r.tag == "tiny_single" and r.decode]
    b.results.update(
        tiny_single_stream_ratio=got["ratio"], tiny_single_stream_sidecar_tok_s=got["sidecar_tok_s"],
        tiny_single_stream_mlx_lm_tok_s=got["mlx_lm_tok_s"], tiny_single_stream_tokens_match=got["tokens_match"],
        tiny_single_stream_sidecar_ms_per_token=1e3 / got["sidecar_tok_s"],
        tiny_single_stream_mlx_lm_ms_per_token=1e3 / got["mlx_lm_tok_s"],
        tiny_single_stream_step_client_ms=median([r.client_s * 1e3 for r in steps]),
        tiny_model=p.tiny_model, tiny_single_stream_cpu_ratio=got["cpu_ratio"],
        tiny_single_stream_sidecar_cpu_ms_per_token=got["sidecar_cpu_ms_per_token"],
        tiny_single_stream_mlx_lm_cpu_ms_per_token=got["mlx_lm_cpu_ms_per_token"],
    )
    server = [r.server_s * 1e3 for r in steps if r.server_s is not None]
    if server:
        b.results["tiny_single_stream_step_server_ms"] = median(server)
    b.raw["tiny_single_stream_pair_ratios"] = got["pair_ratios"]
    # The same with two steps in flight (placeholders, docs/protocol.md "Pipelined steps"), over
    # one pipelined connection and over two.
    for conns in (1, 2):
        sidecar.run(requests_for([prompt], 4), tag="warmup", pipelined=conns)
        piped = _pairs(b, f"tiny_single_stream pipelined x{conns}", p.tiny_repeats, sidecar,
                       lambda: sidecar.run(requests_for([prompt], p.tiny_new_tokens), tag="tiny_piped",
                                           pipelined=conns)[0],
                       lambda: mlx.single(prompt, p.tiny_new_tokens), p.tiny_new_tokens)
        key = f"tiny_single_stream_pipelined{'' if conns == 1 else '_2conn'}"
        b.results.update({f"{key}_ratio": piped["ratio"], f"{key}_sidecar_tok_s": piped["sidecar_tok_s"],
                          f"{key}_tokens_match": piped["tokens_match"], f"{key}_cpu_ratio": piped["cpu_ratio"]})
        b.raw[f"{key}_pair_ratios"] = piped["pair_ratios"]
    sidecar.run(requests_for([prompt], 4), tag="warmup", decode_steps=DECODE_STEPS)
    multi = _pairs(b, f"tiny_single_stream {DECODE_STEPS} steps a call", p.tiny_repeats, sidecar,
                   lambda: sidecar.run(requests_for([prompt], p.tiny_new_tokens), tag="tiny_steps",
                                       decode_steps=DECODE_STEPS)[0],
                   lambda: mlx.single(prompt, p.tiny_new_tokens), p.tiny_new_tokens)
    b.results.update({"tiny_single_stream_steps_ratio": multi["ratio"], "tiny_decode_steps": DECODE_STEPS,
                      "tiny_single_stream_steps_sidecar_tok_s": multi["sidecar_tok_s"],
                      "tiny_single_stream_steps_tokens_match": multi["tokens_match"],
                      "tiny_single_stream_steps_cpu_ratio": multi["cpu_ratio"]})
    b.raw["tiny_single_stream_steps_pair_ratios"] = multi["pair_ratios"]


def _mlx_cached_decode(mlx: MlxLmSide, prompt: list[int], cached: int,
                       kv_bits: int | None = None) -> Callable[[int], RunResult]:
    """mlx-lm with the first `cached` context tokens prefilled once (what the sidecar's prefix
    cache holds: its full blocks short of the last token); each call prefills the rest, decodes,
    and trims the cache back (stream_generate on the uncached tail with the prompt cache).
    `kv_bits`: a QuantizedKVCache from the first token (the sidecar's kv_dtype 8bit/4bit)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(mlx.model)
    quant: dict[str, Any] = {}
    if kv_bits:
        cache = [QuantizedKVCache(64, kv_bits) if type(c) is KVCache else c for c in cache]
        quant = {"kv_bits": kv_bits, "kv_group_size": 64, "quantized_kv_start": 0}
    for i in range(0, cached, 2048):  # mlx-lm's own prefill step size
        mlx.model(mx.array(prompt[i : min(i + 2048, cached)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    base = cached

    def run(new_tokens: int) -> RunResult:
        from bench.sides import perf
        from mlx_lm import stream_generate

        toks: list[int] = []
        times: list[float] = []
        t0 = perf()
        for r in stream_generate(mlx.model, mlx.tokenizer, prompt[base:], max_tokens=new_tokens, prompt_cache=cache,
                                 **quant):
            times.append(perf() - t0)
            toks.append(int(r.token))
        trim_prompt_cache(cache, cache[0].offset - base)
        return RunResult(perf() - t0, {"0": toks}, {"0": times[0]}, {"0": times})

    return run


def _long_pairs(b: Bench, sidecar: SidecarSide, mlx: MlxLmSide, n: int, kv_bits: int | None = None,
                label: str = "") -> dict[str, Any]:
    p = b.params
    label = label or f"long_ctx {n}"
    prompt = b.prompt(n)
    # Prefill once per side: the sidecar's scheduler keeps the prompt's full blocks cached.
    res, sched = sidecar.run(requests_for([prompt], 1), tag=f"long{n}_prefill")
    mlx_run = _mlx_cached_decode(mlx, prompt, (n - 1) // sidecar.block_size * sidecar.block_size, kv_bits)
    mlx_run(2)  # warm

    def side_run() -> RunResult:
        reqs = requests_for([prompt], p.long_new_tokens)
        r = sidecar.run(reqs, tag=f"long{n}", scheduler=copy.deepcopy(sched))[0]
        if reqs[0].num_cached_tokens != (n - 1) // sidecar.block_size * sidecar.block_size:  # as mlx-lm's
            b.notes.append(f"{label}: only {reqs[0].num_cached_tokens} context tokens were cached")
        return r

    side_run()  # warm (and check the cache hit)
    return _pairs(b, label, p.long_repeats, sidecar, side_run, lambda: mlx_run(p.long_new_tokens), p.long_new_tokens)


def long_context(b: Bench, pair_for: PairFor) -> None:
    p = b.params
    sidecar, mlx = pair_for(p.long_model, p.long_blocks)
    curve: dict[str, list] = {"context": [], "sidecar_tok_s": [], "mlx_lm_tok_s": [], "ratio": [], "cpu_ratio": []}
    for n in p.long_contexts:
        got = _long_pairs(b, sidecar, mlx, n)
        b.results.update({f"long_ctx_{n}_ratio": got["ratio"], f"long_ctx_{n}_sidecar_tok_s": got["sidecar_tok_s"],
                          f"long_ctx_{n}_mlx_lm_tok_s": got["mlx_lm_tok_s"],
                          f"long_ctx_{n}_tokens_match": got["tokens_match"], f"long_ctx_{n}_cpu_ratio": got["cpu_ratio"],
                          f"long_ctx_{n}_sidecar_cpu_ms_per_token": got["sidecar_cpu_ms_per_token"],
                          f"long_ctx_{n}_mlx_lm_cpu_ms_per_token": got["mlx_lm_cpu_ms_per_token"]})
        b.raw[f"long_ctx_{n}_pair_ratios"] = got["pair_ratios"]
        for k, v in (("context", n), ("sidecar_tok_s", got["sidecar_tok_s"]), ("mlx_lm_tok_s", got["mlx_lm_tok_s"]),
                     ("ratio", got["ratio"]), ("cpu_ratio", got["cpu_ratio"])):
            curve[k].append(v)
    b.results["long_model"] = p.long_model
    b.raw["long_ctx_curve"] = curve
    n = p.long_kv8_context
    if n:  # 8-bit KV (kv_dtype 8bit) on a second server, against mlx-lm with the same KV quantisation
        side8, mlx8 = pair_for(p.long_model, p.long_blocks, "8bit")
        got = _long_pairs(b, side8, mlx8, n, kv_bits=8, label=f"long_ctx {n} kv8")
        key = f"long_ctx_{n}_kv8"
        b.results.update({f"{key}_ratio": got["ratio"], f"{key}_sidecar_tok_s": got["sidecar_tok_s"],
                          f"{key}_mlx_lm_tok_s": got["mlx_lm_tok_s"], f"{key}_tokens_match": got["tokens_match"],
                          f"{key}_cpu_ratio": got["cpu_ratio"],
                          f"{key}_sidecar_cpu_ms_per_token": got["sidecar_cpu_ms_per_token"],
                          f"{key}_mlx_lm_cpu_ms_per_token": got["mlx_lm_cpu_ms_per_token"]})
        fp = b.results.get(f"long_ctx_{n}_sidecar_tok_s")
        if fp:  # the sidecar's kv8 / fp decode rate, and mlx-lm's
            b.results[f"{key}_vs_fp_sidecar"] = got["sidecar_tok_s"] / fp
            b.results[f"{key}_vs_fp_mlx_lm"] = got["mlx_lm_tok_s"] / b.results[f"long_ctx_{n}_mlx_lm_tok_s"]
        b.raw[f"{key}_pair_ratios"] = got["pair_ratios"]
