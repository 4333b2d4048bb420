"""oneDNN-packed linears (cpu_linear.py): the same outputs as ``nn.Linear``, weights released
except where tied, steps of a few rows through the C kernel that streams the packed weight, and a
runner that packs its linears still matches HF generate (the oracle tests run with packing and the
kernel on, their defaults on a CPU)."""

from __future__ import annotations

import pytest
import torch

from llmfleet.server.runner import cpu_kernels, cpu_linear

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


SMALL = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or cpu_kernels.small_linear_rows() == 0,
    reason="no small-row kernel on this CPU (not built, or not measured faster than oneDNN here)",
)

# With AMX, oneDNN packs bf16 weights for its tiles, [N / 32][K / 2][32][2], which the tile kernel
# reads; elsewhere in 64-column blocks, which the AVX512-BF16 kernel reads.
AMX = torch.cpu._is_amx_tile_supported()
SMALL_BF16 = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available()
    or not cpu_linear.packs_bfloat16()
    or cpu_kernels.small_linear_rows(torch.bfloat16, 32 if AMX else 64) == 0,
    reason="no bfloat16 small-row kernel for this CPU (it needs AVX512-BF16 or AMX)",
)
DTYPES = [pytest.param(torch.float32, marks=SMALL), pytest.param(torch.bfloat16, marks=SMALL_BF16)]


def _float32_only_on_avx2(kernel_build: str, dtype: torch.dtype) -> None:
    """The AVX2 build (conftest.kernel_build) has no bfloat16 kernel: its float32 loop is its own."""
    if kernel_build == "AVX2" and dtype == torch.bfloat16:
        pytest.skip("the AVX2 build reads float32 weights only")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(768, 768), (3072, 768), (768, 3072), (200, 128), (40, 96), (72, 208)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_a_step_of_a_few_rows_streams_the_packed_weight_and_computes_the_same(
    out_features, in_features, bias, dtype, kernel_build
):
    """Every row count the kernel takes (and one more, which oneDNN's kernel takes), on shapes whose
    columns fill whole 64-column blocks and shapes that end in a padded one, and inputs that end in
    a part of the AVX2 loop's 64-input chunks. In bfloat16 both sum in float32 and round once;
    their orders differ, so they may differ in a last bit."""
    _float32_only_on_avx2(kernel_build, dtype)
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    packed = cpu_linear.PackedLinear(linear, rows_hint=256, keep_weight=False)
    if dtype == torch.bfloat16 and in_features % 32:
        # oneDNN pads a bfloat16 weight's inputs to a multiple of 32, a layout the kernel does
        # not read: every step goes to oneDNN's kernels
        assert packed.small_block == 0
    else:
        assert packed.small_block == (32 if AMX and dtype == torch.bfloat16 else 64)
    assert packed.small_rows == cpu_kernels.small_linear_rows(dtype, packed.small_block)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    exact = torch.nn.Linear(in_features, out_features, bias=bias)  # the same weights, in float32
    exact.load_state_dict({name: value.float() for name, value in linear.state_dict().items()})
    with torch.inference_mode():
        for rows in range(1, packed.small_rows + 2):
            x = torch.randn(1, rows, in_features, dtype=dtype)
            expected = exact(x.float())
            torch.testing.assert_close(packed(x).float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_whatever_rows_are_beside_it(dtype, kernel_build):
    """One sum per output in one order: a request's logits do not depend on how many requests
    share its step (for steps the kernel takes)."""
    _float32_only_on_avx2(kernel_build, dtype)
    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 3072).to(dtype)
    packed = cpu_linear.PackedLinear(linear, rows_hint=256, keep_weight=False)
    x = torch.randn(packed.small_rows, 768, dtype=dtype)
    with torch.inference_mode():
        alone = packed(x[:1])
        for rows in range(2, packed.small_rows + 1):
            assert torch.equal(packed(x[:rows])[:1], alone)


@SMALL
def test_a_packed_layout_the_kernel_does_not_read_stays_on_onednn(monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 128, bias=False)
    dense = linear.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(dense, 64)
    assert cpu_kernels.packed_block(packed, dense) == 64
    assert not cpu_kernels.packed_block(packed, dense.t().contiguous().view(128, 64))  # the same bytes elsewhere
    assert not cpu_kernels.packed_block(torch.ops.mkldnn._reorder_linear_weight(dense[:, :32].contiguous(), 64), dense)
    if cpu_kernels.small_linear_rows(torch.bfloat16, 32 if AMX else 64):  # bf16 in pairs of inputs, checked too
        bf16 = dense.to(torch.bfloat16)
        assert cpu_kernels.packed_block(torch.ops.mkldnn._reorder_linear_weight(bf16, 64), bf16) == (32 if AMX else 64)
        assert not cpu_kernels.packed_block(packed, bf16)  # the float32 packing, read as bf16's
    monkeypatch.setattr(cpu_kernels, "packed_block", lambda packed, dense: 0)
    assert cpu_linear.PackedLinear(linear, rows_hint=64, keep_weight=False).small_rows == 0


@pytest.mark.skipif(not AMX or cpu_kernels.small_linear_rows(torch.bfloat16, 32) == 0, reason="no AMX tiles here")
@pytest.mark.parametrize(("out_features", "in_features"), [(3072, 768), (768, 3072), (40, 96)])
def test_the_tile_kernel_gives_onednns_bits(out_features, in_features):
    """Over AMX's packing the tile kernel sums in oneDNN's order: its outputs are oneDNN's, at one
    row, one tile of 16 and two passes of up to 16."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features).to(torch.bfloat16)
    packed = cpu_linear.PackedLinear(linear, rows_hint=256, keep_weight=False)
    assert packed.small_block == 32
    with torch.inference_mode():
        for rows in (1, 7, 16, 17, 32):
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            onednn = torch.ops.mkldnn._linear_pointwise(x, packed.packed, None, "none", [], "")
            small = cpu_kernels.small_linear(x, packed.packed, out_features, None, 32)
            assert torch.equal(small, onednn)


def test_the_small_row_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("LLMFLEET_SMALL_LINEAR", "0")
    assert cpu_kernels.small_linear_rows() == cpu_kernels.small_linear_rows(torch.bfloat16) == 0
    assert cpu_kernels.small_linear_rows(torch.bfloat16, 32) == 0
    assert cpu_linear.PackedLinear(torch.nn.Linear(64, 128), rows_hint=64, keep_weight=False).small_rows == 0
