"""The paged cache's layout, blocks first: a write lands where (block, KV head, offset) says, with
the C write kernel and without; a gather yields each head's blocks one after another; and the KV
transfer payload keeps its own layout (heads, then blocks), whatever the cache's."""

from __future__ import annotations

import pytest
import torch

from llmfleet.server.runner.kv_cache import PagedKVCache

BLOCKS, BLOCK_SIZE, KV_HEADS, DIM = 12, 4, 3, 8


def cache(dtype=torch.float32, layers=2) -> PagedKVCache:
    return PagedKVCache(layers, BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype, torch.device("cpu"))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_a_write_lands_at_its_block_head_and_offset(monkeypatch, kernels):
    monkeypatch.setenv("LLMFLEET_CPU_KERNELS", kernels)
    c = cache()
    assert c.keys[0].shape == (BLOCKS, KV_HEADS, BLOCK_SIZE, DIM)
    slots = torch.tensor([5, 0, 47, 18])
    key = torch.randn(KV_HEADS, len(slots), DIM)
    value = torch.randn(KV_HEADS, len(slots), DIM)
    c.write(1, slots, key, value)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, BLOCK_SIZE)
        for h in range(KV_HEADS):
            assert torch.equal(c.keys[1][block, h, offset], key[h, t])
            assert torch.equal(c.values[1][block, h, offset], value[h, t])
    assert int(c.keys[1].ne(0).any(-1).sum()) == len(slots) * KV_HEADS  # nowhere else
    assert not c.keys[0].any()  # another layer untouched


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_a_slot_outside_the_cache_is_refused(monkeypatch, kernels):
    monkeypatch.setenv("LLMFLEET_CPU_KERNELS", kernels)
    c = cache()
    key = torch.randn(KV_HEADS, 1, DIM)
    with pytest.raises(IndexError):
        c.write(0, torch.tensor([BLOCKS * BLOCK_SIZE]), key, key)
    assert not c.keys[0].any()


def test_a_gather_yields_each_heads_blocks_in_order():
    c = cache()
    c.keys[0].normal_()
    c.values[0].normal_()
    blocks = torch.tensor([7, 2, 9])
    keys, values = c.gather(0, blocks, (1, 3))
    assert keys.shape == (2, len(blocks) * BLOCK_SIZE, DIM)
    for h in (1, 2):
        expected = torch.cat([c.keys[0][b, h] for b in blocks.tolist()])
        assert torch.equal(keys[h - 1], expected)
        assert torch.equal(values[h - 1], torch.cat([c.values[0][b, h] for b in blocks.tolist()]))


def test_blocks_travel_in_the_payload_layout_and_land_in_other_blocks():
    source, target = cache(torch.bfloat16), cache(torch.bfloat16)
    for layer in range(2):
        source.keys[layer].normal_()
        source.values[layer].normal_()
    payload = source.export_blocks([3, 8])
    assert payload.shape == (2, 2, KV_HEADS, 2, BLOCK_SIZE * DIM)
    assert torch.equal(payload[1, 0, 2, 1], source.keys[1][8, 2].reshape(-1))  # layer 1, keys, head 2, block 8
    target.import_blocks([0, 5], payload)
    for layer in range(2):
        assert torch.equal(target.keys[layer][[0, 5]], source.keys[layer][[3, 8]])
        assert torch.equal(target.values[layer][[0, 5]], source.values[layer][[3, 8]])
        assert not target.keys[layer][1:5].any()
