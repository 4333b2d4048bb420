"""A loaded model's modules swapped for this device's faster ones, the same way for a runner and
a parallel worker: oneDNN-packed linear layers on a CPU (cpu_linear.py), RMSNorms in one kernel
(fused_norms.py: a C loop on a CPU, Triton on a GPU) and, on a CPU, the rotary embedding in one C
call (fused_rotary.py) and a gated MLP's activation and product in one pass (fused_mlp.py); on
every device, LongRoPE's table chosen per request (request_rope.py)."""

from __future__ import annotations

import torch

from llmfleet.server.runner import cpu_linear, fused_mlp, fused_norms, fused_rotary, request_rope


def prepare(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_num_batched_tokens: int) -> bool:
    """Swap ``model``'s modules in place; returns whether its linears were packed (a runner pads
    its steps to the shapes oneDNN's packed kernels are built for: step_shapes.py)."""
    request_rope.install(decoder_of(model))  # on every device: it is what HF computes, per request
    packed = cpu_linear.enabled(device, dtype)
    if packed:
        cpu_linear.pack_linears(model, max_num_batched_tokens)
    if fused_norms.enabled(device):
        fused_norms.fuse_rms_norms(model)
    if fused_rotary.enabled(device):
        fused_rotary.install(model)
    if fused_mlp.enabled(device):
        fused_mlp.fuse_gated_mlps(model)
    return packed


def decoder_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's decoder stack (its embedding, layers, final norm and rotary embedding): a
    multimodal model's text decoder (Gemma 3's ``language_model``); None where it has no ``model``."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)
