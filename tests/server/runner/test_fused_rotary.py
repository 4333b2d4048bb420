"""The rotary embedding in C (cpu_kernels.rotary, fused_rotary.py): transformers' bits, or nothing."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.models.llama import modeling_llama

from llmfleet.server.runner import cpu_kernels, fused_rotary
from llmfleet.server.runner.builtin_models import resolve_model

pytestmark = pytest.mark.skipif(not cpu_kernels.built(), reason="no C compiler for the CPU kernels")
HF_ROTARY = getattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__", modeling_llama.apply_rotary_pos_emb)


def rotary_inputs(dtype, heads, kv_heads, tokens, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, tokens, heads, dim, generator=gen).to(dtype).transpose(1, 2)  # as a projection hands it
    k = torch.randn(1, tokens, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    angles = 20 * torch.randn(1, tokens, dim // 2, generator=gen)
    angles = torch.cat([angles, angles], dim=-1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, tokens, dim", [(12, 12, 1, 64), (32, 8, 37, 64), (4, 2, 5, 16), (8, 8, 300, 128)]
)
def test_the_kernel_gives_transformers_bits(dtype, heads, kv_heads, tokens, dim):
    q, k, cos, sin = rotary_inputs(dtype, heads, kv_heads, tokens, dim)
    expected = HF_ROTARY(q, k, cos, sin)
    fused = cpu_kernels.rotary(q, k, cos, sin)
    assert fused is not None
    for a, b in zip(expected, fused, strict=True):
        assert torch.equal(a, b) and a.shape == b.shape
    contiguous = cpu_kernels.rotary(q.contiguous(), k.contiguous(), cos, sin)  # any dense layout
    assert torch.equal(contiguous[0], expected[0]) and contiguous[0].stride() == q.contiguous().stride()


def test_the_kernel_refuses_what_it_does_not_take():
    q, k, cos, sin = rotary_inputs(torch.float32, 4, 2, 3, 16)
    assert cpu_kernels.rotary(q.half(), k.half(), cos.half(), sin.half()) is None  # float16
    assert cpu_kernels.rotary(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), cos, sin) is None  # a batch of 2
    assert cpu_kernels.rotary(q, k, cos[..., :8], sin[..., :8]) is None  # a partial rotary
    assert cpu_kernels.rotary(q[..., ::2], k[..., ::2], cos[..., :8], sin[..., :8]) is None  # strided last dim
    odd = rotary_inputs(torch.float32, 4, 2, 3, 16)
    assert cpu_kernels.rotary(odd[0][..., :15], odd[1][..., :15], odd[2][..., :15], odd[3][..., :15]) is None


def test_installed_where_the_model_computes_it_and_generation_is_unchanged(monkeypatch):
    monkeypatch.setattr(modeling_llama, fused_rotary.NAME, HF_ROTARY)  # transformers' own, whatever ran before
    model = AutoModelForCausalLM.from_pretrained(resolve_model("builtin:tiny"), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 300, 42, 9, 88]])
    before = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert fused_rotary.install(model) == 1
    assert modeling_llama.apply_rotary_pos_emb.llmfleet_fused
    assert fused_rotary.install(model) == 0  # there already
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False), before)


def test_a_rotary_that_differs_is_left_alone(monkeypatch):
    def interleaved(q, k, cos, sin):  # pairs (0, 1), (2, 3)...: not Llama's halves
        def rotate(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)

        return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin

    module = types.ModuleType("llmfleet_test_interleaved")
    module.apply_rotary_pos_emb = interleaved

    class Attention(torch.nn.Module):
        pass

    Attention.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model = torch.nn.Module()
    model.attention = Attention()
    model.weight = torch.nn.Parameter(torch.zeros(1))
    model.config = PretrainedConfig(num_attention_heads=4, hidden_size=64)
    assert fused_rotary.install(model) == 0
    assert module.apply_rotary_pos_emb is interleaved
