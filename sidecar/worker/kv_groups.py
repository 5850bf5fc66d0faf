"""KV cache groups on the wire: the worker's own grouping (`get_kv_cache_groups`) and the groups a
scheduler sends in `initialize_from_config` (their order is the order of every request's block lists)."""

from __future__ import annotations

from typing import Any

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import check, get
from sidecar.kv.spec import STATE


def groups_view(runner: Any) -> list[dict]:
    """[{layer_names, kv_cache_spec}] per group, as vLLM's KVCacheGroupSpec."""
    specs = runner.specs
    return [{"layer_names": [specs[i].name for i in g], "kv_cache_spec": specs[g[0]].to_wire()} for g in runner.groups]


def scheduler_groups(runner: Any, groups: list, path: str, block_size: int, *,
                     only_own: str | None = None) -> list[list[int]]:
    """The scheduler's `kv_cache_groups` as leaf indices (ours when it sends none), validated:
    every layer known and in a group, a group of one kind only (except that attention layers may all
    share one group, as vLLM without its hybrid allocator: each layer still attends with its own
    window, over the one table), the worker's block size. `only_own`: accept no grouping but the
    worker's own, with this message. `runner`: anything with `specs` and `groups`."""
    if not groups:
        return runner.groups
    index = {s.name: i for i, s in enumerate(runner.specs)}
    out: list[list[int]] = []
    for gi, g in enumerate(groups):
        gp = f"{path}.kv_cache_groups[{gi}]"
        check(g, dict, gp)
        leaves = []
        for j, name in enumerate(get(g, "layer_names", list, gp)):
            if check(name, str, f"{gp}.layer_names[{j}]") not in index:
                raise ProtocolError(f"unknown layer {name!r}", field=f"{gp}.layer_names[{j}]")
            leaves.append(index[name])
        if not leaves:
            raise ProtocolError("a KV cache group needs at least one layer", field=f"{gp}.layer_names")
        state = {runner.specs[i].kind == STATE for i in leaves}
        if len(state) > 1:
            raise ProtocolError("a KV cache group cannot mix recurrent-state and attention layers",
                                field=f"{gp}.layer_names")
        bs = get(g, "kv_cache_spec", dict, gp, default={}).get("block_size", block_size)
        # A recurrent-state group's block size means nothing here (one state slot per block id);
        # vLLM's hybrid allocator sizes it to match page sizes.
        if bs != block_size and not state.pop():
            raise ProtocolError(f"block_size {bs} differs from the worker's {block_size}",
                                field=f"{gp}.kv_cache_spec.block_size")
        out.append(leaves)
    named = {i for g in out for i in g}
    missing = sorted(s.name for i, s in enumerate(runner.specs) if i not in named)
    if missing:
        raise ProtocolError(f"layer {missing[0]!r} is in no KV cache group", field=f"{path}.kv_cache_groups")
    if only_own and sorted(map(sorted, out)) != sorted(map(sorted, runner.groups)):
        raise ProtocolError(only_own, field=f"{path}.kv_cache_groups")
    return out
