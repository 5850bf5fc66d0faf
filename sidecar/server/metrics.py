"""Prometheus metrics (prefix `mlx_worker_`, docs/operations.md, Metrics and alerts) on an injected registry.

A scrape never waits for the MLX thread and never walks structures that thread mutates:

- after every call it runs, the MLX thread publishes a `Snapshot` (an immutable object swapped in
  with one attribute assignment) holding everything derived from the runner and the pool;
- scalar worker attributes (`state`, `healthy`, `last_health_check`) are read directly: each is
  one attribute read, atomic under the GIL;
- MLX memory counters are read live (they are plain allocator counters, no device sync), so they
  move during a long step; MLX releases the GIL inside `eval`, so the scrape thread runs freely.

Counters and histograms are observed where the events happen (RPCs on the event loop, steps on
the MLX thread); prometheus-client's children are thread-safe.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.kv.spec import spec_wire
from sidecar.engine.model_runner import StepStats
from sidecar.server import kv_store
from sidecar.server.instance import Instance
from sidecar.worker.mlx_worker import MLXWorker, State, device_memory_bytes

PREFIX = "mlx_worker_"

# Histogram buckets (seconds), for what we see: sub-millisecond RPCs (check_health, small JSON
# calls) up to multi-second prefills and minute-long model loads on big models. 0.5, 2.5 and 5 are
# referenced by deploy/prometheus/alerts.yml (step latency p99 > 2 s).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time to first token spans queueing in the scheduler plus prefill: tens of milliseconds to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Tokens per step: powers of two, 1 .. 16384 (decode batches low, prefill chunks high).
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))
# Requests per step: powers of two, 1 .. 512.
BATCH_BUCKETS = tuple(float(2**i) for i in range(10))


@dataclass(frozen=True)
class Snapshot:
    """What the MLX thread publishes after each call; read by scrapes and /info, never mutated."""

    model: str = ""
    model_path: str | None = None
    dtype: str = ""
    device: str = "none"
    memory_total_bytes: int = 0
    weights_bytes: int = 0
    num_blocks: int = 0
    block_size: int = 0
    block_size_bytes: int = 0
    max_model_len: int | None = None
    vocab_size: int | None = None
    kv_cache_spec: dict | None = None
    # The held requests' block tables, taken on the MLX thread once per call (one reference per
    # table: a step's cost does not grow with the contexts); their distinct blocks are counted at
    # scrape time. The lists are the requests' own: a step replaces a table, never edits it.
    tables: tuple = ()
    running_requests: int = 0
    kv_tier: Any = None  # the disk KV tier (engine/kv_tier.py): its counters are ints, read atomically
    encoder: tuple = (0, 0, 0, 0, 0.0)  # the vision encoder's runs, hits, misses, evictions, seconds

    @property
    def blocks_used(self) -> int:
        return len(set().union(*self.tables))

    @classmethod
    def of(cls, w: MLXWorker) -> Snapshot:
        """Build on the thread that owns the worker (the MLX thread, or the creator before it starts)."""
        runner = w.runner
        specs = list(runner.specs) if runner is not None else []
        specs = list(getattr(w, "global_specs", None) or specs)  # a group's rank 0: the whole model, not its shard
        pool = runner.pool if runner is not None else None
        return cls(
            model=w.config.model,
            model_path=str(w.model_path) if w.model_path else None,
            dtype=specs[0].dtype if specs else "",
            device=w.device,
            memory_total_bytes=device_memory_bytes() if w.device != "none" else 0,
            weights_bytes=w.weights_bytes if w.model is not None else 0,
            num_blocks=pool.num_blocks if pool is not None else 0,
            block_size=w.config.block_size,
            block_size_bytes=sum(s.page_size_bytes for s in specs),
            max_model_len=runner.max_model_len if runner is not None else None,
            vocab_size=runner.vocab_size if runner is not None else None,
            kv_cache_spec=spec_wire(specs) if specs else None,
            **cls.usage(w),
        )

    @staticmethod
    def usage(w: MLXWorker) -> dict[str, Any]:
        """The fields a step changes."""
        runner = w.runner
        tier = getattr(runner, "kv_tier", None)
        mm = getattr(runner, "mm", None) if runner is not None else None
        enc = (mm.stats.runs, mm.stats.hits, mm.stats.misses, mm.stats.evictions, mm.stats.seconds) if mm else (0,) * 5
        if runner is None or not runner.pool:
            return {"tables": (), "running_requests": 0, "kv_tier": tier, "encoder": enc}
        reqs = runner.requests
        return {"tables": tuple(t for r in reqs.values() for t in (r.block_ids, *r.other_block_ids)),
                "running_requests": len(reqs), "kv_tier": tier, "encoder": enc}

    @staticmethod
    def static_key(w: MLXWorker) -> tuple:
        """What every other field is derived from: while it compares equal, only `usage` changes."""
        runner = w.runner
        pool = runner.pool if runner is not None else None
        return (w.config, w.model_path, w.device, w.model is not None and w.weights_bytes,
                pool.num_blocks if pool is not None else 0, tuple(getattr(w, "global_specs", None) or ()),
                (runner.max_model_len, runner.vocab_size, tuple(runner.specs)) if runner is not None else None)

    def with_usage(self, w: MLXWorker) -> Snapshot:
        """This snapshot with the step-dependent fields of `w` (a new object: published ones never change)."""
        snap = object.__new__(Snapshot)
        snap.__dict__.update(self.__dict__, **self.usage(w))  # (frozen: past __setattr__, before it is shared)
        return snap


class WorkerCollector(Collector):
    """The gauges of §8, computed at scrape time from the published snapshot."""

    def __init__(self, metrics: Metrics, worker: Callable[[], MLXWorker]):
        self._metrics = metrics
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self._worker()
        snap = self._metrics.snapshot
        p = PREFIX

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, doc, value=value)

        info = GaugeMetricFamily(p + "info", "Worker build and model information (always 1)",
                                 labels=["model", "dtype", "device", "mlx_version", "version"])
        info.add_metric([snap.model, snap.dtype, snap.device, mx.__version__, __version__], 1)
        yield info
        current = w.state  # one read: the gauge shows exactly one state
        state = GaugeMetricFamily(p + "state", "Lifecycle state (1 for the current state, 0 for the others)", labels=["state"])
        for s in State:
            state.add_metric([s.value], 1.0 if current == s else 0.0)
        yield state
        yield gauge("healthy", "1 when the last health check passed", 1.0 if w.healthy else 0.0)
        yield gauge("memory_active_bytes", "MLX active (allocated) memory", mx.get_active_memory())
        yield gauge("memory_peak_bytes", "MLX peak active memory since start or the last reset", mx.get_peak_memory())
        yield gauge("memory_cache_bytes", "MLX allocator cache (freed, not yet returned)", mx.get_cache_memory())
        yield gauge("memory_limit_bytes", "MLX memory limit", mx.get_memory_limit())
        yield gauge("memory_total_bytes", "Device memory (the recommended working set on Metal, physical memory on CPU)",
                    snap.memory_total_bytes)
        yield gauge("model_weights_bytes", "Bytes of the loaded weights", snap.weights_bytes)
        blocks, used = snap.num_blocks, snap.blocks_used
        yield gauge("kv_cache_blocks", "KV cache blocks in the pool", blocks)
        yield gauge("kv_cache_blocks_used", "Distinct blocks referenced by the requests the worker holds", used)
        yield gauge("kv_cache_usage_ratio", "kv_cache_blocks_used / kv_cache_blocks", used / blocks if blocks else 0.0)
        yield gauge("kv_cache_block_size_bytes", "Bytes of one block across all layers (K and V)", snap.block_size_bytes)
        yield gauge("running_requests", "Requests the worker holds state for", snap.running_requests)
        yield gauge("last_step_duration_seconds", "Duration of the last execute_model that ran a forward pass",
                    self._metrics.last_step_seconds)
        start = GaugeMetricFamily(p + "start_time_seconds", "Unix time this server instance started; the label "
                                  "is the instance id of /info and the X-Sidecar-Instance header", labels=["instance_id"])
        start.add_metric([self._metrics.instance.id], self._metrics.instance.started_at)
        yield start
        yield gauge("last_health_check_timestamp_seconds", "Unix time of the last health check (0: never)",
                    w.last_health_check)
        m = self._metrics
        idle = CounterMetricFamily(p + "mlx_thread_idle_seconds", "Time the MLX thread waited for a call, since start "
                                   "(per step of a decode stream: the round trip it did not overlap)")
        idle.add_metric([], m.thread.idle_seconds if m.thread is not None else 0.0)
        yield idle
        yield from kv_store.families(snap.kv_tier, p)
        yield gauge("spec_decode_acceptance_ratio", "Speculative decoding: accepted / verified draft tokens since start "
                    "(0 before any)", m.spec_accepted / m.spec_drafts if m.spec_drafts else 0.0)
        for value, name, doc in zip(snap.encoder, ("encoder_runs", "encoder_cache_hits", "encoder_cache_misses",
                                                   "encoder_cache_evictions", "encoder_seconds"),
                                    ("Multimodal items run through the vision encoder",
                                     "New requests' items whose encoder output was cached",
                                     "New requests' items not in the encoder cache",
                                     "Encoder outputs freed by the scheduler", "Time in the vision encoder")):
            fam = CounterMetricFamily(p + name, doc)
            fam.add_metric([], value)
            yield fam


class _WithoutCreated(Collector):
    """The families of an inner registry minus their `_created` samples, which the text format
    would expose as extra gauge families (`mlx_worker_steps_created`, ...) beyond §8's list."""

    def __init__(self, inner: CollectorRegistry):
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        for fam in self._inner.collect():
            fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield fam


