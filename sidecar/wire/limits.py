"""Bounds on what a scheduler can make the worker hold, checked by shape before a step is decoded.

Plain Python, no MLX. `check_step_shape` looks only at container lengths (and the lengths of the
ids), in the raw decoded map, so an oversized part of a body is rejected in time independent of
its size; what has the wrong type is left for the full decode to report. Limits (docs/protocol.md):

- a block table holds at most ceil(max_model_len / block_size) + TABLE_SLACK_BLOCKS (4) blocks,
  per KV cache group; at most MAX_KV_CACHE_GROUPS groups;
- a prompt or a request's stated tokens are at most max_model_len long;
- a step computes at most max(--max-num-batched-tokens, max_model_len) tokens
  (total_num_scheduled_tokens; each per-request count must add up to it);
- a req_id is at most --max-req-id-len characters (default 256);
- the worker holds at most --max-live-requests requests (default 1024);
- finished_req_ids / preempted_req_ids have at most MAX_ID_LIST ids;
- per request, logit_bias, allowed_token_ids and stop_token_ids have at most vocab_size entries,
  bad_words_token_ids at most MAX_BAD_WORDS words of at most max_model_len tokens, and at most
  MAX_BAD_WORD_TOKENS (65536) tokens in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Any, Mapping

from sidecar.errors import ProtocolError

MAX_KV_CACHE_GROUPS = 16
MAX_ID_LIST = 65536
MAX_BAD_WORDS = 4096
MAX_BAD_WORD_TOKENS = 65536  # all of one request's bad words together
# Blocks a table may hold beyond what max_model_len needs: lookahead/speculative slots, and
# schedulers that allocate a few blocks ahead.
TABLE_SLACK_BLOCKS = 4


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    block_size: int
    max_live_requests: int = 1024
    max_req_id_len: int = 256
    vocab_size: int = 1 << 30
    max_num_batched_tokens: int = 0  # 0: only max_model_len bounds a step's tokens

    @classmethod
    def of(cls, config: Any, max_model_len: int, vocab_size: int) -> Limits:
        return cls(max_model_len, config.block_size, config.max_live_requests, config.max_req_id_len, vocab_size,
                   config.max_num_batched_tokens)

    @property
    def max_step_tokens(self) -> int:
        """Tokens one step may compute: what vLLM's scheduler can send (its token budget, or one
        whole prompt when that is longer). Without it, live requests x max_model_len in one forward."""
        return max(self.max_num_batched_tokens, self.max_model_len)

    @property
    def max_table_len(self) -> int:
        return -(-self.max_model_len // self.block_size) + TABLE_SLACK_BLOCKS


_LIST = frozenset({list})


def _list(value: Any) -> list:
    return value if type(value) is list else []


def _len(value: Any) -> int:
    return len(value) if type(value) in (list, dict) else 0


def _longest(rows: list) -> int:
    """The most entries in one of `rows` (0 for a row that is not a container); in C for a list
    of lists, so a step's rows cost nothing per row in Python until one breaks a bound."""
    if set(map(type, rows)) <= _LIST:
        return max(map(len, rows), default=0)
    return max(map(_len, rows), default=0)


def _at_most(value: Any, limit: int, what: str, path: str) -> None:
    if _len(value) > limit:
        raise ProtocolError(f"{what} has {len(value)} entries, the limit is {limit}", field=path)


def _req_id(value: Any, lim: Limits, path: str) -> None:
    if type(value) is str and len(value) > lim.max_req_id_len:
        raise ProtocolError(f"req_id of {len(value)} characters is over the limit of {lim.max_req_id_len} "
                            "(--max-req-id-len)", field=path)


def _ids(value: Any, lim: Limits, path: str, limit: int) -> None:
    _at_most(value, limit, path, path)
    if type(value) is list and value and set(map(type, value)) == {str} and max(map(len, value)) > lim.max_req_id_len:
        i = next(i for i, v in enumerate(value) if len(v) > lim.max_req_id_len)
        _req_id(value[i], lim, f"{path}[{i}]")


def _groups(value: Any, lim: Limits, path: str, already: int = 0) -> None:
    _at_most(value, MAX_KV_CACHE_GROUPS, "block_ids (one list per KV cache group)", path)
    if type(value) is list:
        for g, table in enumerate(value):
            if _len(table) + already > lim.max_table_len:
                raise ProtocolError(f"block table of {_len(table) + already} blocks is over the limit of "
                                    f"{lim.max_table_len} (ceil(max_model_len / block_size) + {TABLE_SLACK_BLOCKS})",
                                    field=f"{path}[{g}]")


def _sampling(sp: dict, lim: Limits, path: str) -> None:
    for key in ("logit_bias", "allowed_token_ids", "stop_token_ids", "_all_stop_token_ids"):
        _at_most(sp.get(key), lim.vocab_size, f"{key} (one per vocabulary token)", f"{path}.{key}")
    for key in ("bad_words_token_ids", "_bad_words_token_ids"):
        words = sp.get(key)
        _at_most(words, MAX_BAD_WORDS, key, f"{path}.{key}")
        for i, w in enumerate(_list(words)):
            _at_most(w, lim.max_model_len, "a bad word (max_model_len)", f"{path}.{key}[{i}]")
        # Every step compares a request's words with its output: their tokens bound that cost.
        total = sum(map(_len, _list(words)))
        if total > MAX_BAD_WORD_TOKENS:
            raise ProtocolError(f"{key} hold {total} tokens in all, the limit is {MAX_BAD_WORD_TOKENS}",
                                field=f"{path}.{key}")


