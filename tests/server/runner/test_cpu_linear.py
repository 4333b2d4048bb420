"""oneDNN-packed linears (cpu_linear.py): the same outputs as ``nn.Linear``, weights released
except where tied, and a runner that packs its linears still matches HF generate (the oracle
tests run with packing on, its default on a CPU)."""

from __future__ import annotations

import pytest
import torch

from llmfleet.server.runner import cpu_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 24, bias=True)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight


NO_BF16 = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not cpu_linear.packs_bfloat16(),
    reason="oneDNN has no bf16 kernels for this CPU (AVX2)",
)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16)])
def test_packed_linears_compute_what_the_plain_ones_do(dtype):
    torch.manual_seed(0)
    model = _Tied().to(dtype)
    x = torch.randn(1, 5, 16, dtype=dtype)
    with torch.inference_mode():
        expected = model.proj(x), model.head(x)
        assert cpu_linear.pack_linears(model, rows_hint=8) == 2
        got = model.proj(x), model.head(x[:, 1:3])  # another row count than the hint
    assert isinstance(model.proj, cpu_linear.PackedLinear)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0], expected[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(got[1], expected[1][:, 1:3], atol=tolerance, rtol=tolerance)


def test_dense_weights_are_released_unless_tied():
    model = _Tied()
    cpu_linear.pack_linears(model, rows_hint=8)
    assert model.proj.weight.shape == (24, 16) and model.proj.weight.stride() == (0, 0)  # a stand-in
    assert model.head.weight is model.embed.weight  # the embedding still reads it


def test_only_cpu_float_runners_pack(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_linear.enabled(cpu, torch.float32)
    assert cpu_linear.enabled(cpu, torch.bfloat16) == cpu_linear.packs_bfloat16()
    assert not cpu_linear.enabled(cpu, torch.float16)
    assert not cpu_linear.enabled(torch.device("cuda"), torch.float32)
    monkeypatch.setenv("LLMFLEET_PACKED_LINEAR", "0")
    assert not cpu_linear.enabled(cpu, torch.float32)


def test_bfloat16_stays_plain_where_onednn_has_no_bf16_kernels(monkeypatch):
    """On an AVX2 CPU oneDNN refuses to pack bf16 weights; the runner keeps nn.Linear there
    instead of failing at load."""
    monkeypatch.setattr(cpu_linear, "packs_bfloat16", lambda: False)
    cpu = torch.device("cpu")
    assert not cpu_linear.enabled(cpu, torch.bfloat16) and cpu_linear.enabled(cpu, torch.float32)
