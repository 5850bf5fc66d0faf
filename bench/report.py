"""The table, the JSON file and the throughput plot."""

from __future__ import annotations

import json
import math
import os
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Goal:
    key: str  # the headline ratio / figure in the JSON
    title: str
    op: str  # ">=" or "<="
    target: float
    sidecar: str  # how to show the two value columns
    mlx_lm: str


GOALS = (
    Goal("single_stream_ratio", "single stream decode", ">=", 0.95,
         "{single_stream_sidecar_tok_s:.2f} tok/s", "{single_stream_mlx_lm_tok_s:.2f} tok/s"),
    Goal("batch32_ratio", "batch {batch32_requests:.0f} throughput", ">=", 1.0,
         "{batch32_sidecar_tok_s:.2f} tok/s", "{batch32_mlx_lm_tok_s:.2f} tok/s"),
    Goal("rpc_overhead_ms_p50", "rpc overhead p50 (worst batch)", "<=", 0.5,
         "b1 {rpc_overhead_ms_p50_b1:.3f} / b64 {rpc_overhead_ms_p50_b64:.3f} ms", "-"),
    Goal("rpc_overhead_ms_p99", "rpc overhead p99 (worst batch)", "", math.nan,
         "b1 {rpc_overhead_ms_p99_b1:.3f} / b64 {rpc_overhead_ms_p99_b64:.3f} ms", "-"),
    Goal("rpc_b1_mlx_idle_ms_per_step", "  b1: server MLX thread idle per step", "", math.nan,
         "{rpc_b1_mlx_idle_ms_per_step:.3f} ms (the overhead not hidden)", "-"),
    Goal("rpc_null_ms_p50", "no-op rpc p50, back to back", "", math.nan,
         "after 30 ms idle: {rpc_null_after_idle_ms_p50:.3f} ms", "-"),
    Goal("msgpack_256_ms", "msgpack 256-req step enc+dec", "", math.nan,
         "{msgpack_256_encode_ms:.3f} + {msgpack_256_decode_ms:.3f} ms", "-"),
    Goal("prefix_ttft_ratio", "prefix-cached TTFT / cold", "<=", 0.1,
         "{prefix_warm_ttft_s:.3f} s / {prefix_cold_ttft_s:.3f} s", "{prefix_mlx_lm_cold_ttft_s:.3f} s cold"),
    Goal("pool_size_ratio", "decode step, {pool_large_blocks:.0f} / {pool_small_blocks:.0f} blocks", "<=", 1.1,
         "{pool_large_step_ms:.2f} / {pool_small_step_ms:.2f} ms", "-"),
    Goal("embed_batch_ratio", "embeddings, batch {embed_batch_requests:.0f}, last-token pooled", ">=", 0.9,
         "{embed_batch_sidecar_tok_s:.0f} prompt tok/s", "{embed_batch_mlx_lm_tok_s:.0f} prompt tok/s"),
    Goal("embed_b1_ratio", "embeddings, batch 1", "", math.nan,
         "{embed_b1_sidecar_tok_s:.0f} prompt tok/s", "{embed_b1_mlx_lm_tok_s:.0f} prompt tok/s"),
    Goal("vllm_engine_ratio", "vLLM engine / reference scheduler (goal >= 0.9)", "", math.nan,
         "vLLM {vllm_engine_tok_s:.2f} tok/s", "ours {vllm_ref_scheduler_tok_s:.2f} tok/s"),
    Goal("sampling_mixed_ratio", "{sampling_rows:.0f}-row step, mixed / greedy", "<=", 1.10,
         "{sampling_mixed_step_ms:.1f} / {sampling_greedy_step_ms:.1f} ms", "-"),
    Goal("tiny_single_stream_ratio", "single stream, {tiny_model}", ">=", 0.9,
         "{tiny_single_stream_sidecar_tok_s:.1f} tok/s", "{tiny_single_stream_mlx_lm_tok_s:.1f} tok/s"),
    Goal("tiny_single_stream_cpu_ratio", "  same, CPU per token (mlx-lm / sidecar)", "", math.nan,
         "{tiny_single_stream_sidecar_cpu_ms_per_token:.3f} ms", "{tiny_single_stream_mlx_lm_cpu_ms_per_token:.3f} ms"),
    Goal("tiny_single_stream_mlx_idle_ms_per_token", "  same, server MLX thread idle per token", "", math.nan,
         "{tiny_single_stream_mlx_idle_ms_per_token:.3f} ms (round trip not overlapped)", "-"),
    Goal("tiny_single_stream_pipelined_ratio", "  same, two steps in flight, 1 / 2 connections", "", math.nan,
         "{tiny_single_stream_pipelined_sidecar_tok_s:.1f} / {tiny_single_stream_pipelined_2conn_sidecar_tok_s:.1f} "
         "tok/s", "x2: {tiny_single_stream_pipelined_2conn_ratio:.2f}"),
    Goal("tiny_single_stream_steps_ratio", "  same, up to {tiny_decode_steps:.0f} decode steps a call", "", math.nan,
         "{tiny_single_stream_steps_sidecar_tok_s:.1f} tok/s", "CPU per token: x{tiny_single_stream_steps_cpu_ratio:.2f}"),
    Goal("long_ctx_1024_ratio", "decode at 1k context, {long_model}", "", math.nan,
         "{long_ctx_1024_sidecar_tok_s:.1f} tok/s", "{long_ctx_1024_mlx_lm_tok_s:.1f} tok/s"),
    Goal("long_ctx_4096_ratio", "decode at 4k context, {long_model}", ">=", 0.9,
         "{long_ctx_4096_sidecar_tok_s:.1f} tok/s", "{long_ctx_4096_mlx_lm_tok_s:.1f} tok/s"),
    Goal("long_ctx_4096_kv8_ratio", "  4k, 8-bit KV both sides (kv8/fp: sidecar, mlx-lm)", "", math.nan,
         "{long_ctx_4096_kv8_sidecar_tok_s:.1f} tok/s, x{long_ctx_4096_kv8_vs_fp_sidecar:.2f}",
         "{long_ctx_4096_kv8_mlx_lm_tok_s:.1f} tok/s, x{long_ctx_4096_kv8_vs_fp_mlx_lm:.2f}"),
    Goal("long_ctx_16384_ratio", "decode at 16k context, {long_model}", ">=", 0.8,
         "{long_ctx_16384_sidecar_tok_s:.1f} tok/s", "{long_ctx_16384_mlx_lm_tok_s:.1f} tok/s"),
    Goal("spec_repetitive_ratio", "ngram spec on/off, repetitive text, {spec_blas_short}", ">=", 1.8,
         "{spec_repetitive_on_tok_s:.2f} / {spec_repetitive_off_tok_s:.2f} tok/s, accept "
         "{spec_repetitive_acceptance:.0%}, {spec_repetitive_tokens_per_step:.2f} tok/step", "-"),
    Goal("spec_random_ratio", "ngram spec on/off, random text, {spec_blas_short}", ">=", 0.95,
         "{spec_random_on_tok_s:.2f} / {spec_random_off_tok_s:.2f} tok/s, accept "
         "{spec_random_acceptance:.0%}, {spec_random_tokens_per_step:.2f} tok/step", "-"),
    Goal("spec_repetitive_ratio_bundled", "  both on the bundled reference BLAS, repetitive", "", math.nan,
         "{spec_repetitive_on_tok_s_bundled:.2f} / {spec_repetitive_off_tok_s_bundled:.2f} tok/s, "
         "{spec_repetitive_tokens_per_step_bundled:.2f} tok/step", "-"),
    Goal("spec_random_ratio_bundled", "  both on the bundled reference BLAS, random", "", math.nan,
         "{spec_random_on_tok_s_bundled:.2f} / {spec_random_off_tok_s_bundled:.2f} tok/s, "
         "{spec_random_tokens_per_step_bundled:.2f} tok/step", "-"),
    Goal("image_ttft_follow_up_ratio", "images: TTFT, the same image + another question / first, {image_model}",
         "<=", 0.2, "{image_ttft_follow_up_ms:.0f} / {image_ttft_first_ms:.0f} ms",
         "encoder {image_encoder_share:.0%} of the first"),
    Goal("image_ttft_identical_ratio", "  the identical request / first", "<=", 0.2,
         "{image_ttft_identical_ms:.0f} ms, {image_cached_identical_tokens:.0f} tokens cached", "-"),
    Goal("image_ttft_encoder_only_ratio", "  the image after other text (encoder cache only) / first", "", math.nan,
         "{image_ttft_encoder_only_ms:.0f} ms", "-"),
    Goal("image_e2e_ratio", "images: end to end, {image_e2e_tokens:.0f} tokens, {image_e2e_model}", ">=", 0.9,
         "{image_e2e_sidecar_s:.2f} s (two in flight {image_e2e_pipelined_sidecar_s:.2f} s, one at a time {image_e2e_sync_sidecar_s:.2f} s)",
         "mlx-vlm {image_e2e_mlx_vlm_s:.2f} s"),
    Goal("image_e2e_tiny_ratio", "  same, {image_e2e_tiny_tokens:.0f} tokens, {image_e2e_tiny_model}", ">=", 0.9,
         "{image_e2e_tiny_sidecar_s:.2f} s (two in flight {image_e2e_tiny_pipelined_sidecar_s:.2f} s, one at a time {image_e2e_tiny_sync_sidecar_s:.2f} s)",
         "mlx-vlm {image_e2e_tiny_mlx_vlm_s:.2f} s"),
    Goal("kv_store_ttft_ratio", "disk KV tier: TTFT after a restart / cold, {kv_store_prefix_len:.0f} tokens", "<=",
         0.1, "{kv_store_ttft_s:.3f} s / {kv_store_cold_ttft_s:.3f} s", "tokens equal: {kv_store_tokens_match:.0f}"),
    Goal("kv_store_bandwidth_ratio", "  load bandwidth / plain file read", ">=", 0.5,
         "{kv_store_load_gbps:.2f} GB/s", "plain {kv_store_plain_read_gbps:.2f} GB/s"),
    Goal("kv_store_decode_ratio", "  decode, saving on / store off", ">=", 0.97,
         "{kv_store_decode_on_tok_s:.2f} / {kv_store_decode_off_tok_s:.2f} tok/s", "-"),
    Goal("kv_store_bound_ratio", "  size / bound, 3x the bound written", "<=", 1.0,
         "{kv_store_bound_size_bytes:.0f} of {kv_store_bound_max_bytes:.0f} B",
         "{kv_store_bound_written_bytes:.0f} B written"),
)

