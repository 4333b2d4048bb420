"""Server test doubles: a one-character-per-token tokenizer and a paced fake runner (the engine
core's hash runner), so API behaviour can be tested in-process in milliseconds; and the real
builtin:tiny engine behind the same ServerState for tests that need a real model."""

from __future__ import annotations

import time

from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.engine import LLMEngine
from llmfleet.server.http.state import ServerState
from tests.server.core.fakes import FakeRunner

VOCAB = 95  # printable ASCII, one character per token


class CharTokenizer:
    """Token t <-> chr(32 + t). Enough of the HF tokenizer API for the server."""

    eos_token_id = None

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(max(ord(c) - 32, 0), VOCAB - 1) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + t) for t in ids)

    def apply_chat_template(
        self,
        messages,
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools=None,
        **variables,
    ) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        text = "".join(f"<tool {t['function']['name']}>" for t in tools or [])
        text += "".join(f"<{name}={value}>" for name, value in sorted(variables.items()))
        text += "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")  # the last message is left open


class PacedRunner(FakeRunner):
    """The hash runner, taking ``step_seconds`` per step like a real forward pass would."""

    def __init__(self, step_seconds: float = 0.0, **kwargs) -> None:
        super().__init__(vocab=VOCAB, **kwargs)
        self.step_seconds = step_seconds

    def execute(self, output):
        if self.step_seconds:
            time.sleep(self.step_seconds)
        return super().execute(output)


def fake_state(config: EngineConfig | None = None, step_seconds: float = 0.0, **runner_kwargs) -> ServerState:
    config = config or EngineConfig()
    runner_kwargs.setdefault("max_model_len", 256)
    runner = PacedRunner(step_seconds, **runner_kwargs)
    tokenizer = CharTokenizer()
    return ServerState.for_engine(LLMEngine(config, runner, detokenizer=tokenizer), tokenizer, "fake")


def real_tiny_state(config: EngineConfig, name: str = "tiny") -> ServerState:
    from llmfleet.server.engine.build import build_engine

    engine, tokenizer = build_engine("builtin:tiny", config)
    return ServerState.for_engine(engine, tokenizer, name)
