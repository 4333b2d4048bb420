"""Paged attention, plugged into any HF decoder-only model through transformers'
``AttentionInterface`` under the name ``llmfleet``.

Each step runs the model once over a flattened ragged batch of shape (1, T). The attention
function writes this step's keys and values into the paged cache at ``slot_mapping`` and then
attends each request's queries to that request's cached keys, causally:

- decode requests (one query each) are batched: their cached K/V are gathered into a padded
  (B, ctx) block and attended with two batched matmuls (CPU SDPA is slow for one-token queries);
- prefill chunks attend one request at a time with a causal mask offset by the chunk start.

The gather indices and masks are built once per step (``StepMetadata``), not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "llmfleet"


class PagedKVCache:
    """Per layer, keys and values for every slot: (kv_heads, num_blocks * block_size, head_dim).

    Heads come first so that gathering a request's slots yields one contiguous (ctx, head_dim)
    matrix per head, which the score matmul reads without another copy."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


@dataclass
class PrefillSpan:
    token_start: int  # first row of this request in the flattened batch
    num_tokens: int
    slots: torch.Tensor  # (ctx,) cache slots of positions 0..ctx-1
    mask: torch.Tensor | None  # (num_tokens, ctx) bool, True = may attend; None = no masking needed


@dataclass
class StepMetadata:
    cache: PagedKVCache
    slot_mapping: torch.Tensor  # (T,) where each token's K/V goes
    decode_rows: torch.Tensor | None  # (B,) rows of one-token requests in the flattened batch
    decode_blocks: torch.Tensor | None  # (B * max_blocks,) block ids to gather, padded with block 0
    decode_mask: torch.Tensor | None  # (1, B, 1, max_blocks * block_size) additive mask, -inf past each length
    prefills: list[PrefillSpan]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    llmfleet_meta: StepMetadata | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta = llmfleet_meta
    if meta is None:
        raise RuntimeError("llmfleet attention called without step metadata (use the llm-fleet runner)")
    layer = module.layer_idx
    k_cache, v_cache = meta.cache.keys[layer], meta.cache.values[layer]
    q = query[0].transpose(0, 1)  # (T, H, D)
    k_cache.index_copy_(1, meta.slot_mapping, key[0].to(k_cache.dtype))
    v_cache.index_copy_(1, meta.slot_mapping, value[0].to(v_cache.dtype))

    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    group = num_heads // kv_heads
    scale = scaling if scaling is not None else head_dim**-0.5
    out = torch.empty_like(q)

    if meta.decode_rows is not None:
        rows = meta.decode_rows
        batch = rows.shape[0]
        qd = q.index_select(0, rows).view(batch, kv_heads, group, head_dim).transpose(0, 1)  # (kvh, B, g, D)
        # Gather whole blocks (block_size * head_dim contiguous values each): much faster than
        # gathering token slots one by one. Positions past each request's length are masked.
        per_block = meta.cache.block_size * head_dim
        keys = k_cache.view(kv_heads, -1, per_block).index_select(1, meta.decode_blocks)
        values = v_cache.view(kv_heads, -1, per_block).index_select(1, meta.decode_blocks)
        keys = keys.view(kv_heads, batch, -1, head_dim)  # (kvh, B, ctx, D)
        values = values.view(kv_heads, batch, -1, head_dim)
        scores = torch.matmul(qd, keys.transpose(-1, -2)).mul_(scale).add_(meta.decode_mask)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)  # (kvh, B, g, ctx)
        attended = torch.matmul(probs, values).transpose(0, 1).reshape(batch, num_heads, head_dim)
        out.index_copy_(0, rows, attended)

    for span in meta.prefills:
        qs = q[span.token_start : span.token_start + span.num_tokens].transpose(0, 1)  # (H, n, D)
        ks = k_cache[:, span.slots]  # (kvh, ctx, D)
        vs = v_cache[:, span.slots]
        if group > 1:
            ks = ks.repeat_interleave(group, dim=0)
            vs = vs.repeat_interleave(group, dim=0)
        attn = torch.nn.functional.scaled_dot_product_attention(
            qs.unsqueeze(0),
            ks.unsqueeze(0),
            vs.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=False,
            scale=scale,
        )
        out[span.token_start : span.token_start + span.num_tokens] = attn[0].transpose(0, 1)

    return out.unsqueeze(0), None


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
