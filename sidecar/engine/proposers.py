"""Draft proposers (vLLM's `speculative_config` in the worker): after a step, drafts for the next one.

vLLM's GPU runner proposes drafts itself and the engine collects them with `take_draft_token_ids`
(vLLM's DraftTokenIds: `{"req_ids": [...], "draft_token_ids": [[...]]}`), which its scheduler sends
back in the next step's `scheduled_spec_decode_tokens`. Two methods:

- `ngram` (prompt lookup): the longest suffix of the request's tokens (prompt_lookup_max down to
  prompt_lookup_min tokens) that occurred before; the tokens that followed it are the drafts.
  Point-mass drafts: plain Python and numpy, no model.
- `draft_model`: a small mlx-lm model with the target's vocabulary, with its own paged KV pool and
  block tables (a second ModelRunner). It catches up on each request's new tokens, then decodes k
  drafts, greedy for greedy requests and sampled from softmax(logits / temperature) otherwise;
  those distributions are kept for the rejection sampler of the next step.

Drafts never exceed the request's max_tokens (one token is always the verified bonus) or the
model's max_model_len.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from sidecar.config import Config
from sidecar.errors import ProtocolError
from sidecar.kv.pool import LayerSpec
from sidecar.engine.ngram import ngram_drafts
from sidecar.engine.state import RequestState, Row
from sidecar.engine.sampler import SamplingParams
from sidecar.engine.spec_policy import VerifyCost, acceptance, best_length, measure

if TYPE_CHECKING:
    from sidecar.engine.model_runner import ModelRunner



@dataclass
class _Pace:
    """A request's draft length, adapted to how its drafts fare (transformers' assisted-generation
    heuristic): +2 after a step that accepted every draft, -1 after one that rejected any, and at
    0 a pause that doubles each time (1, 2, 4, .. 64 steps) before one draft is tried again."""

    k: int
    wait: int = 0
    backoff: int = 1
    drafted: int = 0  # the request's drafts so far, and how many were accepted (spec_policy.py)
    accepted: int = 0

    def update(self, k_max: int, drafted: int, accepted: int) -> int:
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted
        if drafted:
            if accepted == drafted:
                self.k, self.backoff = min(k_max, self.k + 2), 1
            else:
                self.k -= 1
            if self.k <= 0:
                self.wait, self.backoff, self.k = self.backoff, min(2 * self.backoff, 64), 1
        if self.wait:
            self.wait -= 1
            return 0
        return self.k


class Proposer:
    """The drafts of the last step, per request, until taken. Up to k per request: where drafts
    keep being rejected (text that does not repeat) fewer, down to none for a while, so that
    verifying them costs little when speculation does not help. A proposer whose drafts cost
    nothing to make (`costed`) also weighs the model's measured verify cost against the request's
    acceptance rate (spec_policy.py): where verifying costs what decoding the tokens would, none."""

    costed = False

    def __init__(self, k: int):
        self.k = k
        self.cost: VerifyCost | None = None  # measured at the first step (costed proposers)
        self.pending: dict[str, list[int]] = {}
        self.paces: dict[str, _Pace] = {}
        self.proposed = 0  # draft tokens handed out since start

    def propose(self, runner: ModelRunner, rows: Sequence[Row], new_tokens: Sequence[list[int]]) -> set[str]:
        """Called by the runner after the step's tokens are known (before they are appended to
        the request state). Returns the ids that got drafts."""
        want: list[tuple[RequestState, list[int], int]] = []
        if self.costed and self.cost is None:
            self.cost = _measure(runner, self.k)
        for r, new in zip(rows, new_tokens):
            s = r.state
            if not new:
                continue
            p = self.paces.setdefault(s.req_id, _Pace(self.k))
            pace = p.update(self.k, r.num_draft, len(new) - 1)
            if pace and self.cost is not None:
                pace = best_length(pace, acceptance(p.accepted, p.drafted), self.cost)
            n_out = len(s.output_token_ids) + len(new)
            history = s.prompt_token_ids + s.output_token_ids + new
            left = (s.sampling_params.max_tokens or 1 << 62) - n_out - 1  # the bonus token is never a draft
            k = min(pace, left, runner.max_model_len - len(history))
            if k > 0:
                want.append((s, history, k))
        self.pending = self._drafts(runner, want)
        self.pending = {rid: d for rid, d in self.pending.items() if d}
        self.proposed += sum(map(len, self.pending.values()))
        return set(self.pending)

    def _drafts(self, runner: ModelRunner, want: list[tuple[RequestState, list[int], int]]) -> dict[str, list[int]]:
        raise NotImplementedError

    def take(self) -> dict | None:
        """vLLM's DraftTokenIds, or None when no request has drafts."""
        pending, self.pending = self.pending, {}
        if not pending:
            return None
        return {"req_ids": list(pending), "draft_token_ids": list(pending.values())}

    def draft_probs(self, rows: Sequence[Row]) -> dict[str, np.ndarray]:
        """Draft distributions [k, V] for rows whose drafts this proposer made (none: point masses)."""
        return {}

    def allocate(self, num_blocks: int) -> None:
        self.pending, self.paces = {}, {}

    def free(self) -> None:
        self.pending, self.paces = {}, {}

    def forget(self, req_ids: Sequence[str]) -> None:
        for rid in req_ids:
            self.pending.pop(rid, None)
            self.paces.pop(rid, None)


