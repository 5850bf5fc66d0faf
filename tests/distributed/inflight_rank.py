"""One rank of a 2-rank ring group on loopback, for tests/distributed/test_inflight.py.

    python -m tests.distributed.inflight_rank guarded|raw   (MLX_HOSTFILE, MLX_RANK set)

Both ranks shard a chain of 8 linears as mlx-lm's `shard` does (all-to-sharded, sharded-to-all:
one all_sum per pair), all_gather its output as a pipeline stage does, and check the forward built
inside sidecar.distributed.inflight.guarded (or not, "raw") gives exactly the unguarded result while
the group is whole. Then rank 1 stops taking part and dies
0.3 s into rank 0's next forward of the chain, as a killed rank mid-step; rank 0 prints how that
forward ended ("raised: ..."), or is left hanging.
"""

from __future__ import annotations

import os
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear

from sidecar.distributed.inflight import InFlight, guarded


def chain(group: mx.distributed.Group) -> nn.Module:
    mx.random.seed(0)
    layers = []
    for i in range(8):
        layers.append(shard_linear(nn.Linear(64, 64), "all-to-sharded" if i % 2 == 0 else "sharded-to-all",
                                   group=group))
    return nn.Sequential(*layers)


def forward(model: nn.Module, x: mx.array, mode: str) -> mx.array:
    if mode == "raw":
        return mx.distributed.all_gather(model(x))
    with guarded(InFlight()):
        out = mx.distributed.all_gather(model(x))
        mx.eval(out)
    return out


def main(mode: str) -> int:
    group = mx.distributed.init(strict=True, backend="ring")
    model = chain(group)
    x = mx.random.normal((2, 1, 64))
    ok = mx.array_equal(forward(model, x, mode), mx.distributed.all_gather(model(x))).item()
    if group.rank() == 1:
        time.sleep(0.3)
        os._exit(0)
    print(f"equal: {ok}", flush=True)
    try:
        mx.eval(forward(model, x, mode))
        print("no error", flush=True)
    except RuntimeError as e:
        print(f"raised: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
