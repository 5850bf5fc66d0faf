"""vLLM objects <-> the sidecar's wire maps (protocol v2). Imports vLLM and torch, never MLX."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, SlidingWindowSpec
from vllm.v1.outputs import DraftTokenIds, LogprobsLists, LogprobsTensors, ModelRunnerOutput

from sidecar.vllm import multimodal

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class Unsupported(ValueError):
    """Something vLLM asked for that the sidecar cannot do: said, never silently dropped."""


def sampling_params(sp: Any, req_id: str) -> dict:
    if sp is None:
        raise Unsupported(f"request {req_id}: a request with neither sampling nor pooling params")
    if getattr(sp, "logits_processors", None):
        raise Unsupported(f"request {req_id}: custom logits processors cannot run in the MLX sidecar")
    return {
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p, "seed": sp.seed,
        "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
        "repetition_penalty": sp.repetition_penalty,
        "logit_bias": {int(k): float(v) for k, v in sp.logit_bias.items()} if sp.logit_bias else None,
        "allowed_token_ids": list(sp.allowed_token_ids) if sp.allowed_token_ids else None,
        "bad_words_token_ids": [list(w) for w in sp.bad_words_token_ids] if sp.bad_words_token_ids else None,
        "min_tokens": sp.min_tokens, "max_tokens": sp.max_tokens,
        # vLLM's complete stop set (eos included unless ignore_eos): min_tokens masks exactly these.
        "all_stop_token_ids": sorted(sp.all_stop_token_ids), "ignore_eos": bool(sp.ignore_eos),
        "logprobs": sp.logprobs, "prompt_logprobs": sp.prompt_logprobs, "prompt_logprobs_whole": True,
    }


POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")


def pooling_params(pp: Any, req_id: str, pooler_config: Any) -> dict:
    """vLLM's PoolingParams plus the pooling type its pooler config names (the pooler is the
    model runner's in vLLM; here the sidecar pools, so it is told per request)."""
    if pp.task not in POOLING_TASKS:
        raise Unsupported(f"request {req_id}: pooling task {pp.task!r} is not supported by the MLX sidecar "
                          f"(supported: {', '.join(POOLING_TASKS)})")
    token = pp.task.startswith("token_")
    kind = getattr(pooler_config, "tok_pooling_type" if token else "seq_pooling_type", None)
    if kind not in (("ALL",) if token else ("LAST", "MEAN", "CLS")):
        raise Unsupported(f"request {req_id}: pooling type {kind!r} is not supported by the MLX sidecar")
    return {"task": pp.task, "pooling_type": kind, "dimensions": pp.dimensions,
            "use_activation": pp.use_activation}


def pooler_config(pc: Any, enable_prefix_caching: bool) -> None:
    """What the sidecar's pooler cannot honour is refused at start-up, never silently dropped."""
    if pc is None:
        return
    if pc.logit_mean is not None or pc.logit_sigma is not None:
        raise Unsupported("pooler_config logit_mean/logit_sigma (score calibration) is not supported by the MLX sidecar")
    if enable_prefix_caching and pc.seq_pooling_type in ("MEAN", "CLS"):
        raise Unsupported(f"{pc.seq_pooling_type} pooling needs every prompt position's hidden state, which a prefix "
                          "cache hit skips: run without --enable-prefix-caching (vLLM's default for this pooling)")


def lora_request(lr: Any) -> dict | None:
    if lr is None:
        return None
    return {"lora_int_id": lr.lora_int_id, "lora_name": lr.lora_name, "lora_path": lr.lora_path}


def _groups(block_ids: Any) -> list[list[int]]:
    return [list(g) for g in block_ids]


