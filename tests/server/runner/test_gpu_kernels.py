"""The Triton kernels (gpu_kernels.py) against plain torch: on a GPU where the tests run on one
(LLMFLEET_TEST_DEVICE=cuda), else through Triton's interpreter on CPU tensors, the same kernel code
a GPU compiles. The interpreter computes on numpy, which has no bfloat16: that dtype is checked on
a GPU only."""

from __future__ import annotations

import math
import os

import pytest
import torch

from llmfleet.server.runner import gpu_kernels
from tests.server.runner.device import DEVICE

pytest.importorskip("triton")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter was not chosen before Triton was imported", allow_module_level=True)

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != "cpu" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def kernels_on(monkeypatch):
    monkeypatch.setenv("LLMFLEET_TRITON_KERNELS", "interpret" if DEVICE == "cpu" else "1")


def reference_decode(q, keys, values, block_size, rows, blocks, lengths, scale, window, sinks):
    """Each row's attention over its context, gathered by hand, in float64 on the CPU."""
    q, keys, values, blocks = q.cpu(), keys.cpu(), values.cpu(), blocks.cpu()
    _, kv_heads, _, dim = keys.shape
    heads = q.shape[1]
    group = heads // kv_heads
    per_request = blocks.shape[0] // rows.shape[0]
    out = {}
    for i, row in enumerate(rows.tolist()):
        length = int(lengths[i])
        table = blocks[i * per_request : (i + 1) * per_request]
        at = [(int(table[t // block_size]), t % block_size) for t in range(length)]
        first = max(0, length - window) if window else 0
        result = torch.empty(heads, dim, dtype=torch.float64)
        for head in range(heads):
            k = torch.stack([keys[b, head // group, o] for b, o in at]).double()[first:]
            v = torch.stack([values[b, head // group, o] for b, o in at]).double()[first:]
            logits = (k @ q[row, head].double()) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[head : head + 1].double().cpu()])
            probs = torch.softmax(logits, dim=0)[: k.shape[0]]
            result[head] = probs @ v
        out[row] = result
    return out


def decode_case(dtype, heads, kv_heads, dim, block_size, lengths, window=None, sinks=False, device=DEVICE):
    """A step's q (tokens, heads, dim; strided, as a model hands it over) with ``len(lengths)``
    decode rows among other rows, and a paged cache whose block tables are scattered."""
    gen = torch.Generator().manual_seed(len(lengths) * dim + block_size)
    n = len(lengths)
    tokens = n + 3
    per_request = max(-(-length // block_size) for length in lengths)
    num_blocks = n * per_request + 4
    keys = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    values = torch.randn(num_blocks, kv_heads, block_size, dim, generator=gen).to(dtype)
    q = torch.randn(heads, tokens, dim, generator=gen).to(dtype).transpose(0, 1)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    blocks = torch.tensor([order.pop() for _ in range(n * per_request)])
    rows = torch.tensor(sorted(torch.randperm(tokens, generator=gen)[:n].tolist()))
    sink_logits = torch.randn(heads, generator=gen) if sinks else None
    tensors = (q, keys, values, rows, blocks, torch.tensor(lengths), sink_logits)
    q, keys, values, rows, blocks, lengths_t, sink_logits = [t if t is None else t.to(device) for t in tensors]
    return q, keys, values, block_size, rows, blocks, lengths_t, dim**-0.5, window, sink_logits


CASES = [
    (4, 4, 16, 16, [1, 17, 64, 150], None, False),  # one query head a KV head, contexts past a tile
    (8, 2, 64, 16, [33, 5, 200], None, False),  # GQA, 4 query heads a KV head
    (6, 2, 48, 5, [12, 71], None, False),  # a head_dim and a block size of no power of two
    (4, 2, 16, 4, [40, 9, 90], 16, False),  # a sliding window
    (4, 1, 16, 8, [30, 100], None, True),  # sinks
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim, block_size, lengths, window, sinks", CASES)
def test_paged_decode_matches_attention_over_the_gathered_context(
    dtype, heads, kv_heads, dim, block_size, lengths, window, sinks
):
    case = decode_case(dtype, heads, kv_heads, dim, block_size, lengths, window, sinks)
    q, keys, values, block_size, rows, blocks, lengths_t, scale, window, sink_logits = case
    out = torch.full(q.shape, 7.0, dtype=dtype, device=q.device)
    kv = (keys, values, block_size, rows, blocks, lengths_t)
    assert gpu_kernels.paged_decode(q, out, *kv, scale, window, None, sink_logits)
    expected = reference_decode(*case)
    out = out.cpu()
    for row in range(q.shape[0]):
        if row in expected:
            tolerance = TOLERANCE[dtype]
            torch.testing.assert_close(out[row].double(), expected[row], atol=tolerance, rtol=tolerance)
        else:
            assert (out[row] == 7.0).all(), "a row that is not a decode was written"


def test_paged_decode_leaves_a_logit_cap_to_torch():
    q, keys, values, block_size, rows, blocks, lengths, scale, _, _ = decode_case(torch.float32, 4, 2, 16, 4, [9])
    out = torch.zeros(q.shape, device=q.device)
    assert not gpu_kernels.paged_decode(q, out, keys, values, block_size, rows, blocks, lengths, scale, None, 30.0)
    assert (out == 0).all()


def test_switched_off_or_given_cpu_tensors_the_kernels_do_nothing(monkeypatch):
    case = decode_case(torch.float32, 4, 2, 16, 4, [9])
    out = torch.zeros(case[0].shape, device=case[0].device)
    monkeypatch.setenv("LLMFLEET_TRITON_KERNELS", "0")
    assert not gpu_kernels.paged_decode(case[0], out, *case[1:])
    assert gpu_kernels.rms_norm(torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE), 1e-5) is None
    monkeypatch.setenv("LLMFLEET_TRITON_KERNELS", "1")  # the default: CUDA tensors only
    cpu_case = decode_case(torch.float32, 4, 2, 16, 4, [9], device="cpu")
    cpu_out = torch.zeros(cpu_case[0].shape)
    assert not gpu_kernels.paged_decode(cpu_case[0], cpu_out, *cpu_case[1:])
    assert gpu_kernels.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-5) is None
    assert (out == 0).all() and (cpu_out == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 100, 2048])
def test_rms_norm_matches_llamas(dtype, width):
    gen = torch.Generator().manual_seed(width)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype).to(DEVICE)
    x = (3 * torch.randn(3, 5, width, generator=gen)).to(dtype).to(DEVICE)
    out = gpu_kernels.rms_norm(x, weight, 1e-5)
    assert out is not None and out.shape == x.shape and out.dtype == dtype
    variance = x.float().pow(2).mean(-1, keepdim=True)
    expected = weight * (x.float() * torch.rsqrt(variance + 1e-5)).to(dtype)  # LlamaRMSNorm.forward
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


def test_rms_norm_refuses_what_it_does_not_take():
    x = torch.randn(2, 16, device=DEVICE)
    assert gpu_kernels.rms_norm(x, torch.ones(16, dtype=torch.float16, device=DEVICE), 1e-5) is None  # dtype
    assert gpu_kernels.rms_norm(x, torch.ones(8, device=DEVICE), 1e-5) is None  # width
    assert gpu_kernels.rms_norm(torch.randn(0, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-5) is None
    assert math.isfinite(float(gpu_kernels.rms_norm(x, torch.ones(16, device=DEVICE), 1e-5).sum()))
