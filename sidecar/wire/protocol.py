"""Wire types (vLLM v1 field names), strict decoding with field paths, and the body codecs.

Decoding checks types and shapes only; the semantic checks that need worker state (known request
ids, block ranges, token counts) live in engine/planner.py so both run before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable

from sidecar.errors import ProtocolError
from sidecar.wire.codec import KIND_NAMES, wire_type
from sidecar.wire.pooling_params import PoolingParams
from sidecar.wire.sampling_params import SamplingParams
from sidecar.wire import kv_store
from sidecar.wire import multimodal


# --- field helpers ------------------------------------------------------------------------

_MISSING = object()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def get(d: dict, key: str, kind: type | tuple[type, ...], path: str = "", default: Any = _MISSING) -> Any:
    """d[key] checked against `kind` (bool is not an int; int is accepted as float)."""
    v = d.get(key, _MISSING)
    if v is _MISSING or (v is None and default is not _MISSING):
        if default is _MISSING:
            raise ProtocolError(f"missing required field {key!r}", field=_join(path, key))
        return default
    return v if type(v) is kind else check(v, kind, _join(path, key))  # the path is built for errors only


def check(value: Any, kind: type | tuple[type, ...], path: str) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    elif float in kinds and isinstance(value, int):
        return float(value)
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = "|".join(KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise ProtocolError(f"expected {names}, got {wire_type(value)}", field=path)
    return value


_INT, _STR, _LIST, _LIST_OR_NONE = frozenset({int}), frozenset({str}), frozenset({list}), frozenset({list, type(None)})


def _uniform(value: Any, levels: int, kinds: frozenset) -> bool:
    """`value` is a list of lists `levels` deep whose leaves' types are all in `kinds`, checked in
    C, one pass per level (a step's token and block lists); False: the checks below name the path."""
    if type(value) is not list:
        return False
    for _ in range(levels):
        if not set(map(type, value)) <= _LIST:
            return False
        value = list(chain.from_iterable(value))
    return set(map(type, value)) <= kinds


def int_list(value: Any, path: str) -> list[int]:
    if _uniform(value, 0, _INT):
        return value
    check(value, list, path)
    for i, v in enumerate(value):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(f"expected integer, got {wire_type(v)}", field=f"{path}[{i}]")
    return value


def list_of(value: Any, path: str, item: Callable[[Any, str], Any]) -> list:
    check(value, list, path)
    return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]


def str_list(value: Any, path: str) -> list[str]:
    return value if _uniform(value, 0, _STR) else list_of(value, path, _str)


def block_groups(value: Any, path: str) -> list[list[int]]:
    """block_ids: one list of block ids per KV cache group (a vLLM tuple of lists)."""
    return list(value) if _uniform(value, 1, _INT) else list_of(value, path, int_list)


def _block_rows(value: list) -> bool:
    """new_block_ids: per request null, or block_ids."""
    return set(map(type, value)) <= _LIST_OR_NONE and _uniform(list(filter(None, value)), 2, _INT)


# --- wire types -------------------------------------------------------------------------


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]
    num_computed_tokens: int
    lora_request: dict | None = None
    # v2: vLLM's model runner V2 resumes a preempted request as a new one carrying every known
    # token (prompt + outputs so far); its state replaces the old one of the same id.
    prefill_token_ids: list[int] | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (wire/pooling_params.py)
    mm_features: list[multimodal.MMFeature] = field(default_factory=list)  # images (wire/multimodal.py)


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[list[int]] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    # v2: copy-on-write block copies (src, dst), applied to the pool before the forward.
    kv_cache_block_copies: list[tuple[int, int]] = field(default_factory=list)
    # {req_id: [draft token ids]}: verified in this step (engine/spec_decode.py)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # disk KV tier (wire/kv_store.py): stored blocks to load before the forward, blocks to save after
    kv_store_load: dict[str, kv_store.BlockTransfer] = field(default_factory=dict)
    kv_store_save: dict[str, kv_store.BlockTransfer] = field(default_factory=dict)
    # which requests' multimodal items to encode this step, and which encoder outputs to drop
    encoder: multimodal.EncoderInstructions = field(default_factory=multimodal.EncoderInstructions)
    # v4: decode every sampling row up to this many tokens in the call (engine/multistep.py)
    num_decode_steps: int = 1

    @classmethod
    def from_wire(cls, d: Any, *, vocab_size: int, max_logprobs: int) -> SchedulerOutput:
        check(d, dict, "scheduler_output")
        new_reqs = list_of(
            get(d, "scheduled_new_reqs", list, default=[]), "scheduled_new_reqs",
            lambda v, p: _new_request(v, p, vocab_size, max_logprobs),
        )
        cached = _cached_requests(get(d, "scheduled_cached_reqs", dict, default={}))
        nst = get(d, "num_scheduled_tokens", dict)
        if not (set(map(type, nst)) <= _STR and set(map(type, nst.values())) <= _INT):
            for k, v in nst.items():
                check(k, str, "num_scheduled_tokens")
                check(v, int, f"num_scheduled_tokens.{k}")
        return cls(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=nst,
            total_num_scheduled_tokens=get(d, "total_num_scheduled_tokens", int),
            finished_req_ids=str_list(get(d, "finished_req_ids", list, default=[]), "finished_req_ids"),
            preempted_req_ids=str_list(get(d, "preempted_req_ids", list, default=[]), "preempted_req_ids"),
            kv_cache_block_copies=list_of(get(d, "kv_cache_block_copies", list, default=[]), "kv_cache_block_copies",
                                          _block_copy),
            scheduled_spec_decode_tokens=_spec_tokens(get(d, "scheduled_spec_decode_tokens", dict, default={})),
            kv_store_load=kv_store.transfers(d, kv_store.LOAD),
            kv_store_save=kv_store.transfers(d, kv_store.SAVE),
            encoder=multimodal.encoder_instructions(d),
            num_decode_steps=_decode_steps(get(d, "num_decode_steps", int, default=1)),
        )


