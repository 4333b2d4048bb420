"""Piecewise CUDA graphs for steps that carry prompt tokens (and decodes no decode graph takes).

A decode graph (cuda_graphs.py) holds the whole forward, attention included, which works
because a decode step's attention has a fixed shape once padded. A step with prompt chunks has
ragged attention (each chunk its own length and context), so here, as in vLLM's piecewise
graphs, the forward is captured in pieces *between* its attention calls and attention runs
eagerly in the gaps. Everything else (embeddings, projections, RoPE, norms, MLPs, the LM head:
most of a small model's kernel launches) replays from graphs.

The step is padded to a token bucket. Each bucket's forward is captured once with an
``AttentionSplit`` in place of the step metadata: at each attention call it copies the layer's
q/k/v into buffers shared by every layer and bucket, ends the current graph, starts the next,
and hands back a shared output buffer that the next piece reads. A replay then alternates:
piece i, attention of layer i on the real rows (writing the shared output buffer), piece i + 1.
Padding rows carry stale ids and positions; no attention reads or writes them, and every other
kernel treats rows independently, so they change no real row. Their logit rows are dropped.
"""

from __future__ import annotations

import gc
import logging

import torch

from llmfleet.server.runner.attention import Scoring, attend, model_logits
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.step_inputs import StepInputs

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
# Logit rows a bucket keeps (sampled rows, then prompt-logprob rows): at most its token count.
MAX_LOGIT_ROWS = 512


def token_bucket(num_tokens: int, num_logit_rows: int) -> int | None:
    """The bucket a step of ``num_tokens`` tokens pads to, or None if it must run eagerly."""
    bucket = next((b for b in TOKEN_BUCKETS if b >= num_tokens), None)
    if bucket is None or num_logit_rows > min(bucket, MAX_LOGIT_ROWS):
        return None
    return bucket


class _Shared:
    """Static inputs and the attention hand-over buffers, sized for the largest bucket and shared
    by all (one bucket replays at a time)."""

    def __init__(self, device: torch.device) -> None:
        size = TOKEN_BUCKETS[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros((1, size), **long)
        self.positions = torch.zeros((1, size), **long)
        self.rows = torch.zeros((min(size, MAX_LOGIT_ROWS),), **long)
        self.q: torch.Tensor | None = None  # (tokens, heads, D), made at the first split
        self.k: torch.Tensor | None = None  # (kv_heads, tokens, D)
        self.v: torch.Tensor | None = None
        self.out: torch.Tensor | None = None  # (tokens, heads, D)

    def hand_over(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Copy one layer's q/k/v into the shared buffers; return the output buffer's rows."""
        tokens = query.shape[2]
        if self.q is None:  # outside any capture: the first split is a warm-up's
            size = TOKEN_BUCKETS[-1]
            heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
            self.q = torch.zeros((size, heads, dim), dtype=query.dtype, device=query.device)
            self.out = torch.zeros_like(self.q)
            self.k = torch.zeros((kv_heads, size, dim), dtype=key.dtype, device=key.device)
            self.v = torch.zeros_like(self.k)
        self.q[:tokens].copy_(query[0].transpose(0, 1))
        self.k[:, :tokens].copy_(key[0])
        self.v[:, :tokens].copy_(value[0])
        return self.out[:tokens].unsqueeze(0)


class _Pieces:
    """One bucket's forward: ``len(layers) + 1`` graphs, attention of ``layers[i]`` between
    graph i and graph i + 1. Also the ``AttentionSplit`` that records them."""

    def __init__(self, shared: _Shared, pool) -> None:
        self.shared = shared
        self.pool = pool
        self.capturing = False
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.layers: list[tuple[int, Scoring]] = []  # layer index and how it scores
        self.logits: torch.Tensor | None = None

    def split(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scoring: Scoring
    ) -> torch.Tensor:
        out = self.shared.hand_over(query, key, value)
        if self.capturing:
            self.layers.append((layer, scoring))
            self.graphs[-1].capture_end()
            self.begin()
        return out

    def begin(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)


class PiecewiseGraphs:
    def __init__(self, model, cache: PagedKVCache, pool) -> None:
        self.model = model
        self.cache = cache
        self.pool = pool
        self.shared = _Shared(cache.device)
        self.buckets: dict[int, _Pieces] = {}
        self.replays = 0

    def captured(self, bucket: int) -> _Pieces:
        """``bucket``'s pieces, captured now if they were not yet."""
        if bucket not in self.buckets:
            self.buckets[bucket] = self._capture(bucket)
        return self.buckets[bucket]

    def run(self, step: StepInputs, bucket: int) -> torch.Tensor:
        """Logits of ``step.logit_rows``, the forward replayed from ``bucket``'s pieces."""
        pieces = self.captured(bucket)
        shared, meta = self.shared, step.meta
        tokens, rows = step.input_ids.shape[1], step.logit_rows.shape[0]
        shared.input_ids[:, :tokens].copy_(step.input_ids)
        shared.positions[:, :tokens].copy_(step.positions)
        shared.rows[:rows].copy_(step.logit_rows)
        shared.rows[rows:].zero_()  # a larger bucket's stale rows could lie past this one's tokens
        q, k, v, out = shared.q[:tokens], shared.k[:, :tokens], shared.v[:, :tokens], shared.out[:tokens]
        for graph, (layer, scoring) in zip(pieces.graphs, pieces.layers, strict=False):
            graph.replay()
            attend(meta, layer, q, k, v, out, scoring)
        pieces.graphs[-1].replay()
        self.replays += 1
        return pieces.logits[:rows]

    def _capture(self, bucket: int) -> _Pieces:
        pieces = _Pieces(self.shared, self.pool)
        self.shared.rows.zero_()  # a larger bucket's stale rows could lie past this one's tokens
        torch.cuda.synchronize()
        gc.collect()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket, pieces)  # warm-up: lazy initialisations happen outside the capture
            pieces.capturing = True
            pieces.begin()
            pieces.logits = self._forward(bucket, pieces)
            pieces.graphs[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        log.debug("captured %d CUDA graph pieces for steps of up to %d tokens", len(pieces.graphs), bucket)
        return pieces

    def _forward(self, bucket: int, pieces: _Pieces) -> torch.Tensor:
        shared = self.shared
        rows = shared.rows[: min(bucket, MAX_LOGIT_ROWS)]
        return model_logits(self.model, shared.input_ids[:, :bucket], shared.positions[:, :bucket], rows, pieces)
