"""`mlx-sidecar serve --tensor-parallel N | --pipeline-parallel N`: one process per rank.

Started on every host by `mlx.launch` (or with MLX_RANK and MLX_HOSTFILE set by hand, as the
launchd/systemd files do). All ranks join the group first; rank 0 then serves HTTP as a normal
sidecar whose worker leads the group, the others follow it.

In-process (a scheduler that builds its worker itself, vLLM-style): `build_worker(config,
rank=r, distributed_init_method="ring://<hostfile>")` joins the group from the constructor's
arguments instead of the environment; rank 0 gets the LeaderWorker to drive, every other rank
runs `follow(worker)` until rank 0 stops.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from sidecar.config import Config

log = logging.getLogger("sidecar.distributed")


class GroupError(RuntimeError):
    """The group could not be formed as configured (the message says how to start it)."""


def build_worker(config: Config, *, rank: int | None = None, distributed_init_method: str = "") -> Any:
    """Join the group and return this rank's worker: a LeaderWorker on rank 0, else a GroupWorker
    for `follow`. Rank and hostfile from the arguments, or the environment mlx.launch sets."""
    from sidecar.distributed.group import Channel, init_group

    try:
        group = init_group(config.distributed_backend, rank, distributed_init_method)
    except RuntimeError as e:  # no MLX_RANK/MLX_HOSTFILE, a peer unreachable, an unknown backend
        raise GroupError(f"mx.distributed.init({config.distributed_backend}) failed: {e} (start every rank with "
                         "mlx.launch, or set MLX_RANK and MLX_HOSTFILE; see README 'Scale-out')") from None
    if group.size() != config.world_size:
        raise GroupError(f"the group has {group.size()} ranks, --tensor-parallel x --pipeline-parallel asks for "
                         f"{config.world_size} (start one process per rank: mlx.launch, or MLX_RANK + MLX_HOSTFILE)")
    channel = Channel(group)
    if channel.rank != 0:
        from sidecar.distributed.shard import GroupWorker

        return GroupWorker(config, channel)
    from sidecar.distributed.leader import LeaderWorker

    return LeaderWorker(config, channel)


def _probes_while_forming(config: Config) -> Any:
    """On rank 0 (as MLX_RANK says) over TCP: the stand-in server while mx.distributed.init waits."""
    if os.environ.get("MLX_RANK") != "0" or config.uds:
        return None
    from sidecar.distributed.forming import FormingServer
    from sidecar.errors import StartupError
    from sidecar.server.auth import check_bind, load_token

    try:
        check_bind(config, load_token(config))  # refused binds are the real server's to report
    except StartupError:
        return None
    return FormingServer(config).start()


def serve_group(config: Config) -> int:
    from sidecar.server.logs import configure_logging

    try:
        configure_logging(config.log_level, config.log_format)
    except ValueError as e:
        print(f"mlx-sidecar: {e}", file=sys.stderr)
        return 2
    forming = _probes_while_forming(config)
    try:
        worker = build_worker(config)
    except GroupError as e:
        log.error("%s", e)
        return 2
    finally:
        if forming is not None:
            forming.stop()  # before the real server binds the port
    if worker.rank != 0:
        from sidecar.distributed.follower import follow

        return follow(worker)
    from sidecar.server.app import serve

    try:
        return serve(config, worker=worker)
    finally:
        worker.close()
