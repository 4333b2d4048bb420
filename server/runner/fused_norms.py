"""RMSNorm in one kernel: a C loop on a CPU, a Triton kernel on a GPU.

transformers' Llama RMSNorm, and the many RMSNorms written as the same forward (Qwen, Mistral,
Granite, GLM, DeepSeek...), run eight tensor ops for each call: a float32 copy, square, mean, add,
rsqrt, multiply, a copy back and the weight's multiply, twice a layer and once more at the end;
on a few rows each op costs its dispatch (on a GPU, its kernel) more than its arithmetic, and a
second CPU thread does not shorten them (docs/engine.md has the figures). ``fuse_rms_norms`` swaps
each such module for one that calls ``cpu_kernels.rms_norm`` or, on a GPU, ``gpu_kernels.rms_norm``,
which read the row once to sum and once to write, with the module's roundings. Which modules:
those whose ``forward`` is, to the character, Llama's (their weight and epsilon the same
attributes), and on a CPU those whose ``forward`` is Gemma's (times ``1 + weight``, rounded once:
``FusedGemmaRMSNorm``); any other (norms without a weight, LayerNorms) keeps its own.
``LLMFLEET_FUSED_NORMS=0`` keeps every module's own.
"""

from __future__ import annotations

import os

import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmfleet.server.runner import cpu_kernels, gpu_kernels
from llmfleet.server.runner.module_swaps import forward_is, swap_modules


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm (its weight, the same parameter, and epsilon) whose forward runs the
    kernel of its weight's device where it can and Llama's own elsewhere."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)
        self._kernel = gpu_kernels.rms_norm if norm.weight.is_cuda else cpu_kernels.rms_norm

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self._kernel(hidden_states, self.weight, self.variance_epsilon)
        return LlamaRMSNorm.forward(self, hidden_states) if out is None else out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class FusedGemmaRMSNorm(torch.nn.Module):
    """A Gemma-style RMSNorm (its weight, an offset from one, and epsilon, under Gemma's names)
    whose forward runs the C kernel where it can and Gemma's own elsewhere."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = float(norm.eps)

    _norm = GemmaRMSNorm._norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.rms_norm(x, self.weight, self.eps, gemma=True)
        return GemmaRMSNorm.forward(self, x) if out is None else out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def is_gemma_norm(norm: torch.nn.Module) -> bool:
    """Whether ``norm`` computes Gemma's RMSNorm: the fused one, or a module whose forward is Gemma's."""
    return isinstance(norm, FusedGemmaRMSNorm) or (
        forward_is(type(norm), GemmaRMSNorm, "RMSNorm", "_norm")
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and isinstance(getattr(norm, "eps", None), float)
    )


def enabled(device: torch.device) -> bool:
    """Whether a runner on ``device`` swaps its norms: where its kernels are on and can be had (the C
    kernel built on a CPU, Triton on a GPU)."""
    if os.environ.get("LLMFLEET_FUSED_NORMS", "1") == "0":
        return False
    if device.type == "cpu":
        return cpu_kernels.enabled() and cpu_kernels.built()
    return device.type == "cuda" and gpu_kernels.available()


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of ``model`` whose forward is Llama's for a ``FusedRMSNorm`` and, where
    its weights are on a CPU, every one whose forward is Gemma's for a ``FusedGemmaRMSNorm``;
    returns how many."""
    llamas = swap_modules(
        model,
        lambda m: forward_is(type(m), LlamaRMSNorm, "RMSNorm") and isinstance(getattr(m, "weight", None), torch.Tensor),
        FusedRMSNorm,
    )
    gemmas = swap_modules(
        model,
        lambda m: is_gemma_norm(m) and not isinstance(m, FusedGemmaRMSNorm) and m.weight.device.type == "cpu",
        FusedGemmaRMSNorm,
    )
    return llamas + gemmas