# Every key the JSON must carry with a finite value (the smoke test checks these).
REQUIRED_KEYS = (
    "single_stream_ratio", "batch32_ratio", "rpc_overhead_ms_p50", "rpc_overhead_ms_p99",
    "rpc_overhead_ms_p50_b1", "rpc_overhead_ms_p99_b1", "rpc_overhead_ms_p50_b64", "rpc_overhead_ms_p99_b64",
    "msgpack_256_encode_ms", "msgpack_256_decode_ms", "msgpack_256_ms", "rpc_null_ms_p50", "rpc_null_after_idle_ms_p50",
    "prefix_ttft_ratio", "pool_size_ratio", "sampling_mixed_ratio",
    "single_stream_sidecar_tok_s", "single_stream_mlx_lm_tok_s", "batch32_sidecar_tok_s", "batch32_mlx_lm_tok_s",
    "prefix_cold_ttft_s", "prefix_warm_ttft_s", "pool_small_step_ms", "pool_large_step_ms",
    "sampling_greedy_step_ms", "sampling_mixed_step_ms",
    "tiny_single_stream_ratio", "tiny_single_stream_sidecar_tok_s", "tiny_single_stream_mlx_lm_tok_s",
    "spec_repetitive_ratio", "spec_random_ratio",
)


class _Missing(dict):
    def __missing__(self, key: str) -> float:
        return math.nan


