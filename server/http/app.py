"""The HTTP app of every role: the endpoints all of them serve (health, readiness, version, metrics,
models, load) plus the role's own routes, OpenAI-style errors and an in-flight request gauge.

A role hands its routes in as an installer ``(app, state) -> None``, installed before the common
routes so that it can answer one of them its own way (the router's ``/v1/models`` and ``/load``).
Engine-backed roles get theirs from :mod:`llmfleet.server.openai.app`; the router's are in
:mod:`llmfleet.server.router.routes`.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from llmfleet import __version__
from llmfleet.server.http.auth import APIKeyMiddleware
from llmfleet.server.http.body_guard import BodyGuardMiddleware, GuardedRoute
from llmfleet.server.http.errors import error_response, install_error_handlers
from llmfleet.server.http.state import ServerState
from llmfleet.server.wire.errors import error_body

RouteInstaller = Callable[[FastAPI, ServerState], None]


def build_app(state: ServerState, install_role: RouteInstaller) -> FastAPI:
    """The app serving ``state``'s role: ``install_role`` adds the role's own routes."""
    app = FastAPI(title="llm-fleet", version=__version__, description=f"OpenAI-compatible LLM serving ({state.role})")
    app.state.server = state
    app.router.route_class = GuardedRoute  # before any route: each reads the body the guard parsed
    install_error_handlers(app)
    app.add_middleware(InFlightMiddleware, state=state)
    app.add_middleware(BodyGuardMiddleware, max_bytes=state.max_body_bytes)  # inside the key check
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)  # outermost: before anything counts it
    _document_400_not_422(app)  # first: a role may document more on top of it (the router's bodies)
    install_role(app, state)
    _install_common_routes(app, state)
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
        """Cheap load report for routers: queue depth, running requests and KV usage."""
        if state.engine is None:
            return {"waiting": 0, "running": 0, "kv_usage": 0.0, "role": state.role, "draining": state.draining}
        s = state.engine.stats
        return {
            "waiting": s.num_waiting,
            "running": s.num_running,
            "kv_usage": s.kv_usage,
            "role": state.role,
            "draining": state.draining,
        }

    @app.get("/v1/models")
    async def models():
        return state.model_list(state.max_model_len)


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