MAX_DECODE_STEPS = 64  # bounds one call's cost: this many decodes of its rows


def _decode_steps(n: int) -> int:
    if not 1 <= n <= MAX_DECODE_STEPS:
        raise ProtocolError(f"num_decode_steps must be in [1, {MAX_DECODE_STEPS}], got {n}", field="num_decode_steps")
    return n


def _block_copy(v: Any, path: str) -> tuple[int, int]:
    """vLLM's KVCacheBlockCopy(src_block_id, dst_block_id): a 2-array, or a map with those names."""
    if isinstance(v, dict):
        return get(v, "src_block_id", int, path), get(v, "dst_block_id", int, path)
    pair = int_list(v, path)
    if len(pair) != 2:
        raise ProtocolError(f"a block copy is [src_block_id, dst_block_id], got {len(pair)} entries", field=path)
    return pair[0], pair[1]


def _spec_tokens(d: dict) -> dict[str, list[int]]:
    path = "scheduled_spec_decode_tokens"
    for k, v in d.items():
        check(k, str, path)
        int_list(v, f"{path}.{k}")
    return d


def _str(v: Any, path: str) -> str:
    return check(v, str, path)


def _new_request(d: Any, path: str, vocab_size: int, max_logprobs: int) -> NewRequestData:
    check(d, dict, path)
    prompt = int_list(get(d, "prompt_token_ids", list, path), _join(path, "prompt_token_ids"))
    if not prompt:
        raise ProtocolError("prompt_token_ids must not be empty", field=_join(path, "prompt_token_ids"))
    lora = get(d, "lora_request", (dict, type(None)), path, default=None)
    if lora is not None:
        lp = _join(path, "lora_request")
        lora = {"lora_int_id": get(lora, "lora_int_id", int, lp), "lora_name": get(lora, "lora_name", str, lp, default=""),
                "lora_path": get(lora, "lora_path", str, lp, default="")}
    return NewRequestData(
        req_id=get(d, "req_id", str, path),
        prompt_token_ids=prompt,
        sampling_params=SamplingParams.from_wire(
            get(d, "sampling_params", dict, path, default={}),
            vocab_size=vocab_size, max_logprobs=max_logprobs, path=_join(path, "sampling_params"),
        ),
        block_ids=block_groups(get(d, "block_ids", list, path), _join(path, "block_ids")),
        num_computed_tokens=get(d, "num_computed_tokens", int, path, default=0),
        lora_request=lora,
        prefill_token_ids=_prefill_tokens(d, path, prompt),
        pooling_params=_pooling(d, path),
        mm_features=multimodal.features(d.get("mm_features"), _join(path, "mm_features"), len(prompt)),
    )


def _pooling(d: dict, path: str) -> PoolingParams | None:
    if d.get("pooling_params") is None:
        return None
    if d.get("sampling_params") is not None:
        raise ProtocolError("a request carries sampling_params or pooling_params, not both",
                            field=_join(path, "pooling_params"))
    return PoolingParams.from_wire(d["pooling_params"], path=_join(path, "pooling_params"))


