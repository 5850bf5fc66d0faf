"""The disk block store: keys, LRU eviction to the bound, verified reads, concurrency, crash safety."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sidecar.kv.store import BlockStore, entry_key

NS = b"namespace-a"


def payload(i: int, n: int = 4096) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def test_keys_cover_namespace_adapter_and_hash():
    h = b"\x01" * 32
    keys = {entry_key(NS, h), entry_key(b"namespace-b", h), entry_key(NS, h, "adapter"), entry_key(NS, b"\x02" * 32)}
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)
    assert entry_key(NS, h) == entry_key(NS, h)  # stable across processes: no salt


def test_put_get_and_restart(tmp_path: Path):
    s = BlockStore(tmp_path, 1 << 30)
    keys = [entry_key(NS, bytes([i]) * 8) for i in range(5)]
    for i, k in enumerate(keys):
        assert s.put(k, payload(i))
    assert s.lookup(keys) == 5  # pending entries count already
    s.flush(10)
    assert [s.get(k) for k in keys] == [payload(i) for i in range(5)]
    s.close()
    s2 = BlockStore(tmp_path, 1 << 30)  # a new process with the same directory serves the old blocks
    assert s2.lookup(keys) == 5 and s2.lookup([keys[0], entry_key(NS, b"x"), keys[1]]) == 1
    assert s2.get(keys[3]) == payload(3) and s2.stats.hits == 1
    assert s2.get_many(keys + [entry_key(NS, b"missing")]) == [payload(i) for i in range(5)] + [None]  # in order
    assert s2.get(entry_key(NS, b"missing")) is None and s2.stats.misses == 2
    s2.close()


ENTRY = 4096 + 56  # a payload of 4096 bytes and its header


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.kvs"))


def test_a_steps_entries_share_one_segment_and_read_back_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    s = BlockStore(tmp_path, 1 << 30)
    keys = [entry_key(NS, bytes([i])) for i in range(6)]
    assert s.put_many([(k, payload(i)) for i, k in enumerate(keys)]) == 6
    s.flush(10)
    places = [s.locate(k) for k in keys]
    assert len({p for p, _, _ in places}) == 1 and segment_files(tmp_path) == [places[0][0]]
    assert [off for _, off, _ in places] == [i * ENTRY for i in range(6)] and places[0][2] == ENTRY
    opened, reads = [], []
    real_open, real_preadv = os.open, os.preadv
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    monkeypatch.setattr(os, "preadv", lambda *a: reads.append(a[2]) or real_preadv(*a))
    got = s.get_many([keys[4], keys[0], keys[1], keys[2], keys[5]])  # any order: one run, in file order
    assert got == [payload(4), payload(0), payload(1), payload(2), payload(5)]
    assert len(opened) == 1 and reads == [0, 4 * ENTRY]  # entries 0-2 in one read, 4-5 in another
    s.close()


def test_lru_eviction_holds_the_bound_on_disk(tmp_path: Path):
    bound = 48 * ENTRY  # segments of at most 3 entries (a sixteenth of the bound)
    s = BlockStore(tmp_path, bound)
    keys = [entry_key(NS, i.to_bytes(4, "little")) for i in range(3 * 48)]  # 3x the bound
    s.put_many([(k, payload(i)) for i, k in enumerate(keys[:3])])
    s.flush(10)
    time.sleep(0.01)
    for j in range(3, len(keys), 3):
        s.put_many([(k, payload(i)) for i, k in enumerate(keys[j:j + 3], j)])
        s.flush(10)
        assert s.lookup(keys[:1]) == 1  # a hot prefix, looked up again and again: its segment stays
        on_disk = sum(f.stat().st_size for f in segment_files(tmp_path))
        assert on_disk == s.size_bytes <= bound
    assert s.get_many(keys[:3]) == [payload(i) for i in range(3)]  # the looked-up segment, whole (negative
    # control: without the lookups it goes first, see keys[3])
    assert s.get(keys[3]) is None and s.recently_evicted(keys[3]) and not s.recently_evicted(keys[-1])
    assert s.get(keys[-1]) == payload(len(keys) - 1)
    assert s.size_bytes == bound and s.stats.evictions == len(keys) - 48
    s.close()
    s2 = BlockStore(tmp_path, bound // 2)  # reopened with a smaller bound: evicts to it at once
    assert sum(f.stat().st_size for f in segment_files(tmp_path)) == s2.size_bytes <= bound // 2
    s2.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_a_damaged_entry_is_a_miss_and_its_neighbours_serve(tmp_path: Path, damage: str):
    s = BlockStore(tmp_path, 1 << 30)
    a, b, c = entry_key(NS, b"a"), entry_key(NS, b"b"), entry_key(NS, b"c")
    s.put_many([(b, payload(2)), (c, payload(3)), (a, payload(1))])  # a is the segment's last entry
    s.flush(10)
    path, off, size = s.locate(a)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[off + size - 100] ^= 1
    elif damage == "truncate":
        del raw[-1]
    elif damage == "foreign":  # another key's (valid) entry where the index expects this key's
        _, boff, _ = s.locate(b)
        raw[off:off + size] = raw[boff:boff + size]
    else:
        raw[off:off + 4] = b"junk"
    path.write_bytes(bytes(raw))
    assert s.get_many([b, c, a]) == [payload(2), payload(3), None]
    assert s.stats.corrupt == 1 and s.lookup([a]) == 0 and s.locate(a) is None
    assert s.get(b) == payload(2) and path.exists()  # the segment lives on for its other entries
    s.close()


def test_a_segment_is_deleted_with_its_last_entry(tmp_path: Path):
    s = BlockStore(tmp_path, 1 << 30)
    k = entry_key(NS, b"k")
    s.put(k, payload(1))
    s.flush(10)
    path, off, _ = s.locate(k)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert s.get(k) is None and not path.exists() and s.size_bytes == 0
    s.close()


def test_concurrent_readers_and_writer(tmp_path: Path):
    entry = 4096 + 56
    s = BlockStore(tmp_path, 40 * entry)  # small: readers race eviction too
    keys = [entry_key(NS, i.to_bytes(4, "little")) for i in range(200)]
    errors: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            for i, k in enumerate(keys):
                got = s.get(k)
                if got is not None and got != payload(i):
                    errors.append(f"key {i}: wrong bytes")

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for i, k in enumerate(keys):
        s.put(k, payload(i))
        if i % 20 == 0:
            s.flush(10)
    s.flush(10)
    done.set()
    for t in threads:
        t.join()
    assert not errors and s.stats.hits > 0 and s.stats.corrupt == 0
    assert s.size_bytes <= 40 * entry
    s.close()


_CHILD = """
import sys
from sidecar.kv.store import BlockStore, entry_key
s = BlockStore(sys.argv[1], 1 << 40)
print("ready", flush=True)
i = 0
while True:  # segments of 8 entries of 256 KiB, as a step saving 8 blocks
    s.put_many([(entry_key(b"ns", j.to_bytes(8, "little")), j.to_bytes(8, "little") * 32768) for j in range(i, i + 8)])
    i += 8
    s.flush(30)
