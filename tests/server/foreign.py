"""A msgpack encoder with the habits of other languages' clients, for tests: the same value written
the way @msgpack/msgpack (JS), vmihailenco/msgpack (Go), rmp-serde (Rust), msgpack-java / C#
encoders or old-spec (raw-only) encoders write it. Every style is valid msgpack for the same value;
a float32 style rounds floats as a client's f32 field would (the worker samples in float32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Style:
    name: str
    ints: str = "compact"  # compact | int64 (Go: every int an int64) | uint (no fixints) | widest (u64/i64)
    floats: str = "f64"  # f64 | f32 | js (integral -> int) | js32 (integral -> int, else float32)
    strs: str = "compact"  # compact | str32 | raw (old spec: fixraw, raw16, raw32; no str8)
    containers: str = "compact"  # compact | wide16 | wide32 (fixed-size headers for small arrays/maps)
    nils: bool = False  # every optional field present as nil (Go nil pointers, Rust None, C# null)


STYLES = [
    Style("python"),
    Style("js", floats="js"),
    Style("js-forceFloat32", floats="js32", nils=True),
    Style("go", ints="int64", nils=True),
    Style("rust-rmp", ints="uint", floats="f32", nils=True),
    Style("java-old-spec", strs="raw", containers="wide16"),
    Style("csharp-wide", ints="widest", strs="str32", containers="wide32", nils=True),
]


def _int(v: int, how: str) -> bytes:
    if how == "int64":
        return b"\xd3" + struct.pack(">q", v) if v < 2**63 else b"\xcf" + struct.pack(">Q", v)
    if how == "widest":
        return b"\xcf" + struct.pack(">Q", v) if v >= 0 else b"\xd3" + struct.pack(">q", v)
    if how == "uint" and v >= 0:
        for tag, fmt, top in ((b"\xcc", ">B", 2**8), (b"\xcd", ">H", 2**16), (b"\xce", ">I", 2**32)):
            if v < top:
                return tag + struct.pack(fmt, v)
        return b"\xcf" + struct.pack(">Q", v)
    if 0 <= v < 128:
        return bytes([v])
    if -32 <= v < 0:
        return struct.pack(">b", v)
    for tag, fmt, lo, hi in ((b"\xd0", ">b", -(2**7), 2**7), (b"\xd1", ">h", -(2**15), 2**15),
                             (b"\xd2", ">i", -(2**31), 2**31)):
        if v < 0 and lo <= v:
            return tag + struct.pack(fmt, v)
    if v < 0:
        return b"\xd3" + struct.pack(">q", v)
    for tag, fmt, top in ((b"\xcc", ">B", 2**8), (b"\xcd", ">H", 2**16), (b"\xce", ">I", 2**32)):
        if v < top:
            return tag + struct.pack(fmt, v)
    return b"\xcf" + struct.pack(">Q", v)


def _float(v: float, s: Style) -> bytes:
    if s.floats in ("js", "js32") and v.is_integer():
        return _int(int(v), s.ints)
    if s.floats in ("f32", "js32"):  # a float32 field rounds
        return b"\xca" + struct.pack(">f", v)
    return b"\xcb" + struct.pack(">d", v)


def _header(n: int, fix: int, tags: tuple[bytes, bytes], how: str, fix_max: int = 15) -> bytes:
    if how == "compact" and n <= fix_max:
        return bytes([fix | n])
    if how != "wide32" and n < 2**16:
        return tags[0] + struct.pack(">H", n)
    return tags[1] + struct.pack(">I", n)


def _str(v: str, s: Style) -> bytes:
    b = v.encode()
    n = len(b)
    if s.strs == "str32":
        return b"\xdb" + struct.pack(">I", n) + b
    if n < 32:
        return bytes([0xA0 | n]) + b
    if s.strs == "compact" and n < 256:
        return b"\xd9" + bytes([n]) + b
    return (b"\xda" + struct.pack(">H", n) if n < 2**16 else b"\xdb" + struct.pack(">I", n)) + b


def pack(v: Any, s: Style) -> bytes:
    if v is None:
        return b"\xc0"
    if v is True or v is False:
        return b"\xc3" if v else b"\xc2"
    if isinstance(v, int):
        return _int(v, s.ints)
    if isinstance(v, float):
        return _float(v, s)
    if isinstance(v, str):
        return _str(v, s)
    if isinstance(v, bytes):
        return (b"\xc4" + bytes([len(v)]) if len(v) < 256 else b"\xc6" + struct.pack(">I", len(v))) + v
    if isinstance(v, (list, tuple)):
        return _header(len(v), 0x90, (b"\xdc", b"\xdd"), s.containers) + b"".join(pack(x, s) for x in v)
    if isinstance(v, dict):
        return _header(len(v), 0x80, (b"\xde", b"\xdf"), s.containers) + b"".join(
            pack(k, s) + pack(x, s) for k, x in v.items())
    raise TypeError(type(v))
