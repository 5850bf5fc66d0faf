"""The disk KV tier (`--kv-store-dir`, docs/kv-store.md): four figures, ratios within one run.

- TTFT of a long prompt served from the store by a *restarted* server, against the cold prefill
  (the same prompt, first server); the tokens must be identical.
- Load bandwidth: the store's read path (every stored block of that prefix read and verified, as
  a load does) against a plain sequential read of one file of the same size in the same
  directory, in interleaved pairs, each evicted from the page cache first; the median of the
  pairs' ratios. Pairs, because a shared (or virtual) disk's rate can move by 2x from one second
  to the next: one load after a restart against one plain read compares two moments. The
  restarted server's own figure (its one load) is reported beside it.
- Steady-state decode with saving on against the same server with the store unused (a step
  without store fields takes the store-off path), interleaved.
- The size bound under a workload that writes 3x it (a third server with a small bound, fed
  prompts of one bound's worth of blocks each).

The stage's servers take the prefix plus some room as their max_model_len (builtin:small's own
is 2048 positions; its rotary embedding has no limit).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.scenarios import Bench, decode_rate, median
from bench.sides import SidecarSide, requests_for
from sidecar.kv.segment import HEAD, SUFFIX
from sidecar.kv.store import BlockStore
from sidecar.scheduler import Scheduler

SEGMENTS = f"segments/*{SUFFIX}"  # sidecar/kv/store.py's files


def _run(side: SidecarSide, prompt: list[int], new: int, tag: str,
         store: bool = True) -> tuple[float, list[int], list[float]]:
    sched = Scheduler(num_blocks=side.num_blocks, block_size=side.block_size, max_num_seqs=side.max_num_seqs,
                      max_num_batched_tokens=side.max_num_batched_tokens, eos_token_ids=side.eos,
                      kv_store_lookup=side.worker.kv_store_lookup if store else None)
    res, _ = side.run(requests_for([prompt], new), tag=tag, scheduler=sched)
    rid = next(iter(res.tokens))
    return res.first_token_s[rid], res.tokens[rid], res.token_times[rid]


def _drained(side: SidecarSide) -> dict:
    deadline = time.monotonic() + 120
    while True:
        info = side.worker.info()["kv_store"]
        if info["write_queue_depth"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def _drop_cache(paths: list[Path]) -> bool:
    """Evict these files from the page cache (Linux), so reads of them come from the disk, as after
    a reboot; False where the OS offers no way (macOS: reads may then be cached)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_rates(store_dir: str, scratch: str, repeats: int = 9) -> tuple[float, float, float]:
    """The store's read path (get_many of every stored block into memory made ready before, as a
    step's staging buffer is) and a plain sequential read (8 MiB reads) of a file of the same
    size: pairs of both, side by side in alternating order, each read evicted from the page cache
    first. Median GB/s of each and the median of the pairs' ratios (the disk's rate here moves
    by 2x from one second to the next)."""
    store = BlockStore(store_dir, 1 << 50)
    keys, segments = store.keys(), sorted(Path(store_dir).glob(SEGMENTS))
    nbytes = sum(f.stat().st_size for f in segments) - HEAD.size * len(keys)
    out = memoryview(np.zeros(nbytes, np.uint8))
    path = Path(scratch) / "plain-read.bin"
    with open(path, "wb") as f:
        for at in range(0, nbytes, 1 << 20):
            f.write(os.urandom(min(1 << 20, nbytes - at)))
    size = path.stat().st_size

    def load() -> float:
        _drop_cache(segments)
        t0 = time.perf_counter()
        got = store.get_many(keys, out=out)
        assert all(g is not None for g in got), "a stored block did not read back"
        return nbytes / (time.perf_counter() - t0) / 1e9

    def plain() -> float:
        _drop_cache([path])
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        return size / (time.perf_counter() - t0) / 1e9

    pairs = []
    try:
        for i in range(repeats):
            pairs.append((load(), plain()) if i % 2 == 0 else tuple(reversed((plain(), load()))))
    finally:
        store.close()
        path.unlink()
    return median([a for a, _ in pairs]), median([b for _, b in pairs]), median([a / b for a, b in pairs])


