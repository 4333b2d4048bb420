"""What the HTTP handlers of every role share: the engine handle, the model's identity, metrics,
and the drain flag."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmfleet.server.core.kv_wire import KVLayout
from llmfleet.server.engine.async_engine import AsyncEngine
from llmfleet.server.engine.engine import LLMEngine
from llmfleet.server.http.body_guard import DEFAULT_MAX_BODY_MB
from llmfleet.server.http.errors import APIError
from llmfleet.server.http.kv_store import KVExportStore
from llmfleet.server.http.prefill_peers import PrefillPeers
from llmfleet.server.http.server_metrics import ServerMetrics
from llmfleet.server.wire.auth import fleet_headers
from llmfleet.server.wire.keepalive import pooled

# Fetching a KV body from a prefill server: connecting is quick or the pod is gone; reading may
# take a while for a long prompt on a slow network.
KV_FETCH_TIMEOUT = httpx.Timeout(60.0, connect=5.0)
LARGE_PROMPT_SLOTS = 1


@dataclass
class ServerState:
    engine: AsyncEngine | None  # None for roles without a local engine (the router)
    tokenizer: object
    model_name: str  # in every answer and metric; requests may name it or one of model_aliases
    max_model_len: int
    metrics: ServerMetrics
    role: str = "colocated"
    draining: bool = False
    # Most tokens (prompt + output) one request can hold in the KV cache; caps the default max_tokens
    max_request_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # Disaggregation: the cache layout a KV transfer must match, the prefill role's held KV
    kv_layout: KVLayout | None = None
    kv_store: KVExportStore | None = None
    in_flight: int = 0  # API calls being answered (a drain waits for them)
    # A role's own readiness condition: why it cannot serve yet (the router: no decode server)
    not_ready: Callable[[], str | None] | None = None
    model_aliases: tuple[str, ...] = ()  # --served-model-name's other names, as vLLM serves them
    api_keys: tuple[str, ...] = ()  # --api-key: /v1 paths need one of them, this server's own calls the first
    kv_token: str | None = None  # LLMFLEET_KV_TRANSFER_TOKEN: what the transfer paths need (auth.py)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice: 'auto' is served
    reasoning_parser: str | None = None  # --reasoning-parser: chat replies carry the thinking apart
    # --structured-outputs-config.enable_in_reasoning: a grammar holds the thinking too (vLLM's flag)
    structured_outputs_in_reasoning: bool = False
    # --structured-outputs-config.disable_any_whitespace: JSON grammars allow no whitespace (vLLM's flag)
    structured_outputs_compact: bool = False
    # --generation-config: what a request that leaves a sampling field out gets (generation_defaults.py)
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # --max-request-body-mb: larger bodies get 413 before they are read further (body_guard.py)
    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
    # Prompts past prompt_work.LARGE_CHARS templated and tokenized at once (small ones never wait)
    large_prompts: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LARGE_PROMPT_SLOTS))
    # The decode role's prefill pool: the only servers it fetches KV from (prefill_peers.py)
    prefill_peers: PrefillPeers | None = None
    _http: Any = None

    def http_client(self) -> httpx.AsyncClient:
        """One pooled client per server for its calls to other servers (KV fetches)."""
        if self._http is None:
            headers = fleet_headers(self.api_key, self.kv_token)
            self._http = httpx.AsyncClient(timeout=KV_FETCH_TIMEOUT, limits=pooled(), headers=headers)
        return self._http

    @property
    def api_key(self) -> str | None:
        """The key this server's own calls to other servers carry (the fleet shares its keys)."""
        return self.api_keys[0] if self.api_keys else None

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def model_list(self, max_model_len: int | None) -> dict:
        """/v1/models: a card per served name, each of the one model (as vLLM lists them)."""
        return {"object": "list", "data": [self.model_card(name, max_model_len) for name in self.model_names]}

    def model_card(self, name: str, max_model_len: int | None) -> dict:
        """/v1/models/{name}: one served name's card; a 404 in the API's terms for any other name."""
        check_model(self, name)
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "llm-fleet",
            "root": self.model_name,
            "parent": None,
            "max_model_len": max_model_len,
        }

    def unavailable_reason(self) -> str | None:
        """Why this replica must not take new requests now (readiness fails), or None."""
        if self.draining:
            return "server is draining; retry on another replica"
        if self.engine is not None and not self.engine.alive:
            return "engine loop is not running"
        return self.not_ready() if self.not_ready is not None else None

    @classmethod
    def for_engine(cls, engine: LLMEngine, tokenizer, model_name: str, role: str = "colocated") -> ServerState:
        """Wire a built engine for serving: metrics observe every step and config change, and the
        engine loop starts in its own thread."""
        runner = engine.runner
        metrics = ServerMetrics(model_name, role, runner.max_model_len)

        def publish_config(e: LLMEngine) -> None:
            metrics.set_config(e.config, e.config_generation, runner)

        publish_config(engine)
        async_engine = AsyncEngine(engine, observers=[metrics.on_step])
        async_engine.config_observers.append(publish_config)
        async_engine.start()
        return cls(
            async_engine,
            tokenizer,
            model_name,
            runner.max_model_len,
            metrics,
            role=role,
            max_request_tokens=runner.num_kv_blocks * runner.kv_block_size,
            kv_layout=getattr(runner, "kv_layout", None),
        )


def check_serving(state: ServerState, model: str | None) -> None:
    reason = state.unavailable_reason()
    if reason is not None:
        raise APIError(503, reason, "unavailable")
    check_model(state, model)


# check_model's 404 as /v1/models/{name} documents it (a server's and a router's alike)
UNKNOWN_MODEL_RESPONSE: dict[int | str, dict] = {404: {"description": "No model is served under this name"}}


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        served = ", ".join(f"`{name}`" for name in state.model_names)
        raise APIError(404, f"The model `{model}` does not exist. Served: {served}.", "NotFoundError", "model")
