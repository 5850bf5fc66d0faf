"""`mlx-sidecar serve --tensor-parallel N | --pipeline-parallel N`: one process per rank.

Started on every host by `mlx.launch` (or with MLX_RANK and MLX_HOSTFILE set by hand, as the
launchd/systemd files do). All ranks join the group first; rank 0 then serves HTTP as a normal
sidecar whose worker leads the group, the others follow it.
"""

from __future__ import annotations

import logging
import sys

from sidecar.config import Config

log = logging.getLogger("sidecar.distributed")


def serve_group(config: Config) -> int:
    from sidecar.distributed.group import Channel, init_group
    from sidecar.server.logs import configure_logging

    try:
        configure_logging(config.log_level, config.log_format)
    except ValueError as e:
        print(f"mlx-sidecar: {e}", file=sys.stderr)
        return 2
    try:
        group = init_group(config.distributed_backend)
    except RuntimeError as e:  # no MLX_RANK/MLX_HOSTFILE, a peer unreachable, an unknown backend
        log.error("mx.distributed.init(%s) failed: %s (start every rank with mlx.launch, or set MLX_RANK "
                  "and MLX_HOSTFILE; see README 'Scale-out')", config.distributed_backend, e)
        return 2
    if group.size() != config.world_size:
        log.error("the group has %d ranks, --tensor-parallel x --pipeline-parallel asks for %d "
                  "(start one process per rank: mlx.launch, or MLX_RANK + MLX_HOSTFILE)", group.size(), config.world_size)
        return 2
    channel = Channel(group)
    if channel.rank != 0:
        from sidecar.distributed.follower import follow
        from sidecar.distributed.shard import GroupWorker

        return follow(GroupWorker(config, channel))
    from sidecar.distributed.leader import LeaderWorker
    from sidecar.server.app import serve

    worker = LeaderWorker(config, channel)
    try:
        return serve(config, worker=worker)
    finally:
        worker.close()
