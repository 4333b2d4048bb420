"""The HTTP app of every role: the endpoints all of them serve (health, readiness, version, metrics,
models, load) plus the role's own routes, OpenAI-style errors, an in-flight request gauge and
vLLM's HTTP metrics.

A role hands its routes in as an installer ``(app, state) -> None``, installed before the common
routes so that it can answer one of them its own way (the router's ``/v1/models`` and ``/load``).
Engine-backed roles get theirs from :mod:`llmfleet.server.openai.app`; the router's are in
:mod:`llmfleet.server.router.routes`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator, metrics
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmfleet import __version__
from llmfleet.server.http.auth import APIKeyMiddleware
from llmfleet.server.http.body_guard import BodyGuardMiddleware, GuardedRoute
from llmfleet.server.http.errors import error_response, install_error_handlers
from llmfleet.server.http.state import UNKNOWN_MODEL_RESPONSE, ServerState
from llmfleet.server.wire.errors import error_body

RouteInstaller = Callable[[FastAPI, ServerState], None]

# Left out of the HTTP metrics, as vLLM leaves its scrapes and probes out (its list, plus /ready)
NOT_INSTRUMENTED = ("/metrics", "/health", "/ready", "/load", "/ping", "/version")
# The HTTP metrics' method label: one of these (RFC 9110's and PATCH), else "other"
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def build_app(state: ServerState, install_role: RouteInstaller) -> FastAPI:
    """The app serving ``state``'s role: ``install_role`` adds the role's own routes."""
    app = FastAPI(title="llm-fleet", version=__version__, description=f"OpenAI-compatible LLM serving ({state.role})")
    app.state.server = state
    app.router.route_class = GuardedRoute  # before any route: each reads the body the guard parsed
    install_error_handlers(app)
    app.add_middleware(InFlightMiddleware, state=state)
    app.add_middleware(BodyGuardMiddleware, max_bytes=state.max_body_bytes)  # inside the key check
    instrument_http(app, state.metrics.registry)  # inside the key check too, as vLLM's: a 401 is not counted
    if state.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=state.api_keys)  # outermost: before anything counts it
    _document_400_not_422(app)  # first: a role may document more on top of it (the router's bodies)
    install_role(app, state)
    _install_common_routes(app, state)
    _drop_shadowed_routes(app)
    return app


def _drop_shadowed_routes(app: FastAPI) -> None:
    """Routes match in order, so a common route the role answers its own way is never reached:
    it leaves the app, and the OpenAPI document lists each operation once (a repeated operation
    id breaks clients generated from it)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    kept = []
    for route in app.router.routes:
        key = (getattr(route, "path", ""), frozenset(getattr(route, "methods", None) or ()))
        if isinstance(route, APIRoute) and key in seen:
            continue
        seen.add(key)
        kept.append(route)
    app.router.routes[:] = kept


def instrument_http(app: FastAPI, registry: CollectorRegistry) -> None:
    """vLLM's HTTP metrics, from the library vLLM takes them from (prometheus-fastapi-instrumentator,
    with vLLM's settings): ``http_requests_total{handler,method,status}`` (status grouped: ``2xx``),
    ``http_request_duration_seconds{handler,method}``, ``http_request_duration_highr_seconds``,
    ``http_request_size_bytes{handler}`` and ``http_response_size_bytes{handler}``.

    ``handler`` is the route's template (``/v1/responses/{response_id}``), and ``none`` for every
    path no route matches; ``method`` is ``other`` for any but the standard ones (vLLM passes any
    through): made-up paths and methods cannot add series. The middleware is plain ASGI: a
    stream's chunks pass through as they come, and its duration runs to its last byte (vLLM's)."""
    record = metrics.default(registry=registry)  # the library's own (vLLM's) metrics, as it makes them
    if record is None:  # they are in this registry already: a second app on one ServerState (tests)
        return

    def known_method(info: metrics.Info) -> None:
        if info.method not in HTTP_METHODS:
            info.method = "other"
        record(info)

    excluded = [f"^{path}$" for path in NOT_INSTRUMENTED]
    Instrumentator(excluded_handlers=excluded, registry=registry).add(known_method).instrument(app)