class NgramProposer(Proposer):
    costed = True

    def __init__(self, k: int, n_min: int, n_max: int):
        super().__init__(k)
        self.n_min, self.n_max = n_min, n_max

    def _drafts(self, runner: ModelRunner, want: list[tuple[RequestState, list[int], int]]) -> dict[str, list[int]]:
        return {s.req_id: ngram_drafts(np.asarray(h, np.int32), self.n_min, self.n_max, k) for s, h, k in want}


@dataclass
class _DraftSeq:
    tokens: list[int] = field(default_factory=list)  # the tokens whose K/V the draft pool holds, from 0
    blocks: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # the last drafts handed out, and their distributions
    probs: np.ndarray | None = None


class DraftModelProposer(Proposer):
    _GREEDY = SamplingParams(temperature=0.0)

    def __init__(self, k: int, runner: ModelRunner, seed: int = 0):
        super().__init__(k)
        self.runner = runner  # the draft model's own runner (its own pool)
        self.seqs: dict[str, _DraftSeq] = {}
        self.free_blocks: list[int] = []
        self.rng = np.random.default_rng(seed)

    def allocate(self, num_blocks: int) -> None:
        super().allocate(num_blocks)
        self.runner.allocate(num_blocks)
        self.seqs.clear()
        self.free_blocks = list(range(num_blocks - 1, -1, -1))

    def free(self) -> None:
        super().free()
        self.runner.free()
        self.seqs.clear()
        self.free_blocks = []

    def forget(self, req_ids: Sequence[str]) -> None:
        super().forget(req_ids)
        for rid in req_ids:
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self.free_blocks += seq.blocks

    def draft_probs(self, rows: Sequence[Row]) -> dict[str, np.ndarray]:
        out = {}
        for r in rows:
            seq = self.seqs.get(r.state.req_id)
            if r.num_draft and seq is not None and seq.probs is not None \
                    and r.token_ids[len(r.token_ids) - r.num_draft:] == seq.drafts[: r.num_draft]:
                out[r.state.req_id] = seq.probs
        return out

    def _drafts(self, runner: ModelRunner, want: list[tuple[RequestState, list[int], int]]) -> dict[str, list[int]]:
        dr = self.runner
        if dr.pool is None or not want:
            return {}
        bs = dr.pool.block_size
        rows: list[Row] = []
        meta: list[tuple[RequestState, _DraftSeq, int]] = []
        for s, history, k in want:
            seq = self.seqs.setdefault(s.req_id, _DraftSeq())
            n = len(history)
            common = _common_prefix(seq.tokens, history)
            need = -(-(n + k - 1) // bs) - len(seq.blocks)
            if need > len(self.free_blocks):
                continue  # the draft pool is full: no drafts for this request this time
            seq.blocks += [self.free_blocks.pop() for _ in range(max(0, need))]
            start = min(common, n - 1)
            seq.tokens = history
            st = RequestState(s.req_id, history, self._GREEDY, seq.blocks)
            rows.append(Row(st, start, history[start:], seq.blocks, True))
            meta.append((s, seq, k))
        if not rows:
            return {}
        k_max = max(k for _, _, k in meta)
        drafts: list[list[int]] = [[] for _ in rows]
        probs: list[list[np.ndarray]] = [[] for _ in rows]
        for step in range(k_max):
            live = [i for i, (_, _, k) in enumerate(meta) if step < k]
            logits = dr.forward([rows[i] for i in live], list(range(len(live))), None, {})
            greedy = [meta[i][0].sampling_params.greedy for i in live]
            if all(greedy):
                picks, ps = mx.argmax(logits, axis=-1).tolist(), None
            else:
                temps = mx.array([max(meta[i][0].sampling_params.temperature, 1e-5) for i in live])[:, None]
                ps = np.asarray(mx.softmax(logits / temps, axis=-1), np.float64)
                picks = np.argmax(ps, axis=-1).tolist()
            for j, i in enumerate(live):
                s = meta[i][0]
                if ps is not None and not greedy[j]:
                    picks[j] = int(self._rng_for(s, len(s.output_token_ids) + step).choice(len(ps[j]), p=ps[j] / ps[j].sum()))
                    probs[i].append(ps[j].astype(np.float32))
                drafts[i].append(int(picks[j]))
                r = rows[i]
                rows[i] = Row(r.state, r.end, [int(picks[j])], r.block_ids, True)
        out = {}
        for (s, seq, _), d, p in zip(meta, drafts, probs):
            seq.drafts, seq.probs = d, (np.stack(p) if p else None)
            out[s.req_id] = d
        return out

    def _rng_for(self, s: RequestState, pos: int) -> np.random.Generator:
        seed = s.sampling_params.seed
        return self.rng if seed is None else np.random.default_rng([seed & (2**63 - 1), pos, 0x5D])


def _measure(runner: ModelRunner, k: int) -> VerifyCost:
    try:
        return measure(runner.model, k)
    except Exception:  # noqa: BLE001 - a model that cannot run without its cache: draft by acceptance alone
        return VerifyCost(0.0)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def proposer_for(cfg: Config, *, vocab_size: int, max_model_len: int,
                 layer_specs: Callable[[dict, Any], list[LayerSpec]]) -> Proposer | None:
    """The server's proposer (None: speculation off); a draft model is loaded here and must share
    the target's vocabulary (400 on config.draft_model otherwise)."""
    method, k = cfg.spec_method, cfg.num_speculative_tokens
    if method == "ngram":
        ngram = NgramProposer(k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        if cfg.speculative_verify_cost >= 0:  # the device's cost as the operator knows it: not timed
            ngram.cost = VerifyCost(cfg.speculative_verify_cost)
        return ngram
    if method != "draft_model":
        return None
    from mlx_lm.utils import load_model

    from sidecar.models import resolve_model
    from sidecar.engine.model_runner import ModelRunner

    try:
        model, conf = load_model(resolve_model(cfg.draft_model, cfg.home))  # type: ignore[arg-type]
    except (ValueError, OSError) as e:
        raise ProtocolError(f"draft model: {e}", field="config.draft_model") from None
    vocab = int(conf.get("vocab_size") or conf["text_config"]["vocab_size"])
    if vocab != vocab_size:
        raise ProtocolError(f"the draft model's vocabulary ({vocab}) differs from the model's ({vocab_size})",
                            field="config.draft_model")
    runner = ModelRunner(model, layer_specs(conf, model), vocab_size=vocab, eos_token_ids=[],
                         max_model_len=max_model_len, max_logprobs=0, decode_ahead=False)
    return DraftModelProposer(k, runner, cfg.seed)
