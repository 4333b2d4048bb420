"""The C attention kernels give what the torch paths give: the decode kernel, reading the paged
cache in place (against a gather, then batched matmuls), and the prompt kernel (against SDPA or
the scored torch path), for GQA, padded groups, sliding windows, strided queries, a chunk that
starts at position 0 or later in its prompt, and Gemma 2's logit cap and gpt-oss's sinks; and
which prompts go to SDPA first. The cache write kernel stores what ``index_copy_`` stores. The
attention checks run the native build and an AVX2 one (conftest.kernel_build)."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from llmfleet.server.runner import attention, cpu_kernels
from llmfleet.server.runner.attention import DecodeGroup, PrefillSpan
from llmfleet.server.runner.kv_cache import PagedKVCache

HEADS, KV_HEADS, BLOCKS = 6, 2, 256
# (block size, head size, context lengths, a sliding window): small blocks and heads; sixteen-key
# blocks and a 64-wide head, as builtin models have (contexts over many blocks, a window starting
# inside a block); a head that is not a multiple of 16 wide (the per-key path), one that is but
# not of 64 (values summed eight vectors at a time, then the rest); enough requests that each
# thread takes runs of several items and prefetches the next one's keys
LAYOUTS = {
    "small": (4, 16, [1, 7, 12, 3], 5),
    "16-key blocks": (16, 64, [1, 40, 17, 100], 37),
    "odd head": (8, 24, [5, 30, 9, 64], 11),
    "80-wide head": (16, 80, [3, 33, 50, 17], 21),
    "many requests": (16, 64, [(7 * i) % 90 + 1 for i in range(40)], 37),
}


@pytest.fixture(autouse=True)
def kernel_built():
    if not cpu_kernels.built():
        pytest.skip("no C compiler here: the torch path runs")


def through(monkeypatch, kernel: str, use_kernel: bool, q, window, scored, attend) -> tuple[torch.Tensor, list]:
    """``attend(out, scoring)`` with the C kernels on or off, and each call of ``kernel`` seen:
    the rows it wrote (into zeros) and what the kernel answered (whether it took the work)."""
    monkeypatch.setenv("LLMFLEET_CPU_KERNELS", "1" if use_kernel else "0")
    out = torch.zeros(q.shape, dtype=q.dtype)
    extra = {"softcap": 0.5, "sinks": torch.linspace(-1.0, 2.0, HEADS).to(q.dtype)} if scored else {}
    ran, wrapped = [], getattr(cpu_kernels, kernel)
    monkeypatch.setattr(cpu_kernels, kernel, lambda *args: ran.append(wrapped(*args)) or ran[-1])
    attend(out, attention.Scoring(q.shape[-1] ** -0.5, window, **extra))
    return out, ran


def attend(monkeypatch, use_kernel: bool, q, cache, group, window, scored=False):
    out, ran = through(
        monkeypatch,
        "paged_decode",
        use_kernel,
        q,
        window,
        scored,
        lambda out, s: attention._decode(q, out, cache, 1, group, s),
    )
    assert ran == [use_kernel]  # the kernel took it (or, turned off, the torch path)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("windowed", "scored"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_kernel_attends_as_the_torch_path(monkeypatch, kernel_build, dtype, windowed, scored, layout):
    block_size, dim, lengths, window = LAYOUTS[layout]
    window = window if windowed else None
    rng = random.Random(3)
    torch.manual_seed(3)
    cache = PagedKVCache(2, BLOCKS, block_size, KV_HEADS, dim, dtype, torch.device("cpu"))
    for layer in range(2):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    # the decoding rows of a step whose other rows are prompt tokens
    rows = [0, 3, 4, 8] if len(lengths) == 4 else list(range(0, 2 * len(lengths), 2))
    tokens = rows[-1] + 1
    q = torch.randn(HEADS, tokens, dim).to(dtype).transpose(0, 1)  # (T, heads, D), strided as in a step
    per_request = -(-max(lengths) // block_size)
    free = rng.sample(range(BLOCKS), len(rows) * per_request)
    tables = [free[i * per_request : i * per_request + -(-n // block_size)] for i, n in enumerate(lengths)]
    blocks = [b for table in tables for b in table + [0] * (per_request - len(table))]
    group = DecodeGroup(torch.tensor(rows), torch.tensor(blocks), torch.tensor(lengths), per_request, padded=True)
    expected = attend(monkeypatch, False, q, cache, group, window, scored)
    got = attend(monkeypatch, True, q, cache, group, window, scored)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[rows].float(), expected[rows].float(), atol=tolerance, rtol=tolerance)
    assert not got[[r for r in range(tokens) if r not in rows]].any(), "rows outside the group were written"


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("lengths", [[70], [33, 50], [9, 40, 17, 64, 3]])
def test_requests_split_into_spans_of_kv_heads_attend_as_the_torch_path(monkeypatch, kernel_build, threads, lengths):
    """Where there are too few requests for the threads, each request's KV heads are split into
    spans, the last one shorter where they do not divide: three KV heads make spans of one, of
    three, and of two beside one of one (the AVX2 build; with AVX-512 an item is one KV head)."""
    block_size, dim, window = 16, 64, 37
    torch.manual_seed(5)
    cache = PagedKVCache(2, 64, block_size, 3, dim, torch.float32, torch.device("cpu"))
    cache.keys[1].normal_()  # the layer attend() reads
    cache.values[1].normal_()
    per_request = -(-max(lengths) // block_size)
    free = random.Random(5).sample(range(64), len(lengths) * per_request)
    group = DecodeGroup(torch.arange(len(lengths)), torch.tensor(free), torch.tensor(lengths), per_request, padded=True)
    q = torch.randn(len(lengths), HEADS, dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for windowed in (None, window):
            expected = attend(monkeypatch, False, q, cache, group, windowed, scored=True)
            got = attend(monkeypatch, True, q, cache, group, windowed, scored=True)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 24])
def test_the_write_kernel_stores_as_index_copy(monkeypatch, dtype, dim):
    """A step's keys and values, strided as a fused QKV projection leaves them, at scattered
    slots; a key to convert (float32 into a bfloat16 cache) is left to torch."""
    torch.manual_seed(7)
    block_size, tokens = 16, 9
    slots = torch.tensor(random.Random(7).sample(range(BLOCKS * block_size), tokens))
    qkv = torch.randn(tokens, 3, KV_HEADS, dim).to(dtype)
    key, value = qkv[:, 1].transpose(0, 1), qkv[:, 2].transpose(0, 1)  # (kv_heads, T, D), strided
    caches, ran, wrapped = {}, [], cpu_kernels.kv_write
    monkeypatch.setattr(cpu_kernels, "kv_write", lambda *args: ran.append(wrapped(*args)) or ran[-1])
    for use_kernel in (False, True):
        monkeypatch.setenv("LLMFLEET_CPU_KERNELS", "1" if use_kernel else "0")
        cache = PagedKVCache(1, BLOCKS, block_size, KV_HEADS, dim, dtype, torch.device("cpu"))
        cache.write(0, slots, key, value)
        assert ran.pop() is use_kernel and not ran  # the kernel took it (or, turned off, torch did)
        caches[use_kernel] = cache
    assert torch.equal(caches[True].keys[0], caches[False].keys[0])
    assert torch.equal(caches[True].values[0], caches[False].values[0])
    assert caches[True].keys[0].any()
    if dtype == torch.bfloat16:
        monkeypatch.setenv("LLMFLEET_CPU_KERNELS", "1")
        wide = qkv.float()[:, 1].transpose(0, 1)
        assert not wrapped(caches[True].keys[0], caches[True].values[0], slots, wide, wide)
    before = caches[True].keys[0].clone()
    outside = slots.clone()
    outside[-1] = BLOCKS * block_size  # one past the cache: nothing written, as index_copy_ refuses it
    with pytest.raises(IndexError, match="a cache slot outside"):
        wrapped(caches[True].keys[0], caches[True].values[0], outside, key, value)
    assert torch.equal(caches[True].keys[0], before)


# (head size, tokens in the chunk, context it attends to, a sliding window): whole prompts of
# several query blocks; chunks later in their prompt, one shorter than a block; a head that is not
# a multiple of 16 wide, which the kernel leaves to torch
PROMPTS = {
    "prompt": (64, 37, 37, 11),
    "later chunk": (32, 20, 53, 9),
    "short later chunk": (64, 5, 70, 30),
    "odd head": (24, 12, 12, 5),
}


def attend_prompt(monkeypatch, use_kernel: bool, q, key, value, cache, span, window, scored=False):
    monkeypatch.setattr(attention, "sdpa_first", lambda q, scoring: False)  # the kernel on every CPU
    out, ran = through(
        monkeypatch,
        "prefill_attention",
        use_kernel,
        q,
        window,
        scored,
        lambda out, s: attention._prefill(q, key, value, out, cache, 1, span, s),
    )
    assert ran == [use_kernel and q.shape[-1] % 16 == 0]  # the kernel took it, or torch did
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("windowed", "scored"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("layout", PROMPTS)
def test_the_prompt_kernel_attends_as_torch(monkeypatch, kernel_build, dtype, windowed, scored, layout):
    dim, tokens, context, window = PROMPTS[layout]
    window = window if windowed else None
    block_size = 16
    torch.manual_seed(5)
    cache = PagedKVCache(2, BLOCKS, block_size, KV_HEADS, dim, dtype, torch.device("cpu"))
    for layer in range(2):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
    first = 3  # the chunk's rows follow a decode row or two in the step
    rows = first + tokens + 2
    q = torch.randn(HEADS, rows, dim).to(dtype).transpose(0, 1)  # (T, heads, D), strided as in a step
    key = torch.randn(rows, KV_HEADS, dim).to(dtype).transpose(0, 1)  # (kv_heads, T, D)
    value = torch.randn(rows, KV_HEADS, dim).to(dtype).transpose(0, 1)
    blocks = None
    if context > tokens:  # earlier chunks are in the cache
        blocks = torch.tensor(random.Random(5).sample(range(BLOCKS), -(-context // block_size)))
    span = PrefillSpan(first, tokens, context, blocks)
    expected = attend_prompt(monkeypatch, False, q, key, value, cache, span, window, scored)
    got = attend_prompt(monkeypatch, True, q, key, value, cache, span, window, scored)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    chunk = slice(first, first + tokens)
    torch.testing.assert_close(got[chunk].float(), expected[chunk].float(), atol=tolerance, rtol=tolerance)
    assert not got[:first].any() and not got[first + tokens :].any(), "rows outside the chunk were written"


@pytest.mark.parametrize(
    ("dtype", "scored", "dim", "to_sdpa"),
    [
        (torch.bfloat16, False, 48, True),
        (torch.bfloat16, False, 32, False),
        (torch.bfloat16, True, 48, False),
        (torch.float32, False, 48, False),
    ],
)
def test_which_bfloat16_prompts_go_to_sdpa_on_a_cpu_with_amx(monkeypatch, dtype, scored, dim, to_sdpa):
    """SDPA multiplies in AMX tiles, faster than the kernel's vectors there, for the head sizes the
    kernel's own tiles do not take (not a multiple of 32); a logit cap or sinks, which SDPA does
    not apply, and float32 stay with the kernel. Either way the result is the kernel's."""
    _, tokens, context, _ = PROMPTS["later chunk"]
    torch.manual_seed(7)
    cache = PagedKVCache(2, BLOCKS, 16, KV_HEADS, dim, dtype, torch.device("cpu"))
    cache.keys[1].normal_()
    cache.values[1].normal_()
    q = torch.randn(HEADS, tokens, dim).to(dtype).transpose(0, 1)
    key = torch.randn(tokens, KV_HEADS, dim).to(dtype).transpose(0, 1)
    value = torch.randn(tokens, KV_HEADS, dim).to(dtype).transpose(0, 1)
    span = PrefillSpan(0, tokens, context, torch.tensor(random.Random(7).sample(range(BLOCKS), -(-context // 16))))
    expected = attend_prompt(monkeypatch, True, q, key, value, cache, span, None, scored)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "amx_tiles", lambda: True)
    # what an AMX CPU's kernels answer (llmfleet_prompt_attention_tiles), on any CPU
    monkeypatch.setattr(cpu_kernels, "amx_prompt_attention", lambda head_dim: head_dim % 32 == 0)
    out, ran = through(
        monkeypatch,
        "prefill_attention",
        True,
        q,
        None,
        scored,
        lambda out, s: attention._prefill(q, key, value, out, cache, 1, span, s),
    )
    assert ran == ([] if to_sdpa else [True])
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_builds_unused_for_a_month_are_pruned(tmp_path):
    names = ("attention-this", "attention-recent", "attention-stale", "paged_decode-recent", "paged_decode-stale")
    paths = {name: tmp_path / f"{name}.so" for name in names}
    for path in paths.values():
        path.write_bytes(b"")
    month_ago = time.time() - 31 * 86400
    for name in ("attention-this", "attention-stale", "paged_decode-stale"):  # the one just built is never pruned
        os.utime(paths[name], (month_ago, month_ago))
    cpu_kernels._prune(paths["attention-this"])
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["attention-recent", "attention-this", "paged_decode-recent"]


# (prompt tokens, context, query heads, KV heads, head size, window): blocks of 16 queries over odd
# and even counts of 16-key tiles, GQA, 128-wide heads (their values summed in four passes of 32
# dimensions); a later chunk under a window that starts mid-tile; one query
AMX_PROMPTS = {
    "GQA, 128-wide heads": (130, 130, 8, 2, 128, None),
    "later chunk, window": (45, 301, 4, 4, 64, 50),
    "one query": (1, 77, 4, 1, 32, None),
}


def attention_in_float64(q, keys, values, scale, window, softcap, sinks) -> torch.Tensor:
    """Causal attention of q (n, heads, D) at positions ctx - n .. ctx - 1 over keys and values
    (kv_heads, ctx, D), in float64."""
    n, heads, _ = q.shape
    kv_heads, ctx, _ = keys.shape
    k, v = (t.double().repeat_interleave(heads // kv_heads, 0) for t in (keys, values))
    scores = torch.einsum("nhd,hcd->hnc", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    position, key = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None]
    allowed = (key <= position) & (key > position - window if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, n, 1)], -1)
    return torch.einsum("hnc,hcd->nhd", torch.softmax(scores, -1)[..., :ctx], v)


@pytest.mark.parametrize("scored", ["plain", "sinks", "cap and sinks"])
@pytest.mark.parametrize("layout", AMX_PROMPTS)
def test_amx_tiles_attend_a_bfloat16_prompt_as_float64_does(layout, scored):
    """On a CPU with AMX a bfloat16 prompt's heads of a multiple of 32 are multiplied in tiles, the
    softmax's weights rounded to bfloat16 between the two products (as torch's flash attention
    rounds them): within bfloat16's rounding of attention in float64 on the same inputs."""
    n, ctx, heads, kv_heads, dim, window = AMX_PROMPTS[layout]
    if not cpu_kernels.amx_prompt_attention(dim):
        pytest.skip("no AMX tiles here")
    torch.manual_seed(11)
    q = torch.randn(heads, n + 3, dim).bfloat16().transpose(0, 1)[2 : 2 + n]  # strided, as in a step
    keys, values = torch.randn(2, kv_heads, ctx, dim).bfloat16()
    softcap = 30.0 if scored == "cap and sinks" else None  # a cap takes the vector softmax's steps
    sinks = None if scored == "plain" else torch.linspace(-1.0, 2.0, heads)
    out = torch.zeros(n, heads, dim, dtype=torch.bfloat16)
    assert cpu_kernels.prefill_attention(q, out, keys, values, dim**-0.5, window, softcap, sinks)
    expected = attention_in_float64(q, keys, values, dim**-0.5, window, softcap, sinks)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
