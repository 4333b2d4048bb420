"""RMSNorm in one C loop for CPUs.

transformers' Llama RMSNorm, and the many RMSNorms written as the same forward (Qwen, Mistral,
Granite, GLM, DeepSeek...), run eight tensor ops for each call: a float32 copy, square, mean, add,
rsqrt, multiply, a copy back and the weight's multiply, twice a layer and once more at the end;
on a few rows each op costs its dispatch more than its arithmetic, and a second thread does not
shorten them (docs/engine.md has the figures). ``fuse_rms_norms`` swaps each such module for one
that calls ``cpu_kernels.rms_norm``, which reads the row once to sum and once to write, with the
module's roundings. Which modules: those whose ``forward`` is, to the character, Llama's (their weight
and epsilon the same attributes); any other (Gemma's ``1 + weight``, norms without a weight)
keeps its own. ``LLMFLEET_FUSED_NORMS=0`` keeps every module's own.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from llmfleet.server.runner import cpu_kernels


class FusedRMSNorm(torch.nn.Module):
    """A Llama-style RMSNorm (its weight, the same parameter, and epsilon) whose forward runs the C
    kernel where it can and Llama's own elsewhere."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = float(norm.variance_epsilon)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = cpu_kernels.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return LlamaRMSNorm.forward(self, hidden_states) if out is None else out

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def enabled(device: torch.device) -> bool:
    """Whether a runner on ``device`` swaps its norms: on a CPU, with the kernels on and built."""
    return (
        device.type == "cpu"
        and cpu_kernels.enabled()
        and os.environ.get("LLMFLEET_FUSED_NORMS", "1") != "0"
        and cpu_kernels.built()
    )


def fuse_rms_norms(model: torch.nn.Module) -> int:
    """Swap every RMSNorm of ``model`` whose forward is Llama's for a ``FusedRMSNorm``; returns how many."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _llama_forward(type(child)) and isinstance(getattr(child, "weight", None), torch.Tensor)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, FusedRMSNorm(child))
    return len(swaps)


@functools.cache
def _llama_forward(cls: type) -> bool:
    if not issubclass(cls, torch.nn.Module) or not cls.__name__.endswith("RMSNorm"):
        return False
    try:
        return inspect.getsource(cls.forward) == _LLAMA_FORWARD
    except (OSError, TypeError):  # no source to compare: not known to be Llama's
        return False


_LLAMA_FORWARD = inspect.getsource(LlamaRMSNorm.forward)
