"""A gated MLP's activation and product in one C pass on a CPU.

Llama's MLP, which Qwen2, Mistral, Gemma and many others share to the character, computes
``down(act(gate(x)) * up(x))``: between its linears, two tensor ops, each a full pass over the
(tokens, intermediate) activations, which in a prompt step are too large for the CPU's caches. So
``act`` reads and writes them once and the product reads two and writes one again.
``fuse_gated_mlps`` swaps each such module whose activation is SiLU or torch's GeLU with the tanh
approximation (Gemma's) for one that runs ``cpu_kernels.silu_times`` or
``cpu_kernels.gelu_tanh_times`` instead: one pass, gate and up read once, the result written over
the gate, with the module's roundings (SiLU in bfloat16: its bits; GeLU within an ulp or two of
torch's tanh). The swap keeps the module's linears and activation under their names, which the
decode layers in C read (cpu_decode.py). ``LLMFLEET_FUSED_MLP=0`` keeps every module's own.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from transformers.activations import GELUTanh, SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP

from llmfleet.server.runner import cpu_kernels
from llmfleet.server.runner.module_swaps import forward_is, swap_modules

SILU = (SiLUActivation, torch.nn.SiLU)


class FusedGatedMLP(torch.nn.Module):
    """A Llama-style gated MLP (the same linears and activation) whose activation and product run
    the C kernel where it takes the tensors and the module's own two ops elsewhere."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self._kernel = kernel_for(mlp.act_fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not self._kernel(gate, up):
            gate = self.act_fn(gate) * up
        return self.down_proj(gate)


def kernel_for(act: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], bool] | None:
    """The C kernel that computes ``act(gate) * up`` as the module's ops do, or None."""
    if type(act) in SILU:
        return cpu_kernels.silu_times
    return cpu_kernels.gelu_tanh_times if is_torchs_gelu_tanh(act) else None


def is_torchs_gelu_tanh(act: torch.nn.Module) -> bool:
    """Whether ``act`` is transformers' GeLU (tanh) calling torch's kernel, not its Python formula."""
    call = getattr(act, "act", None)
    return (
        type(act) is GELUTanh
        and type(act).forward is GELUTanh.forward
        and isinstance(call, functools.partial)
        and call.func is torch.nn.functional.gelu
        and call.keywords == {"approximate": "tanh"}
    )


def enabled(device: torch.device) -> bool:
    """Whether a runner on ``device`` swaps its MLPs: on a CPU where the C kernels are on and built."""
    return (
        device.type == "cpu"
        and cpu_kernels.enabled()
        and os.environ.get("LLMFLEET_FUSED_MLP", "1") != "0"
        and cpu_kernels.built()
    )


def fuse_gated_mlps(model: torch.nn.Module) -> int:
    """Swap every MLP of ``model`` whose forward is Llama's and whose activation has a kernel (SiLU,
    torch's GeLU with tanh) for a ``FusedGatedMLP``; returns how many."""
    return swap_modules(
        model,
        lambda m: forward_is(type(m), LlamaMLP, "MLP") and kernel_for(getattr(m, "act_fn", None)) is not None,
        FusedGatedMLP,
    )
