"""Paged attention, plugged into any HF decoder-only model through transformers'
``AttentionInterface`` under the name ``llmfleet``.

Each step runs the model once over a flattened ragged batch of shape (1, T). Read in
transformers 5.23 (models/llama, qwen2, mistral; masking_utils): for an implementation with no
registered mask function no mask is built (``attention_mask`` is None), our extra kwargs reach
this function unchanged, and it gets q/k/v as (1, heads, T, head_dim) after RoPE, ``scaling``,
the layer in ``module.layer_idx`` and, for Qwen2/Mistral, the layer's ``sliding_window``
(None for full attention). It must return (1, T, heads, head_dim) in token order. Two more
kwargs change the weights: Gemma 2's ``softcap`` and gpt-oss's ``s_aux`` (sinks); see ``Scoring``.

The function writes this step's keys and values into the paged cache at the slot mapping, then
attends each request's queries to that request's cached keys, causally, with GQA:

- one-query requests (decodes) are batched per group of similar context length. On a CPU a C
  kernel attends them reading the cache in place (cpu_kernels.py), on a GPU a Triton kernel
  (gpu_kernels.py); otherwise (or with a logit cap on a GPU) their blocks are
  gathered into a padded (kv_heads, n, ctx, head_dim) tensor and attended with two batched
  matmuls and a length mask (CPU SDPA is several times slower for one-token queries);
- prompt chunks are attended one request at a time: a chunk that starts at position 0 attends
  to its own fresh keys (causal, no gather); a later chunk gathers its request's blocks and
  attends causally from the chunk start. On a CPU a C kernel does it (cpu_kernels.py; torch's
  CPU SDPA is several times slower), in bfloat16 on CPUs with AMX in AMX tiles, except for head
  sizes those tiles do not take, where SDPA multiplies in them and is the faster (``sdpa_first``);
  otherwise SDPA with a mask offset by the chunk start.

Sliding windows are honoured through the masks (``kv_pos > q_pos - window``, as transformers
does), so Mistral and Qwen2 with a window shorter than the context stay exact. A layer with a
logit cap or sinks takes a plain-torch path for prompts where the C kernels do not run (SDPA
applies neither); the C kernels apply both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface

from llmfleet.server.runner import cpu_kernels, gpu_kernels, request_rope
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.model_support import OWN_ATTENTION, UnsupportedModel, refused

ATTN_IMPLEMENTATION = "llmfleet"

# Decode attention gathers this many bytes of K and V at a time (a few heads), then attends:
# small enough to stay in the CPU cache, faster than gathering all heads first.
DECODE_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, eq=False)  # eq: it holds a tensor
class Scoring:
    """How a layer turns ``q . k`` into attention weights, read from the kwargs its model passes:
    the scale, a sliding window, a tanh cap on the logits (Gemma 2: ``softcap * tanh(x / softcap)``)
    and sinks (gpt-oss: a learned logit per head that takes part in the softmax, then is dropped,
    so a query may attend to "nothing")."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (heads,)

    @property
    def plain(self) -> bool:
        """A scaled softmax within the window: what SDPA computes."""
        return self.softcap is None and self.sinks is None


