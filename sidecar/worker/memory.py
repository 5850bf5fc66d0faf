"""Memory accounting: how much the device has, how much this process may really use, and the
profile run that measures a step's activation peak.

On Metal/CUDA the budget is MLX's recommended working set. On the CPU backend it is what the OS
can give now (Linux: MemAvailable, within the cgroup's limit) plus what this process already
holds through MLX: the machine's *total* memory is not a budget, a pool sized from it gets the
process OOM-killed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from sidecar.errors import ProtocolError

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # v2 unified hierarchy: memory.max, memory.current


def _physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _gpu_working_set() -> int | None:
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return None


def device_memory_bytes() -> int:
    """Device memory: MLX's device info on Metal/CUDA, the OS's physical memory on CPU."""
    if mx.default_device() == mx.gpu:
        size = _gpu_working_set()
        if size:
            return size
    return _physical_bytes()


def meminfo_available(meminfo: Path | None = None) -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        text = (meminfo or MEMINFO).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            parts = line.split()
            return int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return None


def cgroup_headroom(cgroup: Path | None = None) -> int | None:
    """Bytes the cgroup (v2) still allows: memory.max - memory.current; None without a limit."""
    cgroup = cgroup or CGROUP
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        current = int((cgroup / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    return None if limit == "max" or not limit.isdigit() else max(0, int(limit) - current)


def held_bytes() -> int:
    """What this process holds through MLX (arrays plus MLX's buffer cache): reusable by it."""
    return mx.get_active_memory() + mx.get_cache_memory()


def memory_budget_bytes(meminfo: Path | None = None, cgroup: Path | None = None) -> int:
    """The most memory this process's MLX allocations can add up to, counting what it holds now."""
    if mx.default_device() == mx.gpu:
        size = _gpu_working_set()
        if size:
            return size
    physical = _physical_bytes()
    free = meminfo_available(meminfo)
    if free is None:  # not Linux: on a Mac's CPU backend, unified memory's recommended working set
        if mx.metal.is_available():
            return _gpu_working_set() or physical
        return physical
    room = cgroup_headroom(cgroup)
    if room is not None:
        free = min(free, room)
    return min(physical, free + held_bytes())


def check_pool_fits(num_blocks: int, block_bytes: int, held_pool_bytes: int, activation_peak_bytes: int) -> int:
    """Bytes a pool of num_blocks needs; a 400 naming num_gpu_blocks when it cannot fit beside what
    the process holds outside the pool (weights, ...) and a step's measured activation peak."""
    need = num_blocks * block_bytes
    budget = memory_budget_bytes()
    others = max(0, mx.get_active_memory() - held_pool_bytes)
    room = budget - others - activation_peak_bytes
    if need > room:
        raise ProtocolError(f"{num_blocks} blocks need {need} bytes; {max(0, room)} are available for the KV "
                            f"cache (budget {budget}, {others} held outside the pool, activation peak "
                            f"{activation_peak_bytes})", field="num_gpu_blocks")
    return need


def kv_bytes_free(fraction: float, held_pool_bytes: int, activation_peak_bytes: int) -> int:
    """determine_available_memory's arithmetic: the fraction of the budget, less everything the
    process holds outside the pool (weights, what the profile run left, ...) and the activation
    peak. An existing pool is reusable. Within check_pool_fits's room whenever fraction <= 1."""
    others = max(0, mx.get_active_memory() - held_pool_bytes)
    return int(memory_budget_bytes() * fraction) - others - activation_peak_bytes


def profile_run(runner: Any, cfg: Any) -> float:
    """Forwards at the configured limits on a scratch pool: a full-budget prefill and a full decode batch."""
    from sidecar.kv.pool import KVPool
    from sidecar.engine.state import RequestState, Row
    from sidecar.engine.sampler import SamplingParams

    seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
    prefill = max(1, min(cfg.max_num_batched_tokens, runner.max_model_len))
    bs = cfg.block_size
    blocks = -(-prefill // bs) + seqs
    pool, saved = runner.pool, runner.requests
    t0 = time.perf_counter()
    try:
        runner.pool, runner.requests = KVPool(runner.specs, blocks), {}
        greedy = SamplingParams(temperature=0.0)
        big = RequestState("profile-prefill", [0] * prefill, greedy, list(range(-(-prefill // bs))))
        runner.run_rows([Row(big, 0, big.prompt_token_ids, big.block_ids, True)])
        rows = []
        for i in range(seqs):
            s = RequestState(f"profile-{i}", [0], greedy, [blocks - 1 - i])
            rows.append(Row(s, 0, [0], s.block_ids, True))
        runner.run_rows(rows)
    finally:
        runner.pool, runner.requests = pool, saved
    return time.perf_counter() - t0
