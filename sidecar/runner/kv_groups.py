"""KV cache groups on the wire: the worker's own grouping (`get_kv_cache_groups`) and the groups a
scheduler sends in `initialize_from_config` (their order is the order of every request's block lists)."""

from __future__ import annotations

from typing import Any

from sidecar.errors import ProtocolError
from sidecar.protocol import check, get


def groups_view(runner: Any) -> list[dict]:
    """[{layer_names, kv_cache_spec}] per group, as vLLM's KVCacheGroupSpec."""
    specs = runner.specs
    return [{"layer_names": [specs[i].name for i in g], "kv_cache_spec": specs[g[0]].to_wire()} for g in runner.groups]


def scheduler_groups(runner: Any, groups: list, path: str) -> list[list[int]]:
    """The scheduler's groups as leaf indices (ours when it sends none). A group may join layers of
    one kind only, except that attention layers may all share one group (vLLM without its hybrid
    allocator): each layer still attends with its own window, over the one table."""
    if not groups:
        return runner.groups
    index = {s.name: i for i, s in enumerate(runner.specs)}
    out: list[list[int]] = []
    for gi, g in enumerate(groups):
        gp = f"{path}.kv_cache_groups[{gi}]"
        check(g, dict, gp)
        names = get(g, "layer_names", list, gp)
        leaves = []
        for j, name in enumerate(names):
            if name not in index:
                raise ProtocolError(f"unknown layer {name!r}", field=f"{gp}.layer_names[{j}]")
            leaves.append(index[name])
        kinds = {runner.specs[i].kind == "state" for i in leaves}
        if len(kinds) > 1:
            raise ProtocolError("a KV cache group cannot mix recurrent-state and attention layers",
                                field=f"{gp}.layer_names")
        if not leaves:
            raise ProtocolError("a KV cache group needs at least one layer", field=f"{gp}.layer_names")
        out.append(leaves)
    return out
