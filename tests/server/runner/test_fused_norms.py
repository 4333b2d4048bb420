"""RMSNorm in C (fused_norms.py): what Llama's module and Gemma's compute, to a rounding, in
float32 and bfloat16; a row's bits whatever rows share its call; swapped in only for modules whose
forward is Llama's or Gemma's; the module's own forward wherever the kernel cannot run. The oracle
tests run a CPU runner with it on, its default."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from llmfleet.server.runner import cpu_kernels, fused_norms

pytestmark = pytest.mark.skipif(not cpu_kernels.built(), reason="no C compiler for the CPU kernels")

# shapes: a decode row, a decode batch, a prompt, a size that is no multiple of a vector
SHAPES = [(1, 1, 768), (32, 1, 768), (2, 100, 770), (5, 7)]


def _norm(dim: int, dtype: torch.dtype, cls=LlamaRMSNorm) -> torch.nn.Module:
    torch.manual_seed(dim)
    norm = cls(dim, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    return norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_computes_what_the_module_does(dtype, shape):
    norm = _norm(shape[-1], dtype)
    x = (torch.randn(*shape) * 3).to(dtype)
    fused = fused_norms.FusedRMSNorm(norm)
    with torch.inference_mode():
        got = cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon)
        expected = norm(x)
        assert torch.equal(fused(x), got)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    # one rounding of the scale apart at most: float32's last bits, bfloat16's last one
    tolerance = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0.0}
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_computes_what_gemmas_module_does(dtype, shape):
    norm = _norm(shape[-1], dtype, GemmaRMSNorm)  # 1 + weight: weights about 0 scale by about 1
    x = (torch.randn(*shape) * 3).to(dtype)
    fused = fused_norms.FusedGemmaRMSNorm(norm)
    with torch.inference_mode():
        got = cpu_kernels.rms_norm(x, norm.weight, norm.eps, gemma=True)
        expected = norm(x)
        assert torch.equal(fused(x), got)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    tolerance = {"rtol": 2e-6, "atol": 2e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 0.0}
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    norm = _norm(768, dtype)
    batch = torch.randn(32, 1, 768).to(dtype)
    with torch.inference_mode():
        together = cpu_kernels.rms_norm(batch, norm.weight, norm.variance_epsilon)
        alone = [cpu_kernels.rms_norm(batch[i : i + 1], norm.weight, norm.variance_epsilon) for i in range(32)]
    assert torch.equal(together, torch.cat(alone))


def test_only_norms_with_llamas_or_gemmas_forward_are_swapped():
    model = torch.nn.ModuleDict(
        {
            "llama": _norm(16, torch.float32),
            "qwen2": _norm(16, torch.float32, Qwen2RMSNorm),
            "gemma3": Gemma3RMSNorm(16),  # Gemma's forward, another comment in it
            "layer": torch.nn.LayerNorm(16),
        }
    )
    assert fused_norms.fuse_rms_norms(model) == 3
    assert isinstance(model["llama"], fused_norms.FusedRMSNorm)
    assert isinstance(model["qwen2"], fused_norms.FusedRMSNorm)
    assert isinstance(model["gemma3"], fused_norms.FusedGemmaRMSNorm)  # 1 + weight: Gemma's kernel
    assert isinstance(model["layer"], torch.nn.LayerNorm)
    assert fused_norms.fuse_rms_norms(model) == 0  # a fused norm is not swapped again


def test_what_the_kernel_does_not_take_runs_the_modules_own_forward(monkeypatch):
    norm = _norm(16, torch.float16)  # a dtype the kernel has no loop for
    x = torch.randn(3, 16).to(torch.float16)
    with torch.inference_mode():
        assert cpu_kernels.rms_norm(x, norm.weight, norm.variance_epsilon) is None
        assert torch.equal(fused_norms.FusedRMSNorm(norm)(x), norm(x))
    monkeypatch.setenv("LLMFLEET_FUSED_NORMS", "0")
    assert not fused_norms.enabled(torch.device("cpu"))
