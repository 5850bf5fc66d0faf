"""sidecar/worker/profiling.py: the profile call's files are bounded in number."""

from __future__ import annotations

from pathlib import Path

from sidecar.worker import profiling
from sidecar.worker.profiling import MAX_PROFILES, Profiler


def test_profiles_on_disk_are_bounded_and_the_newest_kept(tmp_path: Path) -> None:
    p = Profiler()
    paths = []
    for _ in range(MAX_PROFILES + 5):  # many in the same second: each its own file
        p.start()
        paths.append(p.stop(str(tmp_path)))
    assert len(set(paths)) == len(paths)
    folder = Path(paths[0]).parent
    left = sorted(folder.glob("worker-*.prof"))
    assert len(left) == MAX_PROFILES
    assert set(map(str, left)) == set(paths[-MAX_PROFILES:])  # the oldest went first
    (folder / "notes.txt").write_text("not a profile")  # other files are left alone
    p.start()
    p.stop(str(tmp_path))
    assert (folder / "notes.txt").exists() and len(list(folder.glob("worker-*.prof"))) == profiling.MAX_PROFILES
