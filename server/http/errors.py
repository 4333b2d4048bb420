"""OpenAI-style errors: every failure, including request validation, answers
``{"error": {"message", "type", "param", "code"}}`` with a 4xx/5xx status, never pydantic's shape."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.wire.errors import error_body

log = logging.getLogger(__name__)

# Statuses a client should retry after a pause: a full queue, a draining replica.
RETRYABLE = (429, 503)
RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    @classmethod
    def invalid(cls, exc: InvalidRequestError) -> APIError:
        """The 400 for a request the shared checks refused (core/validation.py)."""
        return cls(400, str(exc), param=exc.param)


def error_response(
    status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    headers = {**(headers or {}), **({"Retry-After": str(RETRY_AFTER_S)} if status in RETRYABLE else {})}
    return JSONResponse(error_body(message, type_, status, param), status, headers=headers or None)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per offending field; a union (e.g. ``prompt``) reports its field once."""
    by_field: dict[str, list[str]] = {}
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = loc[0] if loc else "body"
        if err.get("type") == "json_invalid":
            field = "body"
        msg = _clean(str(err.get("msg", "invalid value")))
        if err.get("type") == "extra_forbidden":  # a strict object (structured_outputs): name the key
            msg = f"unknown key {loc[-1]!r}"
        if msg not in by_field.setdefault(field, []):
            by_field[field].append(msg)
    parts = [f"{field}: {'; or '.join(msgs[:3])}" for field, msgs in by_field.items()]
    param = next((f for f in by_field if f != "body"), None)
    return "invalid request: " + " | ".join(parts), param


def invalid_request(exc: ValidationError) -> APIError:
    """A body validated by hand (not by FastAPI) refused as FastAPI's validation refuses one."""
    message, param = validation_message(RequestValidationError(exc.errors()))
    return APIError(400, message, param=param)


def _is_json(request: Request) -> bool:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _clean(msg: str) -> str:
    # pydantic phrasing that names our classes or its own machinery says nothing to a client
    msg = re.sub(r" or instance of \w+", "", msg)
    return msg.removeprefix("Value error, ")


def _allowed_methods(request: Request) -> str:
    """The methods of every route on the request's path: one route per method (``/ping``, a
    stored response's GET and DELETE) leaves Starlette naming only the first's."""
    methods = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(_: Request, exc: InvalidRequestError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        if not _is_json(request) and any(tuple(err.get("loc", ())) == ("body",) for err in exc.errors()):
            # FastAPI reads a body as JSON only under a JSON content type; vLLM's words
            message = "Unsupported Media Type: Only 'application/json' is allowed (send Content-Type: application/json)"
            return error_response(400, message, "invalid_request_error", None)
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: Allow names every method the path takes
            headers["Allow"] = _allowed_methods(request)
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no route: say which, and where they are listed
            path = request.url.path if len(request.url.path) <= 200 else request.url.path[:200] + "..."
            message = f"Not Found: {request.method} {path} is not served here (GET /openapi.json lists what is)"
        return error_response(exc.status_code, message, type_, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal error", "internal_error")