def _fmt(template: str, results: dict[str, Any]) -> str:
    try:
        return template.format_map(_Missing(results))
    except (ValueError, TypeError):
        return "?"


def _fields(template: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


def verdict(goal: Goal, value: Any) -> str:
    if not goal.op:
        return ""
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return "n/a"
    ok = value >= goal.target if goal.op == ">=" else value <= goal.target
    return "PASS" if ok else "FAIL"


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str, str]]:
    out = []
    for g in GOALS:
        key = g.key
        value = results.get(key, math.nan)
        shown = f"{value:.3f}" if isinstance(value, (int, float)) and math.isfinite(value) else "n/a"
        if key.startswith(("rpc_", "msgpack_")):
            shown += " ms"
        goal = f"{g.op} {g.target:g}" if g.op else "-"
        if key not in results:  # a figure this run did not measure (a stage left out, a missing library)
            title = g.title if all(k in results for k in _fields(g.title)) else re.sub(r"\{[^}]*\}", "-", g.title)
            out.append((_fmt(title, results), "not measured", "-", shown, goal, verdict(g, value) or "-"))
            continue
        out.append((_fmt(g.title, results), _fmt(g.sidecar, results), _fmt(g.mlx_lm, results), shown, goal,
                    verdict(g, value) or "-"))
    return out


