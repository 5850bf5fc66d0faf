"""add_lora's argument, checked before the runner's adapter registry sees it."""

from __future__ import annotations

from sidecar.errors import ProtocolError
from sidecar.wire.protocol import check, get


def lora_request_args(lora_request: dict) -> tuple[int, str, str]:
    """add_lora's {lora_int_id, lora_name, lora_path (relative to --lora-dir)}, checked."""
    check(lora_request, dict, "lora_request")
    lora_id = get(lora_request, "lora_int_id", int, "lora_request")
    if lora_id < 1:
        raise ProtocolError("lora_int_id must be >= 1", field="lora_request.lora_int_id")
    name = get(lora_request, "lora_name", str, "lora_request", default=str(lora_id))
    return lora_id, name, get(lora_request, "lora_path", str, "lora_request")
