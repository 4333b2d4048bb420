"""When the runner's Triton kernels (triton_kernels.py) run, and their calls.

- ``paged_decode``: decode attention read in place from the paged cache. Without it a decode
  group gathers its blocks into a padded copy and attends with two batched matmuls, a mask and a
  softmax: the gather alone reads and writes every cached key and value once more (its share of a
  step on an H200: docs/benchmarks.md).
- ``rms_norm``: Llama's RMSNorm in one kernel instead of seven.

Each returns False or None, having done nothing, where it does not apply: not a CUDA tensor,
Triton missing, a dtype or layout it does not take, or ``LLMFLEET_TRITON_KERNELS=0``. The caller
then runs its torch path. ``LLMFLEET_TRITON_KERNELS=interpret`` also runs them on CPU tensors,
through Triton's interpreter (``TRITON_INTERPRET=1`` from before Triton's first import): the
tests' way to check the kernels' code on a machine without a GPU.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE = 64  # tokens of one request's context a decode program reads per iteration


def _mode() -> str:
    return os.environ.get("LLMFLEET_TRITON_KERNELS", "1")


@functools.cache
def _kernels():
    """The kernels' module, or None where Triton cannot be imported."""
    try:
        return importlib.import_module("llmfleet.server.runner.triton_kernels")
    except ImportError:
        return None


def available() -> bool:
    """Whether the kernels may run on CUDA tensors here: switched on, and Triton importable."""
    return _mode() != "0" and _kernels() is not None


def _runs_on(t: torch.Tensor) -> bool:
    mode = _mode()
    on_device = t.is_cuda if mode == "1" else mode == "interpret" and t.device.type == "cpu"
    return on_device and _kernels() is not None


def _pow2(n: int, least: int) -> int:
    return max(least, 1 << (n - 1).bit_length())


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
    kv_heads, block_size, D) and write those rows of ``out`` (T, heads, D), as
    cpu_kernels.paged_decode does on a CPU: request i of ``rows`` has context ``lengths[i]`` in row
    i of ``blocks`` (n, blocks per request, flattened). Logit caps are left to the torch path."""
    if (
        softcap is not None
        or not _runs_on(q)
        or keys.dtype not in _DTYPES
        or q.dtype != keys.dtype
        or out.dtype != keys.dtype
        or q.stride(2) != 1
        or out.stride(2) != 1
        or not (keys.is_contiguous() and values.is_contiguous())
        or keys.dim() != 4
        or keys.shape[2] != block_size
        or rows.shape[0] == 0
    ):
        return False
    n, heads, dim = rows.shape[0], q.shape[1], q.shape[2]
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    _kernels().paged_decode_kernel[(n, kv_heads)](
        q,
        out,
        keys,
        values,
        rows,
        blocks,
        lengths,
        sink_logits if sink_logits is not None else lengths,  # unread without sinks
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        keys.stride(1),
        block_size,
        blocks.shape[0] // n,
        scale,
        window or 0,
        GROUP=group,
        GROUP_PAD=_pow2(group, 16),  # tl.dot takes at least 16 rows
        DIM=dim,
        DIM_PAD=_pow2(dim, 16),
        TILE=TILE,
        HAS_SINKS=sink_logits is not None,
        HAS_WINDOW=window is not None,
        IEEE=keys.dtype == torch.float32,  # float32 stays float32 (no TF32): the oracle tests' exactness
        # a power of two, so that a kernel is compiled for a few context lengths, not each one
        TILES=_pow2(-(-(blocks.shape[0] // n) * block_size // TILE), 1),
    )
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """Llama's RMSNorm of ``x`` over its last dimension, or None where the kernel does not take
    it (``weight`` in another dtype or of another size, an empty or very wide ``x``)."""
    width = x.shape[-1]
    if (
        not _runs_on(x)
        or x.dtype not in _DTYPES
        or weight.dtype != x.dtype
        or weight.dim() != 1
        or weight.shape[0] != width
        or x.numel() == 0
        or width > 1 << 16
    ):
        return None
    rows = x.contiguous()
    out = torch.empty_like(rows)
    kernel = _kernels().rms_norm_kernel
    kernel[(rows.numel() // width,)](rows, weight.contiguous(), out, width, eps, WIDTH_PAD=_pow2(width, 16))
    return out