"""


def _key(i: int) -> bytes:
    return entry_key(b"ns", i.to_bytes(8, "little"))


def test_kill_9_mid_write_leaves_a_store_that_opens_and_serves(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 30
    while len(segment_files(tmp_path)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    s = BlockStore(tmp_path, 1 << 40)
    assert not list((tmp_path / "segments").glob("*.tmp"))  # the killed writer's temp file is gone
    n = s.lookup([_key(i) for i in range(100000)])
    assert n >= 32 and n % 8 == 0  # whole segments only
    assert s.get_many([_key(i) for i in range(n)]) == [i.to_bytes(8, "little") * 32768 for i in range(n)]
    assert s.size_bytes == sum(f.stat().st_size for f in segment_files(tmp_path))
    path, off, size = s.locate(_key(9))  # damage one entry in the middle of a segment
    with open(path, "r+b") as f:
        f.seek(off + size // 2)
        f.write(b"\xff" * 16)
    s.close()
    s2 = BlockStore(tmp_path, 1 << 40)  # reopens; the damaged entry is a miss, its neighbours serve
    got = s2.get_many([_key(i) for i in range(8, 16)])
    assert got[1] is None and s2.stats.corrupt == 1
    assert [g for j, g in enumerate(got) if j != 1] == [i.to_bytes(8, "little") * 32768 for i in range(8, 16) if i != 9]
    s2.close()


def test_a_segment_the_index_missed_is_recovered_and_a_row_without_its_file_dropped(tmp_path: Path):
    s = BlockStore(tmp_path, 1 << 30)
    k, gone = entry_key(NS, b"k"), entry_key(NS, b"gone")
    s.put(k, payload(7))
    s.flush(10)
    s.put(gone, payload(8))
    s.flush(10)
    s.locate(gone)[0].unlink()
    s.close()
    import sqlite3

    db = sqlite3.connect(tmp_path / "index.sqlite")
    kept = db.execute("SELECT segment FROM blocks WHERE key = ?", (k,)).fetchone()[0]
    db.execute("DELETE FROM blocks WHERE key = ?", (k,))  # as if killed between the rename and the index insert
    db.execute("DELETE FROM segments WHERE id = ?", (kept,))
    db.commit()
    db.close()
    s2 = BlockStore(tmp_path, 1 << 30)
    assert s2.lookup([k]) == 1 and s2.get(k) == payload(7) and s2.size_bytes == ENTRY
    assert s2.lookup([gone]) == 0
    s2.close()


def test_the_one_file_per_entry_layout_is_adopted(tmp_path: Path):
    """A directory written by the earlier layout (xx/<key>.kvb, one entry per file, index table
    `entries`) still serves: each file is a one-entry segment, moved in on open."""
    import sqlite3

    from sidecar.kv import segment

    keys = [entry_key(NS, bytes([i])) for i in range(3)]
    for i, k in enumerate(keys):
        d = tmp_path / k.hex()[:2]
        d.mkdir(exist_ok=True)
        data = payload(i)
        (d / f"{k.hex()}.kvb").write_bytes(segment.HEAD.pack(segment.MAGIC, k, len(data), segment.CHECKSUMS[segment.MAGIC](data)) + data)
    (tmp_path / keys[0].hex()[:2] / "x.kvb.1.tmp").write_bytes(b"torn")
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("CREATE TABLE entries (key BLOB PRIMARY KEY, size INTEGER NOT NULL, last_used REAL NOT NULL)")
    db.commit()
    db.close()
    s = BlockStore(tmp_path, 1 << 30)
    assert s.get_many(keys) == [payload(i) for i in range(3)] and s.size_bytes == 3 * ENTRY
    assert not list(tmp_path.glob("*/*.kvb")) and not list(tmp_path.glob("*/*.tmp")) and len(segment_files(tmp_path)) == 3
    s.close()


def test_both_checksums_verify_and_an_unknown_one_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from sidecar.kv import segment

    s = BlockStore(tmp_path, 1 << 30)
    keys = [entry_key(NS, bytes([i])) for i in range(3)]
    for magic, k in zip(list(segment.CHECKSUMS), keys):  # each checksum this process knows
        monkeypatch.setattr(segment, "MAGIC", magic)
        s.put(k, payload(1))
        s.flush(10)
        path, off, _ = s.locate(k)
        assert path.read_bytes()[off:off + 8] == magic and s.get(k) == payload(1)
    monkeypatch.setattr(segment, "MAGIC", b"MLXKVB\0\1")
    s.put(keys[2], payload(2))
    s.flush(10)
    path, off, _ = s.locate(keys[2])
    raw = bytearray(path.read_bytes())
    raw[off:off + 8] = b"MLXKVB\0\7"  # a checksum this process cannot compute
    path.write_bytes(bytes(raw))
    assert s.get(keys[2]) is None and s.stats.corrupt == 1
    s.close()


def test_a_failed_write_leaves_nothing_behind_and_the_writer_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from sidecar.kv import segment

    s = BlockStore(tmp_path, 1 << 30)
    a, b = entry_key(NS, b"a"), entry_key(NS, b"b")
    real = os.replace

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(segment.os, "replace", full_disk)
    s.put(a, payload(1))
    s.flush(10)
    assert s.lookup([a]) == 0 and not list((tmp_path / "segments").iterdir()) and s.size_bytes == 0
    monkeypatch.setattr(segment.os, "replace", real)
    s.put(b, payload(2))
    s.flush(10)
    assert s.get(b) == payload(2) and s.size_bytes == ENTRY
    s.close()
