"""RemoteWorker: the MLXWorker interface over HTTP (msgpack), for schedulers written in Python.

Uses one persistent connection (sidecar/client/http1.py: one send and one receive per call). `http://host:port`
and `unix:///path/to/socket` URLs are accepted.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from typing import Any, Callable
from urllib.parse import urlparse

import msgpack

from sidecar.errors import SidecarError
from sidecar.client.http1 import Connection, Response
from sidecar.wire.protocol import LogprobsLists, ModelRunnerOutput, PromptLogprobs

MSGPACK = "application/msgpack"


class RemoteError(SidecarError):
    """An error envelope from the server; `status`, `type`, `message` and `field` as sent."""

    def __init__(self, status: int, type_: str, message: str, field: str | None, retry_after: float | None = None):
        super().__init__(message, field, retry_after)
        self.status, self.type = status, type_

    def __str__(self) -> str:
        where = f" at {self.field}" if self.field else ""
        return f"{self.status} {self.type}{where}: {self.message}"


def connect(url: str, timeout: float | None) -> Connection:
    """A connection (not opened yet) to an `http://host:port` or `unix:///path` URL."""
    u = urlparse(url)
    if u.scheme == "unix":
        return Connection(timeout=timeout, uds=u.path)
    return Connection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)


def result_of(resp: Response, data: bytes) -> Any:
    """The wire result of an RPC reply, or RemoteError for an error envelope."""
    payload = msgpack.unpackb(data, raw=False, strict_map_key=False) if data else {}
    if resp.status != 200:
        err = payload.get("error", {}) if isinstance(payload, dict) else {}
        retry = resp.getheader("retry-after")
        raise RemoteError(resp.status, err.get("type", "http_error"), err.get("message", data[:200].decode(errors="replace")),
                          err.get("field"), float(retry) if retry else None)
    return payload["result"]


def exec_seconds(resp: Response) -> float | None:
    """The server's own time for the call (Server-Timing: exec;dur=<ms>)."""
    timing = resp.getheader("server-timing") or ""
    return float(timing.split("dur=", 1)[1]) / 1e3 if "dur=" in timing else None


# A reply lost on the way: the call may or may not have run.
_LOST = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead, http.client.BadStatusLine,
         BrokenPipeError, TimeoutError, socket.timeout)