class Metrics:
    def __init__(self, registry: CollectorRegistry, worker: Callable[[], MLXWorker], *, process: bool = True):
        self.registry = registry
        self.snapshot = Snapshot()
        self._static_key: tuple | None = None  # what self.snapshot's static fields were derived from
        self.instance = Instance()  # the app sets the server's own
        self.thread: Any = None  # the app's MLXThread, once started (its idle time is a counter)
        self.last_step_seconds = 0.0
        p = PREFIX
        events = CollectorRegistry()  # the counters and histograms, exposed through registry
        self.rpc_requests = Counter(p + "rpc_requests", "RPC calls by method and HTTP status, rejected ones included "
                                    "(method=\"unknown\" for names outside the allow-list)", ["method", "code"],
                                    registry=events)
        self.rpc_duration = Histogram(p + "rpc_duration_seconds", "RPC wall time, queueing included", ["method"],
                                      buckets=LATENCY_BUCKETS, registry=events)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens computed", registry=events)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens sampled", registry=events)
        self.steps = Counter(p + "steps", "execute_model calls that ran a forward pass", registry=events)
        self.more_decode_steps = Counter(p + "more_decode_steps", "Decode steps calls ran after their first "
                                         "(num_decode_steps)", registry=events)
        self.prefill_chunks = Counter(p + "prefill_chunks", "Rows that computed part of a prompt without sampling "
                                      "(chunked prefill)", registry=events)
        self.pooling_requests = Counter(p + "pooling_requests", "Pooling requests (embeddings, classification, scores) "
                                        "whose result was returned", registry=events)
        self.errors = Counter(p + "errors", "Error replies by error type, plus start-up preload failures (type=\"preload\")",
                              ["type"], registry=events)
        self.step_duration = Histogram(p + "step_duration_seconds", "execute_model compute time",
                                       buckets=LATENCY_BUCKETS, registry=events)
        self.step_tokens = Histogram(p + "step_tokens", "Tokens computed per step", buckets=TOKEN_BUCKETS, registry=events)
        self.step_batch_size = Histogram(p + "step_batch_size", "Requests per step", buckets=BATCH_BUCKETS, registry=events)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From a request's first sight to its first sampled token",
                              buckets=TTFT_BUCKETS, registry=events)
        # Speculative decoding (engine/spec_decode.py): the acceptance rate is accepted / draft tokens.
        self.spec_draft_tokens = Counter(p + "spec_decode_draft_tokens", "Draft tokens verified", registry=events)
        self.spec_accepted_tokens = Counter(p + "spec_decode_accepted_tokens", "Draft tokens accepted", registry=events)
        self.spec_drafts_per_step = Histogram(p + "spec_decode_draft_tokens_per_step", "Draft tokens verified per step "
                                              "(steps with drafts)", buckets=TOKEN_BUCKETS, registry=events)
        self.spec_drafts = self.spec_accepted = 0
        registry.register(_WithoutCreated(events))
        registry.register(WorkerCollector(self, worker))
        if process:  # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
            ProcessCollector(registry=registry)
            if platform.system() != "Windows":
                PlatformCollector(registry=registry)
        # Label children are created once and reused (the label values come from closed sets:
        # the allow-list plus "unknown", the HTTP statuses we send, the error envelope types).
        self._rpc: dict[tuple[str, int], Counter] = {}
        self._dur: dict[str, Histogram] = {}
        self._err: dict[str, Counter] = {}

    def publish(self, worker: MLXWorker) -> None:
        """Called on the thread that owns the worker after each call: one atomic swap. Between
        steps only the usage fields change: the rest is carried over while its key holds."""
        key = Snapshot.static_key(worker)
        if key == self._static_key:
            self.snapshot = self.snapshot.with_usage(worker)
        else:
            self.snapshot, self._static_key = Snapshot.of(worker), key

    def observe_rpc(self, method: str, code: int, seconds: float) -> None:
        child = self._rpc.get((method, code))
        if child is None:
            child = self._rpc[(method, code)] = self.rpc_requests.labels(method, str(code))
        child.inc()
        dur = self._dur.get(method)
        if dur is None:
            dur = self._dur[method] = self.rpc_duration.labels(method)
        dur.observe(seconds)

    def observe_error(self, kind: str) -> None:
        child = self._err.get(kind)
        if child is None:
            child = self._err[kind] = self.errors.labels(kind)
        child.inc()

    def observe_step(self, stats: StepStats) -> None:
        self.last_step_seconds = stats.seconds
        self.steps.inc()
        self.step_duration.observe(stats.seconds)
        self.step_tokens.observe(stats.num_tokens)
        self.step_batch_size.observe(stats.num_rows)
        if stats.prompt_tokens:  # (a decode step adds none: one lock fewer each)
            self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        if stats.prefill_chunks:
            self.prefill_chunks.inc(stats.prefill_chunks)
        if stats.pooled_requests:
            self.pooling_requests.inc(stats.pooled_requests)
        if stats.more_decode_steps:
            self.more_decode_steps.inc(stats.more_decode_steps)
        for t in stats.first_token_latencies:
            self.ttft.observe(t)
        if stats.draft_tokens:
            self.spec_draft_tokens.inc(stats.draft_tokens)
            self.spec_accepted_tokens.inc(stats.accepted_tokens)
            self.spec_drafts_per_step.observe(stats.draft_tokens)
            self.spec_drafts += stats.draft_tokens
            self.spec_accepted += stats.accepted_tokens
