"""In-process, no group needed: a model that cannot be split is refused by load_model with a 400
naming the flag, before any collective, and the worker stays where it was (device_ready)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sidecar.config import Config
from sidecar.distributed.shard import GroupWorker
from sidecar.errors import ProtocolError
from sidecar.worker.mlx_worker import State


@dataclass
class Ranks:
    """Just the group's shape: these checks run before the group is used."""

    size: int
    rank: int = 0
    group: object = None
    leader: bool = True


@pytest.mark.parametrize(("flag", "model", "size", "why"), [
    ("tensor_parallel", "builtin:tiny", 3, "4 attention heads do not split over 3 ranks"),
    ("pipeline_parallel", "builtin:tiny", 2, "no pipeline parallelism"),  # mlx-lm's llama has shard() only
    ("pipeline_parallel", "builtin:tiny-qwen2", 3, "2 layers do not split over 3 ranks"),
])
def test_unsplittable_model_is_refused(home: str, flag: str, model: str, size: int, why: str) -> None:
    w = GroupWorker(Config(model=model, home=home, **{flag: size}), Ranks(size))  # type: ignore[arg-type]
    w.init_device()
    with pytest.raises(ProtocolError) as e:
        w.load_model()
    assert e.value.field == flag and why in str(e.value)
    assert w.state == State.DEVICE_READY and w.model is None
    assert w.config.decode_ahead is False  # the ahead forward would add collectives rank 1 never runs