def kv_store(b: Bench, make_side: Callable[[dict[str, Any]], SidecarSide]) -> None:
    p = b.params
    root = tempfile.mkdtemp(prefix="sidecar-bench-kv-")
    try:
        room = {"max_model_len": p.kv_store_prefix_len + 256}
        store = {"kv_store_dir": str(Path(root) / "store"), "kv_store_max_gb": 64, **room}
        prompt = b.prompt(p.kv_store_prefix_len)
        first = make_side(store)
        cold, cold_tokens, _ = _run(first, prompt, p.kv_store_new_tokens, "kv_cold")
        saved = _drained(first)
        first.close()
        first.server.stop()
        b.log(f"kv store: cold TTFT {cold:.3f}s ({p.kv_store_prefix_len} tokens), {saved['saved_blocks']} blocks saved")
        cold_disk = _drop_cache(sorted(Path(store["kv_store_dir"]).glob(SEGMENTS)))  # as after a reboot
        if not cold_disk:
            b.notes.append("kv store: the page cache could not be dropped here; loads and the plain read may be cached")
        second = make_side(store)  # a new server process on the same store
        warm, warm_tokens, _ = _run(second, prompt, p.kv_store_new_tokens, "kv_store")
        info = second.worker.info()["kv_store"]
        # Read and verified by the steps that loaded (the pool write is in the TTFT, not here).
        restart_gbps = info["bytes_read"] / info["read_seconds"] / 1e9 if info["read_seconds"] else float("nan")
        segments = len(list(Path(store["kv_store_dir"]).glob(SEGMENTS)))
        b.log(f"kv store: TTFT from the store after a restart {warm:.3f}s ({info['loaded_blocks']} blocks in "
              f"{segments} segment files), its load {restart_gbps:.2f} GB/s")
        # Steady-state decode: saving on vs off, on this server (no store fields: the store-off path).
        on, off = [], []
        for i in range(p.kv_store_decode_repeats):
            for rates, saving in ((on, True), (off, False)) if i % 2 == 0 else ((off, False), (on, True)):
                _, _, times = _run(second, b.prompt(p.single_prompt_len), p.kv_store_decode_tokens, "kv_decode",
                                   saving)
                rates.append(decode_rate(times))
        second.close()
        second.server.stop()
        load_gbps, plain, bandwidth_ratio = _read_rates(store["kv_store_dir"], root)
        b.log(f"kv store: read path {load_gbps:.2f} GB/s, plain read {plain:.2f} GB/s, ratio {bandwidth_ratio:.2f} "
              "(medians of interleaved pairs)")
        # The size bound: a small store, written to 3x its bound.
        entry = info["bytes_read"] // max(1, info["loaded_blocks"]) + HEAD.size
        bound = p.kv_store_bound_blocks * entry
        third = make_side({"kv_store_dir": str(Path(root) / "bounded"), "kv_store_max_gb": bound / (1 << 30), **room})
        prompt_len = min(p.kv_store_prefix_len, p.kv_store_bound_blocks * third.block_size + 1)
        per_prompt = max(1, (prompt_len - 1) // third.block_size)
        sizes, on_disk = [], 0
        for _ in range(-(-3 * p.kv_store_bound_blocks // per_prompt)):
            _run(third, b.prompt(prompt_len), 1, "kv_bound")
            sizes.append(_drained(third)["size_bytes"])
            on_disk = max(on_disk, sum(f.stat().st_size for f in (Path(root) / "bounded").glob(SEGMENTS)))
        bounded = _drained(third)
        third.close()
        third.server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    b.results.update(
        kv_store_prefix_len=p.kv_store_prefix_len, kv_store_cold_ttft_s=cold, kv_store_ttft_s=warm,
        kv_store_ttft_ratio=warm / cold, kv_store_tokens_match=float(cold_tokens == warm_tokens),
        kv_store_loaded_blocks=info["loaded_blocks"], kv_store_load_gbps=load_gbps,
        kv_store_plain_read_gbps=plain, kv_store_bandwidth_ratio=bandwidth_ratio,
        kv_store_restart_load_gbps=restart_gbps,
        kv_store_decode_on_tok_s=median(on), kv_store_decode_off_tok_s=median(off),
        kv_store_decode_ratio=median(on) / median(off),
        kv_store_bound_max_bytes=bounded["max_bytes"], kv_store_bound_written_bytes=bounded["bytes_written"],
        kv_store_bound_size_bytes=max(max(sizes), on_disk), kv_store_bound_evictions=bounded["evictions"],
        kv_store_bound_ratio=max(max(sizes), on_disk) / bounded["max_bytes"],
    )
    r = b.results
    b.log(f"kv store ratios: TTFT {r['kv_store_ttft_ratio']:.3f} (goal <= 0.1, tokens equal: {cold_tokens == warm_tokens}), "
          f"load bandwidth {r['kv_store_bandwidth_ratio']:.2f} (>= 0.5), decode {r['kv_store_decode_ratio']:.3f} "
          f"(>= 0.97), size/bound {r['kv_store_bound_ratio']:.2f} (<= 1) after {bounded['bytes_written'] / bound:.1f}x "
          f"the bound written")
    if cold_tokens != warm_tokens:
        b.notes.append("kv store: the tokens served from the store differ from the cold run's")
