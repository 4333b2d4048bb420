"""Structured output at sampling: each constrained request's grammar matcher and the token mask
it gives the sampler, with llguidance (one of vLLM's structured-output backends).

A request's matcher is made at its first sampled token, its grammar (core/grammar.py) compiled against
the model's vocabulary, and it advances by every token sampled for the request. Its mask keeps the
tokens the grammar allows next; once the text is complete, only EOS. Recompute after a preemption
keeps the request's output tokens, so its matcher stays where it was; a request that arrives with
output already (none does today) is replayed into its new matcher.

The engine refuses a request whose grammar does not compile (``core.grammar.check``). A matcher that
still errs (a resource limit met mid-way), or whose grammar allows no token at all, fails its row:
the request ends with finish_reason "abort" and the reason as its error, never with a "stop" on
text the constraint did not hold. Only that request: the rest of the step goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import llguidance
import llguidance.hf
import numpy as np
import torch

from llmfleet.server.core.grammar import compile_grammar
from llmfleet.server.core.request import Request, StructuredOutput

log = logging.getLogger(__name__)
PROBE_STEPS = 2  # tokens a new constraint is followed at admission (problem())


class GrammarMasks:
    """The matchers of the constrained requests in flight, keyed by request id."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._tokenizer: llguidance.LLTokenizer | None = None  # built at the first constrained request
        self._matchers: dict[str, llguidance.LLMatcher] = {}

    def constrain(
        self, logits: torch.Tensor, fallback: torch.Tensor, requests: list[Request], failed: dict[int, str]
    ) -> torch.Tensor:
        """``logits`` (a row per request) with every token its request's grammar forbids at -inf:
        written into ``logits`` where it is the sampler's processed copy, into a copy where it is
        the raw ``fallback`` itself (kept for the logprobs). Where nothing else would be left
        (``min_tokens`` forbids the EOS that completes the text), the grammar wins: its tokens
        take their ``fallback`` (raw) logits. A request whose grammar cannot go on is recorded in
        ``failed``."""
        rows, masks = [], []
        for i, request in enumerate(requests):
            if request.sampling.structured is None or i in failed:
                continue
            try:
                matcher = self._matcher(request)
                mask = matcher.compute_bitmask()
            except Exception as exc:  # llguidance refused it at the vocabulary (a limit): this request only
                failed[i] = f"its structured output cannot be followed: {_first_line(str(exc))}"
                continue
            if matcher.is_error():
                failed[i] = f"its structured output cannot be followed: {_first_line(matcher.get_error())}"
                continue
            rows.append(i)
            masks.append(np.frombuffer(mask, np.uint8))
        if not rows:
            return logits
        words = np.stack(masks)
        # the packed bits travel (a GPU gets 1/8 of the bytes), then unpack there: bit b of byte k is token 8k + b
        packed = torch.from_numpy(words).to(logits.device)
        bits = (packed.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=logits.device)) & 1
        forbidden = (bits.reshape(len(rows), -1) == 0)[:, : logits.shape[-1]]
        index = torch.tensor(rows, device=logits.device)
        masked = logits[index].masked_fill(forbidden, float("-inf"))
        empty = torch.isneginf(masked).all(dim=-1)
        if empty.any():
            masked[empty] = fallback[index][empty].masked_fill(forbidden[empty], float("-inf"))
        for k in torch.nonzero(forbidden.all(dim=-1)).flatten().tolist():
            failed[rows[k]] = "its structured output allows no further token"
        out = logits.clone() if logits is fallback else logits  # a copy already where any row was processed
        out[index] = masked
        return out

    def accept(self, requests: list[Request], token_ids: list[int], failed: dict[int, str]) -> None:
        """Advance each constrained request's matcher by the token sampled for it; one the grammar
        does not take fails its request (recorded in ``failed``)."""
        for i, (request, token) in enumerate(zip(requests, token_ids, strict=True)):
            if request.sampling.structured is None or i in failed:
                continue
            matcher = self._matchers[request.request_id]
            if not matcher.is_stopped() and not matcher.consume_token(token):
                failed[i] = f"its structured output cannot take the token sampled: {_first_line(matcher.get_error())}"

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def problem(self, structured: StructuredOutput) -> str | None:
        """Why a request held to ``structured`` could not be followed from its start, or None,
        found on a matcher of its own: the grammar fails at the vocabulary, allows no token, or
        breaks one of llguidance's limits within its first ``PROBE_STEPS`` tokens (a regex of a
        million states does at the second). Any thread may call it; it may take a second."""
        try:
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), compile_grammar(structured), log_level=0)
            for _ in range(PROBE_STEPS):
                allowed = np.flatnonzero(
                    np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
                )
                if matcher.is_error():
                    return _first_line(matcher.get_error())
                text = [int(t) for t in allowed[allowed < self._vocab_size] if t not in (self._eos or ())]
                if not text:
                    return None if len(allowed) else "it allows no token at all"
                if not matcher.consume_token(text[0]):
                    return _first_line(matcher.get_error())
        except Exception as exc:  # a limit met while compiling against the vocabulary
            return _first_line(str(exc))
        return None

    def _matcher(self, request: Request) -> llguidance.LLMatcher:
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            structured = request.sampling.structured
            assert structured is not None
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), compile_grammar(structured), log_level=0)
            if request.output_token_ids:
                matcher.consume_tokens(request.output_token_ids)
            if matcher.is_error():
                log.warning("request %s: its grammar failed: %s", request.request_id, matcher.get_error())
            self._matchers[request.request_id] = matcher
        return matcher

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            vocab = max(self._vocab_size, len(self._hf_tokenizer))
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=vocab, eos_token=self._eos)
        return self._tokenizer


def _first_line(error: str) -> str:
    """llguidance's error, without the parser state dump that follows its first line."""
    return error.strip().split("\n", 1)[0]
