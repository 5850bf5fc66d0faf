"""The disk KV tier: full KV blocks kept in a directory, keyed by the scheduler's block hash.

A block's key is sha256(namespace || adapter || block hash): the namespace covers the model, the
KV dtype/quantisation, the block size and the pool's page layout (transfer.py), so a different
model or setting never reads another's blocks. An entry is one file holding every layer's page
for the block, as the pool holds it:

    MAGIC(8) | key(32) | payload length(8, little-endian) | checksum of the payload(8) | payload

The checksum is xxh3-64 (the `xxhash` package: ~15x faster than CRC-32, so verifying costs a
fraction of the read), or zlib's CRC-32 where that package is missing; the magic says which, and
an entry whose checksum this process cannot compute is a miss.

Writes go through a queue to one writer thread (the step only copies the pages to host memory):
each entry is written to a temp file and renamed into place, then recorded in a SQLite index
(stdlib sqlite3, WAL) that keeps sizes and last-use times for LRU eviction to the size bound.
Files are the truth: opening the store drops temp files a killed writer left, indexes entry
files the index missed and forgets rows whose file is gone. Every read checks the magic, the key
recorded inside the entry, the length and the checksum; anything else is a miss (counted as
corrupt, and the entry is deleted). Plain Python, no MLX.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import sqlite3
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

try:
    import xxhash

    def _xxh3(b: bytes | memoryview) -> int:
        return xxhash.xxh3_64_intdigest(b)
except ImportError:  # pragma: no cover (a dependency; older installs fall back to CRC-32)
    _xxh3 = None  # type: ignore[assignment]

CHECKSUMS = {b"MLXKVB\0\1": zlib.crc32, **({b"MLXKVB\0\2": _xxh3} if _xxh3 else {})}
MAGIC = b"MLXKVB\0\2" if _xxh3 else b"MLXKVB\0\1"  # what this process writes
_HEAD = struct.Struct("<8s32sQQ")
SUFFIX = ".kvb"
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
    dropped_writes: int = 0  # the queue was over its bound: the block is simply not stored
    read_seconds: float = 0.0


@dataclass
class _Pending:
    items: "OrderedDict[bytes, bytes]" = field(default_factory=OrderedDict)
    nbytes: int = 0


def entry_key(namespace: bytes, block_hash: bytes, adapter: str = "") -> bytes:
    """The 32-byte store key of a block: its scheduler hash under this namespace and LoRA adapter."""
    h = hashlib.sha256(namespace)
    h.update(len(adapter).to_bytes(4, "little") + adapter.encode())
    h.update(block_hash)
    return h.digest()


class BlockStore:
    def __init__(self, root: str | os.PathLike, max_bytes: int, *, max_pending_bytes: int = 256 << 20):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.max_pending_bytes = max_pending_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()  # the index connection and the pending map
        self._db = sqlite3.connect(str(self.root / "index.sqlite"), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS entries (key BLOB PRIMARY KEY, size INTEGER NOT NULL, "
                         "last_used REAL NOT NULL)")
        self._db.execute("CREATE INDEX IF NOT EXISTS by_use ON entries (last_used)")
        self._pending = _Pending()
        self._evicted: OrderedDict[bytes, None] = OrderedDict()
        self._recover()
        self.size_bytes = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._writer.start()
        self._evict()

    # --- paths and recovery ----------------------------------------------------------------

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + SUFFIX)

    def _recover(self) -> None:
        """Make the index agree with the files (a kill -9 can stop the writer anywhere)."""
        on_disk: dict[bytes, int] = {}
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
                elif f.name.endswith(SUFFIX):
                    try:
                        on_disk[bytes.fromhex(f.name[: -len(SUFFIX)])] = f.stat().st_size
                    except (ValueError, OSError):
                        continue
        rows = dict(self._db.execute("SELECT key, size FROM entries").fetchall())
        now = time.time()
        with self._db:
            self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in rows if k not in on_disk])
            # A file the index missed was renamed into place just before a crash: oldest use, evicted first.
            self._db.executemany("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)",
                                 [(k, s, now - 1e9) for k, s in on_disk.items() if k not in rows])

    # --- reads -----------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            if key in self._pending.items:
                return True
            return self._db.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys the store holds; they count as used now (evicted last)."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._pending.items and self._db.execute(
                        "SELECT 1 FROM entries WHERE key = ?", (k,)).fetchone() is None:
                    break
                n += 1
            if n:
                now = time.time()
                self._db.executemany("UPDATE entries SET last_used = ? WHERE key = ?", [(now, k) for k in keys[:n]])
        return n

    def recently_evicted(self, key: bytes) -> bool:
        with self._lock:
            return key in self._evicted

    def get(self, key: bytes) -> bytes | memoryview | None:
        """The entry's payload, verified; None for a miss (absent, truncated, corrupt or foreign).
        (Use is marked by `lookup`, which a scheduler calls right before it loads.)"""
        t0 = time.perf_counter()
        with self._lock:
            data = self._pending.items.get(key)
        if data is None:
            data = self._read_file(key)
        with self._lock:  # (a reader may run beside the writer)
            if data is None:
                self.stats.misses += 1
                return None
            self.stats.hits += 1
            self.stats.bytes_read += len(data)
            self.stats.read_seconds += time.perf_counter() - t0
        return data

    def get_many(self, keys: list[bytes]) -> list[bytes | memoryview | None]:
        """`get` for each key, in order. (Sequential: a thread pool measured slower on a shared 2-core
        CPU; a many-core Mac may gain from one.)"""
        return [self.get(k) for k in keys]

    def _read_file(self, key: bytes) -> memoryview | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError:
            self._forget(key)
            return None
        ok = len(raw) >= _HEAD.size
        if ok:
            magic, stored_key, n, crc = _HEAD.unpack_from(raw)
            payload = memoryview(raw)[_HEAD.size:]
            check = CHECKSUMS.get(magic)
            ok = check is not None and stored_key == key and n == len(payload) and check(payload) == crc
        if not ok:
            log.warning("kv store: entry %s is corrupt or truncated; deleted (a miss)", path.name)
            with self._lock:
                self.stats.corrupt += 1
            self._forget(key, unlink=True)
            return None
        return payload  # a view of the file's bytes: no copy

    def _forget(self, key: bytes, unlink: bool = False) -> None:
        with self._lock:
            row = self._db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            if row:
                self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
                self.size_bytes -= row[0]
        if unlink:
            self.path(key).unlink(missing_ok=True)

    # --- writes ----------------------------------------------------------------------------

    def put(self, key: bytes, payload: bytes) -> bool:
        """Queue an entry for the writer; False (dropped) when the queue holds too many bytes."""
        with self._lock:
            if key in self._pending.items:
                return True
            if self._pending.nbytes + len(payload) > self.max_pending_bytes or self._closed:
                self.stats.dropped_writes += 1
                return False
            self._pending.items[key] = payload
            self._pending.nbytes += len(payload)
        self._queue.put(key)
        return True

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
            self._db.close()

    def _write_loop(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            with self._lock:
                payload = self._pending.items.get(key)
            try:
                if payload is not None:
                    self._write(key, payload)
            except Exception:  # noqa: BLE001 (a full disk must not kill the writer: the block is not stored)
                log.exception("kv store: writing an entry failed")
            finally:
                with self._lock:
                    if self._pending.items.pop(key, None) is not None:
                        self._pending.nbytes -= len(payload or b"")

    def _write(self, key: bytes, payload: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEAD.pack(MAGIC, key, len(payload), CHECKSUMS[MAGIC](payload)))
            f.write(payload)
        os.replace(tmp, path)  # atomic: a reader sees the whole entry or none
        size = _HEAD.size + len(payload)
        with self._lock:
            old = self._db.execute("SELECT size FROM entries WHERE key = ?", (key,)).fetchone()
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?)", (key, size, time.time()))
            self.size_bytes += size - (old[0] if old else 0)
            self._evicted.pop(key, None)
        self.stats.writes += 1
        self.stats.bytes_written += size
        self._evict()

    def _evict(self) -> None:
        """Delete least recently used entries until the store fits its bound."""
        while self.size_bytes > self.max_bytes:
            with self._lock:
                rows = self._db.execute("SELECT key, size FROM entries ORDER BY last_used LIMIT 64").fetchall()
                if not rows:
                    self.size_bytes = 0
                    return
                freed, victims = 0, []
                for k, s in rows:
                    if self.size_bytes - freed <= self.max_bytes:
                        break
                    victims.append(k)
                    freed += s
                self._db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in victims])
                self.size_bytes -= freed
                for k in victims:
                    self._evicted[k] = None
                while len(self._evicted) > _RECENT_EVICTIONS:
                    self._evicted.popitem(last=False)
            for k in victims:
                self.path(k).unlink(missing_ok=True)
            self.stats.evictions += len(victims)