class RemoteWorker:
    """`number_steps`: send `step_id` with every execute_model (1, 2, ...) and resend a step whose
    reply was lost (connection reset, timeout) up to `resends` times; the server answers a resend
    of the step it applied last from its cache, so nothing is applied twice (docs/protocol.md,
    "Exactly-once steps"). `pin_instance`: send the server instance id seen on the first reply
    with every later call, so a restarted server answers 409 instead of acting on a fresh state."""

    def __init__(self, url: str = "http://127.0.0.1:8000", token: str | None = None, timeout: float = 600.0, *,
                 number_steps: bool = False, resends: int = 3, pin_instance: bool = False):
        self.url, self.timeout = url, timeout
        self.number_steps, self.resends, self.pin_instance = number_steps, resends, pin_instance
        self.next_step_id = 1
        self.instance_id: str | None = None  # X-Sidecar-Instance of the last reply
        self.resent = 0  # steps resent after a lost reply, for the curious
        # (no Accept: the reply comes in the request's format, docs/protocol.md; one header fewer to parse per call)
        self._headers = {"content-type": MSGPACK}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._conn: Connection | None = None
        self.last_request_id: str | None = None
        self.last_exec_seconds: float | None = None  # the server's own time for the last call

    def __repr__(self) -> str:
        return f"RemoteWorker({self.url!r})"

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = connect(self.url, self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def call(self, method: str, **kwargs: Any) -> Any:
        """POST /rpc/<method> with kwargs; returns the wire result or raises RemoteError."""
        body = msgpack.packb(kwargs, use_bin_type=True)
        headers = self._headers
        if self.pin_instance and self.instance_id:
            headers = {**headers, "x-sidecar-expect-instance": self.instance_id}
        # A numbered step is safe to resend after any loss; anything else only after a kept-alive
        # connection turned out closed (reconnect once).
        numbered = kwargs.get("step_id") is not None
        attempts = 1 + (self.resends if numbered else 1)
        for attempt in range(attempts):
            conn = self._connection()
            try:
                conn.request("POST", f"/rpc/{method}", body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except _LOST if numbered else (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
                self.close()
                if attempt == attempts - 1:
                    raise
                self.resent += numbered
        self.last_request_id = resp.getheader("x-request-id")
        self.instance_id = resp.getheader("x-sidecar-instance") or self.instance_id
        self.last_exec_seconds = exec_seconds(resp)
        return result_of(resp, data)

    def info(self) -> dict:
        """GET /info: version, state, model, device, KV spec, num_blocks, block_size."""
        conn = self._connection()
        conn.request("GET", "/info", headers={k: v for k, v in self._headers.items() if k == "authorization"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RemoteError(resp.status, "http_error", data[:200].decode(errors="replace"), None)
        return json.loads(data)

    def readyz(self) -> tuple[int, dict]:
        """GET /readyz: (status, body); the body names `state`, and `starting` while preloading."""
        conn = self._connection()
        conn.request("GET", "/readyz")
        resp = conn.getresponse()
        data = resp.read()
        try:
            body = json.loads(data)
        except ValueError:
            raise RemoteError(resp.status, "http_error", data[:200].decode(errors="replace"), None) from None
        return resp.status, body

    def wait_while_starting(self, on_stage: Callable[[str], None] | None = None, timeout: float | None = None,
                            connect_timeout: float = 30.0, poll: float = 0.25) -> dict:
        """While the server brings itself up (`serve --preload`), poll /readyz; returns its last body
        (ready, or idle for the caller to drive). `on_stage` sees what it waits for, as it changes. A failed preload
        or `timeout` (default: the client's) raises RemoteError 503; a server that refuses
        connections for `connect_timeout` (it may still be importing) raises the OSError."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout if timeout is None else timeout)
        seen = None
        while True:
            try:
                _, body = self.readyz()
            except (ConnectionRefusedError, FileNotFoundError):
                self.close()
                if time.monotonic() - t0 > connect_timeout:
                    raise
                if seen is None and on_stage is not None:
                    on_stage(f"not accepting connections at {self.url} yet")
                seen = ""
                time.sleep(poll)
                continue
            if body.get("preload_error"):
                raise RemoteError(503, "preload_failed", f"the server's preload failed: {body['preload_error']}", None)
            stage = body.get("starting")
            if stage is None:
                return body
            if stage != seen and on_stage is not None:
                on_stage(f"starting: {stage}")
            seen = stage
            if time.monotonic() > deadline:
                raise RemoteError(503, "unavailable", f"the server was still starting ({stage}) after the wait", None)
            time.sleep(poll)

    # --- the MLXWorker interface --------------------------------------------------------------

    def init_device(self, config: dict | None = None) -> None:
        return self.call("init_device", **({"config": config} if config else {}))

    def load_model(self) -> None:
        return self.call("load_model")

    def determine_available_memory(self) -> int:
        return self.call("determine_available_memory")

    def get_kv_cache_spec(self) -> dict[str, dict]:
        return self.call("get_kv_cache_spec")

    def get_kv_cache_groups(self) -> list[dict]:
        return self.call("get_kv_cache_groups")

    def get_cache_block_size_bytes(self) -> int:
        return self.call("get_cache_block_size_bytes")

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        return self.call("initialize_cache", num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks)

    def initialize_from_config(self, kv_cache_config: dict) -> None:
        return self.call("initialize_from_config", kv_cache_config=kv_cache_config)

    def compile_or_warm_up_model(self) -> float:
        return self.call("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: dict) -> ModelRunnerOutput:
        if not self.number_steps:
            return output_from_wire(self.call("execute_model", scheduler_output=scheduler_output))
        result = self.call("execute_model", scheduler_output=scheduler_output, step_id=self.next_step_id)
        self.next_step_id += 1  # only once applied: a rejected step changed nothing and keeps its number
        return output_from_wire(result)

    def take_draft_token_ids(self) -> dict | None:
        """The worker's drafts for the next step (vLLM's DraftTokenIds: req_ids, draft_token_ids) or None."""
        return self.call("take_draft_token_ids")

    def check_health(self) -> None:
        return self.call("check_health")

    def get_model(self) -> dict:
        return self.call("get_model")

    def vocab_size(self) -> int:
        return self.call("vocab_size")

    def sleep(self, level: int = 1) -> None:
        return self.call("sleep", level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        return self.call("wake_up", tags=tags)

    def add_lora(self, lora_request: dict) -> bool:
        return self.call("add_lora", lora_request=lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.call("remove_lora", lora_id=lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.call("pin_lora", lora_id=lora_id)

    def list_loras(self) -> list[int]:
        return self.call("list_loras")

    def kv_store_lookup(self, block_hashes: list[bytes], lora_request: dict | None = None) -> int:
        """How many leading blocks of these chained block hashes the worker's disk KV tier holds."""
        return self.call("kv_store_lookup", block_hashes=list(block_hashes), lora_request=lora_request)

    def profile(self, is_start: bool = True) -> None:
        return self.call("profile", is_start=is_start)

    def shutdown(self) -> None:
        return self.call("shutdown")


def output_from_wire(d: dict) -> ModelRunnerOutput:
    def lists(x: dict | None) -> LogprobsLists | PromptLogprobs | None:
        if x is not None and "selected_token_ranks" in x:
            return PromptLogprobs(**x)
        return None if x is None else LogprobsLists(**x)

    return ModelRunnerOutput(
        req_ids=d["req_ids"], req_id_to_index=d["req_id_to_index"], sampled_token_ids=d["sampled_token_ids"],
        logprobs=lists(d.get("logprobs")),
        prompt_logprobs_dict={k: lists(v) for k, v in (d.get("prompt_logprobs_dict") or {}).items()},
        num_nans_in_logits=d.get("num_nans_in_logits"), pooler_output=d.get("pooler_output"),
        invalid_block_ids=(d.get("kv_connector_output") or {}).get("invalid_block_ids"),
    )
