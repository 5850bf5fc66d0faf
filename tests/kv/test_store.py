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


def test_lru_eviction_holds_the_bound(tmp_path: Path):
    entry = 4096 + 56
    s = BlockStore(tmp_path, 10 * entry)
    keys = [entry_key(NS, i.to_bytes(4, "little")) for i in range(30)]  # 3x the bound
    for i, k in enumerate(keys[:5]):
        s.put(k, payload(i))
    s.flush(10)
    time.sleep(0.01)
    assert s.lookup([keys[0]]) == 1  # looked up (a scheduler about to load it): survives the others
    for i, k in enumerate(keys[5:13], 5):
        s.put(k, payload(i))
        s.flush(10)
    assert s.get(keys[0]) == payload(0) and s.get(keys[1]) is None  # least recently used went first
    for i, k in enumerate(keys[13:], 13):
        s.put(k, payload(i))
        s.flush(10)
        assert s.size_bytes <= 10 * entry
    files = list(tmp_path.glob("*/*.kvb"))
    assert len(files) == 10 and sum(f.stat().st_size for f in files) <= 10 * entry
    assert s.stats.evictions == 20 and s.recently_evicted(keys[1]) and not s.recently_evicted(keys[29])
    s.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_a_damaged_entry_is_a_miss_and_deleted(tmp_path: Path, damage: str):
    s = BlockStore(tmp_path, 1 << 30)
    a, b = entry_key(NS, b"a"), entry_key(NS, b"b")
    s.put(a, payload(1))
    s.put(b, payload(2))
    s.flush(10)
    path = s.path(a)
    raw = path.read_bytes()
    if damage == "flip":
        path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    elif damage == "truncate":
        path.write_bytes(raw[:-1])
    elif damage == "foreign":  # another key's (valid) entry under this key's name
        path.write_bytes(s.path(b).read_bytes())
    else:
        path.write_bytes(b"junk")
    assert s.get(a) is None
    assert s.stats.corrupt == 1 and not path.exists() and s.lookup([a]) == 0
    assert s.get(b) == payload(2)  # the others are untouched
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
while True:
    s.put(entry_key(b"ns", i.to_bytes(8, "little")), i.to_bytes(8, "little") * 32768)  # 256 KiB entries
    i += 1
    if i % 8 == 0:
        s.flush(30)
"""


def test_kill_9_mid_write_leaves_a_store_that_opens_and_serves(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    time.sleep(1.0)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    # A torn write: a truncated entry as if the kill had hit before the rename of a direct write.
    s = BlockStore(tmp_path, 1 << 40)
    assert not list(tmp_path.glob("*/*.tmp"))  # the killed writer's temp file is gone
    n = s.lookup([entry_key(b"ns", i.to_bytes(8, "little")) for i in range(100000)])
    assert n > 0
    for i in range(n):
        assert s.get(entry_key(b"ns", i.to_bytes(8, "little"))) == i.to_bytes(8, "little") * 32768
    victim = s.path(entry_key(b"ns", (0).to_bytes(8, "little")))
    victim.write_bytes(victim.read_bytes()[:1000])
    s.close()
    s2 = BlockStore(tmp_path, 1 << 40)  # reopens; the torn entry is a miss, the rest serve
    assert s2.get(entry_key(b"ns", (0).to_bytes(8, "little"))) is None and s2.stats.corrupt == 1
    assert s2.get(entry_key(b"ns", (n - 1).to_bytes(8, "little"))) == (n - 1).to_bytes(8, "little") * 32768
    s2.close()


def test_an_entry_file_the_index_missed_is_recovered(tmp_path: Path):
    s = BlockStore(tmp_path, 1 << 30)
    k = entry_key(NS, b"k")
    s.put(k, payload(7))
    s.flush(10)
    s.close()
    import sqlite3

    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("DELETE FROM entries")  # as if killed between the rename and the index insert
    db.commit()
    db.close()
    s2 = BlockStore(tmp_path, 1 << 30)
    assert s2.lookup([k]) == 1 and s2.get(k) == payload(7) and s2.size_bytes > 0
    s2.close()


def test_both_checksums_verify_and_an_unknown_one_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from sidecar.kv import store as mod

    s = BlockStore(tmp_path, 1 << 30)
    keys = [entry_key(NS, bytes([i])) for i in range(3)]
    for magic, k in zip(list(mod.CHECKSUMS), keys):  # each checksum this process knows
        monkeypatch.setattr(mod, "MAGIC", magic)
        s.put(k, payload(1))
        s.flush(10)
        assert s.path(k).read_bytes()[:8] == magic and s.get(k) == payload(1)
    monkeypatch.setattr(mod, "MAGIC", b"MLXKVB\0\1")
    s.put(keys[2], payload(2))
    s.flush(10)
    raw = s.path(keys[2]).read_bytes()
    s.path(keys[2]).write_bytes(b"MLXKVB\0\7" + raw[8:])  # a checksum this process cannot compute
    assert s.get(keys[2]) is None and s.stats.corrupt == 1
    s.close()
