"""The paged KV cache tensors: per layer, keys and values for every slot of every block.

Layout per layer: (num_blocks, kv_heads, block_size, head_dim), blocks first, as vLLM lays its
cache out. A block of every KV head lies in one place (24 KB in bfloat16 for builtin:small), so
a decode's reads of a request's context are long runs the CPU's prefetchers follow, where with
heads first each head's block was a 2 KB island anywhere in the cache (docs/engine.md has the
figures). Slot s is offset s % block_size of block s // block_size.

Gathers (the torch paths) copy whole blocks of a head and yield one contiguous (ctx, head_dim)
matrix per head and request, which the attention matmuls read without another copy. They go into
one scratch buffer reused by every layer and step: measured on this CPU, ``index_select`` into an
existing buffer is up to twice as fast as into a fresh tensor.

A pipeline stage holds only its own layers (``layers``); they keep the model's layer numbers.
"""

from __future__ import annotations

import torch

from llmfleet.server.runner import cpu_kernels


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layers: range | None = None,
    ) -> None:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.layers = range(num_layers) if layers is None else layers
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # zeros, not empty: padded positions of a gather read stale slots, which must be finite
        held = set(self.layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) if i in held else None for i in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) if i in held else None for i in range(num_layers)]
        self._block_size_elems = block_size * head_dim
        # one row per (block, KV head): block_size * head_dim values
        self._key_rows = [None if k is None else k.view(num_blocks * num_kv_heads, -1) for k in self.keys]
        self._value_rows = [None if v is None else v.view(num_blocks * num_kv_heads, -1) for v in self.values]
        self._scratch = torch.empty(0, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store this step's ``key``/``value`` (kv_heads, T, head_dim) at ``slots`` (T,): on a CPU
        by the write kernel (cpu_kernels.py), which overlaps the rows' cache misses."""
        if cpu_kernels.kv_write(self.keys[layer], self.values[layer], slots, key, value):
            return
        # the row of (head h, slot s) among the cache's (blocks * kv_heads * block_size) rows
        block, offset = slots // self.block_size, slots % self.block_size
        block_rows = self._head_rows(block, 0, self.num_kv_heads).view(self.num_kv_heads, -1)
        rows = (block_rows * self.block_size + offset).view(-1)
        width = self.head_dim
        self.keys[layer].view(-1, width).index_copy_(0, rows, key.reshape(-1, width).to(self.dtype))
        self.values[layer].view(-1, width).index_copy_(0, rows, value.reshape(-1, width).to(self.dtype))

    def gather(
        self, layer: int, blocks: torch.Tensor, heads: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` (n,) for KV heads ``heads`` (first, end; default all),
        each (num_heads, n * block_size, head_dim).

        The results live in the shared scratch buffer: valid until the next ``gather``."""
        first, end = heads if heads is not None else (0, self.num_kv_heads)
        n = blocks.shape[0]
        per_block = self._block_size_elems
        size = (end - first) * n * per_block
        if self._scratch.numel() < 2 * size:
            self._scratch = torch.empty(2 * size, dtype=self.dtype, device=self.device)
        keys = self._scratch[:size].view(end - first, n, per_block)
        values = self._scratch[size : 2 * size].view(end - first, n, per_block)
        rows = self._head_rows(blocks, first, end)
        torch.index_select(self._key_rows[layer], 0, rows, out=keys.view(-1, per_block))
        torch.index_select(self._value_rows[layer], 0, rows, out=values.view(-1, per_block))
        shape = (end - first, n * self.block_size, self.head_dim)
        return keys.view(shape), values.view(shape)

    def export_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A host copy of ``blocks`` of every layer held, in the KV transfer payload layout
        (server/core/kv_wire.py): (layers, 2, kv_heads, len(blocks), block_size * head_dim)."""
        rows = self._head_rows(torch.tensor(blocks, dtype=torch.long, device=self.device), 0, self.num_kv_heads)
        shape = (len(self.layers), 2, self.num_kv_heads * len(blocks), self._block_size_elems)
        out = torch.empty(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.layers):
            torch.index_select(self._key_rows[layer], 0, rows, out=out[i, 0])
            torch.index_select(self._value_rows[layer], 0, rows, out=out[i, 1])
        out = out.view(len(self.layers), 2, self.num_kv_heads, len(blocks), self._block_size_elems)
        return out.cpu()  # on the CPU already: the same tensor, no copy

    def import_blocks(self, blocks: list[int], data: torch.Tensor) -> None:
        """Write ``data`` (the payload layout of the layers held, on any device) into ``blocks``."""
        rows = self._head_rows(torch.tensor(blocks, dtype=torch.long, device=self.device), 0, self.num_kv_heads)
        data = data.to(self.device, non_blocking=True)
        for i, layer in enumerate(self.layers):
            self._key_rows[layer].index_copy_(0, rows, data[i, 0].reshape(rows.shape[0], -1))
            self._value_rows[layer].index_copy_(0, rows, data[i, 1].reshape(rows.shape[0], -1))

    def _head_rows(self, blocks: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """The rows (one per block and KV head) of ``blocks`` for KV heads first..end - 1, head
        by head: gathered in this order, each head's blocks lie one after another."""
        heads = torch.arange(first, end, dtype=torch.long, device=blocks.device).unsqueeze(1)
        return (blocks.unsqueeze(0) * self.num_kv_heads + heads).view(-1)

    def take_scratch(self) -> torch.Tensor:
        """Hand over the gather buffer and start a fresh one (a CUDA graph capture must allocate
        its own inside the graph's memory pool, never keep a pointer into this one)."""
        scratch, self._scratch = self._scratch, torch.empty(0, dtype=self.dtype, device=self.device)
        return scratch

    def restore_scratch(self, scratch: torch.Tensor) -> None:
        self._scratch = scratch

    def heads_per_chunk(self, num_blocks: int, chunk_bytes: int) -> int:
        """How many KV heads of ``num_blocks`` gathered blocks fit in ``chunk_bytes`` (K and V)."""
        per_head = 2 * num_blocks * self._block_size_elems * self.keys[self.layers[0]].element_size()
        return max(1, min(self.num_kv_heads, chunk_bytes // per_head))
