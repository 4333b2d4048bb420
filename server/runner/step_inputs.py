"""Flatten one scheduled step into model inputs: token ids, positions, KV slots and the
attention metadata (decode groups and prompt spans). Built once per step, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.core.request import Request
from llmfleet.server.runner.attention import DecodeGroup, PrefillSpan, StepMetadata
from llmfleet.server.runner.kv_cache import PagedKVCache

# A decode group costs about 8 torch calls per layer; a padding block costs its gather and matmul
# reads, several times less. A new group is started only when it saves more than this many
# padding blocks, a conservative estimate.
GROUP_COST_BLOCKS = 16
# On a GPU the same calls are kernel launches that cost more than the padding they save: there
# every decode goes into one group.
GPU_GROUP_COST_BLOCKS = None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (1, T)
    positions: torch.Tensor  # (1, T)
    meta: StepMetadata
    logit_rows: torch.Tensor  # rows whose logits are kept (logits_to_keep): the sampled, then the prompt rows
    sample_index: list[int]  # for each sampled row, its index in output.scheduled
    # Requests that asked for prompt logprobs: (index in output.scheduled, number of rows), their
    # rows following the sampled ones in this order; row p of a chunk predicts prompt token p + 1
    prompt_spans: list[tuple[int, int]]


@dataclass
class StepPlan:
    """A step's inputs as plain lists: what a parallel runner sends its workers, each of which
    turns it into tensors on its own device (``to_inputs``)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    decode_groups: list[list[tuple[int, int, list[int]]]]  # each member: row, context length, block table
    prefills: list[tuple[int, int, int, list[int] | None]]  # row, tokens, context, blocks or None
    logit_rows: list[int]
    sample_index: list[int]
    prompt_spans: list[tuple[int, int]]
    rope_lengths: list[int] = field(default_factory=list)  # each token's rotary table's (request_rope.py)

    def to_inputs(self, cache: PagedKVCache, device: torch.device) -> StepInputs:
        bs = cache.block_size
        meta = StepMetadata(
            cache=cache,
            slot_mapping=torch.tensor(self.slots, dtype=torch.long, device=device),
            decode_groups=[_decode_group(members, bs, device) for members in self.decode_groups],
            prefills=[
                PrefillSpan(
                    row, n, ctx, None if blocks is None else torch.tensor(blocks, dtype=torch.long, device=device)
                )
                for row, n, ctx, blocks in self.prefills
            ],
            rope_lengths=self.rope_lengths or None,
        )
        return StepInputs(
            input_ids=torch.tensor([self.ids], dtype=torch.long, device=device),
            positions=torch.tensor([self.positions], dtype=torch.long, device=device),
            meta=meta,
            logit_rows=torch.tensor(self.logit_rows, dtype=torch.long, device=device),
            sample_index=self.sample_index,
            prompt_spans=self.prompt_spans,
        )


def build_step_inputs(
    output: SchedulerOutput, cache: PagedKVCache, device: torch.device, rope_lengths: bool = False
) -> StepInputs:
    return plan_step(output, cache.block_size, device.type, rope_lengths).to_inputs(cache, device)