@dataclass
class DecodeGroup:
    """One-query requests attended together, padded to the longest context of the group."""

    rows: torch.Tensor  # (n,) their rows in the flattened batch
    blocks: torch.Tensor  # (n * blocks_per_request,) block ids, padded with block 0
    lengths: torch.Tensor  # (n,) context lengths, the new token included
    blocks_per_request: int
    padded: bool  # some request is shorter than blocks_per_request * block_size
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, block_size: int, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive (1, n, 1, ctx) mask: -inf on padding and outside the window; None if neither."""
        if window not in self._masks:
            ctx = self.blocks_per_request * block_size
            lengths = self.lengths[:, None]
            positions = torch.arange(ctx, device=lengths.device)[None, :]
            hidden = positions >= lengths if self.padded else None
            if window is not None and window < ctx:
                outside = positions < lengths - window
                hidden = outside if hidden is None else hidden | outside
            self._masks[window] = (
                None
                if hidden is None
                else torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
                .masked_fill_(hidden, float("-inf"))
                .view(1, -1, 1, ctx)
            )
        return self._masks[window]


@dataclass
class PrefillSpan:
    """A prompt chunk (or a recompute) of one request: positions ``context - num_tokens .. context - 1``."""

    row: int  # first row of the chunk in the flattened batch
    num_tokens: int
    context: int  # tokens the chunk attends to: everything before it plus itself
    blocks: torch.Tensor | None  # blocks covering the context; None when the chunk starts at position 0
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        return self.blocks is None

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """Boolean (num_tokens, context) mask, True = may attend; None means plain causal."""
        if window not in self._masks:
            windowed = window is not None and window < self.context
            if self.fresh and not windowed:
                self._masks[window] = None
            else:
                q_pos = torch.arange(self.context - self.num_tokens, self.context, device=device)[:, None]
                k_pos = torch.arange(self.context, device=device)[None, :]
                allowed = k_pos <= q_pos
                if windowed:
                    allowed &= k_pos > q_pos - window
                self._masks[window] = allowed
        return self._masks[window]


@dataclass
class StepMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) cache slot of each token of the step
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # the sequence length each token's rotary table is chosen at (request_rope.py)
    rope_lengths: list[int] | None = None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    llmfleet_meta: StepMetadata | AttentionSplit | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = llmfleet_meta
    if meta is None:
        reason = (
            f"its layers do not pass their keyword arguments on to their attention ({type(module).__name__} "
            "got no llm-fleet step metadata)"
        )
        raise refused(type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_"), reason)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scoring = Scoring(scale, sliding_window, softcap, s_aux)
    if not isinstance(meta, StepMetadata):
        return meta.split(module.layer_idx, query, key, value, scoring), None
    q = query[0].transpose(0, 1)  # (T, heads, D)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # token-major
    real = meta.slot_mapping.shape[0]
    if real < q.shape[0]:
        out[real:].zero_()  # padding rows (step_shapes.py): attended by nothing
    attend(meta, module.layer_idx, q, key[0], value[0], out, scoring)
    return out.unsqueeze(0), None


class AttentionSplit(Protocol):
    """Stands in for the step metadata while a forward is captured in pieces between its
    attention calls (piecewise_graphs.py): it takes each layer's q/k/v and returns the tensor the
    rest of the layer reads as the attention output."""

    def split(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scoring: Scoring
    ) -> torch.Tensor: ...


def attend(
    meta: StepMetadata,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scoring: Scoring,
) -> None:
    """One layer's paged attention for a step: store ``key``/``value`` (kv_heads, T, D) in the
    cache, attend ``q`` (T, heads, D) and write the result into ``out`` (T, heads, D). Rows past
    the step's slot mapping are padding: neither stored nor attended."""
    cache = meta.cache
    real = meta.slot_mapping.shape[0]
    cache.write(layer, meta.slot_mapping, key[:, :real], value[:, :real])
    for group in meta.decode_groups:
        _decode(q, out, cache, layer, group, scoring)
    for span in meta.prefills:
        _prefill(q, key, value, out, cache, layer, span, scoring)


def _decode(
    q: torch.Tensor,
    out: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    group: DecodeGroup,
    scoring: Scoring,
) -> None:
    kv = (cache.keys[layer], cache.values[layer], cache.block_size)
    group_kv = (group.rows, group.blocks, group.lengths, scoring.scale, scoring.window, scoring.softcap, scoring.sinks)
    if cpu_kernels.paged_decode(q, out, *kv, *group_kv) or gpu_kernels.paged_decode(q, out, *kv, *group_kv):
        return  # read in place by the C kernel (cpu_kernels.py) or the Triton one (gpu_kernels.py)
    n = group.rows.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.num_kv_heads
    per_kv = num_heads // kv_heads  # query heads sharing one KV head (GQA)
    queries = q.index_select(0, group.rows).view(n, kv_heads, per_kv, head_dim).transpose(0, 1)
    attended = torch.empty((kv_heads, n, per_kv, head_dim), dtype=q.dtype, device=q.device)
    mask = group.mask(cache.block_size, scoring.window, cache.dtype)
    sinks = None if scoring.sinks is None else scoring.sinks.view(kv_heads, 1, per_kv, 1)
    # On CPU a few KV heads at a time, so the gathered keys are still in cache when the matmul
    # reads them; on a GPU all at once (fewer kernel launches).
    step = kv_heads if q.is_cuda else cache.heads_per_chunk(group.blocks.shape[0], DECODE_CHUNK_BYTES)
    for first in range(0, kv_heads, step):
        end = min(first + step, kv_heads)
        keys, values = cache.gather(layer, group.blocks, (first, end))
        keys = keys.view(end - first, n, -1, head_dim)  # (heads, n, ctx, D)
        values = values.view(end - first, n, -1, head_dim)
        scores = torch.matmul(queries[first:end].to(keys.dtype), keys.transpose(-1, -2)).mul_(scoring.scale)
        if scoring.softcap is not None:
            scores = _capped(scores, scoring.softcap)
        if mask is not None:
            scores.add_(mask)
        probs = _softmax(scores, None if sinks is None else sinks[first:end]).to(values.dtype)
        attended[first:end] = torch.matmul(probs, values)
    out.index_copy_(0, group.rows, attended.transpose(0, 1).reshape(n, num_heads, head_dim))


