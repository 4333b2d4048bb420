"""LongRoPE's short or long table chosen per request, as HF ``generate`` chooses it for each
request alone.

Phi-3's 128k checkpoints, Phi-3.5 and Phi-4-mini rotate with one of two frequency tables: the
short one while a sequence fits the pre-training context (``original_max_position_embeddings``,
4096), the long one past it. transformers picks the table once per forward, from the largest
position in it. So alone in ``generate``, a prompt's tokens take the table of the prompt's
length and each new token that of its own position + 1; and Phi-3's ``generate`` (PhiMoE's too)
also drops its cache at the first token past the context and computes the whole sequence again
with the long table, where a Llama with LongRoPE keeps the keys it has. In a batch the
per-forward choice would give every request the table of the longest (vLLM picks per batch the
same way), and a long prompt prefilled in chunks would turn its first chunks with the short one.

Here a token at position p takes the table of max(L, p + 1), L being its request's length when
the scheduler last started it (its prompt's; for Phi-3, its whole sequence's, which the
scheduler starts again past the context: server/core/scheduler.py). Each step carries those
lengths (``StepMetadata.rope_lengths``), and ``RequestRope``, swapped in for the model's rotary
embedding, turns each token with its own table. The prefix cache keeps blocks turned with the
long table in chains of their own (server/core/block_manager.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch

_STEP_LENGTHS: ContextVar[Sequence[int] | None] = ContextVar("llmfleet_rope_lengths", default=None)


class RequestRope(torch.nn.Module):
    """The model's LongRoPE embedding, each token of a step turned with the table of its own
    request's sequence length (the step's, set by ``step_lengths``); without them (a forward
    outside a step), the embedding's own per-forward choice."""

    def __init__(self, original: torch.nn.Module, original_max: int) -> None:
        super().__init__()
        self.original = original
        self.original_max = original_max

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = _STEP_LENGTHS.get()
        if lengths is None or position_ids.shape[0] != 1:
            return self.original(x, position_ids, *args)
        tokens = position_ids.shape[1]
        long = torch.zeros(tokens, dtype=torch.bool)  # rows past the step's own (padding) are short
        long[: len(lengths)] = torch.tensor(lengths, dtype=torch.long) > self.original_max
        long = long.to(position_ids.device)
        if not bool(long.any()):
            # every token's length is at most the pre-training context, and so is every position
            # + 1: the embedding picks the short table itself
            return self.original(x, position_ids, *args)
        # a position past the pre-training context makes the embedding pick the long table; its
        # row is dropped
        past = torch.full((1, 1), self.original_max, dtype=position_ids.dtype, device=position_ids.device)
        if bool(long.all()):
            cos, sin = self.original(x, torch.cat([position_ids, past], dim=1), *args)
            return cos[:, :tokens], sin[:, :tokens]
        short_cos, short_sin = self.original(x, position_ids[:, ~long], *args)
        long_cos, long_sin = self.original(x, torch.cat([position_ids[:, long], past], dim=1), *args)
        cos = short_cos.new_empty((1, tokens, short_cos.shape[-1]))
        sin = torch.empty_like(cos)
        cos[:, ~long], sin[:, ~long] = short_cos, short_sin
        cos[:, long], sin[:, long] = long_cos[:, :-1], long_sin[:, :-1]
        return cos, sin


def install(decoder: torch.nn.Module | None) -> bool:
    """Swap ``decoder``'s rotary embedding (a model's ``model``, or its text decoder) for a
    ``RequestRope`` where it is LongRoPE; returns whether it is one now."""
    rotary = getattr(decoder, "rotary_emb", None)
    if isinstance(rotary, RequestRope):
        return True
    if getattr(rotary, "rope_type", None) != "longrope":
        return False
    original_max = longrope_context(rotary.config)
    if original_max is None:
        return False
    decoder.rotary_emb = RequestRope(rotary, original_max)
    return True


def longrope_context(config) -> int | None:
    """The pre-training context (the short table's) of a text config whose one rope type is
    LongRoPE, or None."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type") != "longrope":
        return None
    original = parameters.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None
    )
    return int(original) if original else None


def recomputes_past_context(model_class: type | None) -> bool:
    """Whether HF ``generate`` on ``model_class`` drops its cache and computes the sequence again
    when it passes the LongRoPE context (Phi-3's, PhiMoE's: their ``prepare_inputs_for_generation``
    compares the cache's length with ``original_max_position_embeddings``). Elsewhere it keeps the
    keys it has, and each new token takes the table of its own position."""
    prepare = getattr(model_class, "prepare_inputs_for_generation", None)
    try:
        return prepare is not None and "original_max_position_embeddings" in inspect.getsource(prepare)
    except (OSError, TypeError):  # no source to read: the generic one keeps its cache
        return False


def installed(decoder: torch.nn.Module | None) -> bool:
    return isinstance(getattr(decoder, "rotary_emb", None), RequestRope)


@contextlib.contextmanager
def step_lengths(lengths: Sequence[int] | None) -> Iterator[None]:
    """Within it, a ``RequestRope`` turns the step's tokens by ``lengths`` (one per token)."""
    token = _STEP_LENGTHS.set(lengths)
    try:
        yield
    finally:
        _STEP_LENGTHS.reset(token)
