"""The Starlette app: `POST /rpc/{method}`, probes, `/info`, `/metrics`; and `serve()` for uvicorn.

Every RPC, rejected ones included, is counted in `rpc_requests_total{method,code}`, logged as one
line with a request id (echoed in `X-Request-Id`) and answered with the error envelope of §4.
`/metrics`, `/healthz`, `/readyz` and `/info` never wait on the MLX thread: they read what it
publishes (see metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, AsyncIterator

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import mlx.core as mx

from sidecar import PROTOCOL_VERSION, __version__
from sidecar.config import Config
from sidecar.errors import (MethodNotAllowed, SidecarError, StartupError, Unavailable,
                            UnknownMethod, UnsupportedMediaType)
from sidecar.wire.codec import JSON_TYPE, MSGPACK_TYPES, decode_body
from sidecar.server import kv_store
from sidecar.server.httpio import encode_reply
from sidecar.server.httpio import media_type as _media_type
from sidecar.server.httpio import BodyBudget
from sidecar.server.httpio import read_body as _read_body
from sidecar.server.httpio import request_id as _request_id
from sidecar.server.httpio import wants_msgpack as _wants_msgpack
from sidecar.server.connguard import fd_room, http_protocol
from sidecar.server.rpcroute import SidecarApp
from sidecar.server.instance import EXPECT_HEADER, InstanceHeader
from sidecar.server.auth import authorize, bind_unix_socket, check_bind, load_token
from sidecar.server.logs import add_secret, configure_logging
from sidecar.server.metrics import Metrics
from sidecar.server.rpc import METHODS, MLXThread, bind_kwargs
from sidecar.server.startup import preload, progress_reporter
from sidecar.server.shutdown import drain, exit_when_idle
from sidecar.server.state import Sidecar
from sidecar.worker.mlx_worker import MLXWorker, State

log = logging.getLogger("sidecar.rpc")
slog = logging.getLogger("sidecar.server")

# Bodies above this are decoded off the event loop, so a big prompt never stalls the probes.
_DECODE_OFF_LOOP_BYTES = 256 * 1024


def create_app(config: Config, *, worker: MLXWorker | None = None, registry: CollectorRegistry | None = None,
               token: str | None = None) -> Starlette:
    """The app. `token` overrides the one from `config` (serve() reads and checks it once)."""
    worker = worker or MLXWorker(config)
    metrics_ = Metrics(registry or CollectorRegistry(), lambda: sc.worker)
    sc = Sidecar(config, worker, metrics_, token if token is not None else load_token(config))
    if hasattr(worker, "metrics_collector"):  # scale-out: per-rank gauges (sidecar/distributed)
        metrics_.registry.register(worker.metrics_collector())
    metrics_.instance = sc.instance
    sc.publish()  # before the MLX thread exists, this thread owns the worker

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sc.loop = asyncio.get_running_loop()
        sc.thread = MLXThread(config.max_queue, after_job=sc.publish, after_reply=sc.after_reply)
        metrics_.thread = sc.thread
        if hasattr(worker, "attach_thread"):  # scale-out: a lost rank answers the call stuck on it
            worker.attach_thread(sc.thread)
        if config.preload:
            sc.startup.stage = "initialising the device"  # before the socket is bound: no RPC can race the preload
            sc.startup.report = progress_reporter()
            sc.thread.submit(lambda: _preload(sc))
        try:
            yield
        finally:
            sc.begin_drain()
            await drain(sc)

    bodies = BodyBudget(4 * config.max_body_bytes)

    @bodies.holding  # `held`: the body bytes this call took from `bodies`, given back once it is answered
    async def rpc_reply(request: Any, held: list[int]) -> tuple[int, dict[str, str], bytes, str]:
        """(status, headers, body, media type) for a server/rpcroute.py request."""
        t0 = time.perf_counter()
        rid = _request_id(request.headers.get("x-request-id"))
        method = request.path_params["method"]
        label = method if method in METHODS else "unknown"
        in_type = _media_type(request.headers.get("content-type", ""))
        as_msgpack = _wants_msgpack(request.headers.get("accept", ""), in_type)
        status, error_type = 200, None
        headers = {"x-request-id": rid}
        try:
            authorize(sc.token, request)
            sc.instance.check(request.headers.get(EXPECT_HEADER))
            if label == "unknown":
                raise UnknownMethod(f"unknown method {method[:64]!r}")
            if request.method != "POST":
                headers["allow"] = "POST"
                raise MethodNotAllowed(f"{request.method} is not allowed; RPCs are POST /rpc/{method}")
            if sc.draining or sc.thread is None:
                raise Unavailable("the worker is shutting down", retry_after=5)
            if getattr(sc.worker, "unavailable", None):  # scale-out: a lost rank; do not queue behind a stuck collective
                raise Unavailable(sc.worker.unavailable, retry_after=5)  # type: ignore[attr-defined]
            if (stage := sc.startup.stage) is not None:
                raise Unavailable(f"starting: {stage} (serve --preload is bringing the worker up; "
                                  "wait for /readyz)", retry_after=2)
            if in_type and in_type not in MSGPACK_TYPES and in_type != JSON_TYPE:
                raise UnsupportedMediaType(f"content type {in_type[:64]!r} is not msgpack or JSON")
            body = await _read_body(request, config.max_body_bytes, bodies, held)
            if body and not in_type:
                raise UnsupportedMediaType("a body needs Content-Type application/msgpack or application/json")
            if len(body) > _DECODE_OFF_LOOP_BYTES:
                kwargs = await asyncio.to_thread(decode_body, body, in_type)
            else:
                kwargs = decode_body(body, in_type)
            step_id = kwargs.get("step_id") if method == "execute_model" else None
            call = bind_kwargs(sc.worker, method, kwargs, sc.steps, body)
            timing: list[float] = []
            if step_id is not None:
                await sc.sequencer.turn(step_id)
                sc.sequencer.handed(step_id)  # no await until the call is queued: the order holds
            result = await sc.thread.call(_on_mlx_thread(sc, method, call, timing), config.call_timeout)
            payload: Any = {"result": result}
            # The time the call spent on the MLX thread, so clients can see the transport's share.
            headers["server-timing"] = f"exec;dur={timing[0] * 1e3:.3f}"
        except SidecarError as e:
            status, error_type, payload = e.status, e.type, e.to_wire()
            if e.retry_after:
                headers["retry-after"] = str(max(1, int(e.retry_after)))
            if status == 401:
                headers["www-authenticate"] = "Bearer"
        except asyncio.CancelledError:
            if not sc.draining:
                raise
            # The shutdown timeout ran out while this call was running: answer instead of letting
            # the server send a bare 500. The worker's state does not survive the exit anyway.
            sc.cut_off(rid)
            status, error_type = 503, "unavailable"
            payload = Unavailable("the worker shut down before the call finished (shutdown timeout); "
                                  "its outcome is unknown", retry_after=5).to_wire()
            headers["retry-after"] = "5"
        except Exception as e:  # noqa: BLE001 - mapped to a 500 envelope; the worker rolled back
            status, error_type = 500, "internal_error"
            payload = {"error": {"type": error_type, "message": f"{type(e).__name__}: {e}", "field": None}}
            log.exception("rpc %s failed", label, extra={"request_id": rid, "method": label})
        content, failed = encode_reply(payload, as_msgpack)
        if failed:  # never a bare 500 from uvicorn: still the envelope
            status, error_type = 500, "internal_error"
            log.error("rpc %s: the reply could not be encoded", label, exc_info=failed,
                      extra={"request_id": rid, "method": label})
        dt = time.perf_counter() - t0
        sc.metrics.observe_rpc(label, status, dt)
        if error_type is not None:
            sc.metrics.observe_error(error_type)
        level = logging.ERROR if status == 500 else logging.WARNING if status >= 500 else logging.INFO
        if log.isEnabledFor(level):
            extra = {"request_id": rid, "method": label, "status": status, "duration_ms": round(dt * 1e3, 3)}
            if error_type is not None:
                extra["error"] = error_type
            log.log(level, "rpc", extra=extra)
        return status, headers, content, MSGPACK_TYPES[0] if as_msgpack else JSON_TYPE

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        w = sc.worker
        state = w.state
        ready = state in (State.CACHE_READY, State.READY) and w.healthy and not sc.draining and sc.startup.stage is None
        body = {"ready": ready, "state": state.value, "healthy": w.healthy, "draining": sc.draining,
                "instance_id": sc.instance.id}
        if sc.preload_error:
            body["preload_error"] = sc.preload_error
        if sc.startup.stage is not None:
            body["starting"] = sc.startup.stage
        if hasattr(w, "group_status"):  # scale-out: which rank is lost
            body["group"] = w.group_status()
        return JSONResponse(body, status_code=200 if ready else 503)

    async def info(request: Request) -> Response:
        if config.protect_metrics:
            authorize(sc.token, request)
        snap, thread = sc.metrics.snapshot, sc.thread
        return JSONResponse({
            "version": __version__, "protocol_version": PROTOCOL_VERSION, "state": sc.worker.state.value,
            "model": snap.model, "model_path": snap.model_path, "device": snap.device, "mlx_version": mx.__version__,
            "kv_cache_spec": snap.kv_cache_spec, "num_blocks": snap.num_blocks, "block_size": snap.block_size,
            "max_model_len": snap.max_model_len, "vocab_size": snap.vocab_size,
            "busy": bool(thread and thread.busy), "queue_depth": thread.depth() if thread else 0,
            "mlx_thread_idle_seconds": thread.idle_seconds if thread else 0.0,
            "decode_ahead": _ahead_counts(sc.worker),
            "device_idle": None,  # kept for protocol-2 clients: no longer measured (docs/protocol.md)
            "draining": sc.draining, "instance_id": sc.instance.id, "started_at": sc.instance.started_at,
            "starting": sc.startup.stage,
            "speculative_method": sc.worker.config.spec_method,  # drafts from take_draft_token_ids unless "none"
            "kv_store": kv_store.info(snap.kv_tier),
        })

    async def metrics(request: Request) -> Response:
        if config.protect_metrics:
            authorize(sc.token, request)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(sc.metrics.registry), media_type=content_type)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse({"error": {"type": kind, "message": exc.detail, "field": None}}, status_code=exc.status_code,
                            headers=exc.headers)

    async def sidecar_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SidecarError)
        headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
        return JSONResponse(exc.to_wire(), status_code=exc.status, headers=headers)

    # Every verb and every name under /rpc/ reaches rpc_reply (server/rpcroute.py), so 404s and
    # 405s are counted, logged and answered like any other RPC.
    app = SidecarApp(
        rpc_reply, sc.instance,
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/info", info, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error, SidecarError: sidecar_error},
        middleware=[Middleware(InstanceHeader, instance=sc.instance)],
    )
    app.state.sidecar = sc
    return app


def _ahead_counts(worker: Any) -> dict[str, int] | None:
    runner = getattr(worker, "runner", None)
    if runner is None or not hasattr(runner, "ahead_hits"):
        return None
    return {"hits": runner.ahead_hits, "misses": runner.ahead_misses}


def _on_mlx_thread(sc: Sidecar, method: str, call: Any, timing: list[float]) -> Any:
    """The call as run on the MLX thread: timed, and steps recorded in the step metrics."""

    def run() -> Any:
        t0 = time.perf_counter()
        before = sc.worker.runner.last_stats if sc.worker.runner is not None else None
        try:
            result = call()
        finally:
            timing.append(time.perf_counter() - t0)
        runner = sc.worker.runner
        # (a resend answered from the step ledger ran nothing: its stats are the previous step's)
        if (method in ("execute_model", "sample_tokens") and runner is not None and runner.last_stats.num_rows
                and runner.last_stats is not before):
            sc.metrics.observe_step(runner.last_stats)
        return result

    return run


def _preload(sc: Sidecar) -> None:
    try:
        preload(sc.worker, after_each=sc.publish, startup=sc.startup)
    except Exception as e:  # noqa: BLE001 - reported by /readyz; the scheduler may still drive the lifecycle
        sc.preload_error = f"{type(e).__name__}: {e}"
        sc.metrics.observe_error("preload")
        slog.exception("preload failed")


def serve(config: Config, worker: MLXWorker | None = None) -> int:
    """Run until SIGTERM/SIGINT. Exit status: 0 after a clean shutdown, 1 when the shutdown
    timeout ran out (or a second SIGINT forced it), 2 for a configuration refused at start-up."""
    import uvicorn

    try:
        configure_logging(config.log_level, config.log_format)
    except ValueError as e:
        print(f"mlx-sidecar: {e}", file=sys.stderr)
        return 2
    try:
        token = load_token(config)
        check_bind(config, token)
        sock = bind_unix_socket(config.uds) if config.uds else None
    except StartupError as e:
        slog.error("%s", e)
        return 2
    if token is not None:
        add_secret(token)
    app = create_app(config, token=token, worker=worker)
    sc: Sidecar = app.state.sidecar
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                        timeout_graceful_shutdown=max(0.1, config.shutdown_timeout),  # type: ignore[arg-type]
                        lifespan="on", log_config=None, timeout_keep_alive=config.idle_timeout,  # type: ignore[arg-type]
                        http=http_protocol(config.read_timeout, fd_room(config.max_connections)))

    class Server(uvicorn.Server):
        exit_requested = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not uvicorn's: it re-raises the signal after shutdown, so the process would die of
            # SIGTERM (or KeyboardInterrupt) instead of exiting 0 once drained.
            sc.begin_drain()  # new RPCs get 503 while the in-flight step finishes
            if self.exit_requested and sig == signal.SIGINT:
                self.force_exit = self.should_exit = True  # a second Ctrl-C: stop waiting
            if not self.exit_requested and sc.loop is not None:
                # The listener stays open (new connections get 503) until the running call is done.
                with contextlib.suppress(RuntimeError):
                    sc.loop.call_soon_threadsafe(lambda: sc.loop and sc.loop.create_task(exit_when_idle(sc, self)))
            else:
                self.should_exit = True  # (no logging here: a signal handler must not take the handler lock)
            self.exit_requested = True

    server = Server(uv)
    if sock is not None:
        slog.info("serving on unix socket %s", config.uds)
    else:
        slog.info("serving on http://%s:%d", config.host, config.port)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        if config.uds:
            with contextlib.suppress(OSError):
                os.unlink(config.uds)
    if not server.started:
        return 1
    mx.clear_streams()  # this thread's, if any (the MLX thread clears its own when it ends)
    if server.force_exit or not sc.clean_shutdown:
        # The MLX thread may still be inside a computation: do not run interpreter finalisation
        # (and MLX's static destructors) under it.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)
    return 0


