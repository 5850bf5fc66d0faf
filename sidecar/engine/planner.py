"""Planning a step: `plan_step` validates a whole SchedulerOutput against the current request state
and returns what to do; `apply` is the only place request state changes, so a rejected step changes
nothing. Plain Python, no MLX.
"""

from __future__ import annotations

from typing import Mapping

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import SchedulerOutput
from sidecar.engine.placeholders import PLACEHOLDER, check_placeholder
from sidecar.engine.state import RequestState, Row, StepPlan
from sidecar.wire.pooling_params import PoolingModel, needs_every_position

_DRAFTS = "scheduled_spec_decode_tokens"
_NO_DRAFTS = "speculative decoding is not offered for models with recurrent state (a rejected draft cannot be undone)"


def _groups(groups: list[list[int]], path: str, num_groups: int) -> list[list[int]]:
    if len(groups) not in (1, num_groups):
        want = "1" if num_groups == 1 else f"1 (shared by all groups) or {num_groups}"
        raise ProtocolError(f"expected {want} KV cache group block lists, got {len(groups)}", field=path)
    return groups


def _check_drafts(spec: Mapping[str, list[int]], rid: str, start: int, n: int, num_tokens: int,
                 vocab_size: int) -> list[int]:
    """The request's drafts (spec_decode.py), checked: ids in the vocabulary, and the scheduled span is exactly
    [start, num_tokens + k) with at least the last known token in it."""
    drafts = spec.get(rid) or []
    for j, t in enumerate(drafts):
        if not 0 <= t < vocab_size:
            raise ProtocolError(f"draft token id {t} outside [0, {vocab_size})", field=f"{_DRAFTS}.{rid}[{j}]")
    k = len(drafts)
    if k and (start + n != num_tokens + k or n <= k):
        raise ProtocolError(
            f"{k} drafts for {rid!r} need num_scheduled_tokens = known tokens ({num_tokens}) - num_computed_tokens "
            f"({start}) + {k} = {num_tokens - start + k}, got {n}", field=f"num_scheduled_tokens.{rid}")
    return list(drafts)


def _check_no_stray_drafts(spec: Mapping[str, list[int]], scheduled: set[str]) -> None:
    for rid in sorted(spec):
        if rid not in scheduled and spec[rid]:
            raise ProtocolError(f"drafts for {rid!r}, which is not scheduled in this step", field=f"{_DRAFTS}.{rid}")


