"""The app of an engine-backed server: the OpenAI endpoints over a local engine, and for the
prefill role the KV it computed, handed out to decode servers."""

from __future__ import annotations

from fastapi import FastAPI

from llmfleet.server.http.app import build_app
from llmfleet.server.http.state import ServerState
from llmfleet.server.openai import kv_transfer, routes
from llmfleet.server.openai.responses import install_stored_routes

ENGINE_ROLES = ("colocated", "prefill", "decode")


def create_app(state: ServerState) -> FastAPI:
    if state.role not in ENGINE_ROLES:
        raise ValueError(f"role {state.role!r} serves no local engine; engine roles: {', '.join(ENGINE_ROLES)}")
    return build_app(state, _install_routes)


def _install_routes(app: FastAPI, state: ServerState) -> None:
    routes.install(app, state)
    if state.role == "prefill":
        kv_transfer.install_prefill_routes(app, state)
    install_stored_routes(app)
