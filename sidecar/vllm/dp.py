"""vLLM data parallelism over several sidecars: each DP rank's worker drives its own sidecar.

vLLM's `--data-parallel-size N` runs N engine cores behind one OpenAI endpoint and balances requests
over them; each engine core builds one worker class, and rank r's worker picks the r-th URL of
`--additional-config '{"mlx_sidecar": {"urls": [...]}}'` (or `MLX_SIDECAR_URLS`, comma-separated).
A sidecar may itself be a tensor/pipeline group: its rank 0's URL.

Dummy batches cost no model work here. vLLM asks an idle rank for one while another rank runs a
step only so that every rank enters the same collectives: its MoE layers are sharded over the DP
ranks (or, with expert parallelism, dispatch tokens to other ranks' experts), so a rank that sat
out would stall the others. Each sidecar holds the whole model and shares no collective with any
other, so an idle rank has nothing to join: answering is all a dummy batch has to do. Expert
parallelism would split the experts over the sidecars and need the dispatch between them, which
the sidecars do not have: it is refused by name.
"""

from __future__ import annotations

import os
from typing import Any

from sidecar.vllm.convert import Unsupported


def dp_rank(parallel_config: Any) -> int:
    """This engine core's DP rank. vLLM resets `data_parallel_rank` to 0 for a dense model's ranks
    (they run independently); `data_parallel_index` keeps the real one."""
    return int(getattr(parallel_config, "data_parallel_index", None) or parallel_config.data_parallel_rank or 0)


def check_parallel(parallel_config: Any) -> None:
    if getattr(parallel_config, "enable_expert_parallel", False):
        raise Unsupported("--enable-expert-parallel is not supported by the MLX sidecar: every data parallel rank's "
                          "sidecar holds all the experts and no sidecar dispatches tokens to another's; "
                          "run without it (data parallelism then replicates the whole model per sidecar)")


def _key(url: str) -> str:
    return url.strip().rstrip("/").lower()


def rank_url(cfg: dict, rank: int, default: str) -> str:
    """The sidecar URL of DP rank `rank`: a clear start-up error for a setting that cannot serve it."""
    urls, where = cfg.get("urls"), "--additional-config mlx_sidecar.urls"
    if urls is not None and cfg.get("url"):
        raise Unsupported("--additional-config mlx_sidecar: give either url (one sidecar) or urls (one per data "
                          "parallel rank), not both")
    if urls is None and os.environ.get("MLX_SIDECAR_URLS"):
        urls, where = [u.strip() for u in os.environ["MLX_SIDECAR_URLS"].split(",")], "MLX_SIDECAR_URLS"
    if urls is None:
        url = cfg.get("url") or os.environ.get("MLX_SIDECAR_URL") or default
        if rank > 0:
            raise Unsupported(f"data parallel rank {rank} needs its own sidecar, but one URL ({url}, from "
                              "mlx_sidecar.url / MLX_SIDECAR_URL or the default) is given for every rank: list one "
                              "per rank in --additional-config mlx_sidecar.urls or MLX_SIDECAR_URLS")
        return url
    if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u.strip() for u in urls):
        raise Unsupported(f"{where} must be a non-empty list of sidecar URLs, one per data parallel rank")
    seen: dict[str, int] = {}
    for i, u in enumerate(urls):
        if _key(u) in seen:
            raise Unsupported(f"{where} names {u} twice (ranks {seen[_key(u)]} and {i}): two data parallel ranks "
                              "cannot share one sidecar (each drives its own KV cache and request state)")
        seen[_key(u)] = i
    if rank >= len(urls):
        raise Unsupported(f"{where} lists {len(urls)} sidecar URL(s), but data parallel rank {rank} needs one: "
                          "give one URL per rank (--data-parallel-size)")
    return urls[rank].strip()
