"""The disk KV tier: full KV blocks kept in a directory, keyed by the scheduler's block hash.

A block's key is sha256(namespace || adapter || block hash): the namespace covers the model, the
KV dtype/quantisation, the block size and the pool's page layout (transfer.py), so a different
model or setting never reads another's blocks. An entry holds every layer's page for the block,
as the pool holds it, with the key recorded inside it and a checksum (segment.py).

Entries are packed into segment files (`segments/<id>.kvs`): the writer thread writes what is
queued (a step's saved blocks, usually the consecutive blocks of one prompt) as one segment, temp
file + rename, then records it in a SQLite index (stdlib sqlite3, WAL) mapping each key to its
(segment, offset, length). A load of a prompt's blocks is then a few large sequential reads
instead of an open, stat and read per block. Eviction is LRU by segment (a lookup marks the
segments holding its blocks used; before each write the least recently used are deleted until
the new one fits the bound), so the bytes on disk never exceed it.

Files are the truth: opening the store drops temp files a killed writer left, indexes segment
files the index missed (renamed just before a kill) and forgets rows whose file is gone. Files
of the earlier one-file-per-entry layout (`xx/<key>.kvb`) are one-entry segments: opening moves
them into `segments/` and indexes them, so they still serve. Every read checks the magic, the key
recorded inside the entry, the length and the checksum; anything else is a miss (counted as
corrupt, its row deleted). Plain Python and numpy, no MLX.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from sidecar.kv import segment
from sidecar.kv.store_index import Index, Row

log = logging.getLogger(__name__)

SEGMENT_BYTES = 64 << 20  # a segment's size cap, and at most 1/16 of the bound (eviction granularity)
READ_BYTES = 1 << 20  # a load reads runs of adjacent entries in pieces of about this size (measured: 1-4 MiB)
_RECENT_EVICTIONS = 1 << 16  # keys remembered as evicted: a load of one is a miss, not an unknown hash


@dataclass
class StoreStats:
    """Counters since the store opened (metrics.py reads them)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    dropped_writes: int = 0  # the queue was over its bound (or an entry over the store's): not stored
    read_seconds: float = 0.0


@dataclass
class _Pending:
    items: "OrderedDict[bytes, bytes | memoryview]" = field(default_factory=OrderedDict)
    nbytes: int = 0


def entry_key(namespace: bytes, block_hash: bytes, adapter: str = "") -> bytes:
    """The 32-byte store key of a block: its scheduler hash under this namespace and LoRA adapter."""
    h = hashlib.sha256(namespace)
    h.update(len(adapter).to_bytes(4, "little") + adapter.encode())
    h.update(block_hash)
    return h.digest()


def _new_id() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1  # random: two processes never pick the same name


