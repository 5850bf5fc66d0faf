"""What every rank of a group runs: the worker over its shard of the model.

`GroupWorker` is MLXWorker with mlx-lm's own sharding applied after the load: tensor parallel
(`model.shard(group)`: each rank holds its heads and MLP columns, the all-reduces are inside the
model) or pipeline parallel (`model.model.pipeline(group)`: each rank holds a run of layers and the
hidden state travels by send/recv, then an all_gather). Each rank's KV pool holds its share (TP:
its KV heads, PP: its layers); the KV spec, block size and memory it reports describe the group as
a whole, so a scheduler sizes the pool once.

Only rank 0 samples (`LeaderSampler`); the others receive its tokens in the same collective
(`FollowerSampler`) and apply them to their request state exactly as rank 0 does. Both evaluate the
logits first, so the forward's collectives run in the same order on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import Any, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from sidecar.config import Config
from sidecar.distributed.group import Channel
from sidecar.distributed.inflight import InFlight, guarded
from sidecar.errors import ProtocolError
from sidecar.wire.protocol import check, get
from sidecar.worker import kv_groups
from sidecar.kv.spec import LayerSpec, ModelCaches, spec_wire
from sidecar.engine.sampler import SampleResult, Sampler, SamplingRow
from sidecar.worker.mlx_worker import MLXWorker, State

log = logging.getLogger("sidecar.distributed")


class _GroupSampler:
    """The rank's own sampler for everything but `sample`, which goes through the group channel."""

    def __init__(self, inner: Sampler, channel: Channel):
        self.inner, self.channel = inner, channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class LeaderSampler(_GroupSampler):
    def sample(self, logits: mx.array, rows: Sequence[SamplingRow]) -> SampleResult:
        mx.eval(logits)
        res = self.inner.sample(logits, rows)
        self.channel.share_tokens([int(t) for t in res.token_ids], len(rows))
        return res


class FollowerSampler(_GroupSampler):
    def sample(self, logits: mx.array, rows: Sequence[SamplingRow]) -> SampleResult:
        mx.eval(logits)
        tokens = self.channel.share_tokens(None, len(rows))
        return SampleResult(tokens, None, None, None, [0] * len(rows))


