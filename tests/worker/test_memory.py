from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from sidecar.worker import memory
from sidecar.worker.memory import cgroup_headroom, device_memory_bytes, held_bytes, memory_budget_bytes, meminfo_available

MEMINFO = """MemTotal:       24683652 kB
MemFree:          703188 kB
MemAvailable:    1213408 kB
Buffers:          206496 kB
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_meminfo_available_reads_mem_available_not_total(tmp_path: Path) -> None:
    assert meminfo_available(_write(tmp_path, "meminfo", MEMINFO)) == 1213408 * 1024
    assert meminfo_available(_write(tmp_path, "old", "MemTotal: 100 kB\nMemFree: 50 kB\n")) is None
    assert meminfo_available(tmp_path / "absent") is None


def test_cgroup_headroom(tmp_path: Path) -> None:
    _write(tmp_path, "memory.max", "1000000\n")
    _write(tmp_path, "memory.current", "400000\n")
    assert cgroup_headroom(tmp_path) == 600000
    _write(tmp_path, "memory.max", "max\n")
    assert cgroup_headroom(tmp_path) is None  # no limit
    assert cgroup_headroom(tmp_path / "absent") is None


def test_cpu_budget_is_what_the_os_can_give_plus_what_the_process_holds(tmp_path: Path) -> None:
    assert mx.default_device() == mx.cpu  # (the CI backend; on a GPU the budget is MLX's working set)
    meminfo = _write(tmp_path, "meminfo", MEMINFO)
    held = mx.zeros((1 << 20,), mx.float32)  # 4 MiB this process holds: counted, it is ours to reuse
    mx.eval(held)
    budget = memory_budget_bytes(meminfo, tmp_path / "no-cgroup")
    assert budget == 1213408 * 1024 + held_bytes()
    assert held_bytes() >= held.nbytes
    assert budget < device_memory_bytes() // 4  # the machine's total is not the budget (the OOM bug)
    _write(tmp_path, "memory.max", str(10 << 20))  # a container's limit binds before MemAvailable
    _write(tmp_path, "memory.current", str(4 << 20))
    assert memory_budget_bytes(meminfo, tmp_path) == (6 << 20) + held_bytes()


def test_budget_never_exceeds_physical_memory(tmp_path: Path) -> None:
    huge = _write(tmp_path, "meminfo", f"MemAvailable: {device_memory_bytes()} kB\n")
    assert memory_budget_bytes(huge, tmp_path) == device_memory_bytes()
    # The real machine's: below its total (something else runs), above nothing.
    assert 0 < memory_budget_bytes() <= device_memory_bytes()
    assert memory.MEMINFO == Path("/proc/meminfo")