def plan_step(
    requests: dict[str, RequestState], out: SchedulerOutput, *,
    num_blocks: int, block_size: int, vocab_size: int, max_model_len: int, loras: set[int] | frozenset[int] = frozenset(),
    state_groups: frozenset[int] | None = None, num_groups: int = 1, pooling: PoolingModel | None = None,
) -> StepPlan:
    """Validate the whole batch and plan it; raises ProtocolError (with the field path) on any violation.

    `state_groups`: the groups of recurrent layers (None: the model has none). Their state lives in
    the request's first block of the group; it cannot be recovered from blocks, so such a model
    computes every request from position 0 (no prefix caching) and in order. `pooling`: what the
    model offers for pooling requests (None: a generative-only model)."""
    recurrent = state_groups is not None
    finished = set(out.finished_req_ids)  # unknown finished ids are ignored, as vLLM's runner does
    live = {rid for rid in requests if rid not in finished}

    for i, rid in enumerate(out.preempted_req_ids):
        if rid not in live:
            raise ProtocolError(f"unknown request {rid!r}", field=f"preempted_req_ids[{i}]")

    seen: set[str] = set()
    rows: list[Row] = []
    new_states: list[RequestState] = []
    updates: list[tuple[RequestState, list[int], list[int] | None]] = []

    def scheduled(rid: str, path: str) -> int:
        if rid in seen:
            raise ProtocolError(f"request {rid!r} is scheduled twice", field=path)
        seen.add(rid)
        n = out.num_scheduled_tokens.get(rid)
        if n is None or n < 1:
            raise ProtocolError(f"num_scheduled_tokens[{rid!r}] must be >= 1, got {n}", field=f"num_scheduled_tokens.{rid}")
        return n

    def check_tables(tables: list[list[int]], end: int, path: str, index_single: bool,
                     known: list[int] | None = None) -> None:
        """`known`: per group, how many leading blocks were checked when they were added."""
        for g, table in enumerate(tables):
            gp = f"{path}[{g}]" if index_single or len(tables) > 1 else path
            first = known[g] if known else 0
            if len(tables) > 1 and state_groups and g in state_groups:
                check_ids(table, first, gp)
                if not table:
                    raise ProtocolError("a recurrent state group needs the request's state block", field=gp)
                continue
            check_table(table, end, gp, first)

    def check_ids(table: list[int], first: int, path: str) -> None:
        for j in range(first, len(table)):
            if not 0 <= table[j] < num_blocks:
                raise ProtocolError(f"block id {table[j]} outside [0, {num_blocks})", field=f"{path}[{j}]")

    def check_table(table: list[int], end: int, path: str, first: int = 0) -> None:
        check_ids(table, first, path)
        need = -(-end // block_size)
        if len(table) < need:
            raise ProtocolError(
                f"block table has {len(table)} blocks, positions up to {end} need {need}", field=path)
        if end > max_model_len:
            raise ProtocolError(f"position {end} exceeds max_model_len {max_model_len}", field=path)

    def check_tokens(tokens: list[int], path: str) -> None:
        for j, t in enumerate(tokens):
            if not 0 <= t < vocab_size:
                raise ProtocolError(f"token id {t} outside [0, {vocab_size})", field=f"{path}[{j}]")

    preempted = set(out.preempted_req_ids)
    for i, (src, dst) in enumerate(out.kv_cache_block_copies):
        for j, b in enumerate((src, dst)):
            if not 0 <= b < num_blocks:
                raise ProtocolError(f"block id {b} outside [0, {num_blocks})", field=f"kv_cache_block_copies[{i}][{j}]")

    for i, nr in enumerate(out.scheduled_new_reqs):
        path = f"scheduled_new_reqs[{i}]"
        # v2: a new request may reuse the id of a preempted one (vLLM's runner V2 resume).
        if nr.req_id in live and not (nr.prefill_token_ids is not None or nr.req_id in preempted
                                      or requests[nr.req_id].preempted):
            raise ProtocolError(f"request {nr.req_id!r} already exists", field=f"{path}.req_id")
        n = scheduled(nr.req_id, f"{path}.req_id")
        check_tokens(nr.prompt_token_ids, f"{path}.prompt_token_ids")
        known_ids = nr.prefill_token_ids if nr.prefill_token_ids is not None else nr.prompt_token_ids
        if known_ids is not nr.prompt_token_ids:
            check_tokens(known_ids[len(nr.prompt_token_ids):], f"{path}.prefill_token_ids")
        start, end = nr.num_computed_tokens, nr.num_computed_tokens + n
        drafts = _check_drafts(out.scheduled_spec_decode_tokens, nr.req_id, start, n, len(known_ids), vocab_size)
        if recurrent and drafts:
            raise ProtocolError(_NO_DRAFTS, field=f"{_DRAFTS}.{nr.req_id}")
        if start < 0 or end - len(drafts) > len(known_ids):
            raise ProtocolError(
                f"tokens [{start}, {end}) run past the {len(known_ids)} known tokens",
                field=f"{path}.num_computed_tokens")
        if recurrent and start:
            raise ProtocolError("prefix caching is not offered for models with recurrent state: "
                                "num_computed_tokens must be 0", field=f"{path}.num_computed_tokens")
        tables = _groups(nr.block_ids, f"{path}.block_ids", num_groups)
        check_tables(tables, end, f"{path}.block_ids", True)
        table = tables[0]
        if nr.lora_request is not None and nr.lora_request.get("lora_int_id") not in loras:
            raise ProtocolError(f"LoRA {nr.lora_request.get('lora_int_id')!r} is not loaded; call add_lora first",
                                field=f"{path}.lora_request.lora_int_id")
        pp = _pooling(nr, path, start, pooling, bool(drafts))
        state = RequestState(nr.req_id, nr.prompt_token_ids, nr.sampling_params, table, start,
                             lora_request=nr.lora_request, other_block_ids=list(tables[1:]),
                             output_token_ids=list(known_ids[len(nr.prompt_token_ids):]), pooling_params=pp)
        new_states.append(state)
        known = end - len(drafts)
        rows.append(Row(state, start, state.tokens(start, known) + drafts, table,
                        known == state.num_tokens and pp is None, len(drafts), list(tables[1:])))

    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        path = "scheduled_cached_reqs"
        if rid not in live:
            raise ProtocolError(f"unknown request {rid!r}", field=f"{path}.req_ids[{i}]")
        n = scheduled(rid, f"{path}.req_ids[{i}]")
        state = requests[rid]
        start = cached.num_computed_tokens[i]
        # Tokens the scheduler states (pipeline-parallel style / resumed all_token_ids) override ours.
        outputs = None
        if rid in cached.all_token_ids:
            toks = cached.all_token_ids[rid]
            if toks[: len(state.prompt_token_ids)] != state.prompt_token_ids:
                raise ProtocolError("all_token_ids must start with the prompt", field=f"{path}.all_token_ids.{rid}")
            outputs = toks[len(state.prompt_token_ids):]
        elif cached.new_token_ids[i] == PLACEHOLDER:
            check_placeholder(state, start, f"{path}.new_token_ids[{i}]")
        elif cached.new_token_ids[i]:
            known = state.tokens(0, state.num_tokens)[:start] + cached.new_token_ids[i]
            if len(known) < len(state.prompt_token_ids):
                raise ProtocolError("new_token_ids may not rewrite the prompt", field=f"{path}.new_token_ids[{i}]")
            outputs = known[len(state.prompt_token_ids):]
        if outputs is not None:
            check_tokens(outputs, f"{path}.new_token_ids[{i}]")
        num_tokens = len(state.prompt_token_ids) + len(state.output_token_ids if outputs is None else outputs)
        end = start + n
        drafts = _check_drafts(out.scheduled_spec_decode_tokens, rid, start, n, num_tokens, vocab_size)
        if recurrent and drafts:
            raise ProtocolError(_NO_DRAFTS, field=f"{_DRAFTS}.{rid}")
        if start < 0 or end - len(drafts) > num_tokens:
            raise ProtocolError(
                f"tokens [{start}, {end}) run past the {num_tokens} known tokens of {rid!r}",
                field=f"{path}.num_computed_tokens[{i}]")
        resumed = rid in cached.resumed_req_ids
        if recurrent and start != (0 if resumed else state.num_computed_tokens):
            raise ProtocolError(f"a model with recurrent state continues {rid!r} from "
                                f"{0 if resumed else state.num_computed_tokens} (no prefix caching, no rewind)",
                                field=f"{path}.num_computed_tokens[{i}]")
        added = cached.new_block_ids[i]
        ngroups = len(added) if added is not None else 1 + len(state.other_block_ids)
        if added is not None and not resumed and len(added) != 1 + len(state.other_block_ids):
            raise ProtocolError(f"{len(added)} block lists for a request with {1 + len(state.other_block_ids)}",
                                field=f"{path}.new_block_ids[{i}]")
        added_g = _groups(added, f"{path}.new_block_ids[{i}]", num_groups) if added is not None else [[]] * ngroups
        known_blocks = None
        if resumed:
            if added is None:
                raise ProtocolError(f"resumed request {rid!r} needs its new block table", field=f"{path}.new_block_ids[{i}]")
            tables = [list(t) for t in added_g]
        else:
            old_tables = [state.block_ids, *state.other_block_ids]
            tables = [old if not new else old + new for old, new in zip(old_tables, added_g)]
            known_blocks = [len(t) for t in old_tables]
        check_tables(tables, end, f"{path}.new_block_ids[{i}]", False, known_blocks)
        pp = state.pooling_params
        if pp is not None and (drafts or outputs or (needs_every_position(pp) and start not in (0, state.pooled_upto))):
            raise ProtocolError(f"pooling request {rid!r} continues from {state.pooled_upto} or restarts from 0 "
                                "(no drafts, no new tokens)", field=f"{path}.num_computed_tokens[{i}]")
        updates.append((state, tables, outputs))
        known = end - len(drafts)
        # (Only the row's own tokens are sliced out: a decode row is not O(context) here.)
        toks = state.tokens(start, known) if outputs is None else (state.prompt_token_ids + outputs)[start:known]
        rows.append(Row(state, start, toks + drafts, tables[0], known == num_tokens and pp is None, len(drafts),
                        tables[1:]))

    _check_no_stray_drafts(out.scheduled_spec_decode_tokens, seen)
    extra = set(out.num_scheduled_tokens) - seen
    if extra:
        rid = sorted(extra)[0]
        raise ProtocolError(f"request {rid!r} has scheduled tokens but is not scheduled", field=f"num_scheduled_tokens.{rid}")
    total = sum(out.num_scheduled_tokens.values())
    if total != out.total_num_scheduled_tokens:
        raise ProtocolError(
            f"total_num_scheduled_tokens is {out.total_num_scheduled_tokens}, the per-request counts add up to {total}",
            field="total_num_scheduled_tokens")
    return StepPlan(sorted(finished & set(requests)), new_states, updates, rows, sorted(preempted),
                    out.kv_cache_block_copies)


def _pooling(nr, path: str, start: int, model: PoolingModel | None, drafts: bool):
    """A new request's pooling params resolved against the model (None: a sampling request)."""
    pp = nr.pooling_params
    if pp is None:
        if model is not None and model.classify_only:
            raise ProtocolError("this model is a classification model: its requests carry pooling_params",
                                field=f"{path}.sampling_params")
        return None
    if model is None:
        raise ProtocolError("this model serves generation only: pooling needs a pooling model (an embedding or "
                            "classification model directory, or the sidecar started with --runner pooling)",
                            field=f"{path}.pooling_params")
    pp = model.resolve(pp, f"{path}.pooling_params")
    if drafts:
        raise ProtocolError("a pooling request has no drafts", field=f"{_DRAFTS}.{nr.req_id}")
    if needs_every_position(pp) and start:
        raise ProtocolError(f"{pp.pooling_type} pooling needs every position's hidden state, and those of a cached "
                            "prefix are not kept: num_computed_tokens must be 0", field=f"{path}.num_computed_tokens")
    if len(nr.prefill_token_ids or nr.prompt_token_ids) != len(nr.prompt_token_ids):
        raise ProtocolError("a pooling request has no output tokens", field=f"{path}.prefill_token_ids")
    return pp


def apply(requests: dict[str, RequestState], plan: StepPlan) -> None:
    """Commit a validated plan's bookkeeping (before the forward: finished dropped, tables set)."""
    for rid in plan.finished:
        del requests[rid]
    for rid in plan.preempted:
        requests[rid].preempted = True
    for state in plan.new_states:
        requests[state.req_id] = state
    for state, tables, outputs in plan.updates:
        state.block_ids, state.other_block_ids, state.preempted = tables[0], tables[1:], False
        if outputs is not None:
            state.output_token_ids = list(outputs)
    for row in plan.rows:
        row.state.num_computed_tokens = row.end
    for state, computed in plan.rewinds:
        state.num_computed_tokens = computed

