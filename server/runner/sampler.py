"""Token sampling from the last-position logits of each sampling request.

Greedy rows are one vectorized argmax. Random rows get temperature, top-k and top-p applied
together on the batch; unseeded rows then draw in one call from a shared generator, seeded rows
each from their own generator (created at the request's first token, kept until ``release``),
so a seeded request gives the same text whatever else shares its batch.

Before either, the logits are processed in vLLM's order, only for the rows that ask for it:
``min_tokens`` masks the stop tokens (EOS unless ignored, and ``stop_token_ids``) while fewer
have been generated; ``logit_bias`` adds to its tokens; then the penalties, as vLLM applies them:
``repetition_penalty`` over prompt and generated tokens (HF's rule: positive logits divided,
negative multiplied), ``frequency_penalty`` per generated occurrence and ``presence_penalty``
once per generated token. ``min_p`` drops, after temperature, every token below ``min_p`` times
the most likely one's probability. Greedy rows take the argmax of the processed logits.
Last, a structured-output request's grammar (grammar_masks.py) forbids every token it does not allow
next, and advances by the token drawn.

Logprobs (when asked for) are those of the model's distribution before any of this, as vLLM
returns by default: the chosen token's and the top-N.
"""

from __future__ import annotations

import itertools
import math

import torch

from llmfleet.server.core.request import Request, SampledToken
from llmfleet.server.runner.grammar_masks import GrammarMasks


class Sampler:
    def __init__(
        self, device: torch.device, eos_token_ids: frozenset[int] = frozenset(), grammars: GrammarMasks | None = None
    ) -> None:
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars  # None: no request may ask for structured output
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """``logits``: (N, vocab), one row per request in ``requests``. A row that cannot be sampled
        (its processing raised, NaN or inf left in it, no candidate token, a grammar that cannot go
        on) comes back as a token with ``error`` set: only its own request fails."""
        logits = logits.float()
        failed: dict[int, str] = {}
        processed = self._process(logits, requests, failed)
        if self.grammars is not None:
            processed = self.grammars.constrain(processed, logits, requests, failed)
        best, tokens = processed.max(dim=-1)  # greedy rows' tokens: argmax's, the first of ties
        _note_bad_rows(best, failed)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy and i not in failed]
        if random_rows:
            drawn = self._draw(processed[random_rows], [requests[i] for i in random_rows], random_rows, failed)
            tokens[random_rows] = drawn
        ids = tokens.tolist()
        if self.grammars is not None:
            self.grammars.accept(requests, ids, failed)
        out = [SampledToken(token) for token in ids]
        logprob_rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None and i not in failed]
        if logprob_rows:
            self._add_logprobs(logits, logprob_rows, requests, out)
        for i, why in failed.items():
            out[i] = SampledToken(-1, error=why)
        return out

    def _process(self, logits: torch.Tensor, requests: list[Request], failed: dict[int, str]) -> torch.Tensor:
        """``logits`` with each row's min_tokens mask, logit bias and penalties applied (a copy
        when any row has one: the raw logits still give the logprobs). A row whose processing
        raises is recorded in ``failed``."""
        rows = [i for i, r in enumerate(requests) if _processed(r)]
        if not rows:
            return logits
        processed = logits.clone()
        for i in rows:
            try:
                _process_row(processed[i], requests[i], self.eos_token_ids)
            except Exception as exc:  # one request's parameters must not fail the others' step
                failed[i] = f"its sampling parameters could not be applied: {exc}"
        return processed

    def _draw(
        self, logits: torch.Tensor, requests: list[Request], rows: list[int], failed: dict[int, str]
    ) -> torch.Tensor:
        """A token drawn for each of ``requests`` (the batch's ``rows``); a row whose probabilities
        are not a distribution (NaN, inf, nothing left) is recorded in ``failed``."""
        params = [r.sampling for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        if any(0 < p.top_k < logits.shape[-1] or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, params)
        bad = (~torch.isfinite(probs).all(dim=-1) | ~(probs.sum(dim=-1) > 0)).tolist()
        if any(bad):
            for k in (k for k, is_bad in enumerate(bad) if is_bad):
                failed[rows[k]] = "no token could be drawn: its probabilities are NaN, infinite or all zero"
            probs = probs.masked_fill(torch.tensor(bad, device=probs.device)[:, None], 1.0)  # drawn, then dropped
        tokens = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        shared = [i for i, p in enumerate(params) if p.seed is None]
        if shared:
            tokens[shared] = torch.multinomial(probs[shared], 1, generator=self._shared)[:, 0]
        for i, request in enumerate(requests):
            if request.sampling.seed is not None:
                tokens[i] = torch.multinomial(probs[i], 1, generator=self._generator(request))[0]
        return tokens

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling.seed)
            self._generators[request.request_id] = gen
        return gen

    @staticmethod
    def _add_logprobs(logits: torch.Tensor, rows: list[int], requests: list[Request], out: list[SampledToken]) -> None:
        top_n = max(requests[i].sampling.logprobs for i in rows)
        scored = token_logprobs(logits[rows], [out[i].token_id for i in rows], top_n)
        for i, score in zip(rows, scored, strict=True):
            out[i].logprob = score.logprob
            n = requests[i].sampling.logprobs
            if n > 0:  # the top-N come most likely first: each request keeps its own N
                out[i].top_logprobs = dict(itertools.islice(score.top_logprobs.items(), n))


