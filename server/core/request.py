"""Request state: what the scheduler, the block manager and the engine loop share.

Pure Python. Token accounting follows vLLM v1: a request is owed
``num_tokens - num_computed_tokens`` tokens of compute; prefill, chunked prefill, decode
and recompute-after-preemption are all the same mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.validation import InvalidRequestError


class RequestStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV freed, will recompute
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the context limit
    FINISHED_ABORTED = "finished_aborted"  # client went away or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    rank: int | None = None  # the token's place in its distribution (1: the most likely), where computed
    # Why no token could be sampled for the request (NaN or inf probabilities, no candidate left,
    # a grammar that cannot go on): the engine ends that request alone, with this as its error
    error: str | None = None


# OpenAI / vLLM finish_reason strings
FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


_GREEDY_EPS = 1e-5
# A repetition penalty divides (or multiplies) logits: far outside this range it only overflows
# float32 logits to inf (vLLM's check, > 0, lets 1e-300 through to NaN probabilities)
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_KINDS = ("json", "json_object")  # the kinds that are JSON, whose whitespace a pattern sets
# Where a reasoning model's thinking runs free before the constraint holds (vLLM's default: the
# grammar applies after the reasoning): "open", the reply starts inside a think block and the
# constraint holds what follows its first "</think>"; "leading", the reply may open with a
# "<think>...</think>" block, and the constraint holds the rest.
THINKING_MODES = ("open", "leading")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text, as vLLM's structured outputs name them: ``json`` (a JSON
    schema, serialized), ``json_object`` (any JSON object), ``regex``, ``choice`` (a JSON list of
    strings) or ``grammar`` (Lark or GBNF). ``whitespace_pattern`` (a regex) replaces the
    whitespace JSON may hold between its tokens. ``thinking`` (one of ``THINKING_MODES``) leaves
    a reasoning model's thinking free and holds only the answer after it. core/grammar.py makes it
    a grammar, which the runner's sampler holds the request to (runner/grammar_masks.py)."""

    kind: str
    spec: str = ""
    whitespace_pattern: str | None = None
    thinking: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.thinking is not None and self.thinking not in THINKING_MODES:
            raise ValueError(f"thinking must be one of {', '.join(THINKING_MODES)}, got {self.thinking!r}")


@dataclass
class SamplingParams:
    """Per-request sampling. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the text leaves out special tokens (BOS, <|end|>...)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; None: off
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (the model's raw logprobs)
    # Logits processing, as vLLM and the OpenAI API define it (sampler.py applies it):
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability; 0: off
    min_tokens: int = 0  # the first min_tokens tokens never stop it (EOS, stop ids or strings)
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per time a token was generated
    repetition_penalty: float = 1.0  # prompt and generated tokens: positive logits / it, negative x it (HF)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: frozenset[int] | None = None  # only these are sampled (vLLM's); None: all
    structured: StructuredOutput | None = None  # only tokens its grammar allows are sampled
    # Not sampling, but what the engine needs of the request beside it: vLLM's cache_salt, which
    # keys the request's prefix-cache blocks (block_manager.py)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number, got {getattr(self, name)}", name)
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", "min_tokens"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if any(t < 0 for t in self.logit_bias):
            raise InvalidRequestError(
                f"logit_bias token ids must be non-negative, got {min(self.logit_bias)}", "logit_bias"
            )
        if self.allowed_token_ids is not None and not (self.allowed_token_ids and min(self.allowed_token_ids) >= 0):
            raise InvalidRequestError(
                "allowed_token_ids must hold at least one token id, and no negative ones", "allowed_token_ids"
            )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}",
                "repetition_penalty",
            )
        if any(not math.isfinite(b) for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be finite numbers", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidRequestError(f"{name} must be >= 0, got {getattr(self, name)}", name)

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end the request: ``stop_token_ids``, and the model's EOS unless ignored."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else eos_token_ids)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows; vLLM uses the same epsilon
        return self.temperature < _GREEDY_EPS


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0  # larger is more urgent
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # timestamps (engine clock), None until they happen
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Disaggregation: KV received for the first prompt tokens, written by the runner in the step
    # that first schedules the request (then dropped); and, on a prefill server, the request's KV
    # copied out when it finishes (an opaque buffer from the runner).
    kv_import: KVImport | None = None
    kv_export: Any = None
    # Prefix caching: the content hash of each full block of its tokens so far (a chain: each
    # covers every token before it), and how many of its blocks the cache has been offered
    block_hashes: list[int | bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # A LongRoPE model's: the sequence length its table was chosen at when the scheduler last
    # started it (0: its prompt's); a token at position p takes the table of max(that, p + 1)
    # (request_rope.py)
    rope_length: int = 0
    # With sampling.prompt_logprobs: entry k is prompt token k + 1's (the first token has none)
    prompt_logprobs: list[SampledToken] = field(default_factory=list)
    # Pipeline parallelism: a batch holding this request is still in the stages. Until it comes
    # back the request is neither scheduled again nor chosen to be preempted.
    in_flight: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        """Still computing the prompt (or recomputing after preemption)."""
        return self.num_uncomputed_tokens > 1 or self.num_output_tokens == 0

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)
