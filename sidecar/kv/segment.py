"""The disk KV tier's file format: entries packed back to back into segment files.

An entry is

    MAGIC(8) | key(32) | payload length(8, little-endian) | checksum of the payload(8) | payload

and a segment is any number of entries, written at once (one segment per writer batch: the blocks
a step saved) to a temp file and renamed into place, so a segment file is always whole. A file of
the store's earlier one-file-per-entry layout is exactly a one-entry segment.

The checksum is xxh3-64 (the `xxhash` package: ~15x faster than CRC-32, so verifying costs a
fraction of the read), or zlib's CRC-32 where that package is missing; the magic says which, and
an entry whose checksum this process cannot compute does not verify.

Reads take a run of entries lying back to back in a segment with one positioned vector read: the
headers land in a scratch buffer and each payload directly in the slot its caller gave it (no
copy after the read), then every entry is verified against the key and length the index expects.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Sequence

try:
    import xxhash

    def _xxh3(b: bytes | memoryview) -> int:
        return xxhash.xxh3_64_intdigest(b)
except ImportError:  # pragma: no cover (a dependency; older installs fall back to CRC-32)
    _xxh3 = None  # type: ignore[assignment]

CHECKSUMS = {b"MLXKVB\0\1": zlib.crc32, **({b"MLXKVB\0\2": _xxh3} if _xxh3 else {})}
MAGIC = b"MLXKVB\0\2" if _xxh3 else b"MLXKVB\0\1"  # what this process writes
HEAD = struct.Struct("<8s32sQQ")
SUFFIX = ".kvs"
_IOV = 512  # entries per vector read (two buffers each; IOV_MAX is 1024 on Linux and macOS)
_MAX_READ = 1 << 30  # bytes per read call (Linux caps one read at ~2 GiB)


def name(segment_id: int) -> str:
    return f"{segment_id:016x}{SUFFIX}"


def write(path: Path, entries: Sequence[tuple[bytes, bytes | memoryview]]) -> list[int]:
    """Write these (key, payload) entries as one segment, atomically; each entry's offset."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    offsets, pos, check = [], 0, CHECKSUMS[MAGIC]
    try:
        with open(tmp, "wb") as f:
            for key, payload in entries:
                f.write(HEAD.pack(MAGIC, key, len(payload), check(payload)))
                f.write(payload)
                offsets.append(pos)
                pos += HEAD.size + len(payload)
        os.replace(tmp, path)  # a reader, or a store opened after a kill, sees the whole segment or none
    except BaseException:
        tmp.unlink(missing_ok=True)  # (a full disk: nothing half-written stays behind)
        raise
    return offsets


def scan(path: Path) -> list[tuple[bytes, int, int]]:
    """(key, offset, payload length) of each entry whose header is whole and whose payload fits in
    the file, up to the first that does not (indexing a segment the index missed; reads verify)."""
    out: list[tuple[bytes, int, int]] = []
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while pos + HEAD.size <= size:
            f.seek(pos)
            magic, key, n, _ = HEAD.unpack(f.read(HEAD.size))
            if magic not in CHECKSUMS or pos + HEAD.size + n > size:
                break
            out.append((key, pos, n))
            pos += HEAD.size + n
    return out


def verify(head: bytes | memoryview, key: bytes, payload: memoryview) -> bool:
    magic, stored_key, n, crc = HEAD.unpack(head)
    check = CHECKSUMS.get(magic)
    return check is not None and stored_key == key and n == len(payload) and check(payload) == crc


def runs(entries: list[tuple[int, int, bytes, memoryview]],
         piece: int) -> list[tuple[int, int, list[tuple[bytes, memoryview]]]]:
    """Group (segment, offset, key, slot) entries into (segment, offset, [(key, slot)]) runs lying
    back to back in a segment, in file order, cut into pieces of about `piece` bytes."""
    out: list[tuple[int, int, list[tuple[bytes, memoryview]]]] = []
    end, nbytes = -1, 0
    for sid, pos, key, slot in sorted(entries, key=lambda e: e[:2]):
        if not out or out[-1][0] != sid or pos != end or nbytes >= piece:
            out.append((sid, pos, []))
            nbytes = 0
        out[-1][2].append((key, slot))
        end = pos + HEAD.size + len(slot)
        nbytes += end - pos
    return out


def read_run(fd: int, offset: int, run: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
    """Read entries lying back to back from `offset` of an open segment, each (key, slot) payload
    into its slot (sized by the index's length); whether each one verified."""
    return _check(run, *_fill(fd, offset, run))


def _fill(fd: int, offset: int, run: Sequence[tuple[bytes, memoryview]]) -> tuple[memoryview, int]:
    """The reading half of `read_run`: the headers read, and how many bytes of the run were read."""
    heads = memoryview(bytearray(HEAD.size * len(run)))
    got, start = 0, 0
    while start < len(run):
        end, nbytes = start, 0
        while end < len(run) and end - start < _IOV and (end == start or nbytes + len(run[end][1]) < _MAX_READ):
            nbytes += HEAD.size + len(run[end][1])
            end += 1
        iov: list[memoryview] = []
        for j in range(start, end):
            iov += [heads[j * HEAD.size:(j + 1) * HEAD.size], run[j][1]]
        n = _preadv(fd, iov, offset)
        got += n
        if n < nbytes:
            break  # the end of the file: the rest of the run is missing
        offset += nbytes
        start = end
    return heads, got


def _check(run: Sequence[tuple[bytes, memoryview]], heads: memoryview, got: int) -> list[bool]:
    """The verifying half of `read_run`."""
    ok: list[bool] = []
    for j, (key, slot) in enumerate(run):
        need = HEAD.size + len(slot)
        ok.append(got >= need and verify(heads[j * HEAD.size:(j + 1) * HEAD.size], key, slot))
        got -= need
    return ok


def _preadv(fd: int, iov: list[memoryview], offset: int) -> int:
    """Bytes read into the buffers in order (fewer only at the end of the file)."""
    if hasattr(os, "preadv"):
        total, done = sum(map(len, iov)), 0
        while done < total:  # a regular file reads short only at its end (or on a signal)
            n = os.preadv(fd, _skip(iov, done), offset + done)
            if n <= 0:
                break
            done += n
        return done
    data = os.pread(fd, sum(map(len, iov)), offset)  # pragma: no cover (platforms without preadv)
    pos = 0
    for b in iov:
        part = data[pos:pos + len(b)]
        b[:len(part)] = part
        pos += len(part)
    return len(data)


def _skip(iov: list[memoryview], n: int) -> list[memoryview]:
    """The buffers after their first n bytes."""
    out = []
    for b in iov:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:])
        n = 0
    return out