def add_cors(app: FastAPI, origins: list[str], methods: list[str], headers: list[str], credentials: bool) -> None:
    """vLLM's ``--allowed-origins`` (with ``--allowed-methods``, ``--allowed-headers`` and
    ``--allow-credentials``), added to a built app: outermost, so that a browser's preflight is
    answered before the key check, and a 401 carries the CORS headers too."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=methods,
        allow_headers=headers,
        allow_credentials=credentials,
    )


class RequestIdHeaders:
    """vLLM's ``--enable-request-id-headers``: every answer carries ``X-Request-Id``, the request's
    own, else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_vllm_http_flags(app: FastAPI, args) -> FastAPI:
    """vLLM's HTTP flags on the built app: CORS with ``--allowed-origins``, ``--root-path`` (as
    vLLM sets it, on the app) and ``--enable-request-id-headers``."""
    if getattr(args, "allowed_origins", None):
        add_cors(app, args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials)
    if getattr(args, "root_path", None):
        app.root_path = args.root_path
    if getattr(args, "enable_request_id_headers", False):
        app.add_middleware(RequestIdHeaders)
    return app


def _install_common_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        """Liveness: the process and its engine loop run (draining is still live)."""
        if state.engine is not None and not state.engine.alive:
            return error_response(503, "engine loop is not running", "internal_error")
        return {"status": "ok"}

    for method in ("GET", "POST"):  # vLLM's (SageMaker's) name for it; one route each, one operation id
        app.add_api_route("/ping", health, methods=[method], name=f"ping_{method.lower()}")

    @app.get("/ready")
    async def ready():
        """Readiness: the model is loaded and the server is not draining."""
        reason = state.unavailable_reason()
        if reason is not None:
            return JSONResponse(error_body(reason, "unavailable", 503), 503)
        return {"status": "ready", "role": state.role}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        if state.engine is not None:
            state.metrics.set_load(state.engine.stats)  # fresh gauges even while the engine idles
        if state.kv_store is not None:
            state.kv_store.expire()
            state.metrics.set_kv_held(state.kv_store.held_bytes)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load():
        """Cheap load report for routers: vLLM's ``server_load`` (the API calls in flight, as its
        --enable-server-load-tracking counts them: from arrival to a stream's end), queue depth,
        running requests and KV usage."""
        if state.engine is None:
            idle = {"waiting": 0, "running": 0, "kv_usage": 0.0}
            return {"server_load": state.in_flight, **idle, "role": state.role, "draining": state.draining}
        s = state.engine.stats
        return {
            "server_load": state.in_flight,
            "waiting": s.num_waiting,
            "running": s.num_running,
            "kv_usage": s.kv_usage,
            "role": state.role,
            "draining": state.draining,
        }

    @app.get("/v1/models")
    async def models():
        return state.model_list(state.max_model_len)

    @app.get("/v1/models/{model:path}", responses=UNKNOWN_MODEL_RESPONSE)
    async def model(model: str):
        """OpenAI's retrieve-model call (``client.models.retrieve``), which vLLM does not serve; a
        name may hold slashes (``meta-llama/Llama-3.2-1B``)."""
        return state.model_card(model, state.max_model_len)


class InFlightMiddleware:
    """``llmfleet_requests_in_flight``: API calls from arrival until their last byte (a stream
    counts until it ends), so a scale-down can pick the replica with the least work."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.gauge = state.metrics.lab(state.metrics.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/") or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        self.state.in_flight += 1
        self.gauge.set(self.state.in_flight)
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1
            self.gauge.set(self.state.in_flight)


def _document_400_not_422(app: FastAPI) -> None:
    """Validation errors answer 400 (OpenAI style), so the schema must not promise 422."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
