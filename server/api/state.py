"""What the HTTP handlers of every role share: the engine handle, the model's identity, metrics,
and the drain flag."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.engine import LLMEngine
from .async_engine import AsyncEngine
from .metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine | None  # None for roles without a local engine (the router)
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    role: str = "colocated"
    draining: bool = False
    # Most tokens (prompt + output) one request can hold in the KV cache; caps the default max_tokens
    max_request_tokens: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def unavailable_reason(self) -> str | None:
        """Why this replica must not take new requests now (readiness fails), or None."""
        if self.draining:
            return "server is draining; retry on another replica"
        if self.engine is not None and not self.engine.alive:
            return "engine loop is not running"
        return None

    @classmethod
    def for_engine(cls, engine: LLMEngine, tokenizer, model_name: str, role: str = "colocated") -> ServerState:
        """Wire a built engine for serving: metrics observe every step and config change, and the
        engine loop starts in its own thread."""
        metrics = ServerMetrics(model_name, role)
        runner = engine.runner

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
        )
