"""The disk KV tier's metrics and `/info` entry, read from the tier the MLX thread published in its
snapshot (metrics.py): counters the MLX thread and the store's writer update, each an int
attribute (one atomic read, never a wait on either thread)."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def info(tier: Any) -> dict | None:
    """`/info` `kv_store`: null without --kv-store-dir."""
    if tier is None:
        return None
    s, c = tier.store.stats, tier.counters
    return {"dir": str(tier.store.root), "max_bytes": tier.store.max_bytes, "size_bytes": tier.store.size_bytes,
            "refused": tier.refused, "write_queue_depth": tier.store.queue_depth,
            "lookup_blocks": c.lookup_blocks, "lookup_hit_blocks": c.lookup_hits, "loaded_blocks": c.loaded_blocks,
            "saved_blocks": c.saved_blocks, "failed_loads": c.failed_loads, "bytes_read": s.bytes_read,
            "bytes_written": s.bytes_written, "evictions": s.evictions, "corrupt_entries": s.corrupt,
            "dropped_writes": s.dropped_writes, "load_seconds": c.load_seconds, "read_seconds": s.read_seconds}


def families(tier: Any, prefix: str) -> Iterator[Metric]:
    if tier is None:
        return
    s, c, bs = tier.store.stats, tier.counters, tier.block_size

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        m = CounterMetricFamily(prefix + "kv_store_" + name, doc)
        m.add_metric([], value)
        return m

    yield counter("lookup_hit_blocks", "Blocks kv_store_lookup found in the disk KV tier", c.lookup_hits)
    yield counter("lookup_miss_blocks", "Blocks kv_store_lookup asked for and the tier lacked",
                  c.lookup_blocks - c.lookup_hits)
    yield counter("hit_tokens", "Tokens of the blocks kv_store_lookup found", c.lookup_hits * bs)
    yield counter("miss_tokens", "Tokens of the blocks kv_store_lookup lacked", (c.lookup_blocks - c.lookup_hits) * bs)
    yield counter("loaded_blocks", "Blocks loaded from the disk KV tier into the pool", c.loaded_blocks)
    yield counter("failed_load_blocks", "Blocks whose load failed (reported as invalid_block_ids, recomputed)",
                  c.failed_loads)
    yield counter("saved_blocks", "Blocks handed to the disk KV tier's writer", c.saved_blocks)
    yield counter("read_bytes", "Bytes read from the disk KV tier", s.bytes_read)
    yield counter("written_bytes", "Bytes written to the disk KV tier", s.bytes_written)
    yield counter("evictions", "Entries evicted to keep the tier within --kv-store-max-gb", s.evictions)
    yield counter("corrupt_entries", "Entries found corrupt, truncated or foreign on read (deleted; a miss)", s.corrupt)
    yield counter("dropped_writes", "Blocks not stored because the write queue was full", s.dropped_writes)
    yield counter("load_seconds", "Time steps spent reading and verifying entries", c.load_seconds)
    yield GaugeMetricFamily(prefix + "kv_store_write_queue_depth", "Entries waiting for the writer",
                            value=tier.store.queue_depth)
    yield GaugeMetricFamily(prefix + "kv_store_size_bytes", "Bytes the disk KV tier holds", value=tier.store.size_bytes)
    yield GaugeMetricFamily(prefix + "kv_store_max_bytes", "The tier's size bound (--kv-store-max-gb)",
                            value=tier.store.max_bytes)
