"""Paged KV cache bookkeeping: fixed-size blocks, a free list and per-request block tables.

Only bookkeeping lives here; the runner owns the tensors. Blocks are reference counted so a
later prefix cache can share them between requests.
"""

from __future__ import annotations

from collections import deque

from .request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` still needs so that its table covers ``num_tokens`` token slots."""
        return max(0, self.blocks_for(num_tokens) - len(request.block_table))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.num_new_blocks(request, num_tokens) <= len(self._free)

    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow ``request.block_table`` to cover ``num_tokens`` slots. All or nothing."""
        needed = self.num_new_blocks(request, num_tokens)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"block {block} on the free list is still referenced"
            self._ref_counts[block] = 1
            request.block_table.append(block)
        return True

    def append_slot(self, request: Request) -> bool:
        """Make room for one more token (a decode step)."""
        return self.allocate(request, request.num_tokens)

    def free(self, request: Request) -> None:
        # Free in reverse so the tail blocks, the least likely to be shared, are reused first.
        for block in reversed(request.block_table):
            count = self._ref_counts[block]
            assert count > 0, f"double free of block {block} by {request.request_id}"
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)
        request.block_table = []

    def fork(self, source: Request, target: Request) -> None:
        """Share ``source``'s blocks with ``target`` (prefix sharing)."""
        assert not target.block_table, "fork target must own no blocks"
        for block in source.block_table:
            self._ref_counts[block] += 1
        target.block_table = list(source.block_table)

    def check_consistency(self, live: list[Request]) -> None:
        """Assert that refcounts match the live block tables and the free list (tests call this)."""
        expected = [0] * self.num_blocks
        for request in live:
            for block in request.block_table:
                expected[block] += 1
        assert expected == self._ref_counts, "reference counts do not match live block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert free == {b for b, c in enumerate(self._ref_counts) if c == 0}, "free list out of sync"
