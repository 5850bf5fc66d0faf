"""A vLLM KV connector for the sidecar's disk KV tier: an unmodified vLLM gets a prefix cache that
outlives the pool and restarts by configuration.

    --worker-cls sidecar.vllm.worker.MLXSidecarWorker \\
    --kv-transfer-config '{"kv_connector": "MLXSidecarStoreConnector",
                           "kv_connector_module_path": "sidecar.vllm.kv_connector", "kv_role": "kv_both"}'

Scheduler side (in vLLM's EngineCore): `get_num_new_matched_tokens` asks the sidecar
(`kv_store_lookup`) how many of the request's next full blocks its store holds, beyond vLLM's own
in-memory hit; those tokens count as computed (a synchronous load: the sidecar loads them at the
start of the step that schedules the request). `build_connector_meta` names the blocks to load
into (the ones vLLM allocated) and every block the step fills, to save. The metadata rides in the
step the worker class forwards (`kv_store_load` / `kv_store_save`), and a load the sidecar could not
verify comes back as `kv_connector_output.invalid_block_ids`, vLLM's path to recompute it.

Block keys are chained sha256 hashes of the token ids and of the identifiers of the images inside
each block (the reference scheduler's `chain_hashes`, the LoRA adapter's name added by the
sidecar), not vLLM's block hashes, which are seeded at random
per process unless PYTHONHASHSEED is set: a restarted vLLM finds the blocks an earlier one saved.
The worker side of the interface is unused: the worker class forwards the metadata itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from sidecar.client.remote import RemoteError, RemoteWorker
from sidecar.scheduler.blocks import chain_hashes

log = logging.getLogger(__name__)


@dataclass
class SidecarStoreMetadata(KVConnectorMetadata):
    """One step's transfers in the wire's form: {req_id: {block_hashes, block_ids}}."""

    load: dict[str, dict] = field(default_factory=dict)
    save: dict[str, dict] = field(default_factory=dict)

    def step_fields(self) -> dict:
        return {"kv_store_load": self.load, "kv_store_save": self.save}


def _check_groups(groups: list) -> None:
    """One group of full-attention layers: vLLM swaps the blocks a sliding window or an attention
    chunk has left for its null block, so their tables cannot name every stored block."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if len(groups) > 1:
        raise ValueError("MLXSidecarStoreConnector needs one KV cache group (a model whose layers are all "
                         f"full attention); this model has {len(groups)}")
    for g in groups:
        inner = getattr(g.kv_cache_spec, "kv_cache_specs", None)
        for spec in (inner.values() if isinstance(inner, dict) else [g.kv_cache_spec]):
            if not isinstance(spec, FullAttentionSpec):
                raise ValueError(f"MLXSidecarStoreConnector serves full-attention layers only, not "
                                 f"{type(spec).__name__} (vLLM frees the blocks that leave a window)")


@dataclass
class _Tracked:
    request: Any
    hashes: list[bytes] = field(default_factory=list)
    load_from: int = 0  # first block index of a pending load


class MLXSidecarStoreConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self._reqs: dict[str, _Tracked] = {}
        self._loads: dict[str, tuple[int, int]] = {}  # req_id -> (first block index, count), for the next step
        self._remote: RemoteWorker | None = None
        self._refused: str | None = None  # the sidecar has no usable store: the connector stands aside
        self._probed = False
        tc = vllm_config.kv_transfer_config
        if role == KVConnectorRole.SCHEDULER and tc.kv_load_failure_policy != "recompute":
            # A store entry that fails verification is a cache miss, never a failed request. (vLLM's
            # scheduler reads the policy right after creating its connector.)
            log.info("kv_load_failure_policy %r -> 'recompute': a failed disk-tier load is recomputed",
                     tc.kv_load_failure_policy)
            tc.kv_load_failure_policy = "recompute"
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        if role == KVConnectorRole.SCHEDULER:
            _check_groups(groups)

    # --- scheduler side ------------------------------------------------------------------------

    def _lookup(self, hashes: list[bytes], lora: Any) -> int:
        if not self._probed:  # once: does the sidecar have a store for this model?
            self._probed = True
            self._lookup([], None)
        if self._refused:
            return 0
        if self._remote is None:
            from sidecar.vllm.worker import sidecar_settings

            s = sidecar_settings(self._vllm_config.additional_config)
            self._remote = RemoteWorker(s["url"], token=s["token"], timeout=s["timeout"])
        lora_req = None if lora is None else {"lora_int_id": lora.lora_int_id, "lora_name": lora.lora_name}
        try:
            return int(self._remote.kv_store_lookup(hashes, lora_req))
        except RemoteError as e:
            if e.status == 400:  # no --kv-store-dir, or a model the tier refuses: never send it steps
                self._refused = str(e)
                log.warning("the sidecar's disk KV tier is not available (%s): the connector does nothing", e)
            else:
                log.warning("kv store lookup failed (%s); computing the prompt", e)
            return 0
        except OSError as e:  # unreachable: a miss, never an error
            log.warning("kv store lookup failed (%s); computing the prompt", e)
            return 0

    def _hashes(self, t: _Tracked, n: int) -> list[bytes]:
        spans = [(int(f.mm_position.offset), int(f.mm_position.length), f.identifier)
                 for f in getattr(t.request, "mm_features", None) or ()]
        return chain_hashes(t.hashes, t.request.all_token_ids, n, self.block_size, spans)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self._reqs.setdefault(request.request_id, _Tracked(request))
        t.request = request
        first, limit = num_computed_tokens // self.block_size, (request.num_tokens - 1) // self.block_size
        if limit <= first:
            return 0, False
        n = self._lookup(self._hashes(t, limit)[first:], request.lora_request)
        t.load_from = first
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            t = self._reqs[request.request_id]
            self._loads[request.request_id] = (t.load_from, num_external_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, bs = SidecarStoreMetadata(), self.block_size
        if not self._probed:
            self._lookup([], None)
        if self._refused:
            self._loads = {}
            return meta
        for rid, (first, n) in self._loads.items():
            t = self._reqs[rid]
            table = self._table(rid)
            meta.load[rid] = {"block_hashes": self._hashes(t, first + n)[first:], "block_ids": table[first:first + n]}
        self._loads = {}
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        c = scheduler_output.scheduled_cached_reqs
        computed.update(zip(c.req_ids, c.num_computed_tokens))
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            t = self._reqs.get(rid)
            if t is None or rid not in computed:
                continue
            start = computed[rid]
            end = min(start + n - len(spec.get(rid, ())), t.request.num_tokens)  # only tokens vLLM knows
            lo, hi = start // bs, end // bs
            if hi > lo:
                meta.save[rid] = {"block_hashes": self._hashes(t, hi)[lo:hi], "block_ids": self._table(rid)[lo:hi]}
        return meta

    def _table(self, rid: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager to the connector"
        return list(self._kv_cache_manager.get_block_ids(rid)[0])

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None  # saves are copied to host within their step: the blocks are free to go

    # --- worker side: unused (the worker class forwards the metadata in the step) ----------------

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def shutdown(self) -> None:
        if self._remote is not None:
            self._remote.close()