def scheduler_output(so: SchedulerOutput, pooler: Any = None) -> dict:
    """`pooler`: vLLM's PoolerConfig (a pooling runner)."""
    new = []
    for r in so.scheduled_new_reqs:
        if r.prompt_token_ids is None:
            raise Unsupported(f"request {r.req_id}: prompt embeddings are not supported by the MLX sidecar")
        pooling = getattr(r, "pooling_params", None)
        new.append({
            "req_id": r.req_id, "prompt_token_ids": list(r.prompt_token_ids),
            "sampling_params": None if pooling is not None else sampling_params(r.sampling_params, r.req_id),
            "block_ids": _groups(r.block_ids),
            "num_computed_tokens": r.num_computed_tokens, "lora_request": lora_request(r.lora_request),
            "prefill_token_ids": None if r.prefill_token_ids is None else list(r.prefill_token_ids),
            "mm_features": multimodal.features(r.mm_features),
        })
        if pooling is not None:
            new[-1]["pooling_params"] = pooling_params(pooling, r.req_id, pooler)
    c = so.scheduled_cached_reqs
    cached = {
        "req_ids": list(c.req_ids), "resumed_req_ids": sorted(c.resumed_req_ids),
        "new_token_ids": [list(t) for t in c.new_token_ids],
        "new_block_ids": [None if b is None else _groups(b) for b in c.new_block_ids],
        "num_computed_tokens": list(c.num_computed_tokens), "num_output_tokens": list(c.num_output_tokens),
        "all_token_ids": {k: list(v) for k, v in (c.all_token_ids or {}).items()},
    }
    spec, num_scheduled, total = spec_decode_tokens(so)
    return {
        "scheduled_new_reqs": new, "scheduled_cached_reqs": cached,
        "num_scheduled_tokens": num_scheduled, "total_num_scheduled_tokens": total,
        "finished_req_ids": sorted(so.finished_req_ids), "preempted_req_ids": sorted(so.preempted_req_ids or ()),
        "scheduled_spec_decode_tokens": spec,
        "kv_cache_block_copies": [[int(s), int(d)] for s, d in (so.kv_cache_block_copies or ())],
        **multimodal.encoder_instructions(so),
    }


def spec_decode_tokens(so: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, int], int]:
    """Drafts, per-request and total scheduled counts, without vLLM's -1 placeholders.

    vLLM pads a decode request that has no drafts to 1 + k positions of -1 drafts (uniform shapes
    for CUDA graphs) and drafts the grammar rejects become -1; no real draft follows a -1. The
    sidecar computes only the real positions: its one sampled token is what vLLM's rejection of
    every placeholder expects (vLLM rolls num_computed_tokens back by the rejected count)."""
    spec: dict[str, list[int]] = {}
    num_scheduled = dict(so.num_scheduled_tokens)
    total = so.total_num_scheduled_tokens
    for rid, drafts in so.scheduled_spec_decode_tokens.items():
        drafts = list(drafts)
        real = next((i for i, t in enumerate(drafts) if t < 0), len(drafts))
        dropped = len(drafts) - real
        if dropped and rid in num_scheduled:
            num_scheduled[rid] -= dropped
            total -= dropped
        if real:
            spec[rid] = drafts[:real]
    return spec, num_scheduled, total


def speculative_config(sc: Any) -> dict:
    """init_device overrides for vLLM's speculative_config: the sidecar's own proposer makes the
    drafts (vLLM's proposers run in its GPU model runner, which this worker class replaces)."""
    if sc is None:
        return {"speculative_method": "none"}  # vLLM would never take the drafts: propose none
    if sc.method == "ngram":
        return {"speculative_method": "ngram", "num_speculative_tokens": int(sc.num_speculative_tokens),
                "prompt_lookup_min": int(sc.prompt_lookup_min), "prompt_lookup_max": int(sc.prompt_lookup_max)}
    if sc.method == "draft_model":  # the sidecar's own --draft-model runs; vLLM's `model` is only validated there
        return {"speculative_method": "draft_model", "num_speculative_tokens": int(sc.num_speculative_tokens)}
    raise Unsupported(f"speculative_config method {sc.method!r} is not supported through the MLX sidecar: "
                      'use method "ngram", or "draft_model" with the sidecar started with --draft-model '
                      "(the sidecar proposes the drafts itself)")


def cache_dtype(dtype: str) -> None:
    """vLLM's --kv-cache-dtype: its formats (fp8, int8_per_token_head, ...) are not the sidecar's.
    The sidecar's own quantised cache is chosen where it runs, and vLLM then counts its blocks."""
    if dtype != "auto":
        raise Unsupported(f"--kv-cache-dtype {dtype} is not supported through the MLX sidecar: leave it at auto and "
                          "start the sidecar with --kv-dtype 8bit or 4bit (mlx-lm's quantised KV cache; vLLM "
                          "sizes its pool by the sidecar's quantised page size)")


def grammar_output(g: GrammarOutput | None) -> dict | None:
    if g is None:
        return None
    mask = np.ascontiguousarray(np.asarray(g.grammar_bitmask), dtype="<i4")
    return {"structured_output_request_ids": list(g.structured_output_request_ids), "grammar_bitmask": mask.tobytes()}


