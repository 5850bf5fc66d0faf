"""Multimodal inputs on the wire: vLLM's `mm_features` of a new request and the per-step encoder
instructions (`scheduled_encoder_inputs`, `free_encoder_mm_hashes`). Plain Python and numpy, no MLX.

A processed tensor travels as a typed binary array, `{"dtype", "shape", "data": <raw bytes,
C order, little-endian>}`; decoding checks that the bytes are exactly what dtype and shape say, so
what reaches the encoder is an array of a known shape. Family-specific checks (the pixel rows a
grid implies, the placeholder tokens) need the model and live in engine/multimodal.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sidecar.errors import ProtocolError

DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32, "uint8": np.uint8,
          "bool": np.bool_}
MAX_TENSOR_BYTES = 256 << 20  # one processed tensor (a 4k image's pixel_values in fp32 is ~50 MiB)
MAX_TENSORS = 16  # keys of one item
MAX_FEATURES = 256  # items of one request
MAX_DIMS = 6
MODALITIES = ("image",)


@dataclass
class PlaceholderRange:
    offset: int  # first prompt position of the item's placeholder tokens
    length: int
    is_embed: list[bool] | None = None  # None: every position takes an encoder output row

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)


@dataclass
class MMFeature:
    modality: str
    identifier: str  # the encoder cache key (vLLM: mm_hash, with a LoRA prefix where one applies)
    mm_position: PlaceholderRange
    data: dict[str, np.ndarray] | None  # None: no tensors sent (the output must already be cached)
    mm_hash: str | None = None


@dataclass
class EncoderInstructions:
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # req_id -> feature indices
    free_encoder_mm_hashes: list[str] = field(default_factory=list)


def _fail(msg: str, path: str) -> ProtocolError:
    return ProtocolError(msg, field=path)


def _int(v: Any, path: str) -> int:
    if type(v) is not int:
        raise _fail(f"expected integer, got {type(v).__name__}", path)
    return v


def _str(v: Any, path: str, max_len: int = 1024) -> str:
    if type(v) is not str or not v or len(v) > max_len:
        raise _fail(f"expected a non-empty string of at most {max_len} characters", path)
    return v


def tensor(d: Any, path: str) -> np.ndarray:
    """One typed binary array: {"dtype", "shape", "data"}."""
    if not isinstance(d, dict):
        raise _fail("expected a map {dtype, shape, data}", path)
    dtype = d.get("dtype")
    if type(dtype) is not str or dtype not in DTYPES:
        raise _fail(f"dtype {repr(dtype)[:40]} is not one of {sorted(DTYPES)}", f"{path}.dtype")
    shape = d.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise _fail(f"expected a list of at most {MAX_DIMS} dimensions", f"{path}.shape")
    for i, n in enumerate(shape):
        if not 0 <= _int(n, f"{path}.shape[{i}]") <= MAX_TENSOR_BYTES:
            raise _fail(f"a dimension must be in [0, {MAX_TENSOR_BYTES}]", f"{path}.shape[{i}]")
    data = d.get("data")
    if not isinstance(data, bytes):
        raise _fail("expected binary (raw array bytes)", f"{path}.data")
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    want = math.prod(shape) * itemsize  # (exact: a product of client-sent dimensions must not wrap)
    if want > MAX_TENSOR_BYTES:
        raise _fail(f"{want} bytes exceed the bound of {MAX_TENSOR_BYTES}", f"{path}.shape")
    if len(data) != want:
        raise _fail(f"{len(data)} bytes, but dtype {dtype} and shape {shape} need {want}", f"{path}.data")
    arr = np.frombuffer(data, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).reshape(tuple(shape))
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise _fail("non-finite values", f"{path}.data")
    return arr


def _placeholder(d: Any, path: str) -> PlaceholderRange:
    if not isinstance(d, dict):
        raise _fail("expected a map {offset, length, is_embed}", path)
    offset, length = _int(d.get("offset"), f"{path}.offset"), _int(d.get("length"), f"{path}.length")
    if offset < 0 or length < 1:
        raise _fail(f"offset {offset} and length {length}: need offset >= 0 and length >= 1", path)
    is_embed = d.get("is_embed")
    if is_embed is not None:
        if not isinstance(is_embed, list) or len(is_embed) != length or not all(type(b) is bool for b in is_embed):
            raise _fail(f"expected null or {length} booleans", f"{path}.is_embed")
        if not any(is_embed):
            raise _fail("no position takes an embedding", f"{path}.is_embed")
    return PlaceholderRange(offset, length, is_embed)


def feature(d: Any, path: str) -> MMFeature:
    if not isinstance(d, dict):
        raise _fail("expected a map", path)
    modality = d.get("modality")
    if modality not in MODALITIES:
        raise _fail(f"modality {modality!r} is not served (served: {', '.join(MODALITIES)})", f"{path}.modality")
    identifier = _str(d.get("identifier") or d.get("mm_hash"), f"{path}.identifier")
    mm_hash = d.get("mm_hash")
    if mm_hash is not None:
        _str(mm_hash, f"{path}.mm_hash")
    data = d.get("data")
    if data is not None:
        if not isinstance(data, dict) or len(data) > MAX_TENSORS:
            raise _fail(f"expected null or a map of at most {MAX_TENSORS} tensors", f"{path}.data")
        data = {_str(k, f"{path}.data", 64): tensor(v, f"{path}.data.{k}") for k, v in data.items()}
    return MMFeature(modality, identifier, _placeholder(d.get("mm_position"), f"{path}.mm_position"), data, mm_hash)


def features(value: Any, path: str, prompt_len: int) -> list[MMFeature]:
    """A new request's `mm_features`: placeholders inside the prompt, in order, not overlapping."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_FEATURES:
        raise _fail(f"expected a list of at most {MAX_FEATURES} items", path)
    out = [feature(v, f"{path}[{i}]") for i, v in enumerate(value)]
    end = 0
    for i, f in enumerate(out):
        r = f.mm_position
        if r.offset < end or r.offset + r.length > prompt_len:
            raise _fail(f"placeholder [{r.offset}, {r.offset + r.length}) is outside the prompt ({prompt_len} "
                        "tokens) or overlaps the previous item", f"{path}[{i}].mm_position")
        end = r.offset + r.length
    return out


def encoder_instructions(d: dict) -> EncoderInstructions:
    sched = d.get("scheduled_encoder_inputs") or {}
    if not isinstance(sched, dict):
        raise _fail("expected a map req_id -> [item index]", "scheduled_encoder_inputs")
    for rid, idx in sched.items():
        p = f"scheduled_encoder_inputs.{rid}"
        if not isinstance(rid, str) or not isinstance(idx, list):
            raise _fail("expected a list of item indices", p)
        for j, v in enumerate(idx):
            _int(v, f"{p}[{j}]")
    free = d.get("free_encoder_mm_hashes") or []
    if not isinstance(free, list):
        raise _fail("expected a list of identifiers", "free_encoder_mm_hashes")
    for j, h in enumerate(free):
        _str(h, f"free_encoder_mm_hashes[{j}]")
    return EncoderInstructions(sched, free)


def encode_tensor(arr: np.ndarray) -> dict:
    """The wire form of a numpy array (the client side: vLLM's worker, the reference scheduler)."""
    arr = np.asarray(arr, order="C")  # (ascontiguousarray would make a scalar 1-D)
    if arr.dtype.name not in DTYPES:
        arr = arr.astype(np.float32)
    # (no copy where the array is little-endian already: tobytes is the one copy)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": little.tobytes()}