class BlockStore:
    def __init__(self, root: str | os.PathLike, max_bytes: int, *, max_pending_bytes: int = 256 << 20):
        self.root = Path(root)
        self.segments = self.root / "segments"
        self.segments.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.segment_bytes = max(1, min(SEGMENT_BYTES, self.max_bytes // 16))
        self.max_pending_bytes = max_pending_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()  # the index connection, the pending map and the size
        self._index = Index(self.root / "index.sqlite")
        self._pending = _Pending()
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._recover()
        self.size_bytes = self._index.size()
        self._make_room(0)
        self._queue: queue.Queue[list[bytes] | None] = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._writer.start()

    # --- paths and recovery ----------------------------------------------------------------

    def segment_path(self, segment_id: int) -> Path:
        return self.segments / segment.name(segment_id)

    def locate(self, key: bytes) -> tuple[Path, int, int] | None:
        """Where an entry lies: its segment file, the entry's offset and its size with the header."""
        with self._lock:
            row = self._index.rows([key]).get(key)
        return None if row is None else (self.segment_path(row[0]), row[1], segment.HEAD.size + row[2])

    def _recover(self) -> None:
        """Make the index agree with the files (a kill -9 can stop the writer anywhere)."""
        self._adopt_entry_files()
        files: dict[int, Path] = {}
        for f in self.segments.iterdir():
            if f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)  # a write the kill interrupted: never renamed, never indexed
            elif f.name.endswith(segment.SUFFIX):
                try:
                    files[int(f.name[: -len(segment.SUFFIX)], 16)] = f
                except ValueError:
                    continue
        known = self._index.segment_ids()
        self._index.forget_segments([i for i in known if i not in files])
        for i, f in files.items():
            if i not in known:  # renamed into place just before a kill, or adopted
                self._index_file(i, f)

    def _adopt_entry_files(self) -> None:
        """Move the one-file-per-entry layout's files (`xx/<key>.kvb`, a one-entry segment each) in."""
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2 or sub == self.segments:
                continue
            for f in sub.iterdir():
                if f.name.endswith(".kvb"):
                    os.replace(f, self.segment_path(_new_id()))
                elif f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
            try:
                sub.rmdir()
            except OSError:
                pass  # something else lives there: left alone

    def _index_file(self, segment_id: int, path: Path) -> None:
        try:
            entries, st = segment.scan(path), path.stat()
        except OSError:
            return
        if not self._index.add(segment_id, st.st_size, entries, st.st_mtime):
            path.unlink(missing_ok=True)

    # --- reads -----------------------------------------------------------------------------

    def keys(self) -> list[bytes]:
        """Every stored key (queued ones aside), segment by segment in file order."""
        with self._lock:
            return self._index.keys()

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending.items:
                return True
            return self._index.has(key)

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys the store holds; their segments count as used now (evicted last)."""
        with self._lock:
            rows = self._index.rows([k for k in keys if k not in self._pending.items])
            n = 0
            for k in keys:
                if k not in self._pending.items and k not in rows:
                    break
                n += 1
            self._index.touch({rows[k][0] for k in keys[:n] if k in rows})
        return n

    def recently_evicted(self, key: bytes) -> bool:
        with self._lock:
            return key in self._evicted

    def get(self, key: bytes) -> memoryview | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes], out: memoryview | None = None) -> list[memoryview | None]:
        """Each key's payload, verified, or None for a miss (absent, truncated, corrupt or foreign).
        The payloads lie back to back in one buffer, in the order of the keys (a run of them can be
        viewed as one array without a copy): `out` when it is large enough (a byte buffer the
        caller will use them from: no copy after the read), else a new one. Entries adjacent in a
        segment are read together. (Use is marked by `lookup`, which a scheduler calls right
        before it loads.)"""
        t0 = time.perf_counter()
        order = list(dict.fromkeys(keys))
        with self._lock:
            pending = {k: self._pending.items[k] for k in order if k in self._pending.items}
            rows = self._index.rows([k for k in order if k not in pending])
        sizes = {k: len(pending[k]) if k in pending else rows[k][2] for k in order if k in pending or k in rows}
        total = sum(sizes.values())
        buf = out.cast("B") if out is not None and out.nbytes >= total else memoryview(np.empty(total, np.uint8))
        slots, pos = {}, 0
        for k in order:
            if k in sizes:
                slots[k], pos = buf[pos:pos + sizes[k]], pos + sizes[k]
        for k, data in pending.items():
            slots[k][:] = data
        bad, gone = self._read(rows, slots)
        self._drop(bad, corrupt=True)
        self._drop(gone, corrupt=False)
        out = [None if k not in slots or k in bad or k in gone else slots[k] for k in keys]
        with self._lock:  # (a reader may run beside the writer)
            hits = [v for v in out if v is not None]
            self.stats.hits += len(hits)
            self.stats.misses += len(out) - len(hits)
            self.stats.bytes_read += sum(map(len, hits))
            self.stats.read_seconds += time.perf_counter() - t0
        return out

    def _read(self, rows: dict[bytes, Row],
              slots: dict[bytes, memoryview]) -> tuple[set[bytes], set[bytes]]:
        """Read the indexed entries into their slots, a vector read per run of adjacent entries,
        in pieces of READ_BYTES (a sequence of reads of a few MiB lets the OS read ahead; one
        read of a whole run, and a reader thread handing pieces over, both measured slower);
        the keys that failed verification, and those whose segment is gone (evicted meanwhile)."""
        bad: set[bytes] = set()
        gone: set[bytes] = set()
        fds: dict[int, int] = {}
        try:
            for sid, pos, run in segment.runs([(s, p, k, slots[k]) for k, (s, p, _) in rows.items()], READ_BYTES):
                if sid not in fds:
                    try:
                        fds[sid] = os.open(self.segment_path(sid), os.O_RDONLY)
                    except OSError:
                        fds[sid] = -1
                if fds[sid] < 0:
                    gone.update(k for k, _ in run)
                    continue
                try:
                    oks = segment.read_run(fds[sid], pos, run)
                except OSError:
                    oks = [False] * len(run)
                bad.update(k for (k, _), ok in zip(run, oks) if not ok)
        finally:
            for fd in fds.values():
                if fd >= 0:
                    os.close(fd)
        for k in sorted(bad):
            log.warning("kv store: entry %s is corrupt or truncated; dropped (a miss)", k.hex()[:16])
        return bad, gone

    def _drop(self, keys: set[bytes], corrupt: bool) -> None:
        """Forget these entries; a segment none of whose entries is left is deleted."""
        if not keys:
            return
        with self._lock:
            if corrupt:
                self.stats.corrupt += len(keys)
            emptied = self._index.drop(keys)
            self.size_bytes -= sum(size for _, size in emptied)
        for sid, _ in emptied:
            self.segment_path(sid).unlink(missing_ok=True)

    # --- writes ----------------------------------------------------------------------------

    def put(self, key: bytes, payload: bytes | memoryview) -> bool:
        return self.put_many([(key, payload)]) == 1

    def put_many(self, entries: Sequence[tuple[bytes, bytes | memoryview]]) -> int:
        """Queue entries for the writer, to be written together as one segment; how many were
        taken (the rest are dropped: the queue holds too many bytes)."""
        taken: list[bytes] = []
        with self._lock:
            for key, payload in entries:
                if key in self._pending.items:
                    taken.append(key)
                    continue
                if self._pending.nbytes + len(payload) > self.max_pending_bytes or self._closed:
                    self.stats.dropped_writes += 1
                    continue
                self._pending.items[key] = payload
                self._pending.nbytes += len(payload)
                taken.append(key)
        if taken:
            self._queue.put(taken)
        return len(taken)

    @property
    def queue_depth(self) -> int:
        return len(self._pending.items)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued entry is on disk and indexed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending.items:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("kv store writer did not drain")
            time.sleep(0.002)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=30)
        with self._lock:
            self._index.close()

    def _write_loop(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            if item is None:
                return
            keys = list(item)
            while True:  # everything queued meanwhile joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                keys += more
            try:
                self._write_batch(keys)
            except Exception:  # noqa: BLE001 (a full disk must not kill the writer: the blocks are not stored)
                log.exception("kv store: writing a segment failed")
            finally:
                with self._lock:
                    for k in keys:
                        data = self._pending.items.pop(k, None)
                        if data is not None:
                            self._pending.nbytes -= len(data)

    def _write_batch(self, keys: list[bytes]) -> None:
        with self._lock:
            batch = {k: self._pending.items[k] for k in keys if k in self._pending.items}
            stored = self._index.rows(list(batch))
        entries = [(k, v) for k, v in batch.items() if k not in stored]
        group: list[tuple[bytes, bytes | memoryview]] = []
        size = 0
        for k, v in entries + [(b"", b"")]:
            n = segment.HEAD.size + len(v)
            if group and (not k or size + n > self.segment_bytes):
                self._write_segment(group, size)
                group, size = [], 0
            if k:
                group.append((k, v))
                size += n

    def _write_segment(self, entries: list[tuple[bytes, bytes | memoryview]], size: int) -> None:
        if size > self.max_bytes:  # (an entry larger than the whole store)
            with self._lock:
                self.stats.dropped_writes += len(entries)
            return
        self._make_room(size)
        sid = _new_id()
        offsets = segment.write(self.segment_path(sid), entries)
        with self._lock:
            if not self._index.add(sid, size, [(k, p, len(v)) for (k, v), p in zip(entries, offsets)], time.time()):
                self.segment_path(sid).unlink(missing_ok=True)  # (all indexed meanwhile by another process)
                return
            self.size_bytes += size
            for k, _ in entries:
                self._evicted.pop(k, None)
            self.stats.writes += len(entries)
            self.stats.bytes_written += size

    def _make_room(self, need: int) -> None:
        """Delete least recently used segments until `need` more bytes fit the bound."""
        while self.size_bytes + need > self.max_bytes:
            with self._lock:
                oldest = self._index.evict_oldest()
                if oldest is None:
                    self.size_bytes = 0
                    return
                sid, size, victims = oldest
                self.size_bytes -= size
                for k in victims:
                    self._evicted[k] = None
                while len(self._evicted) > _RECENT_EVICTIONS:
                    self._evicted.popitem(last=False)
                self.stats.evictions += len(victims)
            self.segment_path(sid).unlink(missing_ok=True)