def _prefill(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    cache: PagedKVCache,
    layer: int,
    span: PrefillSpan,
    scoring: Scoring,
) -> None:
    rows = slice(span.row, span.row + span.num_tokens)
    if span.fresh:
        keys, values = key[:, rows], value[:, rows]  # this step's own, no cache read needed
    else:
        keys, values = cache.gather(layer, span.blocks)
        keys, values = keys[:, : span.context], values[:, : span.context]
    if not sdpa_first(q, scoring) and cpu_kernels.prefill_attention(
        q[rows], out[rows], keys, values, scoring.scale, scoring.window, scoring.softcap, scoring.sinks
    ):
        return
    queries = q[rows].transpose(0, 1).unsqueeze(0)  # (1, heads, n, D)
    keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    mask = span.mask(scoring.window, q.device)
    keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    if scoring.plain:
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries,
            keys,
            values,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scoring.scale,
            enable_gqa=keys.shape[1] != queries.shape[1],
        )
    else:
        attended = _attend_scored(queries, keys, values, mask, scoring)
    out[rows] = attended[0].transpose(0, 1)


def sdpa_first(q: torch.Tensor, scoring: Scoring) -> bool:
    """Whether a prompt's attention goes to torch's SDPA before the C kernel: in bfloat16 on a CPU
    with AMX, for a head size the kernel's own AMX tiles do not take (not a multiple of 32), where
    SDPA's flash attention multiplies in AMX tiles and runs several times faster than the kernel's
    AVX-512 FMAs (docs/engine.md, prompt attention). Elsewhere the kernel is the faster, and it
    alone applies a logit cap or sinks."""
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and scoring.plain
        and cpu_kernels.amx_tiles()
        and not cpu_kernels.amx_prompt_attention(q.shape[-1])
    )


def _attend_scored(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scoring: Scoring
) -> torch.Tensor:
    """A prompt chunk's attention where SDPA cannot apply the layer's scoring: queries (1, heads,
    n, D) against keys and values (1, kv_heads, ctx, D); ``mask`` (n, ctx) True where a query may
    attend, None for a chunk that is the whole context (causal)."""
    per_kv = queries.shape[1] // keys.shape[1]
    if per_kv > 1:
        keys, values = keys.repeat_interleave(per_kv, dim=1), values.repeat_interleave(per_kv, dim=1)
    scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scoring.scale)
    if scoring.softcap is not None:
        scores = _capped(scores, scoring.softcap)
    n, ctx = scores.shape[-2:]
    if mask is None:
        mask = torch.ones((n, ctx), dtype=torch.bool, device=scores.device).tril_(ctx - n)
    scores.masked_fill_(~mask, float("-inf"))
    sinks = None if scoring.sinks is None else scoring.sinks.view(1, -1, 1, 1)
    return torch.matmul(_softmax(scores, sinks).to(values.dtype), values)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return scores.div_(softcap).tanh_().mul_(softcap)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax over the last dimension; ``sinks`` (broadcast to one logit per row) join
    the softmax and are dropped from its result."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    logits = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1]


