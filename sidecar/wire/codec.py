"""Body codecs: strict msgpack/JSON decoding into a kwargs map, and reply encoding. No MLX.

Everything a body could do to the decoder is rejected here as a 400, before any handler sees it:
map keys that are not strings (except inside the documented int-keyed maps), duplicate keys, ext
types (the timestamp ext included), strings that cannot be sent back in both formats (lone
surrogates), nesting deeper than MAX_DEPTH. A msgpack body is one `unpackb` (its `max_*_len`
bound every container by the body's size before it is built; `object_pairs_hook` sees each map's
pairs, so a repeated key is caught instead of overwritten) and one walk of the result that names
the path of what it rejects. The typed conversion (wire/protocol.py) is the only other look.

Why not msgspec (typed Structs, as vLLM's engine IPC): it decodes faster, but a repeated map key
silently keeps the last value, non-string keys and ext values pass wherever a field is untyped,
and its bounds are static while ours depend on the model (max_model_len); keeping the contract
would need a second strict pass anyway.
"""

from __future__ import annotations

import gc
import json
import re
from itertools import chain
from typing import Any, Callable

import msgpack

from sidecar.errors import ProtocolError

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
JSON_TYPE = "application/json"
MAX_DEPTH = 32
MAX_CONTAINER_LEN = 4 * 1024 * 1024
MAX_MAPS = 65536  # maps per body: a step needs a few per request
# Maps whose keys are integers on the wire (token ids); JSON sends them as decimal strings.
INT_KEYED_MAPS = frozenset({"logit_bias"})

_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})
# Keys `_map` lets through, for `_check_tree` to judge with the map's path (any other hashable
# key: float, bool, nil, binary). Unhashable ones (an array or map as a key) stop in `_map`.
_KEY_TYPES = frozenset({str, int, bytes, float, bool, type(None)})
_STR_KEYS = frozenset({str})
_KEY_TYPES_INT = frozenset({str, int})
# A JSON escape of a UTF-16 surrogate: the only way a lone surrogate gets into a decoded string
# (the body itself must be valid UTF-8, which excludes encoded surrogates).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def wire_type(value: Any) -> str:
    """The wire name of a decoded value, for messages ("got float 1.5", "got null", "got map")."""
    t = type(value)
    if t is float:
        return f"float {value!r}"
    if t is _Ext:
        return f"ext type {value.code}"
    return _WIRE_NAMES.get(t, "ext type" if isinstance(value, msgpack.Timestamp) else t.__name__)


_WIRE_NAMES = {type(None): "null", bool: "boolean", int: "integer", str: "string", bytes: "binary",
               list: "array", tuple: "array", dict: "map"}
# Names for the kinds a field expects (protocol.check, config overrides).
KIND_NAMES = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", bytes: "binary",
              list: "array", dict: "map"}


def _short(key: Any) -> str:
    r = repr(key)
    return r if len(r) <= 64 else r[:61] + "..."


def _map_hook() -> Callable[[list[tuple[Any, Any]]], dict]:
    """A fresh object_pairs_hook per body: it also counts the maps, and stops the decoder at
    MAX_MAPS (each map costs a Python call, so a body of empty maps must not be decoded in full)."""
    left = MAX_MAPS

    def hook(pairs: list[tuple[Any, Any]]) -> dict:
        nonlocal left
        left -= 1
        if left < 0:
            raise ProtocolError(f"a body may hold at most {MAX_MAPS} maps")
        return _map(pairs) if pairs else {}

    return hook


def _map(pairs: list[tuple[Any, Any]]) -> dict:
    # object_pairs_hook: the pairs arrive as a list, so an unhashable key is caught here, not as
    # a TypeError from inside the unpacker; and a repeated key is seen instead of overwritten.
    try:
        d = dict(pairs)
    except TypeError:
        d = {}
    if len(d) != len(pairs) or not set(map(type, d)) <= _KEY_TYPES:
        bad = [k for k, _ in pairs if type(k) not in _KEY_TYPES][:1]
        if bad:
            bad = bad[0]
            raise ProtocolError(f"map keys must be strings, got {wire_type(bad)}")
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ProtocolError(f"duplicate map key {_short(dup)}")
    return d


class _Ext:
    """An ext value, kept in the tree so `_check_tree` can name where it is (then reject it)."""

    __slots__ = ("code",)

    def __init__(self, code: int):
        self.code = code


def _no_ext(code: int, data: bytes) -> Any:
    return _Ext(code)


def decode_body(body: bytes, content_type: str) -> dict:
    """Decode a request body into a kwargs map (empty body means no kwargs)."""
    if not body:
        return {}
    is_json = content_type not in MSGPACK_TYPES
    # Building many containers would trigger the cyclic GC over and over (10x the decode time).
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        return _decode(body, is_json)
    finally:
        if gc_was_on:
            gc.enable()


