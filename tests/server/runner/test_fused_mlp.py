"""A gated MLP's product in C (fused_mlp.py): what Llama's module computes with a SiLU (bfloat16:
its bits; float32: within an ulp of the product) and Gemma's with torch's GeLU (tanh), swapped in
only for MLPs whose forward is Llama's with one of those, and the module's own ops wherever the
kernel cannot take the tensors, in the native build and an AVX2 one. The oracle tests run a CPU
runner with it on, its default."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from llmfleet.server.runner import cpu_kernels, fused_mlp

pytestmark = pytest.mark.skipif(not cpu_kernels.built(), reason="no C compiler for the CPU kernels")


def _config(act: str) -> LlamaConfig:
    return LlamaConfig(hidden_size=48, intermediate_size=136, num_attention_heads=4, hidden_act=act)


def _mlp(cls=LlamaMLP, act="silu", dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(3)
    return cls(_config(act)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 48), (3, 37, 48)])  # a decode row; prompts of several rows
def test_the_fused_mlp_computes_what_the_module_does(kernel_build, dtype, shape):
    mlp = _mlp(dtype=dtype)
    x = (torch.randn(*shape) * 2).to(dtype)
    with torch.inference_mode():
        expected = mlp(x)
        got = fused_mlp.FusedGatedMLP(mlp)(x)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:  # the product within an ulp, carried through the down projection
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemmas_gelu_mlp_computes_what_the_module_does(kernel_build, dtype):
    torch.manual_seed(4)
    mlp = GemmaMLP(_config("gelu_pytorch_tanh")).to(dtype)
    x = (torch.randn(3, 37, 48) * 2).to(dtype)
    with torch.inference_mode():
        expected = mlp(x)
        got = fused_mlp.FusedGatedMLP(mlp)(x)
    # torch's tanh and the kernel's are an ulp or two apart: bfloat16 rounds a few products the other way
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-6, "atol": 2**-6}
    torch.testing.assert_close(got, expected, **tolerance)


def test_where_the_kernel_cannot_take_the_tensors_the_modules_ops_run(monkeypatch):
    mlp = _mlp()
    x = torch.randn(2, 5, 48)
    calls = []
    monkeypatch.setattr(cpu_kernels, "silu_times", lambda gate, up: calls.append(gate.shape) or False)
    with torch.inference_mode():
        assert torch.equal(fused_mlp.FusedGatedMLP(mlp)(x), mlp(x))
    assert calls == [torch.Size([2, 5, 136])]
    monkeypatch.undo()
    gate, up = torch.randn(4, 6), torch.randn(6, 4).t()  # not contiguous: refused, untouched
    before = gate.clone()
    assert not cpu_kernels.silu_times(gate, up) and torch.equal(gate, before)
    assert not cpu_kernels.silu_times(gate, torch.randn(4, 6, dtype=torch.float64))


def test_only_mlps_with_llamas_forward_and_a_kernels_activation_are_swapped():
    model = torch.nn.ModuleDict(
        {
            "llama": _mlp(),
            "qwen2": _mlp(Qwen2MLP),
            "gelu": _mlp(act="gelu"),
            "gemma": GemmaMLP(_config("gelu_pytorch_tanh")),
        }
    )
    linears = model["llama"].gate_proj, model["llama"].down_proj
    assert fused_mlp.fuse_gated_mlps(model) == 3
    assert all(isinstance(model[name], fused_mlp.FusedGatedMLP) for name in ("llama", "qwen2", "gemma"))
    assert (model["llama"].gate_proj, model["llama"].down_proj) == linears  # the same modules, under their names
    assert type(model["gelu"]) is LlamaMLP  # GeLU by erf: no kernel
