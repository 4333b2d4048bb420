"""Token sampling from the last-position logits of each sampling request.

Greedy rows are one vectorized argmax. Random rows get temperature, top-k and top-p applied
together on the batch; unseeded rows then draw in one call from a shared generator, seeded rows
each from their own generator (created at the request's first token, kept until ``release``),
so a seeded request gives the same text whatever else shares its batch.

Logprobs (when asked for) are those of the model's distribution before temperature and
filtering, as vLLM returns by default: the chosen token's and the top-N.
"""

from __future__ import annotations

import torch

from ..core.batch import SampledToken
from ..core.request import Request


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.seed()

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """``logits``: (N, vocab), one row per request in ``requests``."""
        logits = logits.float()
        tokens = torch.argmax(logits, dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling.greedy]
        if random_rows:
            drawn = self._draw(logits[random_rows], [requests[i] for i in random_rows])
            tokens[random_rows] = drawn
        ids = tokens.tolist()
        out = [SampledToken(token) for token in ids]
        logprob_rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
        if logprob_rows:
            self._add_logprobs(logits, logprob_rows, requests, out)
        return out

    def _draw(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.sampling for r in requests]
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        if any(0 < p.top_k < logits.shape[-1] or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, params)
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
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        chosen = torch.tensor([out[i].token_id for i in rows], device=logits.device)
        chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
        top_n = max(requests[i].sampling.logprobs for i in rows)
        top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n > 0 else (None, None)
        values = top_values.tolist() if top_values is not None else None
        ids = top_ids.tolist() if top_ids is not None else None
        for j, i in enumerate(rows):
            out[i].logprob = chosen_lp[j]
            n = requests[i].sampling.logprobs
            if n > 0:
                out[i].top_logprobs = dict(zip(ids[j][:n], values[j][:n], strict=True))


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
