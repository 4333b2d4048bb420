"""Build an engine for a model name: a built-in (made on first use) or a local HF directory."""

from __future__ import annotations

from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.engine import LLMEngine
from llmfleet.server.runner.builtin_models import resolve_model

# What loading a model fails with for the user's input, to report in one line: a path that is no
# model (OSError), limits beyond the model's or an unknown device (ValueError, RuntimeError), a
# device this torch was not built for (AssertionError: "Torch not compiled with CUDA enabled").
LOAD_ERRORS = (OSError, ValueError, RuntimeError, AssertionError)


def build_engine(model: str, config: EngineConfig, device: str | None = None, distributed: dict | None = None):
    """Returns ``(engine, tokenizer)``; the torch runner loads the weights with from_pretrained, in
    this process, or over tensor x pipeline worker processes (``distributed``: where they meet,
    ParallelRunner's keywords)."""
    from transformers import AutoTokenizer

    from llmfleet.server.runner.torch_runner import TorchModelRunner

    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from llmfleet.server.parallel.runner import ParallelRunner

        runner = ParallelRunner(path, config, device=device, tokenizer=tokenizer, **(distributed or {}))
    else:
        runner = TorchModelRunner(path, config, device=device, tokenizer=tokenizer)
    return LLMEngine(config, runner, detokenizer=tokenizer), tokenizer
