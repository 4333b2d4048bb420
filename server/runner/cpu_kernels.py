"""Attention, cache writes, few-row linears and RMSNorm for CPUs, in C: decodes read straight
from the paged cache, prompts causally, and steps of a few rows read oneDNN's packed weights in
place.

**Decodes.** The torch path (attention._decode) gathers every decoding request's blocks into a
padded copy before two batched matmuls, and the copy costs more than the matmuls. This kernel
walks each request's block table instead, reading each key and value once: per (request, KV
head) it scores the queries of that head's group, takes a float32 softmax over the context (the
sliding window, Gemma 2's logit cap and gpt-oss's sinks honoured), and sums the values, all in
float32 whatever the cache's dtype (float32 or bfloat16).

It is bound by memory: between layers the matmuls evict the cache, so keys and values come from
DRAM, and blocks lie anywhere in it, where the hardware prefetcher does not look. The cache keeps
a block of every KV head together (kv_cache.py). With AVX2 a thread takes a request's KV heads
all at once, block by block, so it reads each block's heads as one stretch (requests are split
into spans of heads only where there are too few for the threads); with AVX-512 it takes them
one at a time, each head's blocks next to those of the head it read before. Two streams are kept
in flight as well: while it scores a block of keys it prefetches the next block of keys and the
same block of values, and while it sums values it prefetches the keys of the item it takes next,
threads taking runs of items so that each knows its next one. The arithmetic is kept under the
reads: keys are scored as many at a time as the CPU's vector holds floats (8 with AVX2, 16 with
AVX-512), one vector partial sum per key, and the partial sums are then summed across lanes all
together by a shuffle tree; the softmax takes its exponentials sixteen at a time; values are
summed eight vectors of dimensions at a time, each value read start to end.

**Prompts.** torch's CPU SDPA (flash attention) computes a prompt's causal attention at a small
fraction of the machine's FMA rate. This kernel is bound by arithmetic instead: one KV head at a
time, its keys laid out in float32 tiles of 16 keys, dimension by dimension, scored in register
blocks of the CPU's own vectors (with AVX-512, eight queries by two vectors of keys: two loads
feed 16 independent FMA chains); blocks of 16 queries skip every tile past their last position;
an exact float32 softmax per query, with the same scoring options. In bfloat16 on CPUs with AMX
both products run in tiles instead (head sizes a multiple of 32), over keys and values packed as
the tiles read them, with the same blocks, masks and softmax.

**Cache writes.** A step's new keys and values land in rows scattered over a cache far larger
than the CPU's caches, so each row's write first reads its lines from DRAM, and torch's
``index_copy_`` takes those misses one row after another. The write kernel asks for every
destination line first (a prefetch for writing), so the misses overlap, then copies.

**Few-row linears.** oneDNN's kernels, built for many rows, read a packed weight at about half
the memory's rate when a decode step has only a few rows. This one streams each block of the
packed weight once, start to end, into up to six rows at a time (cpu_linear.py uses it for steps
of up to ``small_linear_rows()`` rows, on weights whose packed layout ``packed_block`` checked);
in float32, and in bfloat16 on CPUs with AVX512-BF16. On CPUs with AMX, whose bf16 packing is for
its tiles, a tile kernel streams that packing the same way.

**RMSNorm.** Llama's RMSNorm in one pass to sum and one to write, where transformers' module runs
eight tensor ops (fused_norms.py swaps it in).

**Rotary embedding.** transformers' ``apply_rotary_pos_emb`` for a query and a key in one call, bit
for bit (fused_rotary.py installs it), where transformers runs about ten tensor ops.

All of them are compiled on first use with the system's C compiler (``$CC``, default ``cc``) for
this CPU (``-march=native``) into ``$LLMFLEET_CACHE/kernels``, keyed by the source, the command
and the CPU's flags, and run in torch's own OpenMP threads (the same ``libgomp`` is already
loaded). Their arithmetic is written in the CPU's own vector width (``VL``), never in wider
generic vectors, which the compiler splits and, on AVX2, spills.
Without a compiler the torch paths run; ``LLMFLEET_CPU_KERNELS=0`` chooses them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmfleet.cache import cache_root

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t float_to_bf16(float f) {
    union { uint32_t u; float f; } c;
    c.f = f;
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16); /* round to nearest even */
}

/* element at of a float32 or bfloat16 tensor, as a float */
static inline float element(const void *p, int64_t at, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[at]) : ((const float *)p)[at];
}

/* A prompt's key tiles, and the softmax's runs of scores: 16 floats, so that the softmax's sums,
   LANES partial sums added in one order, are the same bits on every CPU */
#define LANES 16

/* The machine's own vector, for all arithmetic: 16 floats with AVX-512, 8 with AVX2, 4 elsewhere
   (NEON, SSE). Wider generic vectors are split by the compiler, and on AVX2 it spilled them. */
#if defined(__AVX512F__)
#define VL 16
#elif defined(__AVX__)
#define VL 8
#else
#define VL 4
#endif
typedef float fvec __attribute__((vector_size(VL * 4)));
typedef int32_t ivec __attribute__((vector_size(VL * 4)));

static inline fvec loadv(const void *p, int bf16) {
    fvec v;
    if (bf16) {
#if VL == 16
        /* one widening load: GCC splits the generic conversion below into 256-bit halves */
        const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16);
        memcpy(&v, &wide, sizeof v);
        return v;
#endif
        typedef uint16_t vh __attribute__((vector_size(VL * 2)));
        typedef uint32_t vu __attribute__((vector_size(VL * 4)));
        vh h;
        memcpy(&h, p, sizeof h);
        const vu w = __builtin_convertvector(h, vu) << 16;
        memcpy(&v, &w, sizeof v);
    } else {
        memcpy(&v, p, sizeof v);
    }
    return v;
}

/* One level of a transposed sum: a and b each hold keys' partial sums, h * 2 lanes per key, in
   order; the result holds a's keys then b's, h lanes each (lane i of the first half of each key's
   lanes, plus the same lane of the second half). */
#define HALF(i, h) (((i) / (h)) * 2 * (h) + (i) % (h))
#if VL == 16
#define MASK(h, o) ((ivec){HALF(0, h) + o, HALF(1, h) + o, HALF(2, h) + o, HALF(3, h) + o, HALF(4, h) + o, \
    HALF(5, h) + o, HALF(6, h) + o, HALF(7, h) + o, HALF(8, h) + o, HALF(9, h) + o, HALF(10, h) + o, \
    HALF(11, h) + o, HALF(12, h) + o, HALF(13, h) + o, HALF(14, h) + o, HALF(15, h) + o})
#elif VL == 8
#define MASK(h, o) ((ivec){HALF(0, h) + o, HALF(1, h) + o, HALF(2, h) + o, HALF(3, h) + o, HALF(4, h) + o, \
    HALF(5, h) + o, HALF(6, h) + o, HALF(7, h) + o})
#else
#define MASK(h, o) ((ivec){HALF(0, h) + o, HALF(1, h) + o, HALF(2, h) + o, HALF(3, h) + o})
#endif
#define FOLD(a, b, h) (__builtin_shuffle(a, b, MASK(h, 0)) + __builtin_shuffle(a, b, MASK(h, h)))

/* Lane t of the result is the sum of p[t]'s lanes: VL - 1 vector adds, not VL * VL scalar ones. */
static inline __attribute__((always_inline)) fvec reduce_lanes(fvec *p) {
#if VL == 16
    for (int j = 0; j < 8; j++) p[j] = FOLD(p[2 * j], p[2 * j + 1], 8);
#endif
#if VL >= 8
    for (int j = 0; j < 4; j++) p[j] = FOLD(p[2 * j], p[2 * j + 1], 4);
#endif
    for (int j = 0; j < 2; j++) p[j] = FOLD(p[2 * j], p[2 * j + 1], 2);
    return FOLD(p[0], p[1], 1);
}

/* e^r for r = x - n ln 2, n = round(x / ln 2), by a degree-7 polynomial (Cephes' expf); n out */
static inline fvec exp_reduced(fvec x, fvec *n_out) {
    const fvec n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    const fvec r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln 2, in two parts */
    fvec p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    *n_out = n;
    return p;
}

/* exp(x) for x <= 0 (scores less their max), within 2 ulp of expf, 0 below -87 (and for -inf):
   2^n * e^r with n = round(x / ln 2) and a degree-7 polynomial for e^r (Cephes' expf). */
static inline fvec expv(fvec x) {
    const ivec underflow = x < -87.0f;
    const fvec low = (fvec){0} - 87.0f;
    ivec xi, lowi;
    memcpy(&xi, &x, sizeof xi);
    memcpy(&lowi, &low, sizeof lowi);
    xi = (xi & ~underflow) | (lowi & underflow);  /* finite from here on */
    memcpy(&x, &xi, sizeof x);
    fvec n;
    const fvec p = exp_reduced(x, &n);
    const ivec bits = ((__builtin_convertvector(n, ivec) + 127) << 23) & ~underflow;
    fvec two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* a where mask, else b, lane by lane */
static inline fvec selectv(ivec mask, fvec a, fvec b) {
    ivec ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & mask) | (bi & ~mask);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* silu(x) = x / (1 + exp(-x)), torch's formula: exp_reduced's reduction and polynomial for any
   argument, 2^n applied as 2^(n - 1) * 2 so that n = 128 stays finite, inf above 88.72 and 0
   below -87 (where 1 + exp is 1 either way). Against torch's own silu on 2.5 * 10^5 random
   values: the same bits in bfloat16, one ulp apart on 0.5% in float32 (glibc's expf: 3.5%). */
static inline fvec siluv(fvec x) {
    fvec a = -x;
    const ivec over = a > 88.72f, under = a < -87.0f;
    a = selectv(over | under, (fvec){0}, a);
    fvec n;
    const fvec p = exp_reduced(a, &n);
    const ivec bits = (__builtin_convertvector(n, ivec) + 126) << 23;
    fvec half_two_n;
    memcpy(&half_two_n, &bits, sizeof half_two_n);
    fvec e = selectv(over, (fvec){0} + INFINITY, p * half_two_n * 2.0f);
    e = selectv(under, (fvec){0}, e);
    return x / (1.0f + e);
}

/* floats rounded to bfloat16 (to nearest, ties to even): their bits, in the low half of each
   lane, and as floats */
static inline ivec bf16_bits(fvec v) {
    ivec u;
    memcpy(&u, &v, sizeof u);
    typedef uint32_t uvec __attribute__((vector_size(VL * 4)));
    return (ivec)((uvec)(u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline fvec round_bf16(fvec v) {
    const ivec u = bf16_bits(v) << 16;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* s[t] = exp(s[t] - top) in place over count (a multiple of LANES) scores, -inf giving 0; returns
   their sum, plus exp(sink - top) where there is a sink (gpt-oss: a logit with no value to add) */
static inline float exp_sum16(float *s, int64_t count, float top, const float *sink) {
    fvec total[LANES / VL] = {{0}};
    for (int64_t t = 0; t < count; t += LANES)
        for (int h = 0; h < LANES / VL; h++) {
            fvec x;
            memcpy(&x, s + t + h * VL, sizeof x);
            x = expv(x - top);
            memcpy(s + t + h * VL, &x, sizeof x);
            total[h] += x;
        }
    float sum = 0.0f;
    for (int h = 0; h < LANES / VL; h++)
        for (int l = 0; l < VL; l++) sum += total[h][l];
    return sink ? sum + expf(*sink - top) : sum;
}

/* tanh(x): Cephes' tanhf's odd polynomial below |x| = 0.625, and 1 - 2e / (1 + e) with
   e = exp(-2|x|) above, which near 1 rounds as a correctly rounded tanh does nearly always
   (Cephes' (1 - e) / (1 + e) is a few ulp off there, and 1 + tanh(x), GeLU's, keeps the error) */
static inline fvec tanhv(fvec x) {
    ivec sign, bits;
    memcpy(&bits, &x, sizeof bits);
    sign = bits & ((ivec){0} + INT32_MIN);
    bits &= (ivec){0} + INT32_MAX;
    fvec a;
    memcpy(&a, &bits, sizeof a);  /* |x| */
    const fvec z = a * a;
    const fvec small = ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z +
                         1.33314422036e-1f) * z - 3.33332819422e-1f) * z * a + a;
    const fvec e = expv(-2.0f * a);
    fvec y = selectv(a < 0.625f, small, 1.0f - 2.0f * e / (1.0f + e));
    memcpy(&bits, &y, sizeof bits);
    bits |= sign;
    memcpy(&y, &bits, sizeof y);
    return y;
}

/* s[t] = cap * tanh(s[t] / cap) over count scores (Gemma 2's logit cap); the last count % VL
   with tanhf */
static inline void cap_scores(float *s, int64_t count, float cap) {
    int64_t t = 0;
    for (; t + VL <= count; t += VL) {
        fvec x;
        memcpy(&x, s + t, sizeof x);
        x = tanhv(x / cap) * cap;
        memcpy(s + t, &x, sizeof x);
    }
    for (; t < count; t++) s[t] = cap * tanhf(s[t] / cap);
}

/* gelu(x) by torch's tanh approximation, its formula term by term:
   0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f
static inline fvec gelu_tanhv(fvec x) {
    const fvec inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
    return 0.5f * x * (1.0f + tanhv(inner));
}

static inline float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_BETA * (x + GELU_KAPPA * (x * x * x))));
}

/* The VL scores at s + t, those outside [lo, pos] set to -inf (in s too): only a vector that
   straddles lo or pos is masked. */
static inline fvec masked_scores(float *s, int64_t t, int64_t lo, int64_t pos) {
    fvec x;
    memcpy(&x, s + t, sizeof x);
    if (t < lo || t + VL - 1 > pos) {
        ivec at;
        for (int l = 0; l < VL; l++) at[l] = (int32_t)t + l;
        x = selectv((at < (int32_t)lo) | (at > (int32_t)pos), (fvec){0} - INFINITY, x);
        memcpy(s + t, &x, sizeof x);
    }
    return x;
}

/* best, lane by lane the larger of it and the masked scores at s + t; NaNs are passed over, as
   ``s > top ? s : top`` does */
static inline fvec fold_top(float *s, int64_t t, int64_t lo, int64_t pos, fvec best) {
    const fvec x = masked_scores(s, t, lo, pos);
    return selectv(x > best, x, best);
}

/* the largest of top and best's lanes */
static inline float top_of(fvec best, float top) {
    for (int l = 0; l < VL; l++) top = best[l] > top ? best[l] : top;
    return top;
}

/* The largest of top and s[t] for t in [from, to) (multiples of LANES), after setting those
   outside [lo, pos] to -inf (masked_scores). */
static inline float masked_max(float *s, int64_t from, int64_t to, int64_t lo, int64_t pos, float top) {
    fvec best = (fvec){0} - INFINITY;
    for (int64_t t = from; t < to; t += VL) best = fold_top(s, t, lo, pos, best);
    return top_of(best, top);
}

/* out[at + d] = acc[d] * factor for d < dim, in the output's dtype */
static inline void store_row(void *out, int64_t at, const float *acc, float factor, int64_t dim, int bf16) {
    for (int64_t d = 0; d < dim; d++) {
        const float value = acc[d] * factor;
        if (bf16) ((uint16_t *)out)[at + d] = float_to_bf16(value);
        else ((float *)out)[at + d] = value;
    }
}

/* q . k for one key in the cache's dtype: runs of fewer than VL keys, head sizes that are not a
   multiple of VL */
static inline float dot(const float *q, const void *k, int64_t dim, int bf16) {
    float s = 0.0f;
    if (bf16) {
        const uint16_t *kh = k;
        #pragma omp simd reduction(+:s)
        for (int64_t d = 0; d < dim; d++) s += q[d] * bf16_to_float(kh[d]);
    } else {
        const float *kf = k;
        #pragma omp simd reduction(+:s)
        for (int64_t d = 0; d < dim; d++) s += q[d] * kf[d];
    }
    return s;
}

/* acc += p * v for one value: head sizes that are not a multiple of VL */
static inline void axpy(float *acc, float p, const void *v, int64_t dim, int bf16) {
    if (bf16) {
        const uint16_t *vh = v;
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] += p * bf16_to_float(vh[d]);
    } else {
        const float *vf = v;
        #pragma omp simd
        for (int64_t d = 0; d < dim; d++) acc[d] += p * vf[d];
    }
}

/* scores[t] = q . k_t for count (<= VL) keys lying one after another; inlined, so that the
   partial sums stay in registers (called, it spilled and zeroed them on the stack) */
static inline __attribute__((always_inline)) void score_keys(const float *q, const char *k, int64_t count,
                                                             int64_t dim, int64_t item_size, int bf16,
                                                             float *scores) {
    if (count < VL || dim % VL) {
        for (int64_t t = 0; t < count; t++) scores[t] = dot(q, k + t * dim * item_size, dim, bf16);
        return;
    }
    fvec partial[VL];
    for (int t = 0; t < VL; t++) partial[t] = (fvec){0};
    for (int64_t d = 0; d < dim; d += VL) {
        fvec qd;
        memcpy(&qd, q + d, sizeof qd);
        for (int t = 0; t < VL; t++) partial[t] += qd * loadv(k + (t * dim + d) * item_size, bf16);
    }
    const fvec s = reduce_lanes(partial);
    memcpy(scores, &s, sizeof s);
}

/* acc += p[t] v_t for W (<= 8) vectors of dimensions, each value read start to end: over five to
   eight vectors one sum per vector; over four or fewer two, even and odd values apart, so that
   eight sums are in flight */
static inline __attribute__((always_inline)) void add_value_run(float *acc, const float *p, const char *v,
                                                                int64_t count, int64_t row, int W, int bf16) {
    const int64_t lane = VL * (bf16 ? 2 : 4);
    fvec a[8], b[4];
    memcpy(a, acc, W * sizeof(fvec));
    int64_t t = 0;
    if (W <= 4) {
        for (int j = 0; j < W; j++) b[j] = (fvec){0};
        for (; t + 1 < count; t += 2, v += 2 * row)
            for (int j = 0; j < W; j++) {
                a[j] += p[t] * loadv(v + j * lane, bf16);
                b[j] += p[t + 1] * loadv(v + row + j * lane, bf16);
            }
    }
    for (; t < count; t++, v += row)
        for (int j = 0; j < W; j++) a[j] += p[t] * loadv(v + j * lane, bf16);
    if (W <= 4)
        for (int j = 0; j < W; j++) a[j] += b[j];
    memcpy(acc, a, W * sizeof(fvec));
}

/* acc += p[t] v_t over count (<= VL) values lying one after another, up to eight vectors of
   dimensions at a time */
static inline void add_values(float *acc, const float *p, const char *v, int64_t count, int64_t dim,
                              int64_t item_size, int bf16) {
    if (dim % VL) {
        for (int64_t t = 0; t < count; t++) axpy(acc, p[t], v + t * dim * item_size, dim, bf16);
        return;
    }
    const int64_t row = dim * item_size;
    for (int64_t d = 0; d < dim; d += 8 * VL) {
        float *a = acc + d;
        const char *at = v + d * item_size;
        switch ((dim - d) / VL < 8 ? (dim - d) / VL : 8) {
            case 1: add_value_run(a, p, at, count, row, 1, bf16); break;
            case 2: add_value_run(a, p, at, count, row, 2, bf16); break;
            case 3: add_value_run(a, p, at, count, row, 3, bf16); break;
            case 4: add_value_run(a, p, at, count, row, 4, bf16); break;
            case 5: add_value_run(a, p, at, count, row, 5, bf16); break;
            case 6: add_value_run(a, p, at, count, row, 6, bf16); break;
            case 7: add_value_run(a, p, at, count, row, 7, bf16); break;
            default: add_value_run(a, p, at, count, row, 8, bf16);
        }
    }
}

/* Blocks lie anywhere in the cache, where the hardware prefetcher does not look: ask for a block
   one step ahead of its use (further ahead was slower on a Zen 4), into L2 (locality 2): asked
   into L1, the scattered blocks read at about half the rate. */
static inline void prefetch(const char *p, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

void llmfleet_paged_decode(
    const void *q, int64_t q_token_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int64_t block_stride, int64_t head_stride,
    const int64_t *rows, const int64_t *blocks, int64_t blocks_per_request, const int64_t *lengths, int64_t n,
    void *out, int64_t out_token_stride, int64_t out_head_stride,
    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
    float scale, int64_t window, float softcap, const float *sinks, int bf16, int num_threads) {
    const int64_t group = heads / kv_heads, item_size = bf16 ? 2 : 4;
    const int64_t block_bytes = block_size * dim * item_size, block_jump = block_stride * item_size;
    const int64_t head_jump = head_stride * item_size;
    /* an item is a request's span of KV heads. A block holds its KV heads side by side: with
       AVX2 an item takes them all where there are requests enough for the threads, and reads
       each block's heads as one stretch, which the memory serves faster than scattered 4 KB
       pieces; with AVX-512 an item is one KV head, which read as fast there */
#if VL == 8
    int64_t parts = (4 * num_threads + n - 1) / n;
    parts = parts < 1 ? 1 : parts > kv_heads ? kv_heads : parts;
#else
    int64_t parts = kv_heads;
#endif
    const int64_t span = (kv_heads + parts - 1) / parts;
    parts = (kv_heads + span - 1) / span;
    /* threads take runs of items, so each knows its next item: the one after, within its run */
    const int64_t items = n * parts, run = items / (8 * num_threads) > 1 ? items / (8 * num_threads) : 1;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, run)
    for (int64_t item = 0; item < items; item++) {
        const int64_t i = item / parts, h0 = (item % parts) * span;
        const int64_t own = kv_heads - h0 < span ? kv_heads - h0 : span, lanes = own * group;
        const int64_t length = lengths[i];
        const int64_t first = (window > 0 && length > window) ? length - window : 0;
        const int64_t ctx = length - first, padded = (ctx + LANES - 1) / LANES * LANES;
        float *scores = malloc(sizeof(float) * lanes * padded);
        float *queries = malloc(sizeof(float) * lanes * dim);
        float *acc = calloc(lanes * dim, sizeof(float));
        float *sums = malloc(sizeof(float) * lanes);
        const int64_t *table = blocks + i * blocks_per_request;
        const char *keys = (const char *)k_cache + h0 * head_jump;
        const char *values = (const char *)v_cache + h0 * head_jump;
        const char *next_keys = NULL;  /* the item this thread takes next */
        const int64_t *next_table = NULL;
        int64_t next_first = 0, next_length = 0, next_own = 0;
        if ((item + 1) % run != 0 && item + 1 < items) {
            const int64_t i2 = (item + 1) / parts, h2 = ((item + 1) % parts) * span;
            next_length = lengths[i2];
            next_first = (window > 0 && next_length > window) ? next_length - window : 0;
            next_table = blocks + i2 * blocks_per_request;
            next_keys = (const char *)k_cache + h2 * head_jump;
            next_own = kv_heads - h2 < span ? kv_heads - h2 : span;
        }
        /* lane r: KV head h0 + r / group, query head h0 * group + r */
        for (int64_t r = 0; r < lanes; r++) {
            const int64_t at = rows[i] * q_token_stride + (h0 * group + r) * q_head_stride;
            for (int64_t d = 0; d < dim; d++) queries[r * dim + d] = scale * element(q, at + d, bf16);
        }
        /* positions first .. length - 1, block by block, each block's heads in turn, in runs of up
           to VL keys */
        for (int64_t h = 0; h < own; h++)
            prefetch(keys + table[first / block_size] * block_jump + h * head_jump, block_bytes);
        for (int64_t b = first / block_size, from = first; from < length; b++) {
            const int64_t stop = (b + 1) * block_size < length ? (b + 1) * block_size : length;
            const char *key_block = keys + table[b] * block_jump;
            const char *next_block = stop < length ? keys + table[b + 1] * block_jump : NULL;
            const char *value_block = values + table[b] * block_jump;  /* summed after the softmax */
            for (int64_t h = 0; h < own; h++) {
                if (next_block) prefetch(next_block + h * head_jump, block_bytes);
                prefetch(value_block + h * head_jump, block_bytes);
                for (int64_t pos = from, count; pos < stop; pos += count) {
                    count = stop - pos < VL ? stop - pos : VL;
                    const char *k = key_block + h * head_jump + (pos - b * block_size) * dim * item_size;
                    for (int64_t r = h * group; r < (h + 1) * group; r++)
                        score_keys(queries + r * dim, k, count, dim, item_size, bf16,
                                   scores + r * padded + pos - first);
                }
            }
            from = stop;
        }
        for (int64_t r = 0; r < lanes; r++) {
            float *sr = scores + r * padded;
            /* Gemma 2's logit cap; gpt-oss's sink: a logit in the softmax with no value to add */
            if (softcap > 0.0f) cap_scores(sr, ctx, softcap);
            const float *sink = sinks ? sinks + h0 * group + r : NULL;
            float top = sink ? *sink : -INFINITY;
            top = masked_max(sr, 0, padded, 0, ctx - 1, top);
            sums[r] = exp_sum16(sr, padded, top, sink);
        }
        for (int64_t b = first / block_size, from = first; from < length; b++) {
            const int64_t stop = (b + 1) * block_size < length ? (b + 1) * block_size : length;
            const char *value_block = values + table[b] * block_jump;
            const char *next_item_block = NULL;  /* the next item's keys, while this one's values are summed */
            if (next_keys) {
                const int64_t j = next_first / block_size + (b - first / block_size);
                if (j * block_size < next_length) next_item_block = next_keys + next_table[j] * block_jump;
            }
            for (int64_t h = 0; h < own; h++) {
                if (next_item_block && h < next_own) prefetch(next_item_block + h * head_jump, block_bytes);
                for (int64_t pos = from, count; pos < stop; pos += count) {
                    count = stop - pos < VL ? stop - pos : VL;
                    const char *v = value_block + h * head_jump + (pos - b * block_size) * dim * item_size;
                    for (int64_t r = h * group; r < (h + 1) * group; r++)
                        add_values(acc + r * dim, scores + r * padded + pos - first, v, count, dim, item_size, bf16);
                }
            }
            from = stop;
        }
        for (int64_t r = 0; r < lanes; r++)
            store_row(out, rows[i] * out_token_stride + (h0 * group + r) * out_head_stride, acc + r * dim,
                      1.0f / sums[r], dim, bf16);
        free(scores); free(queries); free(acc); free(sums);
    }
}

/* Prompt attention, causal, for one request's chunk: queries at positions ctx - n .. ctx - 1
   attend keys 0 .. their own position (and no further back than the window). Per KV head, its
   keys are first laid out in float32 tiles of 16 keys, dimension-major, and its values in float32
   rows; then each (query head, block of 16 queries) is an item: scores for RG queries at a time
   against NV of the machine's vectors of keys (NV vector loads to RG broadcasts, RG * NV
   independent FMA chains), an exact softmax per query, then the values summed the same way, NV
   vectors of dimensions at a time. Tiles past a block's last position are skipped, so the causal
   half costs (almost) nothing. The passes are written in the machine's own vector (VL floats):
   AVX2 has 16 vector registers, and 16-float vectors split in two there spilled every sum to the
   stack. */
#define QB 16
#if VL == 16
#define RG 8  /* queries per pass */
#define NV 2  /* vectors of keys or dimensions per pass: 16 sums in registers, of 32 */
#elif VL == 8
#define RG 4
#define NV 2  /* 8 sums, of 16 registers */
#else
#define RG 4
#define NV 4
#endif

/* scores[j * stride + key - key0] = q_j . k_key for RG queries (q, rows of dim) and the w * VL keys
   from key0 (a multiple of VL) in tiles kt; each query's element is loaded once for w vectors */
static inline __attribute__((always_inline)) void score_pass(const float *q, const float *kt, int64_t key0, int w,
                                                             int64_t dim, float *scores, int64_t stride) {
    fvec s[NV][RG];
    const float *k[NV];
    for (int i = 0; i < w; i++) {
        const int64_t key = key0 + i * VL;
        k[i] = kt + (key / LANES) * dim * LANES + key % LANES;
        for (int j = 0; j < RG; j++) s[i][j] = (fvec){0};
    }
    for (int64_t d = 0; d < dim; d++) {
        fvec key[NV];
        for (int i = 0; i < w; i++) memcpy(&key[i], k[i] + d * LANES, sizeof key[i]);
        for (int j = 0; j < RG; j++) {
            const float x = q[j * dim + d];
            for (int i = 0; i < w; i++) s[i][j] += x * key[i];
        }
    }
    for (int i = 0; i < w; i++)
        for (int j = 0; j < RG; j++) memcpy(scores + j * stride + i * VL, &s[i][j], sizeof s[i][j]);
}

/* acc[j * dim + d0 ...] = sum over keys [from, to) of p_j[key] v_key for RG rows of weights p
   (rows stride apart) and the w * VL dimensions from d0 of the value rows vf; each weight is loaded
   once for w vectors */
static inline __attribute__((always_inline)) void value_pass(const float *p, int64_t stride, const float *vf,
                                                             int64_t from, int64_t to, int64_t d0, int w,
                                                             int64_t dim, float *acc) {
    fvec a[NV][RG];
    for (int i = 0; i < w; i++)
        for (int j = 0; j < RG; j++) a[i][j] = (fvec){0};
    for (int64_t t = from; t < to; t++) {
        fvec value[NV];
        for (int i = 0; i < w; i++) memcpy(&value[i], vf + t * dim + d0 + i * VL, sizeof value[i]);
        for (int j = 0; j < RG; j++) {
            const float x = p[j * stride + t];
            for (int i = 0; i < w; i++) a[i][j] += x * value[i];
        }
    }
    for (int i = 0; i < w; i++)
        for (int j = 0; j < RG; j++) memcpy(acc + j * dim + d0 + i * VL, &a[i][j], sizeof a[i][j]);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
static int prefill_attention_amx(
    const void *q, int64_t q_token_stride, int64_t q_head_stride,
    const void *k, int64_t k_token_stride, int64_t k_head_stride,
    const void *v, int64_t v_token_stride, int64_t v_head_stride,
    int64_t n, int64_t ctx,
    void *out, int64_t out_token_stride, int64_t out_head_stride,
    int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int64_t window, float softcap, const float *sinks, int num_threads);
#endif

void llmfleet_prefill_attention(
    const void *q, int64_t q_token_stride, int64_t q_head_stride,
    const void *k, int64_t k_token_stride, int64_t k_head_stride,
    const void *v, int64_t v_token_stride, int64_t v_head_stride,
    int64_t n, int64_t ctx,
    void *out, int64_t out_token_stride, int64_t out_head_stride,
    int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int64_t window, float softcap, const float *sinks, int bf16, int num_threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (bf16 && prefill_attention_amx(q, q_token_stride, q_head_stride, k, k_token_stride, k_head_stride, v,
                                      v_token_stride, v_head_stride, n, ctx, out, out_token_stride,
                                      out_head_stride, heads, kv_heads, dim, scale, window, softcap, sinks,
                                      num_threads))
        return;
#endif
    const int64_t group = heads / kv_heads, tiles = (ctx + LANES - 1) / LANES, padded = tiles * LANES;
    const int64_t blocks = (n + QB - 1) / QB;
    float *kt = malloc(sizeof(float) * padded * dim), *vf = malloc(sizeof(float) * padded * dim);
    #pragma omp parallel num_threads(num_threads)
    {
        float *queries = malloc(sizeof(float) * QB * dim), *scores = malloc(sizeof(float) * QB * padded);
        float *acc = malloc(sizeof(float) * QB * dim), sums[QB];
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {  /* one KV head at a time: it stays in cache */
            #pragma omp for
            for (int64_t tile = 0; tile < tiles; tile++) {
                for (int64_t t = tile * LANES; t < (tile + 1) * LANES; t++) {
                    const int64_t at_k = t * k_token_stride + kvh * k_head_stride;
                    const int64_t at_v = t * v_token_stride + kvh * v_head_stride;
                    for (int64_t d = 0; d < dim; d++) {
                        kt[(tile * dim + d) * LANES + t % LANES] = t < ctx ? element(k, at_k + d, bf16) : 0.0f;
                        vf[t * dim + d] = t < ctx ? element(v, at_v + d, bf16) : 0.0f;
                    }
                }
            }
            /* the last blocks of queries, which attend the most keys, first */
            #pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < group * blocks; item++) {
                const int64_t block = blocks - 1 - item / group, h = kvh * group + item % group;
                const int64_t row0 = block * QB, rows = n - row0 < QB ? n - row0 : QB;
                const int64_t last = ctx - n + row0 + rows - 1;  /* the block's last query position */
                const int64_t first = ctx - n + row0 - window + 1;  /* the block's first query's first key */
                const int64_t tile0 = window > 0 && first > 0 ? first / LANES : 0, tile1 = last / LANES + 1;
                for (int64_t r = 0; r < QB; r++)
                    for (int64_t d = 0; d < dim; d++) {
                        const int64_t at = (row0 + r) * q_token_stride + h * q_head_stride + d;
                        queries[r * dim + d] = r < rows ? scale * element(q, at, bf16) : 0.0f;
                    }
                for (int64_t r = 0; r < QB; r += RG) {
                    int64_t key = tile0 * LANES;
                    for (; key + NV * VL <= tile1 * LANES; key += NV * VL)
                        score_pass(queries + r * dim, kt, key, NV, dim, scores + r * padded + key, padded);
                    for (; key < tile1 * LANES; key += VL)
                        score_pass(queries + r * dim, kt, key, 1, dim, scores + r * padded + key, padded);
                }
                for (int64_t r = 0; r < QB; r++) {
                    const int64_t pos = r < rows ? ctx - n + row0 + r : last;
                    const int64_t lo = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
                    float *sr = scores + r * padded;
                    const float *sink = sinks ? sinks + h : NULL;
                    float top = sink ? *sink : -INFINITY;
                    if (softcap > 0.0f) cap_scores(sr + tile0 * LANES, (tile1 - tile0) * LANES, softcap);
                    top = masked_max(sr, tile0 * LANES, tile1 * LANES, lo, pos, top);
                    sums[r] = exp_sum16(sr + tile0 * LANES, (tile1 - tile0) * LANES, top, sink);
                }
                for (int64_t r = 0; r < QB; r += RG) {
                    int64_t d = 0;
                    for (; d + NV * VL <= dim; d += NV * VL)
                        value_pass(scores + r * padded, padded, vf, tile0 * LANES, tile1 * LANES, d, NV, dim,
                                   acc + r * dim);
                    for (; d < dim; d += VL)
                        value_pass(scores + r * padded, padded, vf, tile0 * LANES, tile1 * LANES, d, 1, dim,
                                   acc + r * dim);
                }
                for (int64_t r = 0; r < rows; r++)
                    store_row(out, (row0 + r) * out_token_stride + h * out_head_stride, acc + r * dim, 1.0f / sums[r],
                              dim, bf16);
            }
        }
        free(queries); free(scores); free(acc);
    }
    free(kt); free(vf);
}

/* This step's keys and values into the cache: row t of head h of key (value) to slot slots[t]
   of head h, at block slots[t] / block_size, offset slots[t] % block_size. Every destination line
   is requested first, so that their misses overlap. Returns -1, having written nothing, where a
   slot is outside the cache; 0 otherwise. */
int llmfleet_kv_write(char *k_cache, char *v_cache, int64_t num_blocks, int64_t block_size, int64_t block_stride,
                       int64_t head_stride, const int64_t *slots, int64_t n,
                       const char *key, int64_t k_head_stride, int64_t k_token_stride,
                       const char *value, int64_t v_head_stride, int64_t v_token_stride,
                       int64_t kv_heads, int64_t dim, int64_t item_size) {
    const int64_t row = dim * item_size;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return -1;
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = ((slots[t] / block_size) * block_stride + (slots[t] % block_size) * dim) * item_size;
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t b = 0; b < row; b += 64) {
                __builtin_prefetch(k_cache + at + h * head_stride * item_size + b, 1, 3);
                __builtin_prefetch(v_cache + at + h * head_stride * item_size + b, 1, 3);
            }
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t at = ((slots[t] / block_size) * block_stride + (slots[t] % block_size) * dim) * item_size;
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t to = at + h * head_stride * item_size;
            memcpy(k_cache + to, key + (h * k_head_stride + t * k_token_stride) * item_size, row);
            memcpy(v_cache + to, value + (h * v_head_stride + t * v_token_stride) * item_size, row);
        }
    }
    return 0;
}

/* Linears of a few rows over the weight oneDNN packed at load (cpu_linear.py), read in place: in
   float32 oneDNN lays a [N, K] weight out as [N / 64][K][64], each block of 64 output columns
   K rows of 64 floats, one after another (cpu_kernels.packed_block checks this at load, and the
   kernel is not used where it differs). A slice of a block's columns (SL_VECS vectors) is read
   once, start to end, for up to SL_ROWS rows of x at a time, one FMA chain per output, so a
   step's few rows stream the weights at the memory's rate where oneDNN's kernels, built for
   many rows, reach about half of it. Each output is summed over k in one order whatever the
   row count, so a row's result does not depend on the rows beside it. Steps of three rows or
   more (every step on AVX2) go through the weights in L1 chunks instead (SMALL_LINEAR_CHUNKS, below). */
#if VL == 16
#define SL_ROWS 6  /* 24 accumulators, 4 weight vectors and a broadcast of 32 registers */
#define SL_MAX_M 32
#elif VL == 8
#define SL_ROWS 6  /* (chunk_pass) 12 accumulators, 2 weight vectors and a broadcast of 16 */
#define SL_MAX_M 32
#else
#define SL_ROWS 4
#define SL_MAX_M 0  /* not measured: oneDNN's kernels throughout */
#endif
#define SL_VECS 4
#define SL_SLICE (SL_VECS * VL)

/* Weights to fetch into L2 while a pass over a slice runs (none where ``at`` is NULL): a share of
   the next slice's, a few lines at each of the pass's first steps. Where rows take several passes,
   the first streams the slice from memory while the others read it from L2, so without this the
   memory sits idle through the later passes and the arithmetic through the first; and a single
   pass of 3-6 rows, with more work per line than one of a row or two, reads memory below its
   rate unless its next lines were asked for ahead. */
typedef struct {
    const char *at, *end;
} fetch_ahead;

/* Pass ``run`` of ``runs``'s share of the ``lines`` lines at ``next`` (none where ``next`` is NULL) */
static inline fetch_ahead fetch_share(const char *next, int64_t lines, int64_t run, int64_t runs) {
    if (!next) return (fetch_ahead){NULL, NULL};
    return (fetch_ahead){next + run * lines / runs * 64, next + (run + 1) * lines / runs * 64};
}

/* Lines per step to fetch ``ahead`` over ``steps`` steps, and in how many steps that is done */
static inline int64_t fetch_pace(fetch_ahead ahead, int64_t steps, int64_t *until) {
    *until = 0;
    if (!ahead.at || steps <= 0) return 0;
    const int64_t lines = (ahead.end - ahead.at) / 64, per = (lines + steps - 1) / steps;
    *until = per ? (lines + per - 1) / per : 0;
    return per;
}

/* The k loop of a pass, its first ``until`` steps also fetching ``per`` lines each; STEP(kk) is
   the loop's body. Two loops, so a pass that fetches nothing runs no test for it. */
#define FETCHING_LOOP(k, ahead, STEP) do { \
    int64_t until_; \
    const int64_t per_ = fetch_pace(ahead, k, &until_); \
    const char *at_ = ahead.at; \
    int64_t kk_ = 0; \
    for (; kk_ < until_; kk_++, at_ += per_ * 64) { \
        for (int64_t i_ = 0; i_ < per_; i_++) __builtin_prefetch(at_ + i_ * 64, 0, 2); \
        STEP(kk_); \
    } \
    for (; kk_ < (k); kk_++) STEP(kk_); \
} while (0)

static inline __attribute__((always_inline)) void slice_rows(const float *x, int64_t k, const float *w,
        const float *bias, float *out, int64_t n, int64_t col0, const int rows, fetch_ahead ahead) {
    fvec acc[SL_ROWS][SL_VECS];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < SL_VECS; c++) acc[r][c] = (fvec){0};
#define SL_STEP(kk) do { \
        fvec wv[SL_VECS]; \
        _Pragma("GCC unroll 8") for (int c = 0; c < SL_VECS; c++) \
            memcpy(&wv[c], w + (kk) * 64 + c * VL, sizeof(fvec)); \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) { \
            const float xv = x[r * k + (kk)]; \
            _Pragma("GCC unroll 8") for (int c = 0; c < SL_VECS; c++) acc[r][c] += xv * wv[c]; \
        } \
    } while (0)
    FETCHING_LOOP(k, ahead, SL_STEP);
#undef SL_STEP
    const int64_t cols = n - col0 < SL_SLICE ? n - col0 : SL_SLICE;
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 8") for (int c = 0; c < SL_VECS; c++) {
            float lanes[VL];
            const fvec v = acc[r][c];  /* a copy: the accumulators stay in registers */
            memcpy(lanes, &v, sizeof v);
            for (int l = 0; l < VL && c * VL + l < cols; l++)
                out[r * n + col0 + c * VL + l] = lanes[l] + (bias ? bias[col0 + c * VL + l] : 0.0f);
        }
}

/* The loop both dtypes' kernels run: threads take runs of column slices of width SLICE (a block
   of 64 columns is k * 64 elements in either layout), and each slice's rows go in balanced passes
   of at most SL_ROWS (8 rows: two passes of 4, not 6 and 2) through SLICE_FN, whose row count is
   a constant in each call, so its accumulators stay in registers. Where a slice is a whole block
   and has SL_FETCH_ROWS rows or more, each pass fetches its share of the next block (fetch_ahead). */
#if SL_ROWS >= 6
#define SL_CASES(fn) SL_CASE(fn, 1) SL_CASE(fn, 2) SL_CASE(fn, 3) SL_CASE(fn, 4) SL_CASE(fn, 5) SL_CASE(fn, 6)
#elif SL_ROWS >= 4
#define SL_CASES(fn) SL_CASE(fn, 1) SL_CASE(fn, 2) SL_CASE(fn, 3) SL_CASE(fn, 4)
#else
#define SL_CASES(fn) SL_CASE(fn, 1) SL_CASE(fn, 2)
#endif
#define SL_FETCH_ROWS 3  /* fewer rows read memory at its rate without the fetch */
#define SL_CASE(fn, r) case r: fn(xr, k, ws, bias, o, n, col0, r, ahead); break;
#define SMALL_LINEAR_SLICES(T, SLICE, SLICE_FN) do { \
    const int64_t slices = (n + (SLICE) - 1) / (SLICE), passes = (m + SL_ROWS - 1) / SL_ROWS; \
    const int64_t per_pass = (m + passes - 1) / passes, runs = (m + per_pass - 1) / per_pass; \
    const int64_t block_lines = (SLICE) == 64 && m >= SL_FETCH_ROWS ? k * 64 * (int64_t)sizeof(T) / 64 : 0; \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)") \
    for (int64_t s = 0; s < slices; s++) { \
        const int64_t col0 = s * (SLICE); \
        const T *ws = w + (col0 / 64) * k * 64 + col0 % 64; \
        const char *next = block_lines && s + 1 < slices ? (const char *)(w + (s + 1) * k * 64) : NULL; \
        for (int64_t run = 0, r0 = 0; r0 < m; run++, r0 += per_pass) { \
            const int64_t rows = m - r0 < per_pass ? m - r0 : per_pass; \
            const T *xr = x + r0 * k; \
            T *o = out + r0 * n; \
            const fetch_ahead ahead = fetch_share(next, block_lines, run, runs); \
            switch (rows) { SL_CASES(SLICE_FN) } \
        } \
    } \
} while (0)

#if VL == 8 || VL == 16
/* A block of 64 columns in L1 chunks. AVX2's 16 registers hold the sums of 6 rows by 16 columns
   (12 vectors, beside 2 of weights and a broadcast): a quarter of a block, so each 256-byte k row
   of a block is read by four passes; AVX-512's 32 hold 6 rows by the whole 64 (24 vectors, 4 of
   weights and a broadcast). A block goes through in chunks of SLK k rows, which stay in L1 while
   every pass over them runs; each pass keeps its sums in a tile between chunks (still one sum per
   output, in k order), and the passes over a chunk fetch the next one, contiguous in the block,
   into L2. */
#define SLK 64
#define CQ (VL == 8 ? 2 : 4)    /* vectors of columns a pass sums */

static inline __attribute__((always_inline)) void chunk_pass(const float *x, int64_t k, const float *w,
        int64_t steps, float *tile, const int first, const int rows, fetch_ahead ahead) {
    fvec acc[SL_ROWS][CQ];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < CQ; c++) {
            if (first) acc[r][c] = (fvec){0};
            else memcpy(&acc[r][c], tile + r * 64 + c * VL, sizeof(fvec));
        }
#define SQ_STEP(kk) do { \
        fvec wv[CQ]; \
        _Pragma("GCC unroll 4") for (int c = 0; c < CQ; c++) memcpy(&wv[c], w + (kk) * 64 + c * VL, sizeof(fvec)); \
        _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) { \
            const float xv = x[r * k + (kk)]; \
            _Pragma("GCC unroll 4") for (int c = 0; c < CQ; c++) acc[r][c] += xv * wv[c]; \
        } \
    } while (0)
    FETCHING_LOOP(steps, ahead, SQ_STEP);
#undef SQ_STEP
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < CQ; c++) memcpy(tile + r * 64 + c * VL, &acc[r][c], sizeof(fvec));
}

/* The loop both dtypes' chunked kernels run (their PASS_FN sums a chunk's ``steps`` inputs for
   ``rows`` rows, chunk_pass here): threads take blocks of 64 columns (``cols`` of them real),
   each block in chunks of SLK inputs, every pass of at most SL_ROWS rows over every slice of
   PASS_COLS columns of a chunk while it is in L1, each fetching its share of the next chunk (the
   block's next, or the next block's first) into L2. Sums wait in a float32 tile; TO_OUT writes
   one (bias added) as T. */
#define CHUNK_CASE(fn, r) case r: fn(xr, k, wq, steps, tq + r0 * 64, k0 == 0, r, ahead); break;
#define SMALL_LINEAR_CHUNKS(T, PASS_COLS, PASS_FN, TO_OUT) do { \
    const int64_t blocks = (n + 63) / 64, lines_per_input = 64 * (int64_t)sizeof(T) / 64; \
    const int64_t passes = (m + SL_ROWS - 1) / SL_ROWS, per_pass = (m + passes - 1) / passes; \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)") \
    for (int64_t b = 0; b < blocks; b++) { \
        const T *wb = w + b * k * 64; \
        const char *next = b + 1 < blocks ? (const char *)(wb + k * 64) : NULL; \
        const int64_t col0 = b * 64, cols = n - col0 < 64 ? n - col0 : 64; \
        float tile[SL_MAX_M * 64]; \
        for (int64_t k0 = 0; k0 < k; k0 += SLK) { \
            const int64_t steps = k - k0 < SLK ? k - k0 : SLK; \
            const int64_t ahead_k0 = k0 + SLK < k ? k0 + SLK : 0; \
            const char *ahead_at = ahead_k0 ? (const char *)(wb + ahead_k0 * 64) : next; \
            const int64_t ahead_steps = k - ahead_k0 < SLK ? k - ahead_k0 : SLK; \
            int64_t run = 0; \
            for (int q = 0; q < 64 / (PASS_COLS); q++) { \
                const T *wq = wb + k0 * 64 + q * (PASS_COLS); \
                float *tq = tile + q * (PASS_COLS); \
                for (int64_t r0 = 0; r0 < m; r0 += per_pass, run++) { \
                    const int64_t rows = m - r0 < per_pass ? m - r0 : per_pass; \
                    const T *xr = x + r0 * k + k0; \
                    const fetch_ahead ahead = \
                        fetch_share(ahead_at, ahead_steps * lines_per_input, run, 64 / (PASS_COLS) * passes); \
                    switch (rows) { \
                        CHUNK_CASE(PASS_FN, 1) CHUNK_CASE(PASS_FN, 2) CHUNK_CASE(PASS_FN, 3) \
                        CHUNK_CASE(PASS_FN, 4) CHUNK_CASE(PASS_FN, 5) CHUNK_CASE(PASS_FN, 6) \
                    } \
                } \
            } \
        } \
        for (int64_t r = 0; r < m; r++) \
            for (int64_t c = 0; c < cols; c++) \
                out[r * n + col0 + c] = TO_OUT(tile[r * 64 + c] + (bias ? bias[col0 + c] : 0.0f)); \
    } \
} while (0)
#define AS_FLOAT(v) (v)
#endif

/* out (m, n) = x (m, k) . w^T + bias, w packed as above. AVX2 runs every step in L1 chunks;
   AVX-512 those of SL_FETCH_ROWS rows or more, whose passes run from L1 while the next chunk
   comes in (fewer read memory at its rate in one pass over whole slices). */
void llmfleet_small_linear(const float *x, int64_t m, int64_t k, const float *w, int64_t n, const float *bias,
                           float *out, int num_threads) {
#if VL == 8 || VL == 16
    if (VL == 8 || m >= SL_FETCH_ROWS) {
        SMALL_LINEAR_CHUNKS(float, CQ * VL, chunk_pass, AS_FLOAT);
        return;
    }
#endif
#if VL != 8
    SMALL_LINEAR_SLICES(float, SL_SLICE, slice_rows);
#endif
}

/* The most rows the kernel above is used for on this CPU (0: none) */
int llmfleet_small_linear_rows(void) { return SL_MAX_M; }

/* The same for bfloat16, on CPUs with AVX512-BF16: oneDNN packs a bf16 weight in pairs of its
   inputs, [out / 64][in / 2][64][2], the layout VDPBF16PS takes, which multiplies 16 columns'
   pairs by a broadcast pair of x and adds both products to float32 sums. Bias in float32; each
   output rounded to bfloat16 once, at the end. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define SLB_MAX_M 32

/* One pair of inputs into the sums of ``rows`` rows by 64 columns (both bf16 passes below) */
#define SLB_STEP(kp) do { \
    __m512bh wv[4]; \
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) \
        wv[c] = (__m512bh)_mm512_loadu_si512(w + (kp) * 128 + c * 32); \
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++) { \
        int32_t pair; \
        memcpy(&pair, x + r * k + 2 * (kp), sizeof pair); \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair); \
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]); \
    } \
    } while (0)

static inline __attribute__((always_inline)) void slice_rows_bf16(const uint16_t *x, int64_t k, const uint16_t *w,
        const float *bias, uint16_t *out, int64_t n, int64_t col0, const int rows, fetch_ahead ahead) {
    __m512 acc[SL_ROWS][4];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    FETCHING_LOOP(pairs, ahead, SLB_STEP);
    const int64_t cols = n - col0 < 64 ? n - col0 : 64;
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            float lanes[16];
            _mm512_storeu_ps(lanes, acc[r][c]);
            for (int l = 0; l < 16 && c * 16 + l < cols; l++)
                out[r * n + col0 + c * 16 + l] = float_to_bf16(lanes[l] + (bias ? bias[col0 + c * 16 + l] : 0.0f));
        }
}

/* A pass over one L1 chunk of a block, ``steps`` inputs (steps / 2 pairs), its sums kept in a
   tile between chunks, as chunk_pass runs float32; the same sums in the same order as
   slice_rows_bf16 */
_Static_assert(SLB_MAX_M <= SL_MAX_M, "SMALL_LINEAR_CHUNKS' tile holds SL_MAX_M rows");
static inline __attribute__((always_inline)) void chunk_pass_bf16(const uint16_t *x, int64_t k, const uint16_t *w,
        int64_t steps, float *tile, const int first, const int rows, fetch_ahead ahead) {
    __m512 acc[SL_ROWS][4];
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
            acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(tile + r * 64 + c * 16);
    FETCHING_LOOP(steps / 2, ahead, SLB_STEP);
    _Pragma("GCC unroll 8") for (int r = 0; r < rows; r++)
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) _mm512_storeu_ps(tile + r * 64 + c * 16, acc[r][c]);
}
#undef SLB_STEP

/* out (m, n) = x (m, k) . w^T + bias for bfloat16 x, w and out (k even); steps of SL_FETCH_ROWS
   rows or more in L1 chunks, as in float32 */
void llmfleet_small_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                                const float *bias, uint16_t *out, int num_threads) {
    if (m >= SL_FETCH_ROWS) {
        SMALL_LINEAR_CHUNKS(uint16_t, 64, chunk_pass_bf16, float_to_bf16);
        return;
    }
    SMALL_LINEAR_SLICES(uint16_t, 64, slice_rows_bf16);
}
#else
#define SLB_MAX_M 0
void llmfleet_small_linear_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                                const float *bias, uint16_t *out, int num_threads) {}
#endif

int llmfleet_small_linear_bf16_rows(void) { return SLB_MAX_M; }

/* The same over the packing oneDNN gives bf16 weights on CPUs with AMX, [out / 32][in / 2][32][2]:
   a block of 32 columns is two tiles of 16 columns' pairs for each 32 inputs, which the tile
   instructions multiply by a tile of up to 16 rows of x (a second pass for rows 17-32 finds the
   block in L2, and both passes fetch the next block, fetch_ahead). Each thread streams its blocks
   start to end; oneDNN's tile kernels, built for many rows, read the same weights 1.1-1.3x slower
   at 1-32 rows, and sum in the same order (the outputs are its bits). The input size must be a
   multiple of 32. The tiles need the kernel's leave, asked for once (arch_prctl); without it the
   kernel says it takes no rows. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_MAX_M 32

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(int rows) {  /* tiles 0, 1: sums; 2: x; 3, 4: weights */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 5; t++) {
        config.rows[t] = t < 3 ? rows : 16;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

void llmfleet_small_linear_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                               const float *bias, uint16_t *out, int num_threads) {
    const int64_t blocks = (n + 31) / 32;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        int configured = 0;
        float sums[16 * 32];
        const int64_t runs = (m + 15) / 16, block_lines = runs > 1 ? k * 32 * 2 / 64 : 0;
        _Pragma("omp for schedule(static)")
        for (int64_t b = 0; b < blocks; b++) {
            const uint16_t *block = w + b * k * 32;
            const char *next = block_lines && b + 1 < blocks ? (const char *)(block + k * 32) : NULL;
            const int64_t col0 = b * 32, cols = n - col0 < 32 ? n - col0 : 32;
            for (int64_t run = 0, r0 = 0; r0 < m; run++, r0 += 16) {
                const int rows = m - r0 < 16 ? m - r0 : 16;
                if (rows != configured) {
                    configure_tiles(rows);
                    configured = rows;
                }
                const fetch_ahead ahead = fetch_share(next, block_lines, run, runs);
                _tile_zero(0);
                _tile_zero(1);
#define AMX_STEP(j) do {  /* pairs 16 j .. 16 j + 15 of the block */ \
                    _tile_loadd(2, x + r0 * k + 32 * (j), k * 2); \
                    _tile_loadd(3, block + 32 * (j) * 32, 128); \
                    _tile_loadd(4, block + 32 * (j) * 32 + 32, 128); \
                    _tile_dpbf16ps(0, 2, 3); \
                    _tile_dpbf16ps(1, 2, 4); \
                } while (0)
                FETCHING_LOOP(k / 32, ahead, AMX_STEP);
#undef AMX_STEP
                _tile_stored(0, sums, 128);
                _tile_stored(1, sums + 16, 128);
                for (int r = 0; r < rows; r++)
                    for (int64_t c = 0; c < cols; c++)
                        out[(r0 + r) * n + col0 + c] = float_to_bf16(sums[r * 32 + c] + (bias ? bias[col0 + c] : 0.0f));
            }
        }
        if (configured) _tile_release();
    }
}

int llmfleet_small_linear_amx_rows(void) {
    static int permitted = -1;  /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: once per process */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted ? AMX_MAX_M : 0;
}

/* Whether a bfloat16 prompt's heads of dim go through the tiles: the one check of
   llmfleet_prefill_attention's dispatch and of cpu_kernels.amx_prompt_attention */
int llmfleet_prompt_attention_tiles(int64_t dim) {
    return dim % 32 == 0 && dim <= 256 && llmfleet_small_linear_amx_rows() > 0;
}

/* Prompt attention in bfloat16 with AMX tiles: the same items, masks and exact float32 softmax as
   llmfleet_prefill_attention, with both products in tiles. Every KV head's keys are first packed
   as the tiles multiply them, [16 keys][dim / 2][16][2] (pairs of dimensions), and its values
   [32 keys][dim / 16][16][16][2] (pairs of keys); then each block of 16 queries scores two tiles
   of 16 keys at a time (a float32 row of scores per query), folding each row's top into a
   register while those scores are still in L1 (masked keys set to -inf), takes each row's
   softmax in one more pass, rounds the weights to bfloat16 (as torch's flash attention does
   before its second product) and sums the values 32 keys a tile. Returns 0 where it does not
   apply: head sizes that are not a multiple of 32 or above 256, or no tiles. */

static void configure_attention_tiles(void) {  /* all eight tiles: 16 rows of 64 bytes */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* s[t] *= scale over [from, to), a multiple of VL apart */
static inline void scale_scores(float *s, int64_t from, int64_t to, float scale) {
    for (int64_t t = from; t < to; t += VL) {
        fvec x;
        memcpy(&x, s + t, sizeof x);
        x *= scale;
        memcpy(s + t, &x, sizeof x);
    }
}

/* a vector rounded to bfloat16 (to nearest, ties to even) at to: one instruction with
   AVX512-BF16, which every CPU with AMX has */
static inline void store_bf16(uint16_t *to, fvec x) {
#if defined(__AVX512BF16__) && VL == 16
    __m512 v;
    memcpy(&v, &x, sizeof v);
    const __m256bh rounded = _mm512_cvtneps_pbh(v);
    memcpy(to, &rounded, sizeof rounded);
#else
    const ivec bits = bf16_bits(x);
    for (int l = 0; l < VL; l++) to[l] = (uint16_t)bits[l];
#endif
}

/* weights[t] = bf16(p[t]) over [from, to), a multiple of VL apart */
static inline void round_weights(const float *p, uint16_t *weights, int64_t from, int64_t to) {
    for (int64_t t = from; t < to; t += VL) {
        fvec x;
        memcpy(&x, p + t, sizeof x);
        store_bf16(weights + t, x);
    }
}

/* e^x in AVX-512 for the scores less their top: expv's reduction and polynomial (exp_reduced),
   2^n applied by scalef, and lanes below -87 (a masked score's -inf among them) set to 0 by its
   mask */
static inline __m512 exp512(__m512 x) {
    const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    fvec v, n;
    memcpy(&v, &x, sizeof v);
    const fvec p = exp_reduced(v, &n);
    __m512 pm, nm;
    memcpy(&pm, &p, sizeof pm);
    memcpy(&nm, &n, sizeof nm);
    return _mm512_maskz_scalef_ps(kept, pm, nm);
}

/* weights = bf16(exp(scale * s - top)) over [from, to) (a multiple of 16 apart); returns the
   exponentials' sum in float32, with the sink's where there is one */
static inline float exp_weights(const float *s, uint16_t *weights, int64_t from, int64_t to, float scale, float top,
                                const float *sink) {
    const __m512 sc = _mm512_set1_ps(scale), tp = _mm512_set1_ps(top);
    __m512 total0 = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
    int64_t t = from;
    for (; t + 32 <= to; t += 32) {
        const __m512 a = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), sc, tp));
        const __m512 b = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s + t + 16), sc, tp));
        total0 = _mm512_add_ps(total0, a);
        total1 = _mm512_add_ps(total1, b);
        const __m256bh ra = _mm512_cvtneps_pbh(a), rb = _mm512_cvtneps_pbh(b);
        memcpy(weights + t, &ra, 32);
        memcpy(weights + t + 16, &rb, 32);
    }
    if (t < to) {
        const __m512 a = exp512(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), sc, tp));
        total0 = _mm512_add_ps(total0, a);
        const __m256bh ra = _mm512_cvtneps_pbh(a);
        memcpy(weights + t, &ra, 32);
    }
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(total0, total1));
    return sink ? sum + expf(*sink - top) : sum;
}

static int prefill_attention_amx(
    const void *q, int64_t q_token_stride, int64_t q_head_stride,
    const void *k, int64_t k_token_stride, int64_t k_head_stride,
    const void *v, int64_t v_token_stride, int64_t v_head_stride,
    int64_t n, int64_t ctx,
    void *out, int64_t out_token_stride, int64_t out_head_stride,
    int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int64_t window, float softcap, const float *sinks, int num_threads) {
    if (!llmfleet_prompt_attention_tiles(dim)) return 0;
    const int64_t group = heads / kv_heads, chunks = dim / 16;
    const int64_t padded = (ctx + 31) / 32 * 32, blocks = (n + 15) / 16, head_size = padded * dim;
    uint16_t *kp = aligned_alloc(64, kv_heads * head_size * 2), *vp = aligned_alloc(64, kv_heads * head_size * 2);
    const uint16_t *qs = q, *ks = k, *vs = v;
    #pragma omp parallel num_threads(num_threads)
    {
        uint16_t *queries = aligned_alloc(64, 16 * dim * 2), *weights = aligned_alloc(64, 16 * padded * 2);
        float *scores = aligned_alloc(64, sizeof(float) * 16 * padded);
        float *acc = aligned_alloc(64, sizeof(float) * 16 * dim);
        float sums[16];
        fvec tops[16];
        /* every head's keys and values, a pair of positions at a time */
        #pragma omp for
        for (int64_t item = 0; item < kv_heads * padded / 2; item++) {
            const int64_t kvh = item / (padded / 2), t = item % (padded / 2) * 2;
            uint16_t *kt = kp + kvh * head_size + (t / 16) * 16 * dim, *vt = vp + kvh * head_size + (t / 32) * 32 * dim;
            for (int64_t u = t; u < t + 2; u++) {  /* its pairs of dimensions, 16 keys apart */
                const uint16_t *key = ks + u * k_token_stride + kvh * k_head_stride;
                for (int64_t d = 0; d < dim; d += 2) {
                    uint16_t *to = kt + d * 16 + (u % 16) * 2;
                    to[0] = u < ctx ? key[d] : 0;
                    to[1] = u < ctx ? key[d + 1] : 0;
                }
            }
            const uint16_t *v0 = vs + t * v_token_stride + kvh * v_head_stride, *v1 = v0 + v_token_stride;
            uint16_t *to = vt + ((t % 32) / 2) * 32;
            for (int64_t c = 0; c < chunks; c++)
                for (int64_t d = 0; d < 16; d++) {
                    to[c * 512 + d * 2] = t < ctx ? v0[c * 16 + d] : 0;
                    to[c * 512 + d * 2 + 1] = t + 1 < ctx ? v1[c * 16 + d] : 0;
                }
        }
        configure_attention_tiles();
        /* head by head (both threads in one head's keys), each head's last blocks first */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < kv_heads * group * blocks; item++) {
            const int64_t kvh = item / (group * blocks), rest = item % (group * blocks);
            const int64_t block = blocks - 1 - rest / group, h = kvh * group + rest % group;
            const uint16_t *keys = kp + kvh * head_size, *values = vp + kvh * head_size;
            const int64_t row0 = block * 16, rows = n - row0 < 16 ? n - row0 : 16;
            const int64_t last = ctx - n + row0 + rows - 1;
            const int64_t first = ctx - n + row0 - window + 1;
            const int64_t tile0 = window > 0 && first > 0 ? first / 16 : 0, tile1 = last / 16 + 1;
            const int64_t key0 = tile0 / 2 * 32, key1 = (tile1 + 1) / 2 * 32;  /* the values' 32-key tiles */
            for (int64_t r = 0; r < 16; r++) {
                if (r < rows) memcpy(queries + r * dim, qs + (row0 + r) * q_token_stride + h * q_head_stride, dim * 2);
                else memset(queries + r * dim, 0, dim * 2);
            }
            const int plain = softcap <= 0.0f && scale > 0.0f;
            int64_t pos[16], lo[16];
            for (int64_t r = 0; r < 16; r++) {
                pos[r] = r < rows ? ctx - n + row0 + r : last;
                lo[r] = (window > 0 && pos[r] - window + 1 > 0) ? pos[r] - window + 1 : 0;
                tops[r] = (fvec){0} - INFINITY;
            }
            int64_t tile = tile0;
            for (; tile + 2 <= tile1; tile += 2) {  /* two tiles of keys for each tile of queries */
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c = 0; c < dim / 32; c++) {
                    _tile_loadd(2, queries + c * 32, dim * 2);
                    _tile_loadd(3, keys + tile * 16 * dim + c * 512, 64);
                    _tile_loadd(4, keys + (tile + 1) * 16 * dim + c * 512, 64);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                }
                _tile_stored(0, scores + tile * 16, padded * 4);
                _tile_stored(1, scores + tile * 16 + 16, padded * 4);
                if (plain)  /* each row's top while its scores are in L1 */
                    for (int64_t r = 0; r < 16; r++) {
                        tops[r] = fold_top(scores + r * padded, tile * 16, lo[r], pos[r], tops[r]);
                        tops[r] = fold_top(scores + r * padded, tile * 16 + 16, lo[r], pos[r], tops[r]);
                    }
            }
            if (tile < tile1) {
                _tile_zero(0);
                for (int64_t c = 0; c < dim / 32; c++) {
                    _tile_loadd(2, queries + c * 32, dim * 2);
                    _tile_loadd(3, keys + tile * 16 * dim + c * 512, 64);
                    _tile_dpbf16ps(0, 2, 3);
                }
                _tile_stored(0, scores + tile * 16, padded * 4);
                if (plain)
                    for (int64_t r = 0; r < 16; r++)
                        tops[r] = fold_top(scores + r * padded, tile * 16, lo[r], pos[r], tops[r]);
            }
            for (int64_t r = 0; r < 16; r++) {
                float *sr = scores + r * padded;
                uint16_t *wr = weights + r * padded;
                const float *sink = sinks ? sinks + h : NULL;
                if (plain) {
                    float top = scale * top_of(tops[r], -INFINITY);
                    if (sink && *sink > top) top = *sink;
                    sums[r] = exp_weights(sr, wr, tile0 * 16, tile1 * 16, scale, top, sink);
                } else {
                    scale_scores(sr, tile0 * 16, tile1 * 16, scale);
                    if (softcap > 0.0f) cap_scores(sr + tile0 * 16, (tile1 - tile0) * 16, softcap);
                    const float top = masked_max(sr, tile0 * 16, tile1 * 16, lo[r], pos[r], sink ? *sink : -INFINITY);
                    sums[r] = exp_sum16(sr + tile0 * 16, (tile1 - tile0) * 16, top, sink);
                    round_weights(sr, wr, tile0 * 16, tile1 * 16);
                }
                memset(wr + key0, 0, (tile0 * 16 - key0) * 2);
                memset(wr + tile1 * 16, 0, (key1 - tile1 * 16) * 2);
            }
            for (int64_t c = 0; c < chunks; c += 2) {  /* 32 dimensions of the values at a time */
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t key = key0; key < key1; key += 32) {
                    const uint16_t *vt = values + (key / 32) * 32 * dim + c * 512;
                    _tile_loadd(2, weights + key, padded * 2);
                    _tile_loadd(3, vt, 64);
                    _tile_loadd(4, vt + 512, 64);
                    _tile_dpbf16ps(0, 2, 3);
                    _tile_dpbf16ps(1, 2, 4);
                }
                _tile_stored(0, acc + c * 16, dim * 4);
                _tile_stored(1, acc + c * 16 + 16, dim * 4);
            }
            for (int64_t r = 0; r < rows; r++)
                store_row(out, (row0 + r) * out_token_stride + h * out_head_stride, acc + r * dim, 1.0f / sums[r],
                          dim, 1);
        }
        _tile_release();
        free(queries); free(weights); free(scores); free(acc);
    }
    free(kp); free(vp);
    return 1;
}
#else
void llmfleet_small_linear_amx(const uint16_t *x, int64_t m, int64_t k, const uint16_t *w, int64_t n,
                               const float *bias, uint16_t *out, int num_threads) {}
int llmfleet_small_linear_amx_rows(void) { return 0; }
int llmfleet_prompt_attention_tiles(int64_t dim) { return 0; }
#endif

/* RMSNorm as Llama's module computes it (and the many of transformers' RMSNorms that share its
   forward): per row x / sqrt(mean(x^2) + eps) in float32, then times the weight; in bfloat16 the
   normalized row is rounded to bfloat16 before the weight multiplies it and the product is rounded
   again, as the module's two steps do. One pass to sum, one to write, where the module runs eight
   tensor ops. Rows split over threads only where there are many. gemma: Gemma's RMSNorm instead,
   whose weight is an offset from one: x / sqrt(mean(x^2) + eps) * (1 + weight) in float32,
   rounded to the dtype once. */
static void norm_rows(const void *x, int64_t rows, int64_t dim, const void *weight, float eps, void *out,
                      int bf16, int gemma, int num_threads) {
    const int64_t item = bf16 ? 2 : 4;
    _Pragma("omp parallel for num_threads(num_threads) schedule(static) if (rows * dim >= 65536)")
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * dim * item;
        fvec acc = {0};
        int64_t d = 0;
        for (; d + VL <= dim; d += VL) {
            const fvec v = loadv(xr + d * item, bf16);
            acc += v * v;
        }
        float sum = 0.0f;
        for (int l = 0; l < VL; l++) sum += acc[l];
        for (; d < dim; d++) {
            const float v = element(xr, d, bf16);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        if (gemma && bf16) {
            const uint16_t *xh = (const uint16_t *)xr, *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (d = 0; d < dim; d++)
                o[d] = float_to_bf16(bf16_to_float(xh[d]) * scale * (1.0f + bf16_to_float(w[d])));
        } else if (gemma) {
            const float *xf = (const float *)xr, *w = (const float *)weight;
            float *o = (float *)out + r * dim;
            for (d = 0; d < dim; d++) o[d] = xf[d] * scale * (1.0f + w[d]);
        } else if (bf16) {
            const uint16_t *xh = (const uint16_t *)xr, *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (d = 0; d < dim; d++) {
                const float y = bf16_to_float(float_to_bf16(bf16_to_float(xh[d]) * scale));
                o[d] = float_to_bf16(bf16_to_float(w[d]) * y);
            }
        } else {
            const float *xf = (const float *)xr, *w = (const float *)weight;
            float *o = (float *)out + r * dim;
            for (d = 0; d < dim; d++) o[d] = w[d] * (xf[d] * scale);
        }
    }
}

void llmfleet_rms_norm(const void *x, int64_t rows, int64_t dim, const void *weight, float eps, void *out,
                       int bf16, int gemma, int num_threads) {
    norm_rows(x, rows, dim, weight, eps, out, bf16, gemma, num_threads);
}

/* One tensor's rotary embedding, (heads, tokens, dim) at the given strides (the last is 1), with
   cos and sin (tokens, dim): x * cos + rotate_half(x) * sin, where rotate_half(x) is
   (-x[half:], x[:half]). Each product is rounded to the dtype, then their sum, as transformers'
   four tensor ops do (no fused multiply-add: the products are rounded apart). */
__attribute__((optimize("fp-contract=off")))
static void rotate(const void *x, int64_t heads, int64_t tokens, int64_t dim, int64_t head_stride,
                   int64_t token_stride, const void *cos, const void *sin, void *out, int bf16, int num_threads) {
    const int64_t half = dim / 2;
    _Pragma("omp parallel for collapse(2) num_threads(num_threads) if (heads * tokens * dim >= 262144)")
    for (int64_t h = 0; h < heads; h++) {
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t at = h * head_stride + t * token_stride;
            if (bf16) {
                const uint16_t *xr = (const uint16_t *)x + at, *c = (const uint16_t *)cos + t * dim;
                const uint16_t *sn = (const uint16_t *)sin + t * dim;
                uint16_t *o = (uint16_t *)out + at;
                for (int64_t d = 0; d < half; d++) {  /* two loops without a branch: vectorized */
                    const float a = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * bf16_to_float(c[d])));
                    const float b = bf16_to_float(float_to_bf16(-bf16_to_float(xr[d + half]) * bf16_to_float(sn[d])));
                    o[d] = float_to_bf16(a + b);
                }
                for (int64_t d = half; d < dim; d++) {
                    const float a = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * bf16_to_float(c[d])));
                    const float b = bf16_to_float(float_to_bf16(bf16_to_float(xr[d - half]) * bf16_to_float(sn[d])));
                    o[d] = float_to_bf16(a + b);
                }
            } else {
                const float *xr = (const float *)x + at, *c = (const float *)cos + t * dim;
                const float *sn = (const float *)sin + t * dim;
                float *o = (float *)out + at;
                for (int64_t d = 0; d < half; d++) o[d] = xr[d] * c[d] + -xr[d + half] * sn[d];
                for (int64_t d = half; d < dim; d++) o[d] = xr[d] * c[d] + xr[d - half] * sn[d];
            }
        }
    }
}

/* transformers' apply_rotary_pos_emb for a query and a key tensor in one call. */
void llmfleet_rotary(const void *q, int64_t q_heads, int64_t q_head_stride, int64_t q_token_stride, void *q_out,
                     const void *k, int64_t k_heads, int64_t k_head_stride, int64_t k_token_stride, void *k_out,
                     int64_t tokens, int64_t dim, const void *cos, const void *sin, int bf16, int num_threads) {
    rotate(q, q_heads, tokens, dim, q_head_stride, q_token_stride, cos, sin, q_out, bf16, num_threads);
    rotate(k, k_heads, tokens, dim, k_head_stride, k_token_stride, cos, sin, k_out, bf16, num_threads);
}

/* A decode step's decoder layers, Llama's (and Qwen2's and Mistral's, which are the same, and
   Qwen3's, which norms each head of q and k): per layer RMSNorm, q/k/v, the heads' norms, the
   rotary embedding, the cache write, paged attention, o, the residual add, RMSNorm, gate and up,
   SiLU times up, down and the residual add, each by the kernel above that the module path runs
   for it, with the modules' roundings (cpu_decode.py says why). Gemma's layers (1, 2 and 3) are
   the same with its RMSNorm, GeLU (tanh) for SiLU, and in Gemma 2 and 3 a norm of the attention's
   and the MLP's outputs before each residual add, a logit cap (2) and a second rotary table for
   the sliding-window layers (3). Granite's scale each branch before its residual add; Phi-3's
   fuse q, k and v into one linear, and the gate and the up. Where the few-row linear reads every weight,
   llmfleet_decode_layers runs all of it in one call; elsewhere Python runs oneDNN's linears and
   calls the pieces between them. */
typedef struct {
    int64_t hidden_size, heads, kv_heads, dim, intermediate;
    int64_t num_blocks, block_size, block_stride, head_stride;  /* the cache's, strides in elements */
    int bf16;
    int packed_block;  /* columns per block of the packed weights: 64, or 32 (bf16 with AMX) */
    int gemma_norms;  /* every RMSNorm is Gemma's: times (1 + weight), rounded once */
    int gelu_tanh;  /* the MLP's activation is GeLU's tanh approximation, not SiLU */
    float residual_scale;  /* each branch's output times this before its residual add (Granite's); 0: none */
    int fused_qkv;  /* a layer's q weight is q, k and v's in one (Phi-3's qkv_proj); its k and v unused */
    int fused_gate_up;  /* its gate weight is the gate's and the up's in one (gate_up_proj); up unused */
} llmfleet_model;

typedef struct {
    const void *input_norm, *post_norm;
    float input_eps, post_eps;
    const void *q, *k, *v, *o, *gate, *up, *down;  /* weights as packed for small_linear, or NULL */
    const float *q_bias, *k_bias, *v_bias, *o_bias, *gate_bias, *up_bias, *down_bias;  /* NULL: none */
    void *k_cache, *v_cache;
    float scale;
    int64_t window;  /* 0: none */
    const void *q_norm, *k_norm;  /* each head's RMSNorm before the rotary (Qwen3's), or NULL */
    float q_norm_eps, k_norm_eps;
    const void *attention_out_norm, *mlp_out_norm;  /* norms of each output before its add, or NULL */
    float attention_out_eps, mlp_out_eps;
    float softcap;  /* cap * tanh(score / cap) on the logits (Gemma 2's); 0: none */
    int rotary;  /* the step's rotary table: 0, or 1 for its second (cos2, sin2) */
} llmfleet_layer;

typedef struct {
    const int64_t *rows, *blocks, *lengths;
    int64_t n, blocks_per_request;
} llmfleet_decode_group;

typedef struct {
    int64_t m;  /* rows: one new token of each request */
    const void *cos, *sin;  /* (m, dim) */
    const int64_t *slots;  /* (m,) */
    const llmfleet_decode_group *groups;
    int64_t num_groups;
    int num_threads;
    const void *cos2, *sin2;  /* a second rotary table (m, dim), for layers whose rotary is 1 */
} llmfleet_step;

/* x *= scale over ``count`` values, each product rounded to the dtype as torch's multiply by a
   scalar; apart from the add after it, so that the two are never one fused multiply-add */
__attribute__((noinline)) static void scale_values(void *x, int64_t count, float scale, int bf16) {
    if (bf16) {
        uint16_t *v = x;
        for (int64_t i = 0; i < count; i++) v[i] = float_to_bf16(bf16_to_float(v[i]) * scale);
    } else {
        float *v = x;
        for (int64_t i = 0; i < count; i++) v[i] *= scale;
    }
}

/* hidden += delta (none where NULL), first normed in place by delta_norm where that is not
   NULL and scaled by the model's residual_scale where it has one, the sum rounded to the dtype
   once as torch's add; then normed = RMSNorm(hidden) */
void llmfleet_add_norm(const llmfleet_model *M, const llmfleet_step *T, void *hidden, void *delta,
                       const void *delta_norm, float delta_eps, const void *weight, float eps, void *normed) {
    const int64_t count = T->m * M->hidden_size;
    if (delta && delta_norm)
        norm_rows(delta, T->m, M->hidden_size, delta_norm, delta_eps, delta, M->bf16, M->gemma_norms, T->num_threads);
    if (delta && M->residual_scale != 0.0f) scale_values(delta, count, M->residual_scale, M->bf16);
    if (delta && M->bf16) {
        uint16_t *h = hidden;
        const uint16_t *d = delta;
        for (int64_t i = 0; i < count; i++) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(d[i]));
    } else if (delta) {
        float *h = hidden;
        const float *d = delta;
        for (int64_t i = 0; i < count; i++) h[i] += d[i];
    }
    norm_rows(hidden, T->m, M->hidden_size, weight, eps, normed, M->bf16, M->gemma_norms, T->num_threads);
}

/* gate = silu(gate) * up over ``count`` values: silu rounded to the dtype, then the product, as
   the module's two ops; a vector at a time (siluv), the last few with expf */
void llmfleet_silu_mul(void *gate, const void *up, int64_t count, int bf16, int num_threads) {
    const int64_t vectors = count / VL;
    if (bf16) {
        uint16_t *g = gate;
        const uint16_t *u = up;
        _Pragma("omp parallel for num_threads(num_threads) if (count >= 65536)")
        for (int64_t c = 0; c < vectors; c++) {
            const int64_t at = c * VL;
            const ivec bits = bf16_bits(round_bf16(siluv(loadv(g + at, 1))) * loadv(u + at, 1));
            for (int l = 0; l < VL; l++) g[at + l] = (uint16_t)bits[l];
        }
        for (int64_t i = vectors * VL; i < count; i++) {
            const float x = bf16_to_float(g[i]);
            g[i] = float_to_bf16(bf16_to_float(float_to_bf16(x / (1.0f + expf(-x)))) * bf16_to_float(u[i]));
        }
    } else {
        float *g = gate;
        const float *u = up;
        _Pragma("omp parallel for num_threads(num_threads) if (count >= 65536)")
        for (int64_t c = 0; c < vectors; c++) {
            fvec x, y;
            memcpy(&x, g + c * VL, sizeof x);
            memcpy(&y, u + c * VL, sizeof y);
            x = siluv(x) * y;
            memcpy(g + c * VL, &x, sizeof x);
        }
        for (int64_t i = vectors * VL; i < count; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* gate = gelu_tanh(gate) * up over ``count`` values, rounded as llmfleet_silu_mul rounds */
void llmfleet_gelu_tanh_mul(void *gate, const void *up, int64_t count, int bf16, int num_threads) {
    const int64_t vectors = count / VL;
    _Pragma("omp parallel for num_threads(num_threads) if (count >= 65536)")
    for (int64_t c = 0; c < vectors; c++) {
        const int64_t at = c * VL;
        if (bf16) {
            uint16_t *g = gate;
            const fvec act = round_bf16(gelu_tanhv(loadv(g + at, 1)));
            const ivec bits = bf16_bits(act * loadv((const uint16_t *)up + at, 1));
            for (int l = 0; l < VL; l++) g[at + l] = (uint16_t)bits[l];
        } else {
            fvec x = gelu_tanhv(loadv((float *)gate + at, 0)) * loadv((const float *)up + at, 0);
            memcpy((float *)gate + at, &x, sizeof x);
        }
    }
    for (int64_t i = vectors * VL; i < count; i++) {
        if (bf16) {
            uint16_t *g = gate;
            const float a = bf16_to_float(float_to_bf16(gelu_tanh(bf16_to_float(g[i]))));
            g[i] = float_to_bf16(a * bf16_to_float(((const uint16_t *)up)[i]));
        } else {
            ((float *)gate)[i] = gelu_tanh(((float *)gate)[i]) * ((const float *)up)[i];
        }
    }
}

/* A decode step's gate = act(gate) * up: SiLU, or GeLU (tanh) where the model's MLP has it */
void llmfleet_gate_times_up(const llmfleet_model *M, const llmfleet_step *T, void *gate, const void *up) {
    if (M->gelu_tanh) llmfleet_gelu_tanh_mul(gate, up, T->m * M->intermediate, M->bf16, T->num_threads);
    else llmfleet_silu_mul(gate, up, T->m * M->intermediate, M->bf16, T->num_threads);
}

/* Each head of q and k (m, heads or kv_heads, dim) normed in place where the layer norms them,
   their rotary embedding into q_rot and k_rot, k_rot and v into the cache at the step's slots,
   and q_rot attended into attended (m, heads, dim). Returns -1, having written nothing to the
   cache, where a slot is outside it. */
int llmfleet_decode_attend(const llmfleet_model *M, const llmfleet_layer *L, const llmfleet_step *T,
                           void *q, void *k, const void *v, void *q_rot, void *k_rot, void *attended) {
    const int64_t dim = M->dim, q_width = M->heads * dim, kv_width = M->kv_heads * dim;
    const int bf16 = M->bf16, gemma = M->gemma_norms, threads = T->num_threads;
    if (L->q_norm) norm_rows(q, T->m * M->heads, dim, L->q_norm, L->q_norm_eps, q, bf16, gemma, threads);
    if (L->k_norm) norm_rows(k, T->m * M->kv_heads, dim, L->k_norm, L->k_norm_eps, k, bf16, gemma, threads);
    const void *cos = L->rotary ? T->cos2 : T->cos, *sin = L->rotary ? T->sin2 : T->sin;
    rotate(q, M->heads, T->m, dim, dim, q_width, cos, sin, q_rot, bf16, threads);
    rotate(k, M->kv_heads, T->m, dim, dim, kv_width, cos, sin, k_rot, bf16, threads);
    if (llmfleet_kv_write(L->k_cache, L->v_cache, M->num_blocks, M->block_size, M->block_stride, M->head_stride,
                          T->slots, T->m, k_rot, dim, kv_width, v, dim, kv_width, M->kv_heads, dim,
                          M->bf16 ? 2 : 4)) return -1;
    for (int64_t g = 0; g < T->num_groups; g++) {
        const llmfleet_decode_group *G = T->groups + g;
        llmfleet_paged_decode(q_rot, q_width, dim, L->k_cache, L->v_cache, M->block_stride, M->head_stride, G->rows,
                              G->blocks, G->blocks_per_request, G->lengths, G->n, attended, q_width, dim, M->heads,
                              M->kv_heads, dim, M->block_size, L->scale, L->window, L->softcap, NULL, M->bf16,
                              T->num_threads);
    }
    return 0;
}

static void linear(const llmfleet_model *M, const llmfleet_step *T, const void *x, int64_t k, const void *w,
                   int64_t n, const float *bias, void *out) {
    if (M->bf16 && M->packed_block == 32) llmfleet_small_linear_amx(x, T->m, k, w, n, bias, out, T->num_threads);
    else if (M->bf16) llmfleet_small_linear_bf16(x, T->m, k, w, n, bias, out, T->num_threads);
    else llmfleet_small_linear(x, T->m, k, w, n, bias, out, T->num_threads);
}

/* Rows of ``parts`` widths side by side at ``from`` (rows, sum of widths) into one array of rows
   of each width: the output of a fused linear, as the modules' split hands it on */
static void split_columns(const char *from, int64_t rows, int64_t item, int parts, const int64_t *widths,
                          char *const *to) {
    int64_t width = 0;
    for (int p = 0; p < parts; p++) width += widths[p];
    for (int64_t r = 0; r < rows; r++) {
        const char *row = from + item * r * width;
        for (int p = 0; p < parts; p++) {
            memcpy(to[p] + item * r * widths[p], row, item * widths[p]);
            row += item * widths[p];
        }
    }
}

/* Every layer, the few-row linear reading each weight; hidden (m, hidden_size) is the residual
   stream, updated in place, and normed (m, hidden_size) ends as RMSNorm(hidden) by final_norm.
   Returns -1, having written nothing, where a slot is outside the cache; -2 out of memory. */
int llmfleet_decode_layers(const llmfleet_model *M, const llmfleet_layer *layers, int64_t num_layers,
                           const llmfleet_step *T, void *hidden, void *normed, const void *final_norm,
                           float final_eps) {
    const int64_t item = M->bf16 ? 2 : 4, m = T->m, h = M->hidden_size;
    const int64_t q_width = M->heads * M->dim, kv_width = M->kv_heads * M->dim, inter = M->intermediate;
    char *scratch = malloc(item * m * (h + 3 * q_width + 3 * kv_width + (M->fused_gate_up ? 4 : 2) * inter));
    if (!scratch) return -2;
    char *projected = scratch, *q = projected + item * m * h, *k = q + item * m * q_width;
    char *v = k + item * m * kv_width, *q_rot = v + item * m * kv_width, *k_rot = q_rot + item * m * q_width;
    char *attended = k_rot + item * m * kv_width, *gate = attended + item * m * q_width, *up = gate + item * m * inter;
    char *gate_up = up + item * m * inter;  /* a fused gate and up linear's rows, before the split */
    const int64_t qkv_widths[3] = {q_width, kv_width, kv_width}, gate_up_widths[2] = {inter, inter};
    char *const qkv_parts[3] = {q, k, v}, *const gate_up_parts[2] = {gate, up};
    int status = 0;
    llmfleet_add_norm(M, T, hidden, NULL, NULL, 0.0f, layers[0].input_norm, layers[0].input_eps, normed);
    for (int64_t l = 0; l < num_layers && !status; l++) {
        const llmfleet_layer *L = layers + l;
        if (M->fused_qkv) {  /* q_rot, k_rot and attended are free until the rotary: the fused rows go there */
            linear(M, T, normed, h, L->q, q_width + 2 * kv_width, L->q_bias, q_rot);
            split_columns(q_rot, m, item, 3, qkv_widths, qkv_parts);
        } else {
            linear(M, T, normed, h, L->q, q_width, L->q_bias, q);
            linear(M, T, normed, h, L->k, kv_width, L->k_bias, k);
            linear(M, T, normed, h, L->v, kv_width, L->v_bias, v);
        }
        if (llmfleet_decode_attend(M, L, T, q, k, v, q_rot, k_rot, attended)) {
            status = -1;  /* only in the first layer: every layer writes the same slots */
            break;
        }
        linear(M, T, attended, q_width, L->o, h, L->o_bias, projected);
        llmfleet_add_norm(M, T, hidden, projected, L->attention_out_norm, L->attention_out_eps, L->post_norm,
                          L->post_eps, normed);
        if (M->fused_gate_up) {
            linear(M, T, normed, h, L->gate, 2 * inter, L->gate_bias, gate_up);
            split_columns(gate_up, m, item, 2, gate_up_widths, gate_up_parts);
        } else {
            linear(M, T, normed, h, L->gate, inter, L->gate_bias, gate);
            linear(M, T, normed, h, L->up, inter, L->up_bias, up);
        }
        llmfleet_gate_times_up(M, T, gate, up);
        linear(M, T, gate, inter, L->down, h, L->down_bias, projected);
        const int last = l + 1 == num_layers;
        llmfleet_add_norm(M, T, hidden, projected, L->mlp_out_norm, L->mlp_out_eps,
                          last ? final_norm : L[1].input_norm, last ? final_eps : L[1].input_eps, normed);
    }
    free(scratch);
    return status;
}
"""

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [
    _PTR,
    _I64,
    _I64,  # q, its token and head strides
    _PTR,
    _PTR,
    _I64,
    _I64,  # keys, values, their block and head strides
    _PTR,
    _PTR,
    _I64,
    _PTR,
    _I64,  # rows, blocks, blocks per request, lengths, n
    _PTR,
    _I64,
    _I64,  # out, its token and head strides
    _I64,
    _I64,
    _I64,
    _I64,  # heads, kv heads, head dim, block size
    ctypes.c_float,
    _I64,  # scale, window (0: none)
    ctypes.c_float,
    _PTR,  # logit cap (0: none), sinks (float32 per head; NULL: none)
    ctypes.c_int,
    ctypes.c_int,  # bf16, threads
]

