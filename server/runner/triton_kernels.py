"""Triton kernels for the runner on a GPU (gpu_kernels.py decides when they run).

Imported only where Triton is installed (every CUDA build of torch brings it; a CPU install has
none). With ``TRITON_INTERPRET=1`` set before this module is imported they run on CPU tensors
through Triton's interpreter, which is how the tests check them on a machine without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    rows_ptr,
    blocks_ptr,
    lengths_ptr,
    sinks_ptr,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    block_stride,
    head_stride,
    block_size,
    blocks_per_request,
    scale,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    TILES: tl.constexpr,
):
    """One program per (request, KV head): the request's GROUP query heads of that KV head attend
    to its context, read in place from the paged cache TILE tokens at a time, with an online
    softmax in float32 (FlashAttention's recurrence), and write their rows of ``out``."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    length = tl.load(lengths_ptr + i)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = h * GROUP + g
    g_ok = g < GROUP
    d_ok = d < DIM
    q = tl.load(
        q_ptr + row * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(k_ptr.dtype.element_ty)
    if HAS_SINKS:  # a sink joins the softmax as a logit with no value: start from it
        m = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32)
        total = tl.full([GROUP_PAD], 1.0, tl.float32)
    else:
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first = 0
    if HAS_WINDOW:  # transformers' window: a key at kv_pos is seen while kv_pos > q_pos - window
        first = tl.maximum(length - window, 0)
    head_base = h.to(tl.int64) * head_stride
    table = blocks_ptr + i.to(tl.int64) * blocks_per_request
    # TILES covers the longest context the block tables hold, and a tile wholly outside this
    # request's context is skipped: Triton's interpreter takes no loop bound that is not constant
    for tile in range(0, TILES):
        start = tile * TILE
        if (start < length) & (start + TILE > first):
            t = start + tl.arange(0, TILE)
            t_ok = (t < length) & (t >= first)
            block = tl.load(table + t // block_size, mask=t_ok, other=0).to(tl.int64)
            offsets = head_base + (block * block_stride + (t % block_size) * DIM)[:, None] + d[None, :]
            kv_ok = t_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + offsets, mask=kv_ok, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(t_ok[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offsets, mask=kv_ok, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
    result = acc / total[:, None]
    tl.store(
        out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
    )


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, width, eps, WIDTH_PAD: tl.constexpr):
    """One program per row, with Llama's roundings: normalised in float32, rounded to the input's
    dtype, then multiplied by the weight and rounded again."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, WIDTH_PAD)
    ok = c < width
    x = tl.load(x_ptr + row * width + c, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / width
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + c, mask=ok, other=0.0)
    tl.store(out_ptr + row * width + c, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype), mask=ok)
