"""Cut a loaded HF model down to one worker's part: its pipeline stage's layers, and its tensor
shard of each layer.

Tensor parallelism is Megatron's split, done on the loaded weights: q/k/v and gate/up keep the
rows of this shard's heads and MLP columns (column-parallel), o and down keep the matching input
columns (row-parallel) and their outputs are summed over the shard group. The layers' own code
then runs unchanged: it reshapes by ``head_dim``, so it sees fewer heads, in the same GQA
grouping. Embeddings and the LM head stay whole on every rank of the stages that use them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Sums a tensor over the shard group in place (worker.shard_all_reduce: NCCL, gloo or shared memory).
AllReduce = Callable[[torch.Tensor], object]


class SummedOverShards(torch.nn.Module):
    """A row-parallel projection: this shard's partial product, summed over the group."""

    def __init__(self, linear: torch.nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.linear = linear
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.all_reduce(out)
        return out


def _keep_rows(linear: torch.nn.Linear, shard: int, shards: int) -> None:
    rows = linear.out_features // shards
    keep = slice(shard * rows, shard * rows + rows)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[keep].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.detach()[keep].clone(), requires_grad=False)
    linear.out_features = rows


def _keep_columns(linear: torch.nn.Linear, shard: int, shards: int) -> None:
    columns = linear.in_features // shards
    keep = slice(shard * columns, shard * columns + columns)
    linear.weight = torch.nn.Parameter(linear.weight.detach()[:, keep].clone(), requires_grad=False)
    if linear.bias is not None and shard:  # the sum adds the bias once
        linear.bias = None
    linear.in_features = columns


def shard_layers(model: torch.nn.Module, shard: int, shards: int, all_reduce: AllReduce) -> None:
    """Keep shard ``shard`` of ``shards`` of every decoder layer's attention and MLP."""
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            _keep_rows(linear, shard, shards)
        _keep_columns(attention.o_proj, shard, shards)
        _keep_columns(mlp.down_proj, shard, shards)
        attention.o_proj = SummedOverShards(attention.o_proj, all_reduce)
        mlp.down_proj = SummedOverShards(mlp.down_proj, all_reduce)


def keep_stage(model: torch.nn.Module, layers: range, first: bool, last: bool) -> None:
    """Keep ``layers`` of the decoder (they keep their ``layer_idx``, which names their KV), the
    embeddings on the first stage, the final norm and LM head on the last."""
    base = model.model
    base.layers = torch.nn.ModuleList([base.layers[i] for i in layers])
    if not first:
        base.embed_tokens = None  # later stages take the previous one's hidden states
    if not last:
        base.norm = torch.nn.Identity()  # the last stage normalizes
        model.lm_head = torch.nn.Identity()
