"""Sleep mode: level 1 discards the KV cache (contents and request state); level 2 also frees the
weights, reloaded from disk on wake_up. (On unified memory there is no host to offload to.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from sidecar.errors import ProtocolError
from sidecar.worker.lifecycle import State
from sidecar.worker.model_info import weights_bytes
from sidecar.wire.protocol import check

log = logging.getLogger("sidecar.worker")
TAGS = ("weights", "kv_cache")


@dataclass
class SleepMode:
    asleep: set[str] = field(default_factory=set)  # what sleep freed and wake_up has not restored
    awake_state: State = State.READY  # the state wake_up returns to
    blocks: int = 0  # the pool size wake_up reallocates

    def sleep(self, worker: Any, level: int) -> None:
        if check(level, int, "level") not in (1, 2):
            raise ProtocolError(f"level must be 1 or 2, got {level}", field="level")
        runner = worker.runner
        assert runner is not None
        self.awake_state, self.blocks = worker.state, runner.num_blocks
        runner.free()
        self.asleep = {"kv_cache"}
        if level == 2:
            runner.drop_model()
            worker.model = None
            worker.weights_bytes = 0
            self.asleep.add("weights")
        mx.clear_cache()
        worker.state = State.SLEEPING
        log.info("sleep(level=%d): active memory %d bytes", level, mx.get_active_memory())

    def wake_up(self, worker: Any, tags: list[str] | None) -> None:
        wanted = set(TAGS) if tags is None else set(check(tags, list, "tags"))
        unknown = wanted - set(TAGS)
        if unknown:
            raise ProtocolError(f"unknown tag {sorted(unknown)[0]!r} (tags: weights, kv_cache)", field="tags")
        runner = worker.runner
        assert runner is not None
        if "weights" in wanted & self.asleep:
            from sidecar.engine.pooling import load

            from sidecar.models.vision import is_served, load_vision

            model, _ = (load_vision(worker.model_path) if is_served(worker.model_path)
                        else load(worker.model_path, lazy=worker.lazy_load))
            worker.model = model
            runner.set_model(model)
            worker.weights_bytes = weights_bytes(model)
            self.asleep.discard("weights")
        if "kv_cache" in wanted & self.asleep:
            runner.allocate(self.blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            worker.state = self.awake_state
