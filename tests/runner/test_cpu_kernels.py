"""The C decode-attention kernel reads the paged cache in place and gives what the torch path
(gather, then batched matmuls) gives: GQA, padded groups, sliding windows, strided queries."""

from __future__ import annotations

import random

import pytest
import torch

from llmfleet.server.runner import attention, cpu_kernels
from llmfleet.server.runner.attention import DecodeGroup
from llmfleet.server.runner.kv_cache import PagedKVCache

BS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 6, 2, 16, 40


@pytest.fixture(autouse=True)
def kernel_built():
    if not cpu_kernels.built():
        pytest.skip("no C compiler here: the torch path runs")


def attend(monkeypatch, use_kernel: bool, q, cache, group, window):
    monkeypatch.setenv("LLMFLEET_CPU_KERNELS", "1" if use_kernel else "0")
    out = torch.zeros(q.shape, dtype=q.dtype)
    attention._decode(q, out, cache, 1, group, DIM**-0.5, window)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_the_kernel_attends_as_the_torch_path(monkeypatch, dtype, window):
    rng = random.Random(3)
    torch.manual_seed(3)
    cache = PagedKVCache(2, BLOCKS, BS, KV_HEADS, DIM, dtype, torch.device("cpu"))
    for layer in range(2):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    tokens = 9
    q = torch.randn(HEADS, tokens, DIM).to(dtype).transpose(0, 1)  # (T, heads, D), strided as in a step
    rows = [0, 3, 4, 8]  # the decoding rows of a step whose other rows are prompt tokens
    lengths = [1, 7, 12, 3]
    per_request = -(-max(lengths) // BS)
    free = rng.sample(range(BLOCKS), len(rows) * per_request)
    tables = [free[i * per_request : i * per_request + -(-n // BS)] for i, n in enumerate(lengths)]
    blocks = [b for table in tables for b in table + [0] * (per_request - len(table))]
    group = DecodeGroup(torch.tensor(rows), torch.tensor(blocks), torch.tensor(lengths), per_request, padded=True)
    expected = attend(monkeypatch, False, q, cache, group, window)
    got = attend(monkeypatch, True, q, cache, group, window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[rows].float(), expected[rows].float(), atol=tolerance, rtol=tolerance)
    assert not got[[1, 2, 5, 6, 7]].any(), "rows outside the group were written"
