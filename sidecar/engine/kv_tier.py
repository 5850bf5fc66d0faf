"""The disk KV tier inside a step: validate `kv_store_load` / `kv_store_save` against the planned
rows, read and verify the stored blocks, load them into the pool before the forward, and hand the
blocks computed by the step to the store's writer after it.

A load whose entry turns out unreadable (corrupt, truncated, evicted since the lookup) is not an
error: the request's row is left out of the step, its computed tokens end at the first block that
failed, and those block ids are returned as `invalid_block_ids` (vLLM's KVConnectorOutput field)
so the scheduler recomputes them; its next step continues from there and the tokens stay exact.
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass, field

from sidecar.errors import ProtocolError
from sidecar.kv import transfer
from sidecar.kv.pool import KVPool
from sidecar.kv.store import BlockStore, entry_key
from sidecar.wire.kv_store import LOAD, SAVE, block_hashes
from sidecar.wire.protocol import SchedulerOutput, check
from sidecar.engine.state import RequestState, Row, StepPlan

log = logging.getLogger(__name__)


@dataclass
class TierCounters:
    loaded_blocks: int = 0
    saved_blocks: int = 0
    failed_loads: int = 0  # blocks whose load failed (the scheduler recomputes them)
    load_seconds: float = 0.0
    bytes_loaded: int = 0
    lookup_blocks: int = 0  # blocks asked for by kv_store_lookup
    lookup_hits: int = 0  # of them, held by the store (a lookup stops at the first block it lacks)


@dataclass
class TierStep:
    load_ids: list[int] = field(default_factory=list)
    load_data: list[memoryview] = field(default_factory=list)
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, store key)
    invalid: list[int] | None = None  # set when the step asked for loads


def adapter_tag(state_or_lora: RequestState | dict | None) -> str:
    """The LoRA part of a block's key: the adapter's name (vLLM's block hash extra key), else its id."""
    lora = state_or_lora.lora_request if isinstance(state_or_lora, RequestState) else state_or_lora
    if not lora:
        return ""
    return str(lora.get("lora_name") or lora.get("lora_int_id") or "")


class KVTier:
    def __init__(self, store: BlockStore, namespace: bytes, refused: str | None, block_size: int):
        self.store, self.namespace, self.refused, self.block_size = store, namespace, refused, block_size
        self.counters = TierCounters()

    def key(self, block_hash: bytes, adapter: str) -> bytes:
        return entry_key(self.namespace, block_hash, adapter)

    def lookup(self, hashes: object, lora_request: object = None) -> int:
        """How many leading blocks of these hashes the store holds (the `kv_store_lookup` RPC)."""
        if self.refused:
            raise ProtocolError(self.refused, field="block_hashes")
        hs = block_hashes(hashes, "block_hashes")
        if lora_request is not None:
            check(lora_request, dict, "lora_request")
        tag = adapter_tag(lora_request)  # type: ignore[arg-type]
        n = self.store.lookup([self.key(h, tag) for h in hs])
        self.counters.lookup_blocks += len(hs)
        self.counters.lookup_hits += n
        return n

    # --- the step -------------------------------------------------------------------------

    def prepare(self, plan: StepPlan, out: SchedulerOutput, pool: KVPool) -> TierStep | None:
        """Validate the step's transfers (400 naming the field, nothing changed), read the loads and
        take failed rows out of the plan. Runs before the plan is applied."""
        if not out.kv_store_load and not out.kv_store_save:
            return None
        if self.refused:
            raise ProtocolError(self.refused, field=LOAD if out.kv_store_load else SAVE)
        rows = {r.state.req_id: r for r in plan.rows}
        bs = self.block_size
        loads = [(rid, row, self._items(rid, row, t, LOAD, row.start // bs, check_known=True))
                 for rid, t in out.kv_store_load.items() for row in [self._row(rows, rid, LOAD)]]
        saves = [(row, self._items(rid, row, t, SAVE, (row.end - row.num_draft) // bs))
                 for rid, t in out.kv_store_save.items() for row in [self._row(rows, rid, SAVE)]]
        step = TierStep(invalid=[] if loads else None)
        nbytes, dropped = transfer.entry_bytes(pool), set()
        t0 = time.perf_counter()
        keys = [key for _, _, items in loads for _, _, key in items]
        got = iter(self.store.get_many(keys, out=transfer.staging(len(keys) * nbytes)) if keys else [])
        for rid, row, items in loads:
            datas = [next(got) for _ in items]
            for n, ((k, b, key), data) in enumerate(zip(items, datas)):
                if data is None or len(data) != nbytes:
                    failed = [fb for _, fb, _ in items[n:]]
                    log.warning("kv store: load of %d block(s) of %r failed; recomputing from position %d",
                                len(failed), rid, k * bs)
                    step.invalid.extend(failed)  # type: ignore[union-attr]
                    self.counters.failed_loads += len(failed)
                    plan.rows[:] = [r for r in plan.rows if r is not row]
                    plan.rewinds.append((row.state, k * bs))
                    dropped.add(rid)
                    break
                step.load_ids.append(b)
                step.load_data.append(data)
        self.counters.load_seconds += time.perf_counter() - t0
        for row, items in saves:
            if row.state.req_id not in dropped:
                step.saves.extend((b, key) for _, b, key in items if not self.store.contains(key))
        return step

    def _row(self, rows: dict[str, Row], rid: str, what: str) -> Row:
        row = rows.get(rid)
        if row is None:
            raise ProtocolError(f"request {rid!r} is not scheduled in this step", field=f"{what}.{rid}")
        if row.other_block_ids:
            raise ProtocolError("the KV store needs one block table shared by every KV cache group",
                                field=f"{what}.{rid}")
        return row

    def _items(self, rid: str, row: Row, t: object, what: str, full: int,
               check_known: bool = False) -> list[tuple[int, int, bytes]]:
        """(table index, block id, store key) per entry, sorted by index. A load's block must be one
        of the request's blocks before the step's first position; a save's, full after the step."""
        index = {b: k for k, b in enumerate(row.block_ids[:full])}
        tag, path = adapter_tag(row.state), f"{what}.{rid}"
        items: dict[int, tuple[int, int, bytes]] = {}
        for j, (h, b) in enumerate(zip(t.block_hashes, t.block_ids)):  # type: ignore[attr-defined]
            k = index.get(b)
            if k is None:
                where = (f"the {full} blocks before position {row.start}" if what == LOAD
                         else f"the {full} blocks full after this step")
                raise ProtocolError(f"block {b} is not one of {rid!r}'s {where}", field=f"{path}.block_ids[{j}]")
            if k in items:
                raise ProtocolError(f"block {b} is named twice", field=f"{path}.block_ids[{j}]")
            key = self.key(h, tag)
            if check_known and not self.store.contains(key) and not self.store.recently_evicted(key):
                raise ProtocolError("the store holds no block of this hash (ask kv_store_lookup first)",
                                    field=f"{path}.block_hashes[{j}]")
            items[k] = (k, b, key)
        return [items[k] for k in sorted(items)]

    def load(self, pool: KVPool, step: TierStep) -> None:
        """Write the step's loaded blocks into the pool (after the plan is applied, before the forward)."""
        if step.load_ids:
            transfer.write_blocks(pool, step.load_ids, step.load_data)
            self.counters.loaded_blocks += len(step.load_ids)
            self.counters.bytes_loaded += sum(map(len, step.load_data))
            step.load_data = []

    def save(self, pool: KVPool, step: TierStep) -> None:
        """Copy the step's computed blocks to host memory and queue them (after the forward is evaluated)."""
        if not step.saves:
            return
        datas = transfer.read_blocks(pool, [b for b, _ in step.saves])
        self.counters.saved_blocks += self.store.put_many([(key, d) for (_, key), d in zip(step.saves, datas)])


_STORES: dict[str, BlockStore] = {}  # one open store per directory for the process (it outlives reloads)


def open_tier(store_dir: str | None, max_gb: float, model: str, model_path: object, specs: list) -> KVTier | None:
    """The tier for a freshly loaded model (None without --kv-store-dir). The store stays open
    across load_model/shutdown; the namespace follows the model and its settings."""
    if not store_dir:
        return None
    store = _STORES.get(store_dir)
    if store is None:
        store = _STORES[store_dir] = BlockStore(store_dir, int(max_gb * (1 << 30)))
        atexit.register(store.close)  # a clean exit writes what is queued
    identity = transfer.model_identity(model_path) if model_path is not None else model  # type: ignore[arg-type]
    refused = transfer.refusal(specs)
    if refused:
        log.warning("kv store: %s", refused)
    return KVTier(store, transfer.namespace(identity, specs), refused, specs[0].block_size)