def _decode(body: bytes, is_json: bool) -> dict:
    try:
        if not is_json:
            value = msgpack.unpackb(
                body, raw=False, strict_map_key=False, ext_hook=_no_ext, use_list=True, object_pairs_hook=_map_hook(),
                max_str_len=len(body), max_bin_len=len(body), max_array_len=MAX_CONTAINER_LEN,
                max_map_len=MAX_CONTAINER_LEN,
            )
        else:
            # Strict UTF-8 first: json.loads(bytes) would also take UTF-16/32 and encoded surrogates.
            wide: list[int] = []
            value = json.loads(body.decode("utf-8"), object_pairs_hook=_map_hook(), parse_int=_json_int(wide))
    except ProtocolError:
        raise
    except (ValueError, msgpack.UnpackException, RecursionError) as e:
        kind = "JSON" if is_json else "msgpack"
        raise ProtocolError(f"malformed {kind} body: {str(e)[:200]}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"body must be a map of keyword arguments, got {wire_type(value)}")
    _check_tree(value)
    if is_json and _SURROGATE_ESCAPE.search(body):
        _check_strings(value)
    if is_json and wide:
        _check_ints(value)
    return value


# JSON integers live in msgpack's range, so no handler meets an int msgpack could not carry (a
# float(10**400) deep in a check would be an OverflowError, a 500).
INT_MIN, INT_END = -(1 << 63), 1 << 64


def _json_int(wide: list[int]) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text)
        if not INT_MIN <= v < INT_END:
            wide.append(v)
        return v

    return parse


def _check_ints(root: dict) -> None:
    """Name the first integer outside [-2**63, 2**64) (only run when the parse saw one)."""
    stack: list[tuple] = [(root, 0, None, None)]
    while stack:
        entry = stack.pop()
        node = entry[0]
        for k, v in (node.items() if type(node) is dict else enumerate(node)):
            if type(v) is int and not INT_MIN <= v < INT_END:
                raise ProtocolError(f"integer of {len(str(abs(v)))} digits is outside the 64-bit range "
                                    "[-2**63, 2**64) msgpack carries", field=_path((v, 0, entry, k)) or None)
            if type(v) is dict or type(v) is list:
                stack.append((v, 0, entry, k))


def _path(entry: tuple | None) -> str:
    parts: list[str] = []
    while entry is not None:
        _, _, parent, key = entry
        if parent is not None:
            parts.append(f"[{key}]" if type(key) is int and type(parent[0]) is list else f".{key}")
        entry = parent
    path = "".join(reversed(parts)).lstrip(".")
    # Paths inside a step read as in the rest of the protocol: `scheduled_new_reqs[0].req_id`.
    return path.removeprefix("scheduler_output.")


def _flat(node: list, levels: int) -> Any:
    it: Any = node
    for _ in range(levels):
        it = chain.from_iterable(it)
    return it


def _check_tree(root: dict) -> None:
    """Depth, where int keys may appear, and leaf types (a msgpack timestamp decodes to an object
    of its own, not through ext_hook). Iterative; paths are only built for the error message."""
    stack: list[tuple] = [(root, 1, None, None)]
    while stack:
        entry = stack.pop()
        node, depth = entry[0], entry[1]
        if depth > MAX_DEPTH:
            raise ProtocolError(f"nesting deeper than {MAX_DEPTH}", field=_path(entry) or None)
        if type(node) is dict:
            kinds = set(map(type, node))
            if not kinds <= _STR_KEYS and not (kinds <= _KEY_TYPES_INT and entry[3] in INT_KEYED_MAPS):
                key = next(k for k in node if type(k) is not str and (type(k) is not int or entry[3] not in INT_KEYED_MAPS))
                what = f"integer {key}" if type(key) is int else wire_type(key)
                raise ProtocolError(f"map keys must be strings, got {what}", field=_path(entry) or None)
            if set(map(type, node.values())) <= _SCALARS:
                continue
            items = node.items()
        else:
            # Lists of scalars (token ids), of scalar lists (block tables per group), ... are
            # cleared in C: one pass per nesting level, nothing per element in Python.
            k = 0
            while (types := set(map(type, _flat(node, k)))) == {list} and depth + k < MAX_DEPTH:
                k += 1
            if types <= _SCALARS:
                continue
            items = enumerate(node)
        for k, v in items:
            tv = type(v)
            if tv is dict or tv is list:
                stack.append((v, depth + 1, entry, k))
            elif tv not in _SCALARS:
                what = "the timestamp ext (type -1)" if isinstance(v, msgpack.Timestamp) else wire_type(v)
                raise ProtocolError(f"msgpack ext types are not allowed, got {what}",
                                    field=_path((v, depth + 1, entry, k)) or None)


def _check_strings(root: dict) -> None:
    """Every string (keys included) must be valid Unicode, so it can be echoed back in msgpack
    (UTF-8) as well as JSON."""
    stack: list[tuple] = [(root, 1, None, None)]
    while stack:
        entry = stack.pop()
        node = entry[0]
        for k, v in (node.items() if type(node) is dict else enumerate(node)):
            for s, is_key in ((k, True), (v, False)):
                if type(s) is str:
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        at = entry if is_key else (v, 0, entry, k)
                        raise ProtocolError("strings must be valid Unicode (a lone UTF-16 surrogate "
                                            "cannot be sent back in msgpack)", field=_path(at) or None) from None
            if type(v) is dict or type(v) is list:
                stack.append((v, 0, entry, k))


def encode_body(value: Any, use_msgpack: bool) -> bytes:
    if use_msgpack:
        return msgpack.packb(value, use_bin_type=True)
    return json.dumps(value, separators=(",", ":")).encode()
