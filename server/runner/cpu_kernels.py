"""Paged decode attention for CPUs, in C, read straight from the paged cache.

The torch path (attention._decode) gathers every decoding request's blocks into a padded copy
before two batched matmuls: at batch 32 on this 2-core CPU that copy was 21 ms of a 75 ms
builtin:small step, the matmuls over it 10 ms more. This kernel walks each request's block table
instead, reading each key and value once: per (request, KV head) it scores the queries of that
head's group, takes a float32 softmax over the context (the sliding window honoured), and sums the
values, all in float32 whatever the cache's dtype (float32 or bfloat16).

It is compiled on first use with the system's C compiler (``$CC``, default ``cc``) for this CPU
(``-march=native``) into ``$LLMFLEET_CACHE/kernels``, keyed by the source, the command and the
CPU's flags, and runs in torch's own OpenMP threads (the same ``libgomp`` is already loaded).
Without a compiler the torch path runs; ``LLMFLEET_CPU_KERNELS=0`` chooses it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from .builtin_models import cache_root

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* q . k over one head's row, k in the cache's dtype */
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

/* acc += p * v */
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

void llmfleet_paged_decode(
    const void *q, int64_t q_token_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int64_t num_slots,
    const int64_t *rows, const int64_t *blocks, int64_t blocks_per_request, const int64_t *lengths, int64_t n,
    void *out, int64_t out_token_stride, int64_t out_head_stride,
    int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size,
    float scale, int64_t window, int bf16, int num_threads) {
    const int64_t group = heads / kv_heads, item_size = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic)
    for (int64_t item = 0; item < n * kv_heads; item++) {
        const int64_t i = item / kv_heads, kvh = item % kv_heads;
        const int64_t length = lengths[i];
        const int64_t first = (window > 0 && length > window) ? length - window : 0;
        const int64_t ctx = length - first;
        float *scores = malloc(sizeof(float) * group * ctx);
        float *queries = malloc(sizeof(float) * group * dim);
        float *acc = calloc(group * dim, sizeof(float));
        float *sums = malloc(sizeof(float) * group);
        const int64_t *table = blocks + i * blocks_per_request;
        const char *keys = (const char *)k_cache + kvh * num_slots * dim * item_size;
        const char *values = (const char *)v_cache + kvh * num_slots * dim * item_size;
        for (int64_t g = 0; g < group; g++) {
            const int64_t at = rows[i] * q_token_stride + (kvh * group + g) * q_head_stride;
            for (int64_t d = 0; d < dim; d++) {
                const float value = bf16 ? bf16_to_float(((const uint16_t *)q)[at + d]) : ((const float *)q)[at + d];
                queries[g * dim + d] = scale * value;
            }
        }
        /* positions first .. length - 1, block by block: no division per token */
        for (int64_t b = first / block_size, pos = first; pos < length; b++) {
            const int64_t stop = (b + 1) * block_size < length ? (b + 1) * block_size : length;
            const int64_t slot = table[b] * block_size - b * block_size;  /* slot of pos: slot + pos */
            for (; pos < stop; pos++) {
                const void *k = keys + (slot + pos) * dim * item_size;
                for (int64_t g = 0; g < group; g++)
                    scores[g * ctx + pos - first] = dot(queries + g * dim, k, dim, bf16);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = scores + g * ctx;
            float top = -INFINITY, sum = 0.0f;
            for (int64_t t = 0; t < ctx; t++) top = sg[t] > top ? sg[t] : top;
            for (int64_t t = 0; t < ctx; t++) { sg[t] = expf(sg[t] - top); sum += sg[t]; }
            sums[g] = sum;
        }
        for (int64_t b = first / block_size, pos = first; pos < length; b++) {
            const int64_t stop = (b + 1) * block_size < length ? (b + 1) * block_size : length;
            const int64_t slot = table[b] * block_size - b * block_size;
            for (; pos < stop; pos++) {
                const void *v = values + (slot + pos) * dim * item_size;
                for (int64_t g = 0; g < group; g++) axpy(acc + g * dim, scores[g * ctx + pos - first], v, dim, bf16);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            const int64_t at = rows[i] * out_token_stride + (kvh * group + g) * out_head_stride;
            const float factor = 1.0f / sums[g];
            for (int64_t d = 0; d < dim; d++) {
                const float value = acc[g * dim + d] * factor;
                if (bf16) ((uint16_t *)out)[at + d] = float_to_bf16(value);
                else ((float *)out)[at + d] = value;
            }
        }
        free(scores); free(queries); free(acc); free(sums);
    }
}
"""

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_ARGTYPES = [
    _PTR, _I64, _I64,  # q, its token and head strides
    _PTR, _PTR, _I64,  # keys, values, slots per head
    _PTR, _PTR, _I64, _PTR, _I64,  # rows, blocks, blocks per request, lengths, n
    _PTR, _I64, _I64,  # out, its token and head strides
    _I64, _I64, _I64, _I64,  # heads, kv heads, head dim, block size
    ctypes.c_float, _I64, ctypes.c_int, ctypes.c_int,  # scale, window (0: none), bf16, threads
]  # fmt: skip

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def enabled() -> bool:
    return os.environ.get("LLMFLEET_CPU_KERNELS", "1") != "0"


def built() -> bool:
    """Whether the kernel is (or can now be) compiled here."""
    return _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None where it cannot be built (it says why once)."""
    compiler = os.environ.get("CC", "cc")
    command = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    key = hashlib.sha256("\0".join([_SOURCE, *command, cpu]).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"paged_decode-{key}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # another process may build it too
                source = Path(tmp) / "paged_decode.c"
                source.write_text(_SOURCE)
                output = Path(tmp) / path.name
                subprocess.run([*command, "-o", str(output), str(source), "-lm"], check=True, capture_output=True)
                output.replace(path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr.decode(errors="replace")[-500:] if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", detail)
        return None
    library.llmfleet_paged_decode.argtypes = _ARGTYPES
    library.llmfleet_paged_decode.restype = None
    return library


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
) -> bool:
    """Attend ``rows`` of ``q`` (T, heads, D) to their cached ``keys``/``values`` (kv_heads,
    slots, D) and write those rows of ``out`` (T, heads, D). Request i of ``rows`` has context
    ``lengths[i]`` in its block table, row i of ``blocks`` (n, blocks per request). Returns False,
    having done nothing, where the kernel does not apply: turned off, not built, another device or
    dtype, or a layout it does not read."""
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
    ):
        return False
    library = _library()
    if library is None:
        return False
    n, heads, dim = rows.shape[0], q.shape[1], q.shape[2]
    kv_heads, slots = keys.shape[0], keys.shape[1]
    library.llmfleet_paged_decode(
        q.data_ptr(), q.stride(0), q.stride(1),
        keys.data_ptr(), values.data_ptr(), slots,
        rows.data_ptr(), blocks.data_ptr(), blocks.numel() // n, lengths.data_ptr(), n,
        out.data_ptr(), out.stride(0), out.stride(1),
        heads, kv_heads, dim, block_size,
        scale, window or 0, bf16, torch.get_num_threads(),
    )  # fmt: skip
    return True