_PREFILL_ARGTYPES = [
    _PTR,
    _I64,
    _I64,  # q, its token and head strides
    _PTR,
    _I64,
    _I64,  # keys, their token and head strides
    _PTR,
    _I64,
    _I64,  # values, their token and head strides
    _I64,
    _I64,  # queries, context
    _PTR,
    _I64,
    _I64,  # out, its token and head strides
    _I64,
    _I64,
    _I64,  # heads, kv heads, head dim
    ctypes.c_float,
    _I64,  # scale, window (0: none)
    ctypes.c_float,
    _PTR,  # logit cap (0: none), sinks (float32 per head; NULL: none)
    ctypes.c_int,
    ctypes.c_int,  # bf16, threads
]

_WRITE_ARGTYPES = [
    _PTR,
    _PTR,
    _I64,
    _I64,
    _I64,
    _I64,  # key and value caches, their blocks, block size, block and head strides
    _PTR,
    _I64,  # slots, n
    _PTR,
    _I64,
    _I64,  # key, its head and token strides
    _PTR,
    _I64,
    _I64,  # value, its head and token strides
    _I64,
    _I64,
    _I64,  # kv heads, head dim, item size
]

_LINEAR_ARGTYPES = [
    _PTR,
    _I64,
    _I64,  # x, rows, in features
    _PTR,
    _I64,  # packed weight, out features
    _PTR,
    _PTR,  # bias (NULL: none), out
    ctypes.c_int,  # threads
]