def check_step_shape(so: Any, requests: Mapping[str, Any], lim: Limits) -> None:
    """Raise ProtocolError (with the field) when a scheduler_output breaks a bound."""
    if type(so) is not dict:
        return
    total = so.get("total_num_scheduled_tokens")
    if type(total) is int and total > lim.max_step_tokens:
        raise ProtocolError(f"a step of {total} tokens is over the limit of {lim.max_step_tokens} "
                            "(max(--max-num-batched-tokens, max_model_len))", field="total_num_scheduled_tokens")
    new = so.get("scheduled_new_reqs")
    _at_most(new, lim.max_live_requests, "scheduled_new_reqs", "scheduled_new_reqs")
    for i, nr in enumerate(new if type(new) is list else ()):
        if type(nr) is not dict:
            continue
        path = f"scheduled_new_reqs[{i}]"
        _req_id(nr.get("req_id"), lim, f"{path}.req_id")
        _at_most(nr.get("prompt_token_ids"), lim.max_model_len, "prompt_token_ids (max_model_len)", f"{path}.prompt_token_ids")
        _at_most(nr.get("prefill_token_ids"), lim.max_model_len, "prefill_token_ids (max_model_len)",
                 f"{path}.prefill_token_ids")  # v2 resume
        _groups(nr.get("block_ids"), lim, f"{path}.block_ids")
        sp = nr.get("sampling_params")
        if type(sp) is dict:
            _sampling(sp, lim, f"{path}.sampling_params")
    cached = so.get("scheduled_cached_reqs")
    n = 0
    if type(cached) is dict:
        path = "scheduled_cached_reqs"
        rids = cached.get("req_ids")
        _ids(rids, lim, f"{path}.req_ids", lim.max_live_requests)
        n = _len(rids)
        for key in ("new_token_ids", "new_block_ids", "num_computed_tokens", "num_output_tokens", "resumed_from_preemption"):
            v = cached.get(key)
            if type(v) is list and len(v) != n and not (key == "new_token_ids" and not v):  # v2: [] is fine
                raise ProtocolError(f"{key} has {len(v)} entries for {n} req_ids", field=f"{path}.{key}")
        _ids(cached.get("resumed_req_ids"), lim, f"{path}.resumed_req_ids", lim.max_live_requests)
        resumed = cached.get("resumed_req_ids")
        resumed = set(resumed) if type(resumed) is list and set(map(type, resumed)) <= {str} else set()
        toks = _list(cached.get("new_token_ids"))
        if _longest(toks) > lim.max_model_len:
            for i, t in enumerate(toks):
                _at_most(t, lim.max_model_len, "new_token_ids (max_model_len)", f"{path}.new_token_ids[{i}]")
        cap, row_ids = lim.max_table_len, rids if type(rids) is list else repeat(None)
        for i, (rid, groups) in enumerate(zip(row_ids, _list(cached.get("new_block_ids")))):
            if groups is None:
                continue
            state = requests.get(rid) if type(rid) is str and rid not in resumed else None
            have = len(state.block_ids) if state is not None else 0
            if type(groups) is list and len(groups) <= MAX_KV_CACHE_GROUPS:
                for table in groups:
                    if (len(table) if type(table) is list else _len(table)) + have > cap:
                        break
                else:
                    continue
            _groups(groups, lim, f"{path}.new_block_ids[{i}]", have)  # names what is over
        all_tokens = cached.get("all_token_ids")
        _at_most(all_tokens, lim.max_live_requests, "all_token_ids", f"{path}.all_token_ids")
        for rid, toks in (all_tokens.items() if type(all_tokens) is dict else ()):
            _at_most(toks, lim.max_model_len, "all_token_ids (max_model_len)", f"{path}.all_token_ids.{rid}")
    nst = so.get("num_scheduled_tokens")
    _at_most(nst, _len(new) + n, "num_scheduled_tokens (one per scheduled request)", "num_scheduled_tokens")
    for key in ("finished_req_ids", "preempted_req_ids"):
        _ids(so.get(key), lim, key, MAX_ID_LIST)
    _at_most(so.get("kv_cache_block_copies"), MAX_ID_LIST, "kv_cache_block_copies", "kv_cache_block_copies")
    # Live requests after the step: the held ones, minus the finished, plus the new.
    finished = so.get("finished_req_ids")
    gone = len({r for r in finished if type(r) is str} & requests.keys()) if type(finished) is list else 0
    # a new request taking over a live id (v2 resume) replaces it
    gone += len({nr.get("req_id") for nr in new if type(nr) is dict and type(nr.get("req_id")) is str}
                & (requests.keys() - {r for r in (finished if type(finished) is list else ()) if type(r) is str})
                ) if type(new) is list else 0
    if len(requests) - gone + _len(new) > lim.max_live_requests:
        raise ProtocolError(f"the step would leave {len(requests) - gone + _len(new)} live requests, over the limit "
                            f"of {lim.max_live_requests} (--max-live-requests); finish some first",
                            field="scheduled_new_reqs")
