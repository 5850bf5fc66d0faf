"""The disk KV tier's index: SQLite (stdlib sqlite3, WAL) mapping each key to where its entry lies,
(segment, offset, payload length), and each segment to its size, its live entry count and when it
was last used (eviction is LRU by segment). Callers serialise access (the store's lock)."""

from __future__ import annotations

import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Sequence

_SQL_VARS = 500  # keys per `IN (...)` query
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS segments (id INTEGER PRIMARY KEY, size INTEGER NOT NULL, live INTEGER NOT NULL, "
    "last_used REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS segments_by_use ON segments (last_used)",
    "CREATE TABLE IF NOT EXISTS blocks (key BLOB PRIMARY KEY, segment INTEGER NOT NULL, pos INTEGER NOT NULL, "
    "length INTEGER NOT NULL)",
    "CREATE INDEX IF NOT EXISTS blocks_by_segment ON blocks (segment)",
    "DROP TABLE IF EXISTS entries",  # the one-file-per-entry layout's index (its files are adopted)
)

Row = tuple[int, int, int]  # segment, entry offset, payload length


class Index:
    def __init__(self, path: Path):
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        for stmt in _SCHEMA:
            self.db.execute(stmt)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def size(self) -> int:
        return self.db.execute("SELECT COALESCE(SUM(size), 0) FROM segments").fetchone()[0]

    def segment_ids(self) -> set[int]:
        return {i for (i,) in self.db.execute("SELECT id FROM segments")}

    def keys(self) -> list[bytes]:
        return [k for (k,) in self.db.execute("SELECT key FROM blocks ORDER BY segment, pos")]

    def has(self, key: bytes) -> bool:
        return self.db.execute("SELECT 1 FROM blocks WHERE key = ?", (key,)).fetchone() is not None

    def rows(self, keys: Sequence[bytes]) -> dict[bytes, Row]:
        """key -> (segment, offset, payload length) for the indexed ones."""
        out: dict[bytes, Row] = {}
        for i in range(0, len(keys), _SQL_VARS):
            part = keys[i:i + _SQL_VARS]
            q = f"SELECT key, segment, pos, length FROM blocks WHERE key IN ({','.join('?' * len(part))})"
            out.update((k, (s, p, n)) for k, s, p, n in self.db.execute(q, part))
        return out

    def touch(self, segments: Iterable[int]) -> None:
        now = time.time()
        self.db.executemany("UPDATE segments SET last_used = ? WHERE id = ?", [(now, s) for s in segments])

    def add(self, segment: int, size: int, entries: Sequence[tuple[bytes, int, int]], last_used: float) -> int:
        """Record a segment and its (key, offset, payload length) entries, in one transaction; how
        many were new (a key another process sharing the directory indexed first keeps its row).
        A segment without a new entry is not recorded (the caller deletes its file)."""
        with self.tx() as db:
            live = sum(db.execute("INSERT OR IGNORE INTO blocks VALUES (?, ?, ?, ?)", (k, segment, p, n)).rowcount
                       for k, p, n in entries)
            if live:
                db.execute("INSERT INTO segments VALUES (?, ?, ?, ?)", (segment, size, live, last_used))
        return live

    def forget_segments(self, segments: Sequence[int]) -> None:
        with self.tx() as db:
            db.executemany("DELETE FROM blocks WHERE segment = ?", [(s,) for s in segments])
            db.executemany("DELETE FROM segments WHERE id = ?", [(s,) for s in segments])
            db.execute("DELETE FROM blocks WHERE segment NOT IN (SELECT id FROM segments)")

    def drop(self, keys: Iterable[bytes]) -> list[tuple[int, int]]:
        """Forget these entries; the (segment, size) of each segment left without an entry (gone from
        the index too: the caller deletes its file)."""
        emptied: list[tuple[int, int]] = []
        with self.tx() as db:
            for k in keys:
                row = db.execute("SELECT segment FROM blocks WHERE key = ?", (k,)).fetchone()
                if row is None:
                    continue
                db.execute("DELETE FROM blocks WHERE key = ?", (k,))
                db.execute("UPDATE segments SET live = live - 1 WHERE id = ?", row)
                seg = db.execute("SELECT size, live FROM segments WHERE id = ?", row).fetchone()
                if seg is not None and seg[1] <= 0:
                    db.execute("DELETE FROM segments WHERE id = ?", row)
                    emptied.append((row[0], seg[0]))
        return emptied

    def evict_oldest(self) -> tuple[int, int, list[bytes]] | None:
        """Forget the least recently used segment: its id, size and keys (None: the index is empty)."""
        row = self.db.execute("SELECT id, size FROM segments ORDER BY last_used LIMIT 1").fetchone()
        if row is None:
            return None
        keys = [k for (k,) in self.db.execute("SELECT key FROM blocks WHERE segment = ?", row[:1])]
        with self.tx() as db:
            db.execute("DELETE FROM blocks WHERE segment = ?", row[:1])
            db.execute("DELETE FROM segments WHERE id = ?", row[:1])
        return row[0], row[1], keys
