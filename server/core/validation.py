"""Whether a request can be served at all: the checks every way in shares (the OpenAI endpoints,
the engine's own admission, the simulator's pods), so that each refuses the same request with
the same words. The context-length messages are vLLM's, which clients parse to shorten a request
and retry."""

from __future__ import annotations

from collections.abc import Iterable

# No tokenizer's tokens average more characters than this: a longer text cannot fit the context,
# and is refused before the tokenizer spends seconds on it.
MAX_CHARS_PER_TOKEN = 32
TRUNCATION_MARGIN_CHARS = 256


class InvalidRequestError(ValueError):
    """A request no server could serve as asked: the API answers 400 naming ``param``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt_length(max_model_len: int, prompt_len: int) -> None:
    """A prompt that leaves no room for a token."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input messages.",
            "prompt",
        )


def check_context_length(max_model_len: int, prompt_len: int, max_tokens: int | None) -> None:
    """A prompt that leaves no room for a token, or one with ``max_tokens`` past the context (the
    engine's own admission: the API has cut max_tokens to the context already)."""
    check_prompt_length(max_model_len, prompt_len)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_len}).",
            "max_tokens",
        )


def check_token_ids(ids: Iterable[int], vocab_size: int | None, param: str, what: str = "token ids") -> None:
    """Token ids a request names (a prompt's, logit_bias's keys, allowed_token_ids) lie within
    the vocabulary: ``[0, vocab_size)``, or only non-negative where the size is unknown."""
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        bound = "non-negative" if vocab_size is None else f"in [0, {vocab_size})"
        raise InvalidRequestError(f"{what} must be {bound}, got {bad}", param)


def check_prompt_chars(chars: int, max_model_len: int, param: str = "prompt") -> None:
    """Text too long to fit the context in any tokenizer, refused before it is tokenized."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise InvalidRequestError(
            f"The prompt is longer ({chars} characters) than this model's maximum context length of "
            f"{max_model_len} tokens can hold (at most {limit} characters). Please reduce the length "
            "of the input.",
            param,
        )


def truncation_chars(keep: int) -> int:
    """How much of a long text's end to tokenize for its last ``keep`` tokens
    (``truncate_prompt_tokens``): at most ``MAX_CHARS_PER_TOKEN`` characters a token, and a margin
    for the token the cut splits. Tokenizing the whole text instead costs time and memory in
    proportion to a length nothing else bounds."""
    return keep * MAX_CHARS_PER_TOKEN + TRUNCATION_MARGIN_CHARS


def truncation_length(keep: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps, as vLLM reads it:
    None keeps all, -1 the context length; more than the context length is refused."""
    if keep is None:
        return None
    if keep <= -1:
        return max_model_len
    if keep > max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
            "Please, select a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    return keep


def check_sequences(sequences: int, queue_capacity: int) -> None:
    """The n choices of each prompt are as many engine requests, queued at once: more than the
    waiting queue holds could never be admitted, and a 429 would send the client retrying forever."""
    if sequences > queue_capacity:
        raise InvalidRequestError(
            f"n x prompts asks for {sequences} sequences; this server queues at most {queue_capacity} "
            "(its --max-queue-len)",
            "n",
        )


def check_can_sample(
    stop_ids: frozenset[int], allowed: frozenset[int] | None, min_tokens: int, vocab_size: int
) -> None:
    """A request whose first tokens can have no candidate at all: ``min_tokens`` keeps its stop
    tokens (``stop_ids``: stop_token_ids and EOS, unless ignored) out of them, and nothing else is
    left, because every allowed token stops it, or the stop tokens cover the vocabulary. Refused
    here: in a step, its sampler row would hold no probability at all."""
    if min_tokens <= 0:
        return
    if allowed is not None and not (allowed - stop_ids):
        raise InvalidRequestError(
            f"every token in allowed_token_ids is a stop token (stop_token_ids or EOS), which min_tokens={min_tokens} "
            "forbids: no token could be sampled",
            "allowed_token_ids",
        )
    if sum(1 for t in stop_ids if 0 <= t < vocab_size) >= vocab_size:
        raise InvalidRequestError(
            f"stop_token_ids and EOS cover the whole vocabulary of {vocab_size} tokens, which min_tokens={min_tokens} "
            "forbids: no token could be sampled",
            "stop_token_ids",
        )


def check_id_list(ids: list[int], limit: int, param: str) -> None:
    """A list of token ids no longer than ``limit`` (the vocabulary: more would repeat ids), checked
    before any per-id work."""
    if len(ids) > limit:
        raise InvalidRequestError(f"{param} holds {len(ids)} token ids; at most {limit} are accepted", param)
