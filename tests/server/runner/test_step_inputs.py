"""How one scheduled step is flattened: token order, positions, KV slots, decode groups."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.step_inputs import GROUP_COST_BLOCKS, _slots, _split_by_length, build_step_inputs

BS = 4


def cache(num_blocks: int = 256) -> PagedKVCache:
    return PagedKVCache(1, num_blocks, BS, 1, 2, torch.float32, torch.device("cpu"))


def request(rid: str, prompt_len: int, outputs: int, computed: int, table: list[int]) -> Request:
    r = Request(rid, list(range(100, 100 + prompt_len)))
    r.output_token_ids = list(range(900, 900 + outputs))
    r.num_computed_tokens = computed
    r.block_table = table
    return r


def test_a_mixed_step_is_flattened_in_order():
    decode = request("d", 5, 2, 6, [7, 3])  # context 7: decodes position 6
    chunk = request("c", 10, 0, 4, [9, 1, 8])  # prompt chunk, positions 4..8, no sample
    fresh = request("f", 2, 0, 0, [5])  # whole prompt at once
    step = build_step_inputs(
        SchedulerOutput([ScheduledRequest(decode, 1), ScheduledRequest(chunk, 5), ScheduledRequest(fresh, 2)]),
        cache(),
        torch.device("cpu"),
    )
    assert step.input_ids.tolist() == [[901, 104, 105, 106, 107, 108, 100, 101]]
    assert step.positions.tolist() == [[6, 4, 5, 6, 7, 8, 0, 1]]
    assert step.meta.slot_mapping.tolist() == [3 * BS + 2, 1 * BS + 0, 5, 6, 7, 8 * BS, 20, 21]
    assert step.sample_index == [0, 2] and step.logit_rows.tolist() == [0, 7]
    assert step.prompt_spans == []
    (group,) = step.meta.decode_groups
    assert group.rows.tolist() == [0] and group.blocks.tolist() == [7, 3] and group.lengths.tolist() == [7]
    span_chunk, span_fresh = step.meta.prefills
    assert (span_chunk.row, span_chunk.num_tokens, span_chunk.context) == (1, 5, 9)
    assert span_chunk.blocks.tolist() == [9, 1, 8] and not span_chunk.fresh
    assert span_fresh.fresh and span_fresh.mask(None, torch.device("cpu")) is None


def test_prompt_logprob_rows_follow_the_sampled_rows():
    """A request scoring its prompt keeps the logits of each chunk position whose next token is a
    prompt token: not the last prompt position (it predicts the first generated token)."""
    chunk = request("c", 10, 0, 4, [9, 1, 8])  # positions 4..8: each predicts prompt token 5..9
    whole = request("w", 3, 0, 0, [5])  # positions 0..2: 0 and 1 predict prompt tokens, 2 samples
    decode = request("d", 5, 2, 6, [7, 3])  # asks too, but has no prompt position left
    for r in (chunk, whole, decode):
        r.sampling.prompt_logprobs = 1
    step = build_step_inputs(
        SchedulerOutput([ScheduledRequest(chunk, 5), ScheduledRequest(whole, 3), ScheduledRequest(decode, 1)]),
        cache(),
        torch.device("cpu"),
    )
    assert step.sample_index == [1, 2]
    assert step.logit_rows.tolist() == [7, 8, 0, 1, 2, 3, 4, 5, 6]  # sampled rows, then the prompt rows
    assert step.prompt_spans == [(0, 5), (1, 2)]


@given(st.integers(0, 40), st.integers(1, 40), st.lists(st.integers(0, 99), min_size=20, max_size=20, unique=True))
def test_slots_follow_the_block_table(start, n, table):
    expected = [table[p // BS] * BS + p % BS for p in range(start, start + n)]
    assert _slots(table, start, start + n, BS) == expected


def test_decodes_of_very_different_lengths_are_grouped():
    lengths = [200, 198, 190, 20, 18, 17, 16, 3]
    decodes = [request(str(i), n - 1, 1, n - 1, list(range(i * 60, i * 60 + 60))) for i, n in enumerate(lengths)]
    step = build_step_inputs(
        SchedulerOutput([ScheduledRequest(r, 1) for r in decodes]), cache(600), torch.device("cpu")
    )
    groups = step.meta.decode_groups
    assert len(groups) >= 2 and sorted(row for g in groups for row in g.rows.tolist()) == list(range(8))
    assert groups[0].blocks_per_request == 50 and groups[1].blocks_per_request <= 5
    # every group pads each member to the group's longest context, masked past each length
    for g in groups:
        assert g.blocks.shape[0] == len(g.rows) * g.blocks_per_request
        mask = g.mask(BS, None, torch.float32)
        if mask is not None:
            visible = (mask[0, :, 0] == 0).sum(-1)
            assert visible.tolist() == g.lengths.tolist()
    # a group is only split off when it saves more padding than a group costs
    assert GROUP_COST_BLOCKS > 0


def test_without_a_group_cost_every_decode_shares_one_group():
    """On a GPU kernel launches cost more than padding: one group, whatever the lengths."""
    decodes = [(i, n, list(range(60))) for i, n in enumerate([200, 198, 20, 3])]
    assert len(_split_by_length(decodes, BS, GROUP_COST_BLOCKS)) >= 2
    assert _split_by_length(decodes, BS, None) == [decodes]


def test_window_mask_hides_keys_outside_the_window():
    r = request("d", 9, 1, 9, [0, 1, 2])  # context 10
    step = build_step_inputs(SchedulerOutput([ScheduledRequest(r, 1)]), cache(), torch.device("cpu"))
    (group,) = step.meta.decode_groups
    mask = group.mask(BS, 4, torch.float32)[0, 0, 0]
    assert (mask == 0).nonzero().flatten().tolist() == [6, 7, 8, 9]  # kv_pos > q_pos - window