def token_logprobs(logits: torch.Tensor, targets: list[int], top_n: int, ranks: bool = False) -> list[SampledToken]:
    """Each row's logprob of its target token (the token sampled there, or the prompt's next one)
    and the row's top-N, from the model's raw distribution (as vLLM reports them); with ``ranks``,
    the target's place in it too (vLLM's prompt logprobs carry it)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    out = [SampledToken(t, lp) for t, lp in zip(targets, chosen[:, 0].tolist(), strict=True)]
    if ranks:
        for entry, rank in zip(out, ((logprobs > chosen).sum(dim=-1) + 1).tolist(), strict=True):
            entry.rank = rank
    if top_n > 0:
        values, ids = logprobs.topk(top_n, dim=-1)
        for entry, row_ids, row_values in zip(out, ids.tolist(), values.tolist(), strict=True):
            entry.top_logprobs = dict(zip(row_ids, row_values, strict=True))
    return out


def _process_row(row: torch.Tensor, request: Request, eos_token_ids: frozenset[int]) -> None:
    """One request's logits processing, in place (vLLM's order: see the module's docstring)."""
    params, vocab = request.sampling, row.shape[-1]
    if params.allowed_token_ids is not None:  # everything else masked, before any bias
        keep = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long, device=row.device)
        allowed = row[keep]
        row.fill_(float("-inf")).index_copy_(0, keep, allowed)
    if request.num_output_tokens < params.min_tokens:
        row[[t for t in params.stop_ids(eos_token_ids) if 0 <= t < vocab]] = float("-inf")
    bias = {t: b for t, b in params.logit_bias.items() if t < vocab}  # the API checked the ids
    if bias:
        ids, values = torch.tensor(list(bias)), torch.tensor(list(bias.values()))
        row.index_add_(0, ids.to(row.device), values.to(row.device, row.dtype))
    if params.penalized:
        _penalize(row, request)


def _note_bad_rows(best: torch.Tensor, failed: dict[int, str]) -> None:
    """Record in ``failed`` each row that holds NaN or +inf, or no candidate at all (every token at
    -inf), read from its largest logit ``best`` (max carries a NaN through). Their tokens, drawn or
    not, are dropped; the rest of the batch samples on."""
    for i, value in enumerate(best.tolist()):
        if not math.isfinite(value):
            failed.setdefault(
                i,
                "no token is left to sample"
                if value == -math.inf
                else "no token is left to sample: its logits hold NaN or inf",
            )


def _processed(request: Request) -> bool:
    params = request.sampling
    return bool(
        request.num_output_tokens < params.min_tokens
        or params.logit_bias
        or params.penalized
        or params.allowed_token_ids is not None
    )


def _penalize(row: torch.Tensor, request: Request) -> None:
    """Apply one request's repetition, frequency and presence penalties to its logits ``row``."""
    params, vocab = request.sampling, row.shape[-1]
    output = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
    if params.repetition_penalty != 1:
        prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long, device=row.device)
        seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
        seen[prompt[prompt < vocab]] = True
        seen |= counts > 0
        penalty = params.repetition_penalty
        row.copy_(torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row))
    if params.frequency_penalty:
        row.sub_(params.frequency_penalty * counts)
    if params.presence_penalty:
        row.sub_(params.presence_penalty * (counts > 0).to(row.dtype))


def _top_k_top_p(probs: torch.Tensor, params) -> torch.Tensor:
    """Zero every token outside each row's top-k and outside its smallest top-p nucleus."""
    vocab = probs.shape[-1]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], device=probs.device)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(ranks >= top_k[:, None], 0.0)
    sorted_probs /= sorted_probs.sum(dim=-1, keepdim=True)  # top-p applies within the top-k
    # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
    drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p[:, None]
    drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
