"""Images in a step: what vLLM's GPU runner does with `mm_features` and the encoder instructions.

Per step, as vLLM's `_update_states` / `_execute_mm_encoder` / `_gather_mm_embeddings`: the
encoder outputs the scheduler freed are dropped, new requests' items are registered, the items in
`scheduled_encoder_inputs` run through the vision encoder into a cache keyed by their identifier
(the content hash: two requests with the same image share one run), and each batch's input
embeddings take, at every placeholder position its chunk computes, the matching row of the cached
output (an image split across chunks included). M-RoPE families get every row's positions from
the request's prompt and grids (models/vision.py). `plan` validates a step before anything
changes; `apply` commits it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np

from sidecar.errors import ProtocolError
from sidecar.wire.multimodal import MMFeature
from sidecar.wire.protocol import SchedulerOutput

if TYPE_CHECKING:
    from sidecar.engine.state import RequestState, Row
    from sidecar.models.vlm_model import VisionLanguageModel


@dataclass
class EncoderStats:
    runs: int = 0  # items encoded
    hits: int = 0  # a new request's item whose output was already cached
    misses: int = 0
    evictions: int = 0  # outputs freed by the scheduler
    seconds: float = 0.0  # in the encoder


@dataclass
class _Request:
    features: list[MMFeature]
    positions: np.ndarray | None = None  # [3, P] M-RoPE positions of the prompt
    delta: int = 0  # later positions: index + delta
    end: int = 0  # past the last placeholder: a row starting there (a decode) takes no encoder rows

    def __post_init__(self) -> None:
        self.end = max((f.mm_position.offset + f.mm_position.length for f in self.features), default=0)


def _taken(req: _Request, start: int, n: int):
    """Each item whose encoder output the chunk [start, start + n) takes: (index, item, the chunk's
    positions in its placeholder, which of them are embeddings, the placeholder's is_embed)."""
    for j, f in enumerate(req.features):
        r = f.mm_position
        lo, hi = max(r.offset, start), min(r.offset + r.length, start + n)
        if lo >= hi:
            continue
        embed = np.ones(r.length, bool) if r.is_embed is None else np.asarray(r.is_embed)
        at = np.arange(lo, hi)
        keep = embed[at - r.offset]
        if keep.any():  # (none: no embedding in this chunk, and vLLM schedules no encoder input for it)
            yield j, f, at, keep, embed


@dataclass
class MMPlan:
    new: dict[str, _Request] = field(default_factory=dict)
    encode: list[MMFeature] = field(default_factory=list)  # in order, identifiers not cached
    free: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


def refuse_images(out: SchedulerOutput, family: str) -> None:
    """A model served as text only: a request carrying images is a 400 naming the family."""
    for i, nr in enumerate(out.scheduled_new_reqs):
        if nr.mm_features:
            from sidecar.models.vision import SERVED

            raise ProtocolError(f"this model ({family}) is served as text only; images are served for "
                                f"{', '.join(SERVED)} with the vision extra installed",
                                field=f"scheduled_new_reqs[{i}].mm_features")
    if out.encoder.scheduled_encoder_inputs:
        raise ProtocolError("this model is served as text only", field="scheduled_encoder_inputs")


class Multimodal:
    def __init__(self, model: VisionLanguageModel, max_bytes: int = 4 << 30):
        self.model, self.max_bytes = model, max_bytes
        self.requests: dict[str, _Request] = {}
        self.cache: dict[str, mx.array] = {}
        self.stats = EncoderStats()

    def clear(self) -> None:
        """Drop every request's items and every encoder output (the pool was freed)."""
        self.requests.clear()
        self.cache.clear()

    def plan(self, out: SchedulerOutput, requests: dict[str, RequestState], rows: list[Row]) -> MMPlan:
        """Validate the step's multimodal part; raises ProtocolError naming the field. Runs after
        the planner has checked the step (its prompts' token ids reach mlx-vlm's position code)."""
        m = self.model
        plan = MMPlan(free=list(out.encoder.free_encoder_mm_hashes), finished=list(out.finished_req_ids))
        for i, nr in enumerate(out.scheduled_new_reqs):
            grids = []
            for j, f in enumerate(nr.mm_features):
                path = f"scheduled_new_reqs[{i}].mm_features[{j}]"
                r = f.mm_position
                span = np.asarray(nr.prompt_token_ids[r.offset: r.offset + r.length])
                embed = np.ones(r.length, bool) if r.is_embed is None else np.asarray(r.is_embed)
                if (span[embed] != m.image_token_id).any():
                    raise ProtocolError(f"the placeholder's positions must hold the image token {m.image_token_id}",
                                        field=f"{path}.mm_position")
                # vLLM strips the pixels of an item whose placeholder its prefix cache covers (an
                # M-RoPE model keeps the grid, other families may keep their small tensors): no
                # chunk computes those positions. Nor does an item whose output is cached need them.
                covered = r.offset + r.length <= nr.num_computed_tokens
                pixels = "pixel_values" in (f.data or {})
                if not pixels and not covered and f.identifier not in self.cache:
                    raise ProtocolError("the item's processed tensors are missing", field=f"{path}.data")
                if pixels or m.mrope:
                    m.check(f.data or {}, r.num_embeds, path, tensors=pixels)
                grids.append((f.data or {}).get("image_grid_thw"))
            req = _Request(list(nr.mm_features))
            if m.mrope:
                req.positions, req.delta = m.rope_positions(nr.prompt_token_ids, grids)
            plan.new[nr.req_id] = req
        freed = set(plan.free)
        queued: set[str] = set()
        for rid, items in out.encoder.scheduled_encoder_inputs.items():
            path = f"scheduled_encoder_inputs.{rid}"
            req = plan.new.get(rid) or (self.requests.get(rid) if rid in requests else None)
            if req is None:
                raise ProtocolError(f"request {rid!r} has no multimodal items", field=path)
            for k, j in enumerate(items):
                if not 0 <= j < len(req.features):
                    raise ProtocolError(f"item {j} outside [0, {len(req.features)})", field=f"{path}[{k}]")
                f = req.features[j]
                if f.data is None or "pixel_values" not in f.data:  # covered by the prefix cache (as vLLM's runner)
                    continue
                if (f.identifier not in self.cache or f.identifier in freed) and f.identifier not in queued:
                    queued.add(f.identifier)
                    plan.encode.append(f)
        readable = (set(self.cache) - freed) | queued  # the outputs this step's chunks can take
        for row in rows:
            rid = row.state.req_id
            req = plan.new.get(rid) or self.requests.get(rid)
            if req is None or row.start >= req.end:
                continue
            for j, f, at, _, _ in _taken(req, row.start, len(row.token_ids)):
                if f.identifier not in readable:
                    raise ProtocolError(f"the encoder output of item {j} of {rid!r} is needed at positions "
                                        f"[{at[0]}, {at[-1] + 1}) but was never scheduled (or was freed)",
                                        field="scheduled_encoder_inputs")
        return plan

    def apply(self, plan: MMPlan, restore: Callable[[], None]) -> Callable[[], None]:
        """Free, register, encode: vLLM's order. The encoder runs here, timed. Returns `restore`
        (the step's roll-back) extended to undo this too; a failure here undoes it itself."""
        if not (plan.free or plan.finished or plan.new or plan.encode):
            return restore  # (a step of decodes and text: nothing to do or undo)
        saved = dict(self.cache), dict(self.requests)

        def undo() -> None:
            self.cache, self.requests = saved
            restore()

        try:
            self._apply(plan)
        except BaseException:
            self.cache, self.requests = saved
            raise
        return undo

    def _apply(self, plan: MMPlan) -> None:
        for h in plan.free:
            if self.cache.pop(h, None) is not None:
                self.stats.evictions += 1
        for rid in plan.finished:
            self.requests.pop(rid, None)
        seen = set(self.cache)  # as vLLM counts: an item another request of the step brings is a hit too
        for rid, req in plan.new.items():
            self.requests[rid] = req
            for f in req.features:
                self.stats.hits += f.identifier in seen
                self.stats.misses += f.identifier not in seen
                seen.add(f.identifier)
        if plan.encode:
            t0 = time.perf_counter()
            outs = [self.model.encode(f.data) for f in plan.encode]  # type: ignore[arg-type]
            mx.eval(outs)
            self.stats.seconds += time.perf_counter() - t0
            self.stats.runs += len(outs)
            held = {**self.cache, **{f.identifier: o for f, o in zip(plan.encode, outs)}}
            total = sum(o.nbytes for o in held.values())
            if total > self.max_bytes:  # (the scheduler frees outputs; this bounds one that does not)
                raise ProtocolError(f"the encoder outputs held would take {total} bytes, over the bound of "
                                    f"{self.max_bytes} (--max-encoder-cache-bytes): free some first",
                                    field="scheduled_encoder_inputs")
            self.cache = held

    def _decode_position(self, row: Row) -> int | None:
        """The row's position when it starts past its prompt's positions and images, else None."""
        req = self.requests.get(row.state.req_id)
        if req is None or req.positions is None:
            return row.start if req is None or row.start >= req.end else None
        return row.start + req.delta if row.start >= max(req.end, req.positions.shape[1]) else None

    def bind(self, rows: list[Row], ids: np.ndarray) -> None:
        """Set the next forward's input embeddings and positions for the padded batch `ids` [B, L]."""
        m = self.model
        B, L = ids.shape
        at = [self._decode_position(r) for r in rows] if L == 1 else [None]
        if None not in at:  # every decode step: index + delta, no images
            m.bind(None, mx.array([[[p] for p in at]] * 3, dtype=mx.int32) if m.mrope else None)
            return
        pos = np.zeros((3, B, L), np.int32)
        dst: list[np.ndarray] = []
        src: list[mx.array] = []
        for b, row in enumerate(rows):
            req = self.requests.get(row.state.req_id)
            s, n = row.start, len(row.token_ids)
            idx = np.arange(s, s + n)
            if req is None or req.positions is None:
                pos[:, b, :n] = idx
                if req is None:
                    continue
            elif s >= req.positions.shape[1]:  # past the prompt (every decode step): index + delta
                pos[:, b, :n] = idx + req.delta
            else:
                P = req.positions.shape[1]
                pos[:, b, :n] = np.where(idx < P, req.positions[:, np.minimum(idx, P - 1)], idx + req.delta)
            if s >= req.end:
                continue
            for _, f, at, keep, embed in _taken(req, s, n):  # (plan checked that each output is cached)
                which = np.cumsum(embed) - 1  # encoder row of each placeholder position
                dst.append(b * L + at[keep] - s)
                src.append(self.cache[f.identifier][mx.array(which[at[keep] - f.mm_position.offset])])
        embeds = visual = None
        if dst:
            embeds = m.embed(mx.array(ids))
            D = embeds.shape[-1]
            flat = embeds.reshape(B * L, D)
            at, rows = np.concatenate(dst), mx.concatenate(src)
            flat[mx.array(at)] = rows[:, :D].astype(flat.dtype)
            embeds = flat.reshape(B, L, D)
            visual = (at, rows[:, D:]) if rows.shape[-1] > D else None
        m.bind(embeds, mx.array(pos) if m.mrope else None, visual)
