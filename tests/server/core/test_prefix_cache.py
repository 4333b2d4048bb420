"""The block manager's prefix cache on its own: what is shared, what is evicted, and when."""

from __future__ import annotations

import pytest

from llmfleet.server.core.block_manager import BLOCK_HASHES, BlockManager
from llmfleet.server.core.request import Request, SamplingParams


def computed(manager: BlockManager, request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    """A request whose tokens' KV is all computed, its full blocks cached."""
    request = Request(request_id, list(tokens), SamplingParams(cache_salt=salt))
    assert manager.allocate(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    manager.cache_computed(request)
    return request


@pytest.mark.parametrize("hash_algo", list(BLOCK_HASHES))
def test_a_shared_prefix_is_found_up_to_the_last_tokens_block(hash_algo):
    manager = BlockManager(num_blocks=8, block_size=4, prefix_caching=True, hash_algo=hash_algo)
    first = computed(manager, "a", list(range(12)))  # three full blocks cached
    same = Request("b", list(range(12)))
    assert manager.match_prefix(same) == 8  # not the block of its last token: it computes that one
    assert same.block_table == first.block_table[:2]
    longer = Request("c", [*range(12), 99])
    assert manager.match_prefix(longer) == 12 and longer.block_table == first.block_table
    other = Request("d", [0, 1, 2, 9, 4, 5, 6, 7, 8])  # differs inside the first block: nothing
    assert manager.match_prefix(other) == 0 and not other.block_table
    for request in (first, same, longer):
        manager.free(request)
    manager.check_consistency([])


@pytest.mark.parametrize("hash_algo", list(BLOCK_HASHES))
def test_cached_blocks_nobody_holds_are_evicted_last_and_least_recent_first(hash_algo):
    manager = BlockManager(num_blocks=6, block_size=2, prefix_caching=True, hash_algo=hash_algo)
    old = computed(manager, "old", [1, 2, 3, 4])
    new = computed(manager, "new", [5, 6, 7, 8])
    scratch = Request("scratch", [0])
    assert manager.allocate(scratch, 1)
    manager.free(old)
    manager.free(new)
    manager.free(scratch)
    taker = Request("taker", [0] * 6)
    # three blocks: the two never cached, then the least recently freed cached one, the older
    # request's tail (a prefix's head is the most shared: it goes last)
    assert manager.allocate(taker, 6)
    again_old = Request("again-old", [1, 2, 3, 4, 0])
    assert manager.match_prefix(again_old) == 2
    again_new = Request("again-new", [5, 6, 7, 8, 0])
    assert manager.match_prefix(again_new) == 4  # still cached: taken off the free list
    assert manager.num_free_blocks == 0
    manager.check_consistency([taker, again_old, again_new])


def test_off_nothing_is_cached_or_found():
    manager = BlockManager(num_blocks=4, block_size=2)
    computed(manager, "a", [1, 2, 3, 4])
    assert manager.match_prefix(Request("b", [1, 2, 3, 4, 5])) == 0


@pytest.mark.parametrize("hash_algo", list(BLOCK_HASHES))
def test_a_decode_servers_hint_counts_cached_full_blocks_and_takes_none(hash_algo):
    """What a decode server asks before it fetches a prompt's KV; the scheduler then shares
    exactly those blocks (``max_blocks``), never more."""
    manager = BlockManager(num_blocks=8, block_size=4, prefix_caching=True, hash_algo=hash_algo)
    manager.free(computed(manager, "a", list(range(12))))
    assert manager.cached_prefix_blocks(list(range(12))) == 3  # KV tokens: no last token to leave out
    assert manager.cached_prefix_blocks([*range(8), 9, 9, 9, 9]) == 2
    assert manager.cached_prefix_blocks(list(range(7))) == 1  # a partial block never counts
    assert manager.num_free_blocks == 8  # nothing taken
    limited = Request("b", [*range(12), 5])
    assert manager.match_prefix(limited, max_blocks=2) == 8 and len(limited.block_table) == 2
    manager.free(limited)
    manager.check_consistency([])
    off = BlockManager(num_blocks=8, block_size=4)
    computed(off, "a", list(range(12)))
    assert off.cached_prefix_blocks(list(range(12))) == 0


@pytest.mark.parametrize("hash_algo", list(BLOCK_HASHES))
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_longropes_long_table_keeps_a_chain_of_its_own(hash_algo, salt):
    """A LongRoPE model's blocks turned with the long table (a sequence past the pre-training
    context) are never found by a sequence that takes the short one, nor the reverse, salted or
    not; a salt that spells the table's name reaches neither."""
    manager = BlockManager(num_blocks=32, block_size=4, prefix_caching=True, hash_algo=hash_algo, rope_switch=10)
    tokens = list(range(12))
    long = Request("long", tokens, SamplingParams(cache_salt=salt))
    assert manager.allocate(long, 12)
    long.num_computed_tokens = 12
    manager.cache_computed(long)
    short = Request("short", tokens[:9], SamplingParams(cache_salt=salt))  # 9 tokens: the short table
    assert manager.match_prefix(short) == 0
    assert manager.cached_prefix_blocks(tokens[:8], salt, prompt_tokens=9) == 0
    assert manager.cached_prefix_blocks(tokens, salt) == 3  # 12 tokens: the long table's chain
    again = Request("again", [*tokens, 99], SamplingParams(cache_salt=salt))
    assert manager.match_prefix(again) == 12
    for spelled in ("longrope:long", "\x00longrope:long", f"{salt}\x00longrope:long"):
        assert manager.cached_prefix_blocks(tokens, spelled, prompt_tokens=9) == 0
    for request in (long, short, again):
        manager.free(request)
    manager.check_consistency([])


@pytest.mark.parametrize("hash_algo", list(BLOCK_HASHES))
def test_a_cache_salt_shares_prefixes_only_with_its_own(hash_algo):
    """vLLM's cache_salt: a tenant's prompts never hit another tenant's (or the unsalted) blocks,
    so no one can time another's prompt out of the cache; the same salt shares as before."""
    manager = BlockManager(num_blocks=16, block_size=4, prefix_caching=True, hash_algo=hash_algo)
    tokens = list(range(12))
    held = [computed(manager, "a", tokens, salt="tenant-a"), computed(manager, "plain", tokens)]

    def found(salt: str | None) -> int:
        request = Request(f"probe-{salt}", [*tokens, 99], SamplingParams(cache_salt=salt))
        hit = manager.match_prefix(request)
        held.append(request)
        return hit

    assert (found("tenant-a"), found("tenant-b"), found(None)) == (12, 0, 12)
    assert manager.cached_prefix_blocks(tokens, "tenant-a") == 3 and manager.cached_prefix_blocks(tokens, "b") == 0
    computed(manager, "b", tokens, salt="tenant-b")
    assert found("tenant-b") == 12
    for request in held:
        manager.free(request)
