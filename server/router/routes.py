"""The router's HTTP endpoints: the OpenAI generation endpoints (relayed to a colocated server, or
through a prefill and a decode server; ``/v1/responses`` as a chat completion), ``/tokenize`` and
``/detokenize`` as a server of the serving pool (colocated or decode) answers them, ``/v1/models``
as those servers describe the model, and ``/load`` with the router's view of every server and the
requests it holds."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse

from llmfleet.server.http.body_guard import done_with_body, parsed_body
from llmfleet.server.http.errors import APIError
from llmfleet.server.http.sse import SSE_HEADERS, ClosingStreamingResponse
from llmfleet.server.http.state import UNKNOWN_MODEL_RESPONSE, ServerState, check_model
from llmfleet.server.openai.protocol import (
    ERROR_RESPONSES,
    GENERATION_RESPONSES,
    TOKENIZE_RESPONSES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from llmfleet.server.openai.response_events import ResponseStream, chat_chunks, whole_response
from llmfleet.server.openai.responses import ResponsesRequest, error_body_in_responses_terms, install_stored_routes
from llmfleet.server.router.balancer import Balancer
from llmfleet.server.router.proxy import Proxy, json_request
from llmfleet.server.wire.client_gone import CLIENT_GONE, unless_client_gone

log = logging.getLogger(__name__)
# The servers' answers, and the router's own when no server behind it could answer
BAD_GATEWAY = {502: {"model": ErrorResponse, "description": "No server behind the router could answer"}}
RELAYED = {**ERROR_RESPONSES, **BAD_GATEWAY}
RELAYED_GENERATION = {**GENERATION_RESPONSES, **BAD_GATEWAY}


def install(app: FastAPI, state: ServerState, proxy: Proxy, balancer: Balancer) -> None:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await balancer.start()
        try:
            yield
        finally:
            await proxy.holding.stop()
            await balancer.stop()
            await proxy.client.aclose()

    app.router.lifespan_context = lifespan

    async def json_body(raw: Request) -> dict:
        reason = state.unavailable_reason()
        if reason is not None:
            raise APIError(503, reason, "unavailable")
        try:
            body = await parsed_body(raw)
        except ValueError as exc:
            raise APIError(400, f"invalid request: the body is not JSON ({exc})") from exc
        if not isinstance(body, dict):
            raise APIError(400, "invalid request: the body must be a JSON object")
        if isinstance(model := body.get("model"), str):  # another type is the server's 400 to give
            check_model(state, model)
        done_with_body(raw)  # the router reads nothing more of it: the next large body may come in
        return body

    async def relay(path: str, raw: Request):
        body = await json_body(raw)
        if request_id := raw.headers.get("X-Request-Id"):  # the decode server makes the answer's id of it
            body["request_id"] = request_id  # (vLLM's: the header first, else the body's)
        await in_the_servers_name(body)
        return await proxy.serve(path, body, raw)

    async def in_the_servers_name(body: dict) -> None:
        """A request naming one of the router's names that the servers do not serve goes to them
        under theirs (a router given its own --served-model-name)."""
        if isinstance(model := body.get("model"), str):
            await _describe_servers()
            if servers_names and model not in servers_names:
                body["model"] = servers_names[0]

    async def ask_a_server(path: str, raw: Request) -> JSONResponse:
        """One plain call answered by any server of the serving pool (they all hold the model's
        tokenizer)."""
        body = await json_body(raw)
        pool = balancer.serving_pool
        refused = await proxy.holding.wait(pool)
        if refused is not None:
            return refused
        await in_the_servers_name(body)
        server = balancer.pick(pool)
        if server is None:
            raise APIError(503, f"no {pool} server is ready", "unavailable")
        try:
            response = await proxy.client.post(f"{server.url}{path}", **json_request(body), timeout=10.0)
            return JSONResponse(response.json(), response.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            raise APIError(502, f"{pool} server {server.url} failed: {exc}", "bad_gateway") from exc

    @app.post("/v1/completions", responses=RELAYED_GENERATION)
    async def completions(raw: Request):
        """As a colocated server's: relayed to a colocated server, or through a prefill and a decode server."""
        return await relay("/v1/completions", raw)

    @app.post("/v1/chat/completions", responses=RELAYED_GENERATION)
    async def chat(raw: Request):
        return await relay("/v1/chat/completions", raw)

    @app.post("/v1/responses", responses=RELAYED_GENERATION)
    async def responses(raw: Request):
        """OpenAI's Responses API: relayed as a streamed chat completion, whose chunks become the
        Response or its events."""
        request = ResponsesRequest.parsed(await json_body(raw))
        body = request.chat_request()
        if request_id := raw.headers.get("X-Request-Id"):
            body["request_id"] = request_id
        await in_the_servers_name(body)
        answer = await proxy.serve("/v1/chat/completions", body, raw)
        if not isinstance(answer, StreamingResponse):  # refused, or the client left
            if (renamed := error_body_in_responses_terms(answer.body)) is not None:
                answer.body = renamed
                answer.headers["content-length"] = str(len(renamed))
            return answer
        relay = answer.body_iterator
        if request.stream:
            stream = ResponseStream(request, chat_chunks(relay), source=relay)
            return ClosingStreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        whole = await unless_client_gone(raw, whole_response(request, chat_chunks(relay), source=relay))
        if whole is None:
            await relay.aclose()  # type: ignore[attr-defined]
            return Response(status_code=CLIENT_GONE)
        return whole

    @app.post("/tokenize", responses={**RELAYED, **TOKENIZE_RESPONSES}, operation_id="tokenize")
    async def tokenize(raw: Request):
        return await ask_a_server("/tokenize", raw)

    @app.post("/detokenize", responses=RELAYED, operation_id="detokenize")
    async def detokenize(raw: Request):
        return await ask_a_server("/detokenize", raw)

    @app.get("/v1/models")
    async def models():
        await _describe_servers()
        return state.model_list(state.max_model_len or None)

    @app.get("/v1/models/{model:path}", responses=UNKNOWN_MODEL_RESPONSE)
    async def model(model: str):
        """One of the router's names, as a server answers it (app.py)."""
        await _describe_servers()
        return state.model_card(model, state.max_model_len or None)

    servers_names: list[str] = []  # what the servers call the model

    async def _describe_servers() -> None:
        """The model as the serving pool's servers serve it (they run every token): its context
        length, and its names, which the router's own (--served-model-name) may differ from; asked
        until one answers."""
        if servers_names:
            return
        server = balancer.any_server(
            balancer.serving_pool
        )  # not the policy's pick: that would take a turn of round-robin
        if server is None:
            return
        try:
            response = await proxy.client.get(f"{server.url}/v1/models", timeout=2.0)
            cards = response.json()["data"]
            state.max_model_len = int(cards[0]["max_model_len"])
            servers_names[:] = [str(card["id"]) for card in cards]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return
        if state.model_name not in servers_names:
            log.warning(
                "the servers serve %s, not %s: requests for the router's names are sent under %r",
                servers_names,
                state.model_name,
                servers_names[0],
            )

    @app.get("/load")
    async def load():
        """The router's own in-flight requests, those of them held for a pool with no server, the
        last cold start they waited through, and its view of every server."""
        return {
            "role": "router",
            "mode": balancer.mode,
            "server_load": state.in_flight,  # vLLM's name for it
            "in_flight": state.in_flight,
            "held": proxy.holding.held,
            "last_cold_start_s": proxy.holding.last_cold_start_s,
            "draining": state.draining,
            "servers": balancer.snapshot(),
        }

    install_stored_routes(app)
    _document_bodies(app)


