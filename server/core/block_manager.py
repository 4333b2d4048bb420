"""Paged KV cache bookkeeping: fixed-size blocks, a free list and per-request block tables.

Only bookkeeping lives here; the runner owns the tensors. Blocks are reference counted, so that
requests can share them.

Prefix caching (vLLM's automatic prefix caching): a full block whose KV is computed is cached
under the hash of its tokens chained with every token before it, so one hash names one prefix.
A new request shares the cached blocks of its longest cached prefix and computes from there. A
cached block nobody holds stays on the free list, behind the blocks that hold nothing anyone
wants, and is evicted (its hash forgotten) only when the list reaches it: least recently freed
first. The block holding a request's last token is never shared, so no request writes into a
block another one reads. Hashes are Python's 64-bit tuple hashes by default, as vLLM's; with
``sha256`` (vLLM's ``--prefix-caching-hash-algo sha256``) two prefixes sharing KV would take a
SHA-256 collision, for fleets whose tenants must never read each other's prefixes. A request's
``cache_salt`` (vLLM's) starts its chain from a root of its own: it shares prefixes only with
requests of the same salt, so one tenant cannot time another's prompts out of the cache. The
requests of a LongRoPE model whose keys were turned with its long table (``rope_switch``, the
runner's ``longrope_context``; request_rope.py) keep their blocks in chains of their own the
same way.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from array import array
from collections import OrderedDict
from collections.abc import Iterator

from llmfleet.server.core.request import Request

_ROOT = "llmfleet-prefix-cache"


def _builtin_hash(parent: int | bytes | None, tokens: list[int]) -> int:
    return hash((hash(_ROOT) if parent is None else parent, tuple(tokens)))


def _sha256_hash(parent: int | bytes | None, tokens: list[int]) -> bytes:
    digest = hashlib.sha256(_ROOT.encode() if parent is None else parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


BLOCK_HASHES = {"builtin": _builtin_hash, "sha256": _sha256_hash}


def _builtin_root(salt: str) -> int:
    return hash((_ROOT, salt))


def _sha256_root(salt: str) -> bytes:
    return hashlib.sha256(f"{_ROOT}\x00{salt}".encode()).digest()


def _builtin_keyed_root(salt: str | None, key: str) -> int:
    return hash((_ROOT, salt, key))  # three items: never a salt's own root


def _sha256_keyed_root(salt: str | None, key: str) -> bytes:
    return hashlib.sha256(f"{_ROOT}\x01{json.dumps([salt, key])}".encode()).digest()  # \x01: never a salt's


ROOTS = {"builtin": _builtin_root, "sha256": _sha256_root}  # a salted chain's parent of its first block
KEYED_ROOTS = {"builtin": _builtin_keyed_root, "sha256": _sha256_keyed_root}  # and a keyed one's


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        hash_algo: str = "builtin",
        rope_switch: int | None = None,
    ) -> None:
        """``rope_switch``: a LongRoPE model's pre-training context, past which a sequence's keys
        take its long table."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # taken from the front
        self._ref_counts = [0] * num_blocks
        self.prefix_caching = prefix_caching
        self._block_hash = BLOCK_HASHES[hash_algo]
        self._root = ROOTS[hash_algo]
        self._keyed_root = KEYED_ROOTS[hash_algo]
        self.rope_switch = rope_switch
        self._cached: dict[int | bytes, int] = {}  # prefix hash -> block
        self._hash_of: dict[int, int | bytes] = {}  # block -> its prefix hash, while cached
        self.prefix_queries = 0  # tokens looked up, and found (vllm:prefix_cache_queries / _hits)
        self.prefix_hits = 0

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
            block, _ = self._free.popitem(last=False)
            assert self._ref_counts[block] == 0, f"block {block} on the free list is still referenced"
            self._evict(block)
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
                self._free[block] = None
                if block not in self._hash_of:  # nothing anyone could reuse: taken first
                    self._free.move_to_end(block, last=False)
        request.block_table = []
        request.num_cached_blocks = 0

    # --- prefix caching ---------------------------------------------------------------------------
    def match_prefix(self, request: Request, max_blocks: int | None = None) -> int:
        """Share the cached blocks of ``request``'s longest cached prefix, up to ``max_blocks`` (a
        request that holds no blocks yet); returns the tokens they cover, which it need not compute."""
        if not self.prefix_caching or request.block_table:
            return 0
        full = (request.num_tokens - 1) // self.block_size  # the last token's block is computed here
        hashes = self._hashes(request, full if max_blocks is None else min(full, max_blocks))
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            request.block_table.append(block)
        request.num_cached_blocks = len(request.block_table)
        return len(request.block_table) * self.block_size

    def cached_prefix_blocks(
        self, token_ids: list[int], salt: str | None = None, prompt_tokens: int | None = None
    ) -> int:
        """How many of ``token_ids``' leading full blocks are cached now, touching nothing
        (``prompt_tokens``: the whole prompt's length, where ``token_ids`` are the first of them).

        A decode server asks this before it fetches a prompt's KV, from its server thread while
        the engine runs, so the answer is a hint: a block may be evicted before the request is
        admitted, and the scheduler checks again (each dict lookup is atomic under the GIL)."""
        if not self.prefix_caching:
            return 0
        found = 0
        long_rope = self.long_rope(len(token_ids) if prompt_tokens is None else prompt_tokens)
        for h in self._chain(token_ids, 0, self._first_parent(salt, long_rope)):
            if h not in self._cached:
                break
            found += 1
        return found

    def count_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries += queried
        self.prefix_hits += hit

    def cache_computed(self, request: Request) -> None:
        """Cache ``request``'s full blocks whose KV is now computed. A prefix cached already (by
        another request that computed it too) keeps its first block."""
        if not self.prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_table))
        if full <= request.num_cached_blocks:
            return
        hashes = self._hashes(request, full)
        for index in range(request.num_cached_blocks, full):
            block, h = request.block_table[index], hashes[index]
            if h not in self._cached and block not in self._hash_of:
                self._cached[h] = block
                self._hash_of[block] = h
        request.num_cached_blocks = full

    def _hashes(self, request: Request, count: int) -> list[int | bytes]:
        """The prefix hashes of ``request``'s first ``count`` full blocks (computed once each)."""
        hashes = request.block_hashes
        if len(hashes) < count:
            long_rope = self.long_rope(request.rope_length or request.num_prompt_tokens)
            parent = hashes[-1] if hashes else self._first_parent(request.sampling.cache_salt, long_rope)
            more = self._chain(request.all_token_ids, len(hashes), parent)
            hashes.extend(itertools.islice(more, count - len(hashes)))
        return hashes[:count]

    def long_rope(self, length: int) -> bool:
        """Whether a LongRoPE model turns the keys of a sequence whose table is chosen at
        ``length`` tokens with its long table (False for any other model)."""
        return self.rope_switch is not None and length > self.rope_switch

    def _first_parent(self, salt: str | None, long_rope: bool = False) -> int | bytes | None:
        """The parent of a chain's first block: none unsalted, the salt's own root otherwise; for
        keys turned with LongRoPE's long table, the root of the salt and that table."""
        if long_rope:
            return self._keyed_root(salt, "longrope:long")
        return None if salt is None else self._root(salt)

    def _chain(self, tokens: list[int], start: int, parent: int | bytes | None) -> Iterator[int | bytes]:
        """The prefix hashes of ``tokens``' full blocks from block ``start`` on, as they are needed
        (``parent``: block ``start - 1``'s hash, None for the first block)."""
        size = self.block_size
        for index in range(start, len(tokens) // size):
            parent = self._block_hash(parent, tokens[index * size : (index + 1) * size])
            yield parent

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]

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
