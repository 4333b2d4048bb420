"""A loaded model's modules swapped for this device's faster ones, the same way for a runner and
a parallel worker: oneDNN-packed linear layers on a CPU (cpu_linear.py), RMSNorms in one kernel
(fused_norms.py: a C loop on a CPU, Triton on a GPU) and, on a CPU, the rotary embedding in one C
call (fused_rotary.py) and a gated MLP's activation and product in one pass (fused_mlp.py)."""

from __future__ import annotations

import torch

from llmfleet.server.runner import cpu_linear, fused_mlp, fused_norms, fused_rotary


def prepare(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_num_batched_tokens: int) -> bool:
    """Swap ``model``'s modules in place; returns whether its linears were packed (a runner pads
    its steps to the shapes oneDNN's packed kernels are built for: step_shapes.py)."""
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
