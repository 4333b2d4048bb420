"""A SiLU MLP's activation and product in one C pass on a CPU.

Llama's MLP, which Qwen2, Mistral and many others share to the character, computes
``down(silu(gate(x)) * up(x))``: between its linears, two tensor ops, each a full pass over the
(tokens, intermediate) activations, which in a prompt step are too large for the CPU's caches. So
``silu`` reads and writes them once and the product reads two and writes one again.
``fuse_silu_mlps`` swaps each such module for one that runs ``cpu_kernels.silu_times`` instead:
one pass, gate and up read once, the result written over the gate, with the module's roundings
(bfloat16: its bits). The swap keeps the module's linears and activation under their names, which
the decode layers in C read (cpu_decode.py). ``LLMFLEET_FUSED_MLP=0`` keeps every module's own.
"""

from __future__ import annotations

import os

import torch
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from llmfleet.server.runner import cpu_kernels
from llmfleet.server.runner.module_swaps import forward_is, swap_modules

SILU = (SiLUActivation, torch.nn.SiLU)


class FusedSiluMLP(torch.nn.Module):
    """A Llama-style SiLU MLP (the same linears and activation) whose product runs the C kernel
    where it takes the tensors and the module's own two ops elsewhere."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not cpu_kernels.silu_times(gate, up):
            gate = self.act_fn(gate) * up
        return self.down_proj(gate)


def enabled(device: torch.device) -> bool:
    """Whether a runner on ``device`` swaps its MLPs: on a CPU where the C kernels are on and built."""
    return (
        device.type == "cpu"
        and cpu_kernels.enabled()
        and os.environ.get("LLMFLEET_FUSED_MLP", "1") != "0"
        and cpu_kernels.built()
    )


def fuse_silu_mlps(model: torch.nn.Module) -> int:
    """Swap every MLP of ``model`` whose forward is Llama's and whose activation is SiLU for a
    ``FusedSiluMLP``; returns how many."""
    return swap_modules(
        model,
        lambda m: forward_is(type(m), LlamaMLP, "MLP") and type(getattr(m, "act_fn", None)) in SILU,
        FusedSiluMLP,
    )
