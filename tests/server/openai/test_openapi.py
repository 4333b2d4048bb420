"""The published OpenAPI document: one operation id per route, a server's and a router's."""

from __future__ import annotations

import warnings
from functools import partial

import httpx
from fastapi.testclient import TestClient

from llmfleet.server.http.app import build_app
from llmfleet.server.http.state import ServerState
from llmfleet.server.openai.app import create_app
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.proxy import Proxy, ProxySettings
from llmfleet.server.router.router_metrics import RouterMetrics
from llmfleet.server.router.routes import install
from llmfleet.server.wire.endpoints import StaticEndpoints


def _document_with_one_id_per_operation(app) -> dict:
    """The app's OpenAPI document, asserting no operation id repeats (FastAPI warns of one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = app.openapi()
    ids = [op["operationId"] for path in spec["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), ids
    return spec


def test_the_openapi_document_has_one_id_per_operation(state):
    """Clients generated from /openapi.json name methods by operation id: none may repeat."""
    spec = _document_with_one_id_per_operation(create_app(state))
    assert {"get", "post"} <= set(spec["paths"]["/ping"])


def _router_app():
    """A router's app in front of one (never called) server."""
    client = httpx.AsyncClient()
    balancer = Balancer(StaticEndpoints([], ["http://d1:8000"]), "round-robin", client)
    metrics = RouterMetrics("m")
    state = ServerState(None, None, "m", 0, metrics, role="router")
    proxy = Proxy(balancer, client, metrics, ProxySettings())
    return build_app(state, partial(install, proxy=proxy, balancer=balancer))


def test_the_routers_own_answers_replace_the_common_routes_in_its_document():
    """The router answers /v1/models and /load its own way: the common routes they shadow are
    gone, so its document lists each operation once, and the router's own /load answers."""
    app = _router_app()
    spec = _document_with_one_id_per_operation(app)
    assert "/load" in spec["paths"] and "/v1/models" in spec["paths"]
    assert TestClient(app).get("/load").json()["role"] == "router"


def test_the_router_documents_the_bodies_it_relays_as_the_servers_do(state):
    """The router reads its bodies raw, so its document takes their schemas from the servers'
    models. Built with pydantic's model_json_schema they differed from the servers' (a default
    of null on every optional field): schemathesis generated other requests through the router,
    five times as many of them valid, and generated clients saw two contracts for one API."""
    server = create_app(state).openapi()
    router = _router_app().openapi()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"):
        assert router["paths"][path]["post"]["requestBody"] == server["paths"][path]["post"]["requestBody"], path
    assert router["components"]["schemas"] == server["components"]["schemas"]