def model_runner_output(d: dict) -> ModelRunnerOutput:
    lp = d.get("logprobs")
    logprobs = None
    if lp is not None:
        logprobs = LogprobsLists(np.asarray(lp["logprob_token_ids"], np.int32), np.asarray(lp["logprobs"], np.float32),
                                 np.asarray(lp["sampled_token_ranks"], np.int32), lp.get("cu_num_generated_tokens"))
    prompt: dict[str, LogprobsTensors | None] = {}
    for rid, p in (d.get("prompt_logprobs_dict") or {}).items():
        if p is None:
            prompt[rid] = None
            continue
        ranks = p.get("selected_token_ranks", p.get("sampled_token_ranks"))
        width = len(p["logprobs"][0]) if p["logprobs"] else 1
        prompt[rid] = LogprobsTensors(
            torch.tensor(p["logprob_token_ids"], dtype=torch.int32).reshape(-1, width),
            torch.tensor(p["logprobs"], dtype=torch.float32).reshape(-1, width),
            torch.tensor(ranks, dtype=torch.int32))
    pooled = d.get("pooler_output")
    return ModelRunnerOutput(
        req_ids=d["req_ids"], req_id_to_index=d["req_id_to_index"], sampled_token_ids=d["sampled_token_ids"],
        logprobs=logprobs, prompt_logprobs_dict=prompt, num_nans_in_logits=d.get("num_nans_in_logits"),
        pooler_output=None if pooled is None else [None if v is None else torch.tensor(v, dtype=torch.float32)
                                                   for v in pooled])


def kv_cache_spec(wire: dict[str, dict]) -> dict[str, KVCacheSpec]:
    """vLLM specs whose page size is the sidecar's exact `page_size_bytes`: vLLM counts blocks with
    it (available memory // the sum over layers), the attention itself runs in the sidecar."""
    out: dict[str, KVCacheSpec] = {}
    for name, s in wire.items():
        common = dict(block_size=s["block_size"], num_kv_heads=s["num_kv_heads"], head_size=s["head_size"],
                      head_size_v=s["head_size_v"], dtype=TORCH_DTYPES[s["dtype"]])
        if s.get("kv_quantization"):
            common["state_content_bytes"] = _packed_bytes(name, s)
        if s["type"] == "sliding_window":
            out[name] = SlidingWindowSpec(sliding_window=s["sliding_window"], **common)
        elif s["type"] == "full_attention":
            out[name] = FullAttentionSpec(**common)
        else:
            raise Unsupported(f"layer {name}: KV cache type {s['type']!r} has no vLLM spec here")
        if "page_size_bytes" in s and out[name].page_size_bytes != s["page_size_bytes"]:
            raise Unsupported(f"layer {name}: vLLM's page size {out[name].page_size_bytes} differs from the "
                              f"sidecar's {s['page_size_bytes']} bytes (vLLM would count the wrong number of blocks)")
    return out


def _packed_bytes(name: str, s: dict) -> int:
    """A quantised layer (kv_dtype 8bit/4bit): bytes per (KV head, token), packed K and V data plus
    their scales and biases. `state_content_bytes` is vLLM's own field for packed pages (its
    quantised attention backends set it); vLLM's page is then num_kv_heads * block_size of these."""
    cells = s["block_size"] * s["num_kv_heads"]
    if cells <= 0 or s["page_size_bytes"] % cells:
        raise Unsupported(f"layer {name}: quantised page of {s['page_size_bytes']} bytes is not "
                          f"{s['num_kv_heads']} KV heads x {s['block_size']} tokens of whole bytes")
    return s["page_size_bytes"] // cells


def kv_cache_config(c: KVCacheConfig) -> dict:
    return {
        "num_blocks": c.num_blocks,
        "kv_cache_tensors": [{"size": t.size, "shared_by": list(t.layers)} for t in c.kv_cache_tensors],
        "kv_cache_groups": [{"layer_names": list(g.layer_names), "kv_cache_spec": {"block_size": g.kv_cache_spec.block_size}}
                            for g in c.kv_cache_groups],
    }


def draft_token_ids(d: dict | None) -> DraftTokenIds | None:
    if d is None:
        return None
    return DraftTokenIds(list(d["req_ids"]), [list(t) for t in d["draft_token_ids"]])