class GroupWorker(MLXWorker):
    # The weights stay lazy through the load and are read after shard()/pipeline(): a rank holds
    # its share, never the whole model (as mlx-lm's sharded_load).
    lazy_load = True

    def __init__(self, config: Config, channel: Channel, **kwargs: Any):
        super().__init__(config.replace(decode_ahead=False), **kwargs)  # the ahead forward would add collectives
        self.channel = channel
        self.rank, self.world_size = channel.rank, channel.size
        self.global_specs: list[LayerSpec] = []
        self.layer_range = (0, 0)
        self._local_bytes = False
        self.in_flight = InFlight()  # the forward's collectives, one at a time (distributed/inflight.py)

    @property
    def mode(self) -> str:
        return "tensor" if self.config.tensor_parallel > 1 else "pipeline"

    def load_model(self) -> None:
        super().load_model()
        self.global_specs = []  # a new model (init_device may have changed it): specs from its config
        try:
            self._shard()
        except ProtocolError:
            self.runner = self.model = None
            self.state = State.DEVICE_READY
            raise

    def _shard(self) -> None:
        self._shard_model()
        runner = self.runner
        assert runner is not None
        runner.decode_ahead = False
        # Each padded batch evaluated before the next is built: under pipeline parallelism the
        # ranks' graphs differ (one stage receives where another sends), so two batches left lazy
        # together may run their send/recv/all_gather in a different order on each rank (a
        # deadlock). Guarded: a rank lost mid-forward raises instead of hanging (inflight.py).
        runner.batch_guard = lambda: guarded(self.in_flight)
        cls = LeaderSampler if self.channel.leader else FollowerSampler
        runner.sampler = cls(runner.sampler, self.channel)  # type: ignore[assignment]

    def _shard_model(self) -> None:
        """Shard the (whole) loaded model in place; the runner's specs become this rank's share."""
        model, runner, n = self.model, self.runner, self.world_size
        assert model is not None and runner is not None
        c = self.model_config.get("text_config", self.model_config)
        specs = self.global_specs or list(runner.specs)
        field = f"{self.mode}_parallel"
        caches, first = runner.caches, not self.global_specs  # (wake_up re-shards: the runner is already local)
        if first and (caches.has_state or caches.structure != list(range(len(specs))) or caches.scalar_offsets):
            raise ProtocolError(f"--{self.mode}-parallel needs a model of plain attention layers (no recurrent "
                                "state, CacheList or one-row-at-a-time attention)", field=field)
        if self.mode == "tensor":
            heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
            for name, count in (("attention heads", heads), ("KV heads", kv), ("MLP columns", c.get("intermediate_size", n))):
                if count % n:
                    raise ProtocolError(f"the model's {count} {name} do not split over {n} ranks", field=field)
            if not hasattr(model, "shard"):
                raise ProtocolError(f"mlx-lm's {c.get('model_type')} has no tensor parallelism (shard)", field=field)
            model.shard(self.channel.group)
            local = [dataclasses.replace(s, num_kv_heads=s.num_kv_heads // n) for s in specs]
            self.layer_range = (0, len(specs))
        else:
            inner = getattr(model, "model", None)
            if not hasattr(inner, "pipeline"):
                raise ProtocolError(f"mlx-lm's {c.get('model_type')} has no pipeline parallelism "
                                    "(model.model.pipeline); try --tensor-parallel", field=field)
            if len(specs) < n:
                raise ProtocolError(f"{len(specs)} layers do not split over {n} ranks", field=field)
            inner.pipeline(self.channel.group)
            self.layer_range = (inner.start_idx, inner.end_idx)
            local = specs[inner.start_idx : inner.end_idx]
            if _group_keys(local) != _group_keys(specs):  # requests send one block list per group
                raise ProtocolError("every pipeline stage must hold every kind of layer the model has "
                                    "(its KV cache groups)", field=field)
        mx.eval(model.parameters())
        self.weights_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        self.global_specs, runner.specs = specs, local
        if first:
            templates = caches.templates[self.layer_range[0] : self.layer_range[1]] if caches.templates else []
            runner.caches = dataclasses.replace(caches, specs=local, structure=list(range(len(local))),
                                                templates=templates)
            runner.set_groups(runner.caches.groups())
        log.info("rank %d/%d: %s parallel, layers %s, %d weight bytes", self.rank, n, self.mode,
                 self.layer_range, self.weights_bytes)

    def wake_up(self, tags: list[str] | None = None) -> None:
        reload = self.model is None
        super().wake_up(tags)
        if reload and self.model is not None:  # the weights came back whole: shard them again
            self._shard_model()

    # --- the group as a whole ------------------------------------------------------------------

    def local_block_bytes(self) -> int:
        assert self.runner is not None
        return sum(s.page_size_bytes for s in self.runner.specs)

    def determine_available_memory(self) -> int:
        """Blocks the smallest rank can hold, in bytes of a whole-group block."""
        free = super().determine_available_memory()
        blocks = self.channel.min(free // max(1, self.local_block_bytes()))
        return blocks * sum(s.page_size_bytes for s in self.global_specs)

    def _global_view(self) -> SimpleNamespace:
        """The whole model's specs and groups, shaped like a runner for kv_groups."""
        return SimpleNamespace(specs=self.global_specs,
                               groups=ModelCaches(self.global_specs, list(range(len(self.global_specs)))).groups())

    def get_kv_cache_spec(self) -> dict[str, dict]:
        self.require("get_kv_cache_spec")
        return spec_wire(self.global_specs)

    def get_kv_cache_groups(self) -> list[dict]:
        self.require("get_kv_cache_groups")
        return kv_groups.groups_view(self._global_view())

    def initialize_from_config(self, kv_cache_config: dict) -> None:
        """vLLM's KVCacheConfig, with the worker's own grouping (get_kv_cache_groups) or none: each
        rank keeps its share of the same groups."""
        self.require("initialize_from_config")
        path = "kv_cache_config"
        check(kv_cache_config, dict, path)
        num_blocks = get(kv_cache_config, "num_blocks", int, path)
        groups = get(kv_cache_config, "kv_cache_groups", list, path, default=[])
        kv_groups.scheduler_groups(self._global_view(), groups, path, self.config.block_size, only_own=(
            f"with --{self.mode}-parallel the KV cache groups must be the worker's own (get_kv_cache_groups)"))
        self.initialize_cache(num_blocks, 0)

    def get_cache_block_size_bytes(self) -> int:
        self.require("get_cache_block_size_bytes")
        return sum(s.page_size_bytes for s in (self.runner.specs if self._local_bytes else self.global_specs))  # type: ignore[union-attr]

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        self._local_bytes = True  # each rank checks its own share of a block against its own memory
        try:
            super().initialize_cache(num_gpu_blocks, num_cpu_blocks)
        finally:
            self._local_bytes = False

    def get_model(self) -> dict:
        out = super().get_model()
        out["num_layers"] = len(self.global_specs)
        out["num_kv_heads"] = next((s.num_kv_heads for s in self.global_specs), None)
        out["parallel"] = {"mode": self.mode, "world_size": self.world_size,
                           "tensor_parallel": self.config.tensor_parallel,
                           "pipeline_parallel": self.config.pipeline_parallel}
        return out

    def add_lora(self, lora_request: dict) -> bool:
        self.require("add_lora")
        # mlx-lm shards base layers only: an adapter's full-size matrices do not fit a shard.
        raise ProtocolError(f"LoRA adapters are not supported with --{self.mode}-parallel "
                            "(mlx-lm does not shard adapters)", field="lora_request")


def _group_keys(specs: Sequence[LayerSpec]) -> list[tuple]:
    return list(dict.fromkeys(s.group_key for s in specs))