def table(results: dict[str, Any]) -> str:
    header = ("scenario", "sidecar", "mlx-lm", "ratio/value", "goal", "result")
    body = rows(results)
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *map(line, body)])


def sweep_table(sweep: dict[str, list[float]]) -> str:
    lines = ["concurrency  sidecar tok/s  mlx-lm tok/s  ratio"]
    for c, s, m in zip(sweep["concurrency"], sweep["sidecar_tok_s"], sweep["mlx_lm_tok_s"]):
        lines.append(f"{c:>11}  {s:>13.2f}  {m:>12.2f}  {s / m:>5.2f}")
    return "\n".join(lines)


def curve_table(curve: dict[str, list[float]]) -> str:
    lines = ["    context  sidecar tok/s  mlx-lm tok/s  ratio  cpu ratio"]
    cpu = curve.get("cpu_ratio") or [math.nan] * len(curve["context"])
    for c, s, m, r, u in zip(curve["context"], curve["sidecar_tok_s"], curve["mlx_lm_tok_s"], curve["ratio"], cpu):
        lines.append(f"{c:>11.0f}  {s:>13.2f}  {m:>12.2f}  {r:>5.2f}  {u:>9.2f}")
    return "\n".join(lines)


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN/inf; the smoke test treats None as not finite
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str | os.PathLike, doc: dict[str, Any]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)
    return p


def plot(path: str | os.PathLike, sweep: dict[str, list[float]], title: str,
         curve: dict[str, list[float]] | None = None) -> Path | None:
    """Throughput against concurrency, both sides (and, given `curve`, single-stream decode
    against context length beside it); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if curve and curve.get("context"):
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), dpi=110)
        x = curve["context"]
        ax2.plot(x, curve["sidecar_tok_s"], "o-", label="mlx-sidecar")
        ax2.plot(x, curve["mlx_lm_tok_s"], "s--", label="mlx-lm (in process)")
        for xi, yi, r in zip(x, curve["sidecar_tok_s"], curve["ratio"]):
            ax2.annotate(f"{r:.2f}x", (xi, yi), textcoords="offset points", xytext=(4, 6), fontsize=8)
        ax2.set_xscale("log", base=2)
        ax2.set_xticks(x, [f"{v / 1024:g}k" if v >= 1024 else f"{v:g}" for v in x])
        ax2.set_xlabel("tokens of context")
        ax2.set_ylabel("single-stream decode tokens / s")
        ax2.set_ylim(bottom=0)
        ax2.grid(True, alpha=0.3)
        ax2.set_title("long-context decode (ratio: sidecar / mlx-lm)", fontsize=10)
        ax2.legend()
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    c = sweep["concurrency"]
    ax.plot(c, sweep["sidecar_tok_s"], "o-", label="mlx-sidecar (HTTP + reference scheduler)")
    ax.plot(c, sweep["mlx_lm_tok_s"], "s--", label="mlx-lm BatchGenerator (in process)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(c, [str(x) for x in c])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s (prefill included)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(p)
    plt.close(fig)
    return p