def model_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    logit_rows: torch.Tensor,
    meta: StepMetadata | AttentionSplit,
) -> torch.Tensor:
    """One forward of a flattened step (1, T) through this attention: the logits of ``logit_rows``."""
    with request_rope.step_lengths(getattr(meta, "rope_lengths", None)):
        return model(
            input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=logit_rows, llmfleet_meta=meta
        ).logits[0]


@dataclass(frozen=True)
class KVShape:
    """What each layer's attention hands over to be cached: KV heads and the head size."""

    kv_heads: int
    head_dim: int


class _Probe:
    """Answers every attention call of a forward with zeros, counting the calls and noting the
    shapes of the keys, values and queries each layer hands over, and each layer's scoring."""

    def __init__(self) -> None:
        self.calls = 0
        self.shapes: set[tuple[int, int, int, int, int]] = set()
        self.scorings: dict[int, Scoring] = {}

    def split(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scoring: Scoring
    ) -> torch.Tensor:
        self.calls += 1
        # (1, heads, T, D) each: key heads and size, value heads and size, query heads
        self.shapes.add((key.shape[1], key.shape[-1], value.shape[1], value.shape[-1], query.shape[1]))
        self.scorings[layer] = scoring
        return torch.zeros_like(query).transpose(1, 2)  # (1, T, heads, D)


def _probe_forward(model: torch.nn.Module, device: torch.device) -> _Probe:
    """A one-token forward whose attention calls a ``_Probe`` answers."""
    one = torch.zeros((1, 1), dtype=torch.long, device=device)
    counter = _Probe()
    with torch.inference_mode():
        model_logits(model, one, one, torch.zeros(1, dtype=torch.long, device=device), counter)
    return counter


def layer_scorings(model: torch.nn.Module, device: torch.device) -> list[Scoring]:
    """How each layer of a loaded (and probed) model scores its keys, as its attention hands it
    over: the scale and a window (Mistral's from its config, Qwen2's per layer), a cap, sinks."""
    counter = _probe_forward(model, device)
    return [counter.scorings[i] for i in range(model.config.get_text_config().num_hidden_layers)]


def probe(model: torch.nn.Module, device: torch.device) -> KVShape:
    """A one-token forward at load, before the server reports ready: raises UnsupportedModel for
    a model whose layers drop our kwargs (every request's step would fail) or whose attention
    does not come here in every layer (its own code: requests would attend across each other).
    Returns the KV shape the layers hand over, which sizes the cache: a config can carry a
    ``num_key_value_heads`` its architecture ignores (GPT-NeoX) or name heads otherwise
    (JetMoE), and the cache must hold what the attention gets, not what the config says."""
    try:
        counter = _probe_forward(model, device)
    except UnsupportedModel:
        raise
    except Exception as exc:  # MPT: its own mask code expects the mask transformers builds for others
        raise refused(type(model).__name__, f"a one-token forward with llm-fleet's attention failed: {exc!r}") from exc
    layers = model.config.get_text_config().num_hidden_layers  # a multimodal model's: its text decoder's
    if counter.calls != layers:
        reason = f"{OWN_ATTENTION} ({counter.calls} attention calls for {layers} layers)"
        raise refused(type(model).__name__, reason)
    return kv_shape(type(model).__name__, counter.shapes)


def kv_shape(model_name: str, shapes: set[tuple[int, int, int, int, int]]) -> KVShape:
    """The one KV shape of every layer; refused where layers differ (one paged cache holds every
    layer alike), where keys and values differ, or where query heads are not a whole number of
    groups per KV head."""
    if len(shapes) != 1:
        described = ", ".join(f"{k} KV heads of {d}" for k, d, *_ in sorted(shapes))
        raise refused(model_name, f"its layers cache keys of different shapes ({described}), one paged cache holds one")
    ((key_heads, key_dim, value_heads, value_dim, query_heads),) = shapes
    if (key_heads, key_dim) != (value_heads, value_dim):
        reason = f"its keys ({key_heads} heads of {key_dim}) and values ({value_heads} of {value_dim}) differ in shape"
        raise refused(model_name, reason)
    if query_heads % key_heads:
        raise refused(model_name, f"its {query_heads} query heads do not share its {key_heads} KV heads evenly")
    return KVShape(key_heads, key_dim)


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
