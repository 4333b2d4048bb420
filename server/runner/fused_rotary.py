"""transformers' rotary embedding in one C call on a CPU.

Llama's ``apply_rotary_pos_emb``, which Qwen2, Mistral and many other architectures copy, runs
about ten tensor ops for each layer of each step (broadcasts, slices, a negation, a concatenation,
four multiplies and adds); on a decode step's few rows each costs its dispatch more than its
arithmetic. ``cpu_kernels.rotary`` computes the same in one pass, bit for bit.

The function is not a module but a name each architecture's attention looks up in its modeling
module at every call, so ``install`` replaces it there, for every model of that architecture in
this process: the replacement runs the kernel where it takes the tensors and the original
elsewhere. It is installed only where the original computes, on a probe of the model's own head
size and dtype, exactly what the kernel does, so an architecture whose rotary differs (a partial
rotary, interleaved pairs) keeps its own. ``LLMFLEET_FUSED_ROTARY=0`` installs nothing; it has to
be set before a model is loaded, since an installed replacement stays for the process.
"""

from __future__ import annotations

import os
import sys

import torch

from llmfleet.server.runner import cpu_kernels

NAME = "apply_rotary_pos_emb"


def enabled(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and cpu_kernels.enabled()
        and os.environ.get("LLMFLEET_FUSED_ROTARY", "1") != "0"
        and cpu_kernels.built()
    )


def install(model: torch.nn.Module) -> int:
    """Replace ``apply_rotary_pos_emb`` in the modeling modules of ``model``'s classes where the
    probe finds the kernel exact; returns in how many modules (0 where it was there already)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    installed = 0
    for name in sorted({type(module).__module__ for module in model.modules()}):
        module = sys.modules.get(name)
        original = getattr(module, NAME, None)
        if original is None or getattr(original, "llmfleet_fused", False):
            continue
        if _exact(original, dtype, heads, head_dim):
            setattr(module, NAME, _fused(original))
            installed += 1
    return installed


def _fused(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        out = None if args or kwargs else cpu_kernels.rotary(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    apply_rotary_pos_emb.llmfleet_fused = True
    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _exact(original, dtype: torch.dtype, heads: int, head_dim: int) -> bool:
    """Whether ``original`` gives the kernel's bits on random query, key and angles of this
    model's head size, laid out as an attention hands them over."""
    gen = torch.Generator().manual_seed(0)
    tokens = 3
    q = torch.randn(1, tokens, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(1, tokens, 1, head_dim, generator=gen).to(dtype).transpose(1, 2)
    angles = 10 * torch.randn(1, tokens, head_dim // 2, generator=gen)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    fused = cpu_kernels.rotary(q, k, cos, sin)
    if fused is None:
        return False
    try:
        expected = original(q, k, cos, sin)
        return all(torch.equal(a, b) for a, b in zip(expected, fused, strict=True))
    except Exception:  # another signature or shapes: not Llama's rotary
        return False
