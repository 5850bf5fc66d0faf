"""SamplingParams: the wire type of a request's sampling settings (vLLM field names) and its
validation. MLX-free, so the protocol and client import on a host without MLX (the vLLM side).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sidecar.wire.codec import wire_type
from sidecar.errors import ProtocolError

_SAMPLING_EPS = 1e-5

@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None  # k; -1 = whole vocabulary
    prompt_logprobs: int | None = None  # k; -1 = whole vocabulary
    max_tokens: int | None = None  # accepted, unused: stops are the scheduler's
    # v2: the model's eos ids join stop_token_ids in min_tokens masking unless ignore_eos is set
    # or the scheduler sent the complete set (`all_stop_token_ids`, as vLLM computes it).
    ignore_eos: bool = False
    stops_complete: bool = False
    prompt_logprobs_whole: bool = False  # v2: all of a prompt's logprobs in the step of its first token

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_wire(cls, d: dict | None, *, vocab_size: int, max_logprobs: int, path: str) -> SamplingParams:
        """Validate a msgpack/JSON map with vLLM field names; unknown fields are ignored."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ProtocolError("sampling_params must be a map", field=path)
        f = lambda name: f"{path}.{name}"  # noqa: E731
        get = lambda name: d.get(name)  # noqa: E731  (null means "default")
        kw: dict[str, Any] = {}

        def real(name, ok, why):
            if (v := get(name)) is not None:
                kw[name] = _check(_real(v, f(name)), ok, why, f(name))

        def integer(name, ok, why):
            if (v := get(name)) is not None:
                kw[name] = _check(_int(v, f(name)), ok, why, f(name))

        real("temperature", lambda v: v >= 0, "must be >= 0")
        real("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")
        integer("top_k", lambda v: v >= -1, "must be >= -1 (0 or -1 disables it)")
        real("min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]")
        integer("seed", lambda v: True, "")
        real("presence_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        real("frequency_penalty", lambda v: -2 <= v <= 2, "must be in [-2, 2]")
        real("repetition_penalty", lambda v: v > 0, "must be > 0")
        integer("min_tokens", lambda v: v >= 0, "must be >= 0")
        integer("max_tokens", lambda v: v >= 1, "must be >= 1")
        for name in ("logprobs", "prompt_logprobs"):  # as vLLM: -1 counts as the vocabulary size
            integer(name, lambda v: v >= -1, "must be >= -1 (-1: whole vocabulary)")
            k = vocab_size if kw.get(name) == -1 else kw.get(name, 0)
            if max_logprobs != -1 and k > max_logprobs:
                raise ProtocolError(f"{name}={k} is above max_logprobs ({max_logprobs})", field=f(name))
        if kw.get("max_tokens") is not None and kw.get("min_tokens", 0) > kw["max_tokens"]:
            raise ProtocolError("min_tokens must be <= max_tokens", field=f("min_tokens"))

        if (bias := get("logit_bias")) is not None:
            if not isinstance(bias, dict):
                raise ProtocolError("must be a map of token id to bias", field=f("logit_bias"))
            kw["logit_bias"] = {}
            for key, v in bias.items():
                kf = f"{path}.logit_bias[{key}]"
                tok = key if isinstance(key, int) and not isinstance(key, bool) else None
                if isinstance(key, str) and key.strip().isdecimal():
                    tok = int(key)
                if tok is None or not 0 <= tok < vocab_size:
                    raise ProtocolError(f"logit_bias key must be a token id in [0, {vocab_size})", field=kf)
                kw["logit_bias"][tok] = _real(v, kf)
        if (allowed := get("allowed_token_ids")) is not None:
            kw["allowed_token_ids"] = _tokens(allowed, vocab_size, f("allowed_token_ids"))
            if not allowed:
                raise ProtocolError("allowed_token_ids must not be empty", field=f("allowed_token_ids"))
        # A msgspec-encoded vLLM SamplingParams carries these under their private names.
        name = "bad_words_token_ids" if get("bad_words_token_ids") is not None else "_bad_words_token_ids"
        if (words := get(name)) is not None:
            if not isinstance(words, (list, tuple)):
                raise ProtocolError("must be a list of token id lists", field=f(name))
            kw["bad_words_token_ids"] = tuple(_tokens(w, vocab_size, f"{f(name)}[{i}]") for i, w in enumerate(words))
            for i, w in enumerate(kw["bad_words_token_ids"]):
                if not w:
                    raise ProtocolError("a bad word must have at least one token", field=f"{f(name)}[{i}]")
        stops: tuple[int, ...] = ()
        for name in ("stop_token_ids", "_all_stop_token_ids", "all_stop_token_ids"):
            if (v := get(name)) is not None:
                stops += _tokens(v, vocab_size, f(name))
                kw["stops_complete"] = kw.get("stops_complete", False) or name != "stop_token_ids"
        if stops:
            kw["stop_token_ids"] = tuple(dict.fromkeys(stops))
        for name in ("ignore_eos", "prompt_logprobs_whole"):
            if (v := get(name)) is not None:
                if not isinstance(v, bool):
                    raise ProtocolError("must be a boolean", field=f(name))
                kw[name] = v
        return cls(**kw)

    @property
    def adds_eos(self) -> bool:
        """Whether min_tokens also masks the model's eos ids."""
        return not (self.ignore_eos or self.stops_complete)


def _real(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError(f"must be a finite number, got {wire_type(v)}", field=field)
    return float(v)


def _int(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"must be an integer, got {wire_type(v)}", field=field)
    return v


def _check(v, ok, why: str, field: str):
    if not ok(v):
        raise ProtocolError(f"{v} {why}", field=field)
    return v


def _tokens(v: Any, vocab_size: int, field: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise ProtocolError("must be a list of token ids", field=field)
    for i, t in enumerate(v):
        if _int(t, f"{field}[{i}]") < 0 or t >= vocab_size:
            raise ProtocolError(f"token id {t} outside the vocabulary [0, {vocab_size})", field=f"{field}[{i}]")
    return tuple(v)
