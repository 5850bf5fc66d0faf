"""The decode step's fast path through `SchedulerOutput.from_wire`: no new requests, no drafts.

Nearly every step of a stream only continues cached requests (one token each), and the full
decode (protocol.py) spends ~10 us of Python on one: a closure, a field path and a checked copy
per value. `cached_step` reads the same fields with type checks alone and returns what the full
decode would build from them, or None whenever the body is anything else: a new request, drafts,
a resumed request, stated tokens, block copies, or any value of an unexpected type. Then the full
decode runs and gives its answer or its error, so a body is accepted or rejected (with the same
field path) exactly as before. Plain Python, no MLX.
"""

from __future__ import annotations

from typing import Any

_INT = int
_STR = str
_LIST = list


def _empty(v: Any, kind: type) -> bool:
    """A field the full decode defaults when missing or null, and that is empty here."""
    return v is None or (type(v) is kind and not v)


def _ints(v: Any) -> bool:
    """A list of ints (bool is not one: the full decode names it)."""
    return type(v) is _LIST and all(type(x) is _INT for x in v)


def _str_list(v: Any) -> list | None:
    if v is None:
        return []
    if type(v) is not _LIST:
        return None
    for s in v:
        if type(s) is not _STR:
            return None
    return v


def cached_step(d: Any) -> tuple | None:
    """(req_ids, new_token_ids, new_block_ids, num_computed_tokens, num_scheduled_tokens,
    total_num_scheduled_tokens, finished_req_ids, preempted_req_ids) of a step that only continues
    cached requests, as the full decode would give them; None: use the full decode."""
    if type(d) is not dict:
        return None
    g = d.get
    if not (_empty(g("scheduled_new_reqs"), list) and _empty(g("kv_cache_block_copies"), list)
            and _empty(g("scheduled_spec_decode_tokens"), dict)):
        return None
    nst = g("num_scheduled_tokens")
    total = g("total_num_scheduled_tokens")
    if type(nst) is not dict or type(total) is not _INT:
        return None
    for k, v in nst.items():
        if type(k) is not _STR or type(v) is not _INT:
            return None
    finished = _str_list(g("finished_req_ids"))
    preempted = _str_list(g("preempted_req_ids"))
    if finished is None or preempted is None:
        return None
    cached = g("scheduled_cached_reqs")
    if cached is None:
        cached = {}
    elif type(cached) is not dict:
        return None
    c = cached.get
    req_ids = _str_list(c("req_ids"))
    if req_ids is None or not _empty(c("resumed_req_ids"), list) or c("resumed_from_preemption") is not None \
            or not _empty(c("all_token_ids"), dict):
        return None
    n = len(req_ids)
    toks = c("new_token_ids")
    if toks is None or (type(toks) is _LIST and not toks):  # v2: vLLM sends [] unless pipeline-parallel
        toks = [[] for _ in range(n)]
    elif type(toks) is not _LIST or len(toks) != n:
        return None
    elif not all(_ints(t) for t in toks):
        return None
    blocks = c("new_block_ids")
    if blocks is None:
        blocks = [None] * n
    elif type(blocks) is not _LIST or len(blocks) != n:
        return None
    elif not all(gs is None or (type(gs) is _LIST and all(_ints(t) for t in gs)) for gs in blocks):
        return None
    computed = c("num_computed_tokens")
    if computed is None:
        computed = [0] * n
    elif not _ints(computed) or len(computed) != n:
        return None
    return req_ids, toks, blocks, computed, nst, total, finished, preempted
