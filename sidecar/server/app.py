"""The Starlette app: `POST /rpc/{method}`, probes, `/info`, `/metrics`; and `serve()` for uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import mlx.core as mx

from sidecar import PROTOCOL_VERSION, __version__
from sidecar.config import Config
from sidecar.errors import ProtocolError, SidecarError, Unavailable
from sidecar.protocol import JSON_TYPE, MSGPACK_TYPES, decode_body, encode_body
from sidecar.server.logs import configure_logging
from sidecar.server.metrics import Metrics
from sidecar.server.rpc import METHODS, MLXThread, bind_kwargs
from sidecar.worker import MLXWorker, State

log = logging.getLogger("sidecar.rpc")


class PayloadTooLarge(SidecarError):
    status = 413
    type = "payload_too_large"


class UnsupportedMediaType(SidecarError):
    status = 415
    type = "unsupported_media_type"


class Unauthorized(SidecarError):
    status = 401
    type = "unauthorized"


class UnknownMethod(SidecarError):
    status = 404
    type = "unknown_method"


@dataclass
class Sidecar:
    config: Config
    worker: MLXWorker
    metrics: Metrics
    token: str | None
    thread: MLXThread | None = None
    draining: bool = False
    preload_error: str | None = field(default=None)


def create_app(config: Config, *, worker: MLXWorker | None = None, registry: CollectorRegistry | None = None) -> Starlette:
    worker = worker or MLXWorker(config)
    sc = Sidecar(config, worker, Metrics(registry or CollectorRegistry(), lambda: sc.worker), config.token())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sc.thread = MLXThread(config.max_queue)
        if config.preload:
            sc.thread.submit(lambda: _preload(sc))
        try:
            yield
        finally:
            sc.draining = True
            await _drain(sc)

    async def rpc(request: Request) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        method = request.path_params["method"]
        t0 = time.perf_counter()
        in_type = _media_type(request.headers.get("content-type", ""))
        as_msgpack = _wants_msgpack(request.headers.get("accept", ""), in_type)
        label, status = (method if method in METHODS else "unknown"), 200
        headers: dict[str, str] = {}
        try:
            _authorize(sc, request)
            if method not in METHODS:
                raise UnknownMethod(f"unknown method {method!r}")
            if sc.draining:
                raise Unavailable("the worker is shutting down", retry_after=5)
            body = await _read_body(request, config.max_body_bytes)
            if body and in_type not in MSGPACK_TYPES and in_type != JSON_TYPE:
                raise UnsupportedMediaType(f"content type {in_type!r} is not msgpack or JSON")
            call = bind_kwargs(sc.worker, method, decode_body(body, in_type))
            assert sc.thread is not None
            result = await sc.thread.call(_with_step_metrics(sc, method, call), config.call_timeout)
            payload: Any = {"result": result}
        except SidecarError as e:
            status, payload = e.status, e.to_wire()
            if status >= 500:
                sc.metrics.observe_error(e.type)
            if e.retry_after:
                headers["retry-after"] = str(int(e.retry_after))
        except Exception as e:  # noqa: BLE001 - mapped to a 500 envelope; the worker rolled back
            status, payload = 500, {"error": {"type": "internal_error", "message": f"{type(e).__name__}: {e}", "field": None}}
            sc.metrics.observe_error("internal_error")
            log.exception("rpc %s failed", method, extra={"request_id": rid, "method": method})
        dt = time.perf_counter() - t0
        sc.metrics.observe_rpc(label, status, dt)
        log.log(logging.ERROR if status >= 500 and status != 503 else logging.INFO, "rpc", extra={
            "request_id": rid, "method": label, "status": status, "duration_ms": round(dt * 1e3, 3)})
        headers["x-request-id"] = rid
        return Response(encode_body(payload, as_msgpack), status_code=status, headers=headers,
                        media_type=MSGPACK_TYPES[0] if as_msgpack else JSON_TYPE)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        w = sc.worker
        ready = w.state in (State.CACHE_READY, State.READY) and w.healthy and not sc.draining
        body = {"ready": ready, "state": w.state.value, "healthy": w.healthy, "draining": sc.draining}
        if sc.preload_error:
            body["preload_error"] = sc.preload_error
        return JSONResponse(body, status_code=200 if ready else 503)

    async def info(request: Request) -> Response:
        if config.protect_metrics:
            _authorize(sc, request)
        w = sc.worker
        runner = w.runner
        return JSONResponse({
            "version": __version__, "protocol_version": PROTOCOL_VERSION, "state": w.state.value,
            "model": w.config.model, "model_path": str(w.model_path) if w.model_path else None,
            "device": w.device, "mlx_version": mx.__version__,
            "kv_cache_spec": {f"model.layers.{i}.self_attn": s.to_wire() for i, s in enumerate(runner.specs)} if runner else None,
            "num_blocks": runner.num_blocks if runner else 0,
            "block_size": w.config.block_size,
            "max_model_len": runner.max_model_len if runner else None,
            "vocab_size": runner.vocab_size if runner else None,
        })

    async def metrics(request: Request) -> Response:
        if config.protect_metrics:
            _authorize(sc, request)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(sc.metrics.registry), media_type=content_type)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        if request.url.path.startswith("/rpc/"):
            sc.metrics.observe_rpc("unknown", exc.status_code, 0.0)
        return JSONResponse({"error": {"type": kind, "message": exc.detail, "field": None}}, status_code=exc.status_code,
                            headers=exc.headers)

    async def auth_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SidecarError)
        return JSONResponse(exc.to_wire(), status_code=exc.status)

    app = Starlette(
        routes=[
            Route("/rpc/{method}", rpc, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, SidecarError: auth_error},
    )
    app.state.sidecar = sc
    return app


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


def _wants_msgpack(accept: str, in_type: str) -> bool:
    accept = accept.lower()
    if any(t in accept for t in MSGPACK_TYPES):
        return True
    if JSON_TYPE in accept:
        return False
    return in_type in MSGPACK_TYPES


def _authorize(sc: Sidecar, request: Request) -> None:
    if sc.token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    # Constant-time comparison; the same terse answer for a missing and a wrong token.
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), sc.token.encode()):
        raise Unauthorized("missing or invalid bearer token")


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"body of {length} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _with_step_metrics(sc: Sidecar, method: str, call: Any) -> Any:
    if method != "execute_model":
        return call

    def run() -> Any:
        result = call()
        runner = sc.worker.runner
        if runner is not None and runner.last_stats.num_rows:
            sc.metrics.observe_step(runner.last_stats)
        return result

    return run


def _preload(sc: Sidecar) -> None:
    try:
        preload(sc.worker)
    except Exception as e:  # noqa: BLE001 - reported by /readyz; the scheduler may still drive the lifecycle
        sc.preload_error = f"{type(e).__name__}: {e}"
        logging.getLogger("sidecar").exception("preload failed")


def preload(worker: MLXWorker) -> None:
    """Drive the lifecycle to `ready` with a pool sized for max_num_seqs full-length requests."""
    cfg = worker.config
    worker.init_device()
    worker.load_model()
    free = worker.determine_available_memory()
    per_block = worker.get_cache_block_size_bytes()
    assert worker.runner is not None
    want = -(-worker.runner.max_model_len // cfg.block_size) * cfg.max_num_seqs
    worker.initialize_cache(max(1, min(free // per_block, want)), 0)
    worker.compile_or_warm_up_model()
    worker.check_health()


async def _drain(sc: Sidecar) -> None:
    """Let the in-flight call finish, free MLX memory on its own thread, stop the thread."""
    thread = sc.thread
    if thread is None:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(thread.call(sc.worker.shutdown, sc.config.shutdown_timeout), sc.config.shutdown_timeout)
    await asyncio.get_running_loop().run_in_executor(None, thread.stop, sc.config.shutdown_timeout)


def serve(config: Config) -> int:
    import uvicorn

    configure_logging(config.log_level, config.log_format)
    if config.auth_token is None and config.auth_token_file is None and not config.uds and not config.allow_insecure:
        if not _is_loopback(config.host):
            logging.getLogger("sidecar").error(
                "refusing to bind %s without an auth token (--auth-token-file or MLX_SIDECAR_AUTH_TOKEN); "
                "pass --allow-insecure to override", config.host)
            return 2
    app = create_app(config)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                        timeout_graceful_shutdown=int(config.shutdown_timeout), lifespan="on", log_config=None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.sidecar.draining = True  # new RPCs get 503 while the in-flight step finishes
            super().handle_exit(sig, frame)

    server = Server(uv)
    sockets = None
    if config.uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: only the owner may connect
        try:
            sock.bind(config.uds)
        finally:
            os.umask(old)
        sockets = [sock]
    server.run(sockets=sockets)
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