def plan_step(output: SchedulerOutput, bs: int, device_type: str, rope_lengths: bool = False) -> StepPlan:
    """Flatten ``output`` for KV blocks of ``bs`` tokens, its decodes grouped for ``device_type``;
    with ``rope_lengths`` (a LongRoPE model), the length each token's rotary table is chosen at."""
    ids: list[int] = []
    positions: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    decodes: list[tuple[int, int, list[int]]] = []  # row, context length, block table
    prefills: list[tuple[int, int, int, list[int] | None]] = []  # row, tokens, context, blocks or None
    sample_rows: list[int] = []
    sample_index: list[int] = []
    prompt_rows: list[int] = []
    prompt_spans: list[tuple[int, int]] = []
    for i, item in enumerate(output.scheduled):
        request, start, n = item.request, item.start, item.num_tokens
        end = start + n
        row = len(ids)
        ids.extend(_token_slice(request, start, end))
        positions.extend(range(start, end))
        if rope_lengths:
            _rope_lengths(lengths, start, end, request.rope_length or request.num_prompt_tokens)
        table = request.block_table
        if n == 1:
            slots.append(table[start // bs] * bs + start % bs)
        else:
            slots.extend(_slots(table, start, end, bs))
        if n == 1 and start > 0:
            decodes.append((row, end, table))
        else:
            prefills.append((row, n, end, table[: -(-end // bs)] if start > 0 else None))
        if item.sample:
            sample_rows.append(row + n - 1)
            sample_index.append(i)
        if request.sampling.prompt_logprobs is not None:
            # the chunk's positions whose next token is a prompt token
            scored = max(0, min(end, request.num_prompt_tokens - 1) - start)
            if scored:
                prompt_rows.extend(range(row, row + scored))
                prompt_spans.append((i, scored))
    group_cost = GROUP_COST_BLOCKS if device_type == "cpu" else GPU_GROUP_COST_BLOCKS
    return StepPlan(
        ids=ids,
        positions=positions,
        slots=slots,
        decode_groups=_split_by_length(decodes, bs, group_cost),
        prefills=prefills,
        logit_rows=sample_rows + prompt_rows,
        sample_index=sample_index,
        prompt_spans=prompt_spans,
        rope_lengths=lengths,
    )


def _rope_lengths(lengths: list[int], start: int, end: int, base: int) -> None:
    """Append the sequence length each token at positions ``start``..``end - 1`` takes its
    rotary table at (request_rope.py): ``base`` (the request's length when it started), or the
    token's position + 1 past it."""
    if end <= base:
        lengths.extend([base] * (end - start))
    elif start >= base:
        lengths.extend(range(start + 1, end + 1))
    else:
        lengths.extend([base] * (base - start))
        lengths.extend(range(base + 1, end + 1))


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole sequence."""
    prompt = request.prompt_token_ids
    p = len(prompt)
    if start >= p:
        return request.output_token_ids[start - p : end - p]
    if end <= p:
        return prompt[start:end]
    return prompt[start:] + request.output_token_ids[: end - p]


def _slots(table: list[int], start: int, end: int, bs: int) -> list[int]:
    """Cache slots of positions start..end-1: whole blocks expanded, then trimmed."""
    first = start // bs
    slots: list[int] = []
    for block in table[first : (end - 1) // bs + 1]:
        slots.extend(range(block * bs, block * bs + bs))
    offset = start - first * bs
    return slots[offset : offset + end - start]


def _split_by_length(
    decodes: list[tuple[int, int, list[int]]], bs: int, group_cost: int | None = GROUP_COST_BLOCKS
) -> list[list[tuple[int, int, list[int]]]]:
    """Group decodes so that padding each to its group's longest context wastes little.

    Sorted longest first, a new group starts where the padding it saves the remaining requests,
    (current group's blocks - this request's blocks) * remaining, outweighs ``group_cost``
    padding blocks; ``None``: one group whatever the padding."""
    if not decodes:
        return []
    if group_cost is None:
        return [decodes]
    ordered = sorted(decodes, key=lambda d: d[1], reverse=True)
    groups = [[ordered[0]]]
    group_blocks = -(-ordered[0][1] // bs)
    for i, decode in enumerate(ordered[1:], start=1):
        blocks = -(-decode[1] // bs)
        if (group_blocks - blocks) * (len(ordered) - i) > group_cost:
            groups.append([])
            group_blocks = blocks
        groups[-1].append(decode)
    return groups


def _decode_group(members: list[tuple[int, int, list[int]]], bs: int, device: torch.device) -> DecodeGroup:
    lengths = [length for _, length, _ in members]
    per_request = -(-max(lengths) // bs)
    blocks: list[int] = []
    for _, _, table in members:
        used = table[:per_request]
        blocks.extend(used)
        blocks.extend([0] * (per_request - len(used)))
    return DecodeGroup(
        rows=torch.tensor([row for row, _, _ in members], dtype=torch.long, device=device),
        blocks=torch.tensor(blocks, dtype=torch.long, device=device),
        lengths=torch.tensor(lengths, dtype=torch.long, device=device),
        blocks_per_request=per_request,
        padded=any(length != per_request * bs for length in lengths),
    )
