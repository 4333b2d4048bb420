"""Token sampling from the last-position logits of each sampling request.

Greedy rows are one vectorized argmax. Other rows apply temperature, top-k and top-p, then
draw with the request's own generator when it has a seed, so a seeded request gives the same
text whatever else shares its batch.
"""

from __future__ import annotations

import torch

from ..core.batch import SampledToken
from ..core.request import Request, SamplingParams


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """``logits``: (N, vocab) float, one row per request in ``requests``."""
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if random_rows:
            tokens = tokens.clone()
            for i in random_rows:
                tokens[i] = self._draw(logits[i], requests[i])
        want_logprobs = any(r.sampling.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        ids = tokens.tolist()
        out = []
        for i, (token, request) in enumerate(zip(ids, requests, strict=True)):
            sampled = SampledToken(token)
            if logprobs is not None and request.sampling.logprobs is not None:
                sampled.logprob = float(logprobs[i, token])
                k = request.sampling.logprobs
                if k > 0:
                    values, indices = torch.topk(logprobs[i], k)
                    sampled.top_logprobs = dict(zip(indices.tolist(), values.tolist(), strict=True))
            out.append(sampled)
        return out

    def _draw(self, logits: torch.Tensor, request: Request) -> int:
        params: SamplingParams = request.sampling
        scaled = logits / params.temperature
        if params.top_k > 0 and params.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = cumulative - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(request)).item())

    def _generator(self, request: Request) -> torch.Generator:
        if request.sampling.seed is None:
            return self._shared
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request.sampling.seed)
            self._generators[request.request_id] = gen
        return gen
