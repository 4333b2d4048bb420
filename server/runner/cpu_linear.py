"""oneDNN-packed linear layers for CPUs.

On a CPU, ``nn.Linear`` runs through MKL's GEMM, which on this project's AMD machines takes a
generic code path several times slower than oneDNN's (the measurements are in the commit log).
Here every ``nn.Linear`` of a loaded model is swapped for a ``PackedLinear`` whose weight is
reordered once, at load, into oneDNN's blocked layout, and whose forward is oneDNN's linear:
what inductor does for CPU linears when it freezes a graph, and what vLLM's CPU build does.

The packed weight replaces the dense one: the layer keeps a zero-stride stand-in of the same
shape and dtype as its ``weight`` (so code that reads a layer's shape, dtype or parameter count
still works), except where the weight is tied to another module (an embedding), whose dense
tensor stays. Compute anything that reads weight values (the KV fingerprint) before packing.

oneDNN builds a kernel for each new row count on first use, so a packed runner pads its steps
to a bounded set of sizes and warms them up at start-up (step_shapes.py, warm_up.py). A step of a
few rows (a decode of a few requests) skips oneDNN for a C kernel that streams the same packed
weight at the memory's rate (cpu_kernels.small_linear), where its layout was checked at load.
A bfloat16 step size at which oneDNN leaves threads idle runs in pieces (linear_splits.py).
``LLMFLEET_PACKED_LINEAR=0`` keeps the plain linears.
"""

from __future__ import annotations

import os

import torch

from llmfleet.server.runner import cpu_kernels

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a runner on ``device`` in ``dtype`` packs its linears: oneDNN packs bfloat16 only
    on CPUs with its bf16 instructions (AVX-512 or AVX-NE-CONVERT); elsewhere (AVX2) bfloat16
    stays on the plain linears rather than failing at load."""
    return (
        device.type == "cpu"
        and dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()
        and (dtype != torch.bfloat16 or packs_bfloat16())
        and os.environ.get("LLMFLEET_PACKED_LINEAR", "1") != "0"
    )


def packs_bfloat16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(torch.nn.Module):
    """``nn.Linear``'s forward through oneDNN, on a weight packed once."""

    def __init__(self, linear: torch.nn.Linear, rows_hint: int, keep_weight: bool) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dense = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(dense, rows_hint)
        self.bias = linear.bias
        # a step of a few rows streams the packed weight through a C kernel instead, which adds
        # the bias in float32
        self.small_block = cpu_kernels.packed_block(self.packed, dense)
        self.small_rows = cpu_kernels.small_linear_rows(dense.dtype, self.small_block) if self.small_block else 0
        self.small_bias = None if self.bias is None else self.bias.detach().float()
        # {rows: piece}: step sizes at which oneDNN leaves threads idle, run in pieces of fewer
        # rows; found at start-up (linear_splits.py)
        self.row_pieces: dict[int, int] = {}
        if keep_weight:
            self.weight = linear.weight
        else:  # a stand-in: shape and dtype without the memory
            self.weight = torch.nn.Parameter(
                torch.zeros((), dtype=dense.dtype, device=dense.device).expand(dense.shape), requires_grad=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.small_rows * self.in_features and x.dtype == self.weight.dtype and x.numel():
            return cpu_kernels.small_linear(x, self.packed, self.out_features, self.small_bias, self.small_block)
        piece = self.row_pieces.get(x.numel() // self.in_features) if self.row_pieces else None
        return self.onednn(x) if piece is None else self.onednn_in_pieces(x, piece)

    def onednn(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on ``x`` in one oneDNN call."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def onednn_in_pieces(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The layer on ``x`` in oneDNN calls of at most ``rows`` rows each (linear_splits.py)."""
        flat = x.reshape(-1, self.in_features)
        out = torch.cat([self.onednn(piece) for piece in flat.split(rows)])
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: torch.nn.Module, rows_hint: int) -> int:
    """Swap every ``nn.Linear`` of ``model`` for a ``PackedLinear``; returns how many.
    ``rows_hint``: the row count oneDNN picks its packed layout for (any count runs)."""
    owners: dict[int, int] = {}  # weight storage -> modules holding it
    for module in model.modules():
        for param in module.parameters(recurse=False):
            key = param.untyped_storage().data_ptr()
            owners[key] = owners.get(key, 0) + 1
    swaps = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear and child.weight.dtype in PACKED_DTYPES:
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        shared = owners.get(child.weight.untyped_storage().data_ptr(), 0) > 1
        setattr(parent, name, PackedLinear(child, rows_hint, keep_weight=shared))
    return len(swaps)