# What the router relays, unparsed: the servers' request models, named in its OpenAPI document too
_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


def _document_bodies(app: FastAPI) -> None:
    """The router's routes read their bodies raw (the servers validate them), so FastAPI cannot
    see their models: its OpenAPI document gets them from the servers' models, written by
    FastAPI for routes that take them, as the servers' document writes them (pydantic's own
    model_json_schema differs in small ways, a default of null on every optional field, which
    leads generated clients and fuzzers to other requests than the servers' document does)."""
    plain, documented = app.openapi, []

    def openapi() -> dict:
        schema = plain()
        if not documented:
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(_body_schemas())
            for path, model in _BODIES.items():
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                content = {"application/json": {"schema": ref}}
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": content}
            documented.append(True)
        return schema

    app.openapi = openapi


def _body_schemas() -> dict:
    """The relayed request models' component schemas, from a document FastAPI writes for routes
    that take them as the servers' routes do (its own validation-error schemas left out)."""
    probe = FastAPI()
    for path, model in _BODIES.items():

        async def takes(body):  # never called: only its signature is read
            return None

        takes.__annotations__ = {"body": model}
        probe.post(path)(takes)
    schemas = get_openapi(title=probe.title, version=probe.version, routes=probe.routes)["components"]["schemas"]
    return {name: body for name, body in schemas.items() if name not in ("HTTPValidationError", "ValidationError")}
