"""Prometheus metrics (prefix `mlx_worker_`, DESIGN §8) on an injected registry.

Gauges are computed at scrape time from plain attributes the MLX thread publishes, so a scrape
never waits for a step. Counters and histograms are observed where the events happen.
"""

from __future__ import annotations

import platform
from typing import Callable, Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar import __version__
from sidecar.runner.model_runner import StepStats
from sidecar.worker import MLXWorker, State, device_memory_bytes

# Buckets for what we see: sub-millisecond RPCs up to multi-second prefills on big models.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Time to first token spans queueing plus prefill: tens of milliseconds to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384 tokens per step
BATCH_BUCKETS = tuple(float(2**i) for i in range(10))  # 1 .. 512 rows per step


class WorkerCollector(Collector):
    def __init__(self, worker: Callable[[], MLXWorker]):
        self._worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self._worker()
        p = "mlx_worker_"

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, doc, value=value)

        info = GaugeMetricFamily(p + "info", "Worker build and model information",
                                 labels=["model", "dtype", "device", "mlx_version", "version"])
        dtype = w.runner.specs[0].dtype if w.runner else ""
        info.add_metric([w.config.model, dtype, w.device, mx.__version__, __version__], 1)
        yield info
        state = GaugeMetricFamily(p + "state", "Lifecycle state (1 for the current state)", labels=["state"])
        for s in State:
            state.add_metric([s.value], 1.0 if w.state == s else 0.0)
        yield state
        yield gauge("healthy", "1 when the last health check passed", 1.0 if w.healthy else 0.0)
        yield gauge("memory_active_bytes", "MLX active memory", mx.get_active_memory())
        yield gauge("memory_peak_bytes", "MLX peak memory since start or the last reset", mx.get_peak_memory())
        yield gauge("memory_cache_bytes", "MLX allocator cache", mx.get_cache_memory())
        yield gauge("memory_limit_bytes", "MLX memory limit", mx.get_memory_limit())
        yield gauge("memory_total_bytes", "Device memory", device_memory_bytes())
        yield gauge("model_weights_bytes", "Bytes of the loaded weights", w.weights_bytes)
        runner = w.runner
        blocks = runner.num_blocks if runner else 0
        states = list(runner.requests.values()) if runner else []  # one C-level copy: atomic under the GIL
        used = len({b for s in states for b in s.block_ids})
        yield gauge("kv_cache_blocks", "KV cache blocks in the pool", blocks)
        yield gauge("kv_cache_blocks_used", "Blocks referenced by running requests", used)
        yield gauge("kv_cache_usage_ratio", "kv_cache_blocks_used / kv_cache_blocks", used / blocks if blocks else 0.0)
        yield gauge("kv_cache_block_size_bytes", "Bytes of one block across all layers (K and V)",
                    sum(s.page_size_bytes for s in runner.specs) if runner else 0)
        yield gauge("running_requests", "Requests the worker holds state for", len(states))
        yield gauge("last_step_duration_seconds", "Duration of the last execute_model",
                    runner.last_stats.seconds if runner else 0.0)
        yield gauge("last_health_check_timestamp_seconds", "Unix time of the last health check", w.last_health_check)


class Metrics:
    def __init__(self, registry: CollectorRegistry, worker: Callable[[], MLXWorker]):
        self.registry = registry
        p = "mlx_worker_"
        self.rpc_requests = Counter(p + "rpc_requests", "RPC calls by method and HTTP status", ["method", "code"], registry=registry)
        self.rpc_duration = Histogram(p + "rpc_duration_seconds", "RPC wall time", ["method"],
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens computed", registry=registry)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens sampled", registry=registry)
        self.steps = Counter(p + "steps", "execute_model steps", registry=registry)
        self.errors = Counter(p + "errors", "Errors by type", ["type"], registry=registry)
        self.step_duration = Histogram(p + "step_duration_seconds", "execute_model compute time",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.step_tokens = Histogram(p + "step_tokens", "Tokens per step", buckets=TOKEN_BUCKETS, registry=registry)
        self.step_batch_size = Histogram(p + "step_batch_size", "Requests per step", buckets=BATCH_BUCKETS, registry=registry)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From a request's first sight to its first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        registry.register(WorkerCollector(worker))
        ProcessCollector(registry=registry)
        if platform.system() != "Windows":
            PlatformCollector(registry=registry)
        self._rpc: dict[tuple[str, int], Counter] = {}
        self._dur: dict[str, Histogram] = {}
        self._err: dict[str, Counter] = {}

    def observe_rpc(self, method: str, code: int, seconds: float) -> None:
        # Label children are created once and reused.
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
        self.steps.inc()
        self.step_duration.observe(stats.seconds)
        self.step_tokens.observe(stats.num_tokens)
        self.step_batch_size.observe(stats.num_rows)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.generated_tokens)
        for t in stats.first_token_latencies:
            self.ttft.observe(t)