class DecodeModel(ctypes.Structure):
    """A model's sizes and its cache's layout for the decode-layer kernels (llmfleet_model)."""

    _fields_ = [
        *[(name, _I64) for name in ("hidden_size", "heads", "kv_heads", "dim", "intermediate")],
        *[(name, _I64) for name in ("num_blocks", "block_size", "block_stride", "head_stride")],
        ("bf16", ctypes.c_int),
        ("packed_block", ctypes.c_int),
        ("gemma_norms", ctypes.c_int),
        ("gelu_tanh", ctypes.c_int),
        ("residual_scale", ctypes.c_float),
        ("fused_qkv", ctypes.c_int),
        ("fused_gate_up", ctypes.c_int),
    ]


class DecodeLayer(ctypes.Structure):
    """One layer's tensors, as addresses, for the decode-layer kernels (llmfleet_layer); a weight
    the few-row linear does not read is NULL."""

    _fields_ = [
        ("input_norm", _PTR),
        ("post_norm", _PTR),
        ("input_eps", ctypes.c_float),
        ("post_eps", ctypes.c_float),
        *[(name, _PTR) for name in ("q", "k", "v", "o", "gate", "up", "down")],
        *[(f"{name}_bias", _PTR) for name in ("q", "k", "v", "o", "gate", "up", "down")],
        ("k_cache", _PTR),
        ("v_cache", _PTR),
        ("scale", ctypes.c_float),
        ("window", _I64),
        ("q_norm", _PTR),
        ("k_norm", _PTR),
        ("q_norm_eps", ctypes.c_float),
        ("k_norm_eps", ctypes.c_float),
        ("attention_out_norm", _PTR),
        ("mlp_out_norm", _PTR),
        ("attention_out_eps", ctypes.c_float),
        ("mlp_out_eps", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("rotary", ctypes.c_int),
    ]


class DecodeGroupArgs(ctypes.Structure):
    """A decode group's rows, block table and lengths, as addresses (llmfleet_decode_group)."""

    _fields_ = [("rows", _PTR), ("blocks", _PTR), ("lengths", _PTR), ("n", _I64), ("blocks_per_request", _I64)]


class DecodeStep(ctypes.Structure):
    """One decode step's rows, rotary angles, slots and groups, as addresses (llmfleet_step)."""

    _fields_ = [
        ("m", _I64),
        ("cos", _PTR),
        ("sin", _PTR),
        ("slots", _PTR),
        ("groups", ctypes.POINTER(DecodeGroupArgs)),
        ("num_groups", _I64),
        ("num_threads", ctypes.c_int),
        ("cos2", _PTR),
        ("sin2", _PTR),
    ]


def decode_kernels() -> ctypes.CDLL | None:
    """The library whose ``llmfleet_decode_layers``, ``llmfleet_decode_attend``,
    ``llmfleet_add_norm`` and ``llmfleet_gate_times_up`` run a decode step's layers (cpu_decode.py,
    which checks the model and the step they take); None where it cannot be built."""
    return _library() if enabled() else None


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# Places of a packed weight compared with the dense one (packed_block), beside its first block
_LAYOUT_SAMPLES = 4096


def enabled() -> bool:
    return os.environ.get("LLMFLEET_CPU_KERNELS", "1") != "0"


def built() -> bool:
    """Whether the kernel is (or can now be) compiled here."""
    return _library() is not None


def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use for this CPU; None where it cannot be built (it
    says why once)."""
    return build_for("native")


@functools.cache
def build_for(march: str) -> ctypes.CDLL | None:
    """The kernels compiled with ``-march=march``: ``native`` for this CPU, or an older x86 level
    (``x86-64-v3``: AVX2, 8 floats a vector), which the tests run beside the native build."""
    compiler = os.environ.get("CC", "cc")
    command = [compiler, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC"]
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    key = hashlib.sha256("\0".join([_SOURCE, *command, cpu]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"attention-{key}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # another process may build it too
                source = Path(tmp) / "attention.c"
                source.write_text(_SOURCE)
                output = Path(tmp) / path.name
                subprocess.run([*command, "-o", str(output), str(source), "-lm"], check=True, capture_output=True)
                output.replace(path)
            _prune(path)
        with contextlib.suppress(OSError):  # a read-only cache
            os.utime(path)  # in use: kept by _prune
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode(errors="replace")[-500:] if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", detail)
        return None
    library.llmfleet_paged_decode.argtypes = _ARGTYPES
    library.llmfleet_paged_decode.restype = None
    library.llmfleet_prefill_attention.argtypes = _PREFILL_ARGTYPES
    library.llmfleet_prefill_attention.restype = None
    library.llmfleet_kv_write.argtypes = _WRITE_ARGTYPES
    library.llmfleet_kv_write.restype = ctypes.c_int
    library.llmfleet_small_linear.argtypes = _LINEAR_ARGTYPES
    library.llmfleet_small_linear.restype = None
    library.llmfleet_rms_norm.argtypes = [_PTR, _I64, _I64, _PTR, ctypes.c_float, _PTR, *[ctypes.c_int] * 3]
    library.llmfleet_rms_norm.restype = None
    for gated in (library.llmfleet_silu_mul, library.llmfleet_gelu_tanh_mul):
        gated.argtypes = [_PTR, _PTR, _I64, ctypes.c_int, ctypes.c_int]
        gated.restype = None
    library.llmfleet_rotary.argtypes = [_PTR, _I64, _I64, _I64, _PTR] * 2 + [
        _I64,
        _I64,
        _PTR,
        _PTR,
        ctypes.c_int,
        ctypes.c_int,
    ]
    library.llmfleet_rotary.restype = None
    library.llmfleet_small_linear_rows.argtypes = []
    library.llmfleet_small_linear_rows.restype = ctypes.c_int
    library.llmfleet_small_linear_bf16.argtypes = _LINEAR_ARGTYPES
    library.llmfleet_small_linear_bf16.restype = None
    library.llmfleet_small_linear_bf16_rows.argtypes = []
    library.llmfleet_small_linear_bf16_rows.restype = ctypes.c_int
    library.llmfleet_small_linear_amx.argtypes = _LINEAR_ARGTYPES
    library.llmfleet_small_linear_amx.restype = None
    library.llmfleet_small_linear_amx_rows.argtypes = []
    library.llmfleet_small_linear_amx_rows.restype = ctypes.c_int
    library.llmfleet_prompt_attention_tiles.argtypes = [_I64]
    library.llmfleet_prompt_attention_tiles.restype = ctypes.c_int
    model, step = ctypes.POINTER(DecodeModel), ctypes.POINTER(DecodeStep)
    library.llmfleet_add_norm.argtypes = [model, step, _PTR, _PTR, _PTR, ctypes.c_float, _PTR, ctypes.c_float, _PTR]
    library.llmfleet_add_norm.restype = None
    library.llmfleet_gate_times_up.argtypes = [model, step, _PTR, _PTR]
    library.llmfleet_gate_times_up.restype = None
    library.llmfleet_decode_attend.argtypes = [model, ctypes.POINTER(DecodeLayer), step, *[_PTR] * 6]
    library.llmfleet_decode_attend.restype = ctypes.c_int
    library.llmfleet_decode_layers.argtypes = [
        model,
        ctypes.POINTER(DecodeLayer),
        _I64,
        step,
        _PTR,
        _PTR,
        _PTR,
        ctypes.c_float,
    ]
    library.llmfleet_decode_layers.restype = ctypes.c_int
    return library


def _prune(built: Path, unused_days: float = 30.0) -> None:
    """Remove other builds of the kernels not loaded for ``unused_days`` (other versions of
    llm-fleet, other CPUs sharing the cache; ``paged_decode-*`` is what versions with only the
    decode kernel called theirs). One still mapped by a process keeps working, and a later start
    of its version builds it again."""
    cutoff = time.time() - unused_days * 86400
    for other in [*built.parent.glob("attention-*.so"), *built.parent.glob("paged_decode-*.so")]:
        try:
            if other != built and other.stat().st_mtime < cutoff:
                other.unlink()
        except OSError:
            pass  # pruned by another process


def paged_decode(
    q: torch.Tensor,
    out: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_size: int,
    rows: torch.Tensor,
    blocks: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Attend ``rows`` of ``q`` (T, heads, D) to their cached ``keys``/``values`` (blocks,
    kv_heads, block_size, D) and write those rows of ``out`` (T, heads, D). Request i of ``rows``
    has context ``lengths[i]`` in its block table, row i of ``blocks`` (n, blocks per request).
    ``softcap`` caps the scaled logits (``softcap * tanh(x / softcap)``); ``sinks`` (heads,) join
    each head's softmax as a logit without a value (attention.Scoring). Returns False, having done
    nothing, where the kernel does not apply: turned off, not built, another device or dtype, or a
    layout it does not read."""
    bf16 = _DTYPES.get(keys.dtype)
    if (
        not enabled()
        or q.device.type != "cpu"
        or bf16 is None
        or q.dtype != keys.dtype
        or out.dtype != keys.dtype
        or q.stride(2) != 1
        or out.stride(2) != 1
        or not (keys.is_contiguous() and values.is_contiguous())
        or keys.dim() != 4
        or keys.shape[2] != block_size
    ):
        return False
    library = _library()
    if library is None:
        return False
    n, heads, dim = rows.shape[0], q.shape[1], q.shape[2]
    kv_heads = keys.shape[1]
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()  # alive for the call
    library.llmfleet_paged_decode(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        keys.data_ptr(),
        values.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        rows.data_ptr(),
        blocks.data_ptr(),
        blocks.numel() // n,
        lengths.data_ptr(),
        n,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        heads,
        kv_heads,
        dim,
        block_size,
        scale,
        window or 0,
        softcap or 0.0,
        None if sink_logits is None else sink_logits.data_ptr(),
        bf16,
        torch.get_num_threads(),
    )
    return True


def prefill_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Attend a prompt chunk's queries ``q`` (n, heads, D), at positions ctx - n .. ctx - 1, to
    ``keys``/``values`` (kv_heads, ctx, D), causally, and write ``out`` (n, heads, D); scoring as
    in ``paged_decode``. Returns False, having done nothing, where the kernel does not apply:
    turned off, not built, another device or dtype, or a head size that is not a multiple of 16."""
    dtype = q.dtype
    bf16 = _DTYPES.get(dtype)
    n, heads, dim = q.shape
    kv_heads, ctx = keys.shape[0], keys.shape[1]
    if (
        not enabled()
        or q.device.type != "cpu"
        or bf16 is None
        or any(t.dtype != dtype or t.stride(-1) != 1 for t in (out, keys, values, q))
        or dim % 16
        or ctx < n
        or heads % kv_heads
    ):
        return False
    library = _library()
    if library is None:
        return False
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()  # alive for the call
    library.llmfleet_prefill_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        keys.data_ptr(),
        keys.stride(1),
        keys.stride(0),
        values.data_ptr(),
        values.stride(1),
        values.stride(0),
        n,
        ctx,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        heads,
        kv_heads,
        dim,
        scale,
        window or 0,
        softcap or 0.0,
        None if sink_logits is None else sink_logits.data_ptr(),
        bf16,
        torch.get_num_threads(),
    )
    return True


def kv_write(
    keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> bool:
    """Store ``key``/``value`` (kv_heads, T, D) at ``slots`` (T,) of the cache tensors ``keys``/
    ``values`` (blocks, kv_heads, block_size, D): slot s is offset s % block_size of block
    s // block_size. Returns False, having done nothing, where the kernel does not apply: turned
    off, not built, another device, a dtype to convert, or a layout it does not read. A slot
    outside the cache raises IndexError, as ``index_copy_`` does, with nothing written."""
    if (
        not enabled()
        or keys.device.type != "cpu"
        or any(t.dtype != keys.dtype for t in (values, key, value))
        or not (keys.is_contiguous() and values.is_contiguous())
        or keys.dim() != 4
        or key.stride(2) != 1
        or value.stride(2) != 1
        or slots.dtype != torch.int64
        or not slots.is_contiguous()
        or key.shape != value.shape
        or key.shape[0] != keys.shape[1]
        or key.shape[2] != keys.shape[3]
        or slots.shape[0] != key.shape[1]
    ):
        return False
    library = _library()
    if library is None:
        return False
    num_blocks, kv_heads, block_size, dim = keys.shape
    outside = library.llmfleet_kv_write(
        keys.data_ptr(),
        values.data_ptr(),
        num_blocks,
        block_size,
        keys.stride(0),
        keys.stride(1),
        slots.data_ptr(),
        slots.shape[0],
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        kv_heads,
        dim,
        keys.element_size(),
    )
    if outside:
        raise IndexError(f"a cache slot outside 0..{num_blocks * block_size - 1}: {slots.tolist()}")
    return True


def amx_tiles() -> bool:
    """Whether this CPU runs AMX tiles here: the kernels were built with them and the OS lets this
    process use their registers. False where the kernels are off or not built."""
    library = _library() if enabled() else None
    return library is not None and library.llmfleet_small_linear_amx_rows() > 0


def amx_prompt_attention(head_dim: int) -> bool:
    """Whether ``prefill_attention`` multiplies a bfloat16 prompt's heads of ``head_dim`` in AMX
    tiles: where this CPU runs them and the head size is a multiple of 32 up to 256 (the C
    kernel's own check). False where the kernels are off or not built."""
    library = _library() if enabled() else None
    return library is not None and library.llmfleet_prompt_attention_tiles(head_dim) > 0


def small_linear_rows(dtype: torch.dtype = torch.float32, block: int = 64) -> int:
    """The most rows ``small_linear`` takes in ``dtype`` over a packing in blocks of ``block``
    columns on this CPU: 0 where the kernels are off or not built, or on CPUs where it was not
    measured faster than oneDNN (bfloat16: CPUs without AVX512-BF16 or AMX);
    ``LLMFLEET_SMALL_LINEAR=0`` keeps oneDNN's kernels for every step."""
    if not enabled() or os.environ.get("LLMFLEET_SMALL_LINEAR", "1") == "0" or dtype not in _DTYPES:
        return 0
    library = _library()
    if library is None:
        return 0
    if dtype == torch.bfloat16:
        rows = {64: library.llmfleet_small_linear_bf16_rows, 32: library.llmfleet_small_linear_amx_rows}
        return rows[block]() if block in rows else 0
    return library.llmfleet_small_linear_rows() if block == 64 else 0


def packed_block(packed: torch.Tensor, dense: torch.Tensor) -> int:
    """The columns per block of ``packed``, oneDNN's packing of the weight ``dense`` (out, in),
    where ``small_linear`` reads it; 0 where it does not. It reads oneDNN's layouts of today's
    CPUs: [out / 64][in][64] in float32, [out / 64][in / 2][64][2] in bfloat16, and [out / 32][in
    / 2][32][2] in bfloat16 on CPUs with AMX (inputs a multiple of 32). oneDNN picks its layout
    per CPU, shape and version, so the packed weight's bytes are compared with the dense one's at
    its first block and at sampled places; any other layout, or size, says no."""
    if dense.dim() != 2:
        return 0
    for block in (64, 32):
        if block == 32 and dense.shape[1] % 32:
            continue
        if small_linear_rows(dense.dtype, block) and _packed_in_blocks(packed, dense, block):
            return block
    return 0


def _packed_in_blocks(packed: torch.Tensor, dense: torch.Tensor, width: int) -> bool:
    """Whether ``packed`` holds ``dense`` as [out / width][in / pair][width][pair] (pair: 2 in
    bfloat16, 1 in float32)."""
    n, k = dense.shape
    pair = 2 if dense.dtype == torch.bfloat16 else 1  # inputs side by side in a column
    if k % pair:
        return False
    block = width * k  # elements of one block of columns
    count = -(-n // width) * block
    if torch.ops.mkldnn._nbytes(packed) != count * dense.element_size():
        return False
    item = ctypes.c_uint16 if pair == 2 else ctypes.c_float
    memory = (item * count).from_address(torch.ops.mkldnn.data_ptr(packed))
    raw = torch.frombuffer(memory, dtype=torch.int16 if pair == 2 else torch.float32).view(dense.dtype)
    sampled = torch.randint(count, (_LAYOUT_SAMPLES,), generator=torch.Generator().manual_seed(0))
    places = torch.cat([torch.arange(min(count, block)), sampled])
    within = places % block  # (in / pair, width, pair) in the block
    cols = (places // block) * width + (within // pair) % width
    rows = (within // (width * pair)) * pair + within % pair
    inside = cols < n  # the last block's columns past n are padding
    return torch.equal(raw[places[inside]], dense.detach()[cols[inside], rows[inside]])


def small_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, block: int = 64
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of a few rows (at most ``small_linear_rows(x.dtype,
    block)``), in ``x``'s dtype, reading ``packed`` in place, a weight ``packed_block`` found in
    blocks of ``block`` columns; ``bias`` in float32."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    library = _library()
    assert library is not None, "small_linear without the kernels: check small_linear_rows() first"
    if x.dtype == torch.bfloat16:
        kernel = library.llmfleet_small_linear_bf16 if block == 64 else library.llmfleet_small_linear_amx
    else:
        kernel = library.llmfleet_small_linear
    kernel(
        rows.data_ptr(),
        rows.shape[0],
        rows.shape[1],
        torch.ops.mkldnn.data_ptr(packed),
        out_features,
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor | None:
    """Llama's RMSNorm of ``x`` over its last dimension (float32 or bfloat16, ``weight`` in the same
    dtype), or Gemma's (``gemma``: times 1 + weight), or None where the kernel cannot take it: not
    built, another dtype or device, a weight of another size. Called for every norm of every step:
    whether the kernels are switched on is read once, where the norms are swapped
    (fused_norms.enabled)."""
    if (
        x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or weight.dim() != 1
        or weight.shape[0] != x.shape[-1]
        or x.numel() == 0
    ):
        return None
    library = _library()
    if library is None:
        return None
    rows = x.contiguous()
    out = torch.empty_like(rows)
    library.llmfleet_rms_norm(
        rows.data_ptr(),
        rows.numel() // rows.shape[-1],
        rows.shape[-1],
        weight.contiguous().data_ptr(),
        eps,
        out.data_ptr(),
        _DTYPES[x.dtype],
        int(gemma),
        torch.get_num_threads(),
    )
    return out


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """``gate = silu(gate) * up`` in place, as a SiLU MLP's two ops compute it (bfloat16: their
    bits), in one pass; False, having done nothing, where the kernel cannot take them: not built,
    another dtype or device, shapes that differ, a tensor that is not contiguous."""
    return _gated(gate, up, "llmfleet_silu_mul")


def gelu_tanh_times(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """``gate = gelu(gate, approximate="tanh") * up`` in place, as Gemma's MLP computes it, to an
    ulp or two of torch's tanh in float32 (bfloat16: its bits but where that lands on a rounding
    edge); False as ``silu_times``."""
    return _gated(gate, up, "llmfleet_gelu_tanh_mul")


def _gated(gate: torch.Tensor, up: torch.Tensor, kernel: str) -> bool:
    if (
        gate.device.type != "cpu"
        or gate.dtype not in _DTYPES
        or up.dtype != gate.dtype
        or up.device != gate.device
        or up.shape != gate.shape
        or not (gate.is_contiguous() and up.is_contiguous())
    ):
        return False
    library = _library()
    if library is None:
        return False
    threads = torch.get_num_threads()
    getattr(library, kernel)(gate.data_ptr(), up.data_ptr(), gate.numel(), _DTYPES[gate.dtype], threads)
    return True


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` for ``q`` and ``k`` of shape (1,
    heads, tokens, dim) with ``cos`` and ``sin`` of shape (1, tokens, dim), bit for bit: the new
    tensors keep the inputs' strides, as torch's element-wise ops do. None where the kernel does
    not take them (another device, dtype, batch or layout; not built)."""
    bf16 = _DTYPES.get(q.dtype)
    shape = q.shape
    if (
        bf16 is None
        or not q.is_cpu
        or len(shape) != 4
        or shape[0] != 1
        or k.shape[2:] != shape[2:]
        or k.shape[0] != 1
        or k.dtype != q.dtype
        or cos.dtype != q.dtype
        or sin.dtype != q.dtype
        or cos.shape != (1, *shape[2:])
        or sin.shape != cos.shape
        or not (cos.is_contiguous() and sin.is_contiguous())
        or shape[3] % 2
        or q.stride(3) != 1
        or k.stride(3) != 1
        or q.numel() == 0
    ):
        return None
    library = _library()
    if library is None:
        return None
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # the inputs' strides, where they are dense
    if q_out.stride() != q.stride() or k_out.stride() != k.stride():
        return None
    library.llmfleet_rotary(
        q.data_ptr(),
        q.shape[1],
        q.stride(1),
        q.stride(2),
        q_out.data_ptr(),
        k.data_ptr(),
        k.shape[1],
        k.stride(1),
        k.stride(2),
        k_out.data_ptr(),
        q.shape[2],
        q.shape[3],
        cos.data_ptr(),
        sin.data_ptr(),
        bf16,
        torch.get_num_threads(),
    )
    return q_out, k_out