def _prefill_tokens(d: dict, path: str, prompt: list[int]) -> list[int] | None:
    toks = get(d, "prefill_token_ids", (list, type(None)), path, default=None)
    if toks is None:
        return None
    p = _join(path, "prefill_token_ids")
    int_list(toks, p)
    if toks[: len(prompt)] != prompt:
        raise ProtocolError("prefill_token_ids must start with prompt_token_ids", field=p)
    return toks


def _cached_requests(d: dict) -> CachedRequestData:
    path = "scheduled_cached_reqs"
    req_ids = str_list(get(d, "req_ids", list, path, default=[]), _join(path, "req_ids"))
    n = len(req_ids)

    def per_req(key: str, item: Callable[[Any, str], Any], default: Any,
                fast: Callable[[list], bool] | None = None) -> list:
        values = get(d, key, list, path, default=None)
        if values is None:
            values = [default] * n
        elif fast is None or not fast(values):
            values = list_of(values, _join(path, key), item)
        if key == "new_token_ids" and not values:  # v2: vLLM sends [] unless pipeline-parallel
            values = [[] for _ in range(n)]
        if len(values) != n:
            raise ProtocolError(f"{key} has {len(values)} entries for {n} req_ids", field=_join(path, key))
        return values

    resumed = set(str_list(get(d, "resumed_req_ids", list, path, default=[]), _join(path, "resumed_req_ids")))
    # Older vLLM sends one bool per request instead of the id set.
    flags = per_req("resumed_from_preemption", lambda v, p: check(v, bool, p), False)
    resumed |= {rid for rid, f in zip(req_ids, flags) if f}
    all_tokens = get(d, "all_token_ids", dict, path, default={})
    if not _uniform(list(all_tokens.values()), 1, _INT):
        for k, v in all_tokens.items():
            int_list(v, f"{path}.all_token_ids.{k}")
    return CachedRequestData(
        req_ids=req_ids,
        resumed_req_ids=resumed,
        new_token_ids=per_req("new_token_ids", int_list, [], lambda v: _uniform(v, 1, _INT)),
        new_block_ids=per_req("new_block_ids", lambda v, p: None if v is None else block_groups(v, p), None,
                              _block_rows),
        num_computed_tokens=per_req("num_computed_tokens", lambda v, p: check(v, int, p), 0,
                                    lambda v: _uniform(v, 0, _INT)),
        all_token_ids=all_tokens,
    )


@dataclass
class LogprobsLists:
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]
    cu_num_generated_tokens: list[int] | None = None


@dataclass
class PromptLogprobs:
    """v2 (`prompt_logprobs_whole`): a request's whole prompt logprobs, in vLLM's LogprobsTensors
    shape: rows are prompt positions 1..P-1, column 0 the prompt token, then the top-k."""

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    selected_token_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    prompt_logprobs_dict: dict[str, LogprobsLists | PromptLogprobs | None] = field(default_factory=dict)
    num_nans_in_logits: dict[str, int] | None = None
    # Per request: its pooled result (a vector, or one per prompt token) in the step computing its
    # last prompt token, else None; None as a whole when the step has no pooling request.
    pooler_output: list[list[float] | list[list[float]] | None] | None = None
    invalid_block_ids: list[int] | None = None  # disk KV tier: blocks whose load failed (vLLM's name)

    def to_wire(self) -> dict:
        # By hand: dataclasses.asdict deep-copies every leaf, a measurable cost per step.
        def lists(x: LogprobsLists | PromptLogprobs | None) -> dict | None:
            if isinstance(x, PromptLogprobs):
                return {"logprob_token_ids": x.logprob_token_ids, "logprobs": x.logprobs,
                        "selected_token_ranks": x.selected_token_ranks}
            return None if x is None else {
                "logprob_token_ids": x.logprob_token_ids, "logprobs": x.logprobs,
                "sampled_token_ranks": x.sampled_token_ranks, "cu_num_generated_tokens": x.cu_num_generated_tokens}

        out = {
            "req_ids": self.req_ids, "req_id_to_index": self.req_id_to_index,
            "sampled_token_ids": self.sampled_token_ids, "logprobs": lists(self.logprobs),
            "prompt_logprobs_dict": {k: lists(v) for k, v in self.prompt_logprobs_dict.items()},
            "num_nans_in_logits": self.num_nans_in_logits,
        }
        if self.pooler_output is not None:
            out["pooler_output"] = self.pooler_output
        if self.invalid_block_ids is not None:  # only in steps that loaded from the disk KV tier
            out["kv_connector_output"] = {"invalid_block_ids": self.invalid_block_ids}
        return out


EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
