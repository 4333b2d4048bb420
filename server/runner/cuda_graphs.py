"""CUDA graphs for decode steps: on a GPU an eager decode step of a small model is bound by kernel
launches (measured on an H100 with builtin:small: ~13 ms per step from batch 1 to 128, while the
GPU itself was busy for about 1 ms of it). A replayed graph launches the whole forward at once.

A graph is captured per (batch bucket, context bucket): the batch is padded to the next of
``BATCH_BUCKETS`` and every request's block table to the next power of two of blocks, so one
graph serves every step of that shape. Padding rows decode a dummy token into a reserved block
that the block manager never hands out (the cache has one block more than the runner reports),
and attend only to it; padding blocks of real rows are masked by their length, as an eager padded
decode group is. Graphs are captured at start-up (or, with ``LLMFLEET_CUDA_GRAPHS=lazy``, on the
first step of each shape) and share one memory pool with the piecewise graphs: no two of them
run concurrently, and each graph's logits are read before the next replay.

Only pure decode steps use these graphs; a step with a prompt chunk replays piecewise graphs with
attention run eagerly between them (piecewise_graphs.py).
"""

from __future__ import annotations

import logging
from array import array

import torch

from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.runner.attention import DecodeGroup, StepMetadata, model_logits
from llmfleet.server.runner.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_CONTEXT_BLOCKS = 8


def _bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= value), None)


class _Graph:
    """One captured decode forward with its static input and output tensors."""

    def __init__(self, batch: int, blocks_per_request: int, cache: PagedKVCache, device: torch.device) -> None:
        self.batch = batch
        self.blocks_per_request = blocks_per_request
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros((1, batch), **long)
        self.positions = torch.zeros((1, batch), **long)
        self.slots = torch.zeros((batch,), **long)
        self.blocks = torch.zeros((batch * blocks_per_request,), **long)
        self.lengths = torch.ones((batch,), **long)
        self.rows = torch.arange(batch, **long)
        group = DecodeGroup(self.rows, self.blocks, self.lengths, blocks_per_request, padded=True)
        self.meta = StepMetadata(cache=cache, slot_mapping=self.slots, decode_groups=[group], prefills=[])
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None

    def forward(self, model) -> torch.Tensor:
        return model_logits(model, self.input_ids, self.positions, self.rows, self.meta)

    def fill(self, packed: torch.Tensor) -> None:
        """Copy one step's inputs, packed on the host as [ids | positions | slots | lengths | blocks]."""
        b = self.batch
        packed = packed.to(self.input_ids.device, non_blocking=True)
        self.input_ids[0].copy_(packed[:b])
        self.positions[0].copy_(packed[b : 2 * b])
        self.slots.copy_(packed[2 * b : 3 * b])
        self.lengths.copy_(packed[3 * b : 4 * b])
        self.blocks.copy_(packed[4 * b :])


class DecodeGraphs:
    def __init__(self, model, cache: PagedKVCache, dummy_block: int, max_model_len: int) -> None:
        self.model = model
        self.cache = cache
        self.dummy_block = dummy_block
        bs = cache.block_size
        self.max_blocks = -(-max_model_len // bs)
        self.context_buckets = tuple(
            sorted({min(self.max_blocks, MIN_CONTEXT_BLOCKS << i) for i in range(max(1, self.max_blocks.bit_length()))})
        )
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.replays = 0

    def shape_for(self, output: SchedulerOutput) -> tuple[int, int] | None:
        return decode_shape(output, self.cache.block_size, self.context_buckets)

    def captured(self, shape: tuple[int, int]) -> _Graph:
        """The graph of ``shape``, captured now if it was not yet."""
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(*shape)
        return self.graphs[shape]

    def capture_all(self) -> int:
        """Capture every (batch, context) shape, largest first; returns how many there are."""
        shapes = [(b, c) for b in reversed(BATCH_BUCKETS) for c in reversed(self.context_buckets)]
        for shape in shapes:
            self.captured(shape)
        return len(shapes)

    def run(self, output: SchedulerOutput, shape: tuple[int, int]) -> torch.Tensor:
        """Logits (len(output.scheduled), vocab) of a pure decode step, through its graph."""
        graph = self.captured(shape)
        packed = pack_decode_inputs(output, *shape, self.cache.block_size, self.dummy_block)
        # through an array: torch.tensor(list) reads a Python int at a time, several times slower
        graph.fill(torch.frombuffer(array("q", packed), dtype=torch.long).pin_memory())
        graph.graph.replay()
        self.replays += 1
        return graph.logits[: len(output.scheduled)]

    def _capture(self, batch: int, blocks_per_request: int) -> _Graph:
        graph = _Graph(batch, blocks_per_request, self.cache, self.cache.device)
        graph.slots.fill_(self.dummy_block * self.cache.block_size)
        graph.blocks.fill_(self.dummy_block)
        eager_scratch = self.cache.take_scratch()  # the graph's gathers get buffers of its own pool
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                graph.forward(self.model)  # warm-up: lazy initialisations happen outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph.meta.decode_groups[0]._masks.clear()  # the mask must be computed inside the graph
            self.cache.take_scratch()
            with torch.cuda.graph(graph.graph, pool=self.pool):
                graph.logits = graph.forward(self.model)
        finally:
            self.cache.take_scratch()
            self.cache.restore_scratch(eager_scratch)
        log.debug("captured a CUDA graph for decode batch %d, %d context blocks", batch, blocks_per_request)
        return graph


def decode_shape(output: SchedulerOutput, block_size: int, context_buckets: tuple[int, ...]) -> tuple[int, int] | None:
    """The (batch, context blocks) graph for a step, or None if it must run eagerly: any prompt
    chunk, or a batch or context beyond the largest bucket."""
    longest = 0
    for item in output.scheduled:
        if item.num_tokens != 1 or item.start == 0 or not item.sample:
            return None
        longest = max(longest, item.start + 1)
    batch = _bucket(len(output.scheduled), BATCH_BUCKETS)
    blocks = _bucket(-(-longest // block_size), context_buckets)
    if batch is None or blocks is None:
        return None
    return batch, blocks


def pack_decode_inputs(
    output: SchedulerOutput, batch: int, blocks_per_request: int, block_size: int, dummy_block: int
) -> list[int]:
    """[ids | positions | slots | lengths | blocks] of a decode step padded to ``batch`` rows:
    padding rows feed token 0 at position 0 into the dummy block and attend only to it."""
    pad = batch - len(output.scheduled)
    ids, positions, slots, lengths, blocks = [], [], [], [], []
    for item in output.scheduled:
        request, pos = item.request, item.start
        # a decode feeds the last known token: the last output, or the prompt's last token
        ids.append(request.output_token_ids[-1] if request.output_token_ids else request.prompt_token_ids[pos])
        positions.append(pos)
        table = request.block_table
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        lengths.append(pos + 1)
        used = table[:blocks_per_request]
        blocks.extend(used)
        blocks.extend([dummy_block] * (blocks_per_request - len(used)))
    return (
        ids
        + [0] * pad
        + positions
        + [0] * pad
        + slots
        + [dummy_block * block_size] * pad
        + lengths
        + [1] * pad
        + blocks
        + [dummy_block] * (pad * blocks_per_request)
    )
