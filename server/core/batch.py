"""What one scheduler step hands to the runner, and what the runner hands back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from llmfleet.server.core.request import Request, SampledToken


@dataclass
class ScheduledRequest:
    """Compute ``num_tokens`` tokens of ``request`` this step, positions
    ``request.num_computed_tokens .. request.num_computed_tokens + num_tokens - 1``.

    Their KV goes to the slots that ``request.block_table`` maps those positions to (the
    scheduler has allocated the blocks already). If the chunk reaches the end of the
    request's known tokens (``sample`` is True) the runner samples the next token.
    """

    request: Request
    num_tokens: int
    # Filled by the runner where request.sampling.prompt_logprobs asks: for each position p of
    # this chunk whose next token is a prompt token, that token's logprob (from p's logits)
    prompt_logprobs: list[SampledToken] | None = None

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def sample(self) -> bool:
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # lost their KV this step
    step: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class ModelRunner(Protocol):
    """Turns a scheduled step into next tokens. Makes no scheduling decision.

    ``execute`` returns one entry per ``output.scheduled`` item, in order: the sampled
    token, or None for a prefill chunk that did not reach the end of the prompt. A runner of a
    LongRoPE model also has ``longrope_context``: the pre-training context past which a sequence
    takes the long table, and its KV is computed again (request_rope.py).
    """

    max_model_len: int
    num_kv_blocks: int
    kv_block_size: int
    eos_token_ids: frozenset[int]
    vocab_size: int | None  # token ids it embeds are below this; None: any id (a runner with no model)
    structured_output: bool  # whether it can hold sampling to a request's grammar

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        """Before computing, a scheduled request that still holds ``kv_import`` (KV received from
        a prefill server) has that payload written into its first blocks."""
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (e.g. a seeded generator) once a request ends."""
        ...

    def export_kv(self, block_table: list[int], num_tokens: int) -> memoryview:
        """Copy out the KV of a request's first ``num_tokens`` tokens, in the kv_wire payload
        layout (only runners of prefill servers need it)."""
        ...
