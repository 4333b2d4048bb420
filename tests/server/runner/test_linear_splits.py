"""Row splits of oneDNN's bfloat16 linears (linear_splits.py): a step size that one call runs on
fewer threads than the runner has runs in the fewest equal pieces that keep them busy, and the
pieces compute what one call does. How busy oneDNN keeps the threads is faked here, but for the
probe itself, which reads this machine's CPU time (docs/engine.md has what oneDNN does on CPUs
measured so far)."""

from __future__ import annotations

import pytest
import torch

from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.build import build_engine
from llmfleet.server.runner import cpu_linear, linear_splits
from llmfleet.server.runner.cpu_linear import PackedLinear
from tests.server.runner.device import DEVICE

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
BF16 = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not cpu_linear.packs_bfloat16(),
    reason="oneDNN has no bf16 kernels for this CPU (AVX2)",
)
THREADS = 4
SIZES = [256, 384, 512, 768, 1024, 1536, 2048]


def _packed(out_features: int, in_features: int, dtype: torch.dtype = torch.float32) -> PackedLinear:
    torch.manual_seed(0)
    return PackedLinear(torch.nn.Linear(in_features, out_features).to(dtype), rows_hint=512, keep_weight=False)


def _onednn_idles_between(monkeypatch, low: int, high: int) -> list[int]:
    """Fakes ``busy_threads`` for a runner of ``THREADS`` threads: a call of ``low``..``high``
    rows keeps one of them busy, others all; returns the row counts it is asked about."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: THREADS)
    asked = []

    def busy_threads(linear, x):
        asked.append(x.shape[0])
        return 1.0 if low <= x.shape[0] <= high else float(THREADS)

    monkeypatch.setattr(linear_splits, "busy_threads", busy_threads)
    return asked


@BF16
@pytest.mark.parametrize(("rows", "piece"), [(512, 256), (640, 224), (1024, 352)])
def test_pieces_compute_what_one_call_does(rows, piece):
    """Rows are independent: the pieces' rows are one call's, to the rounding of a sum in another
    order (oneDNN's kernel for another row count may block the inputs otherwise)."""
    linear = _packed(768, 3072, torch.bfloat16)
    x = torch.randn(1, rows, 3072, dtype=torch.bfloat16)
    with torch.inference_mode():
        whole = linear(x)
        linear.row_pieces = {rows: piece}
        split = linear(x)
        other = linear(x[:, :-16])  # a size without a split runs in one call
        one_call = linear.onednn(x[:, :-16])
    assert split.shape == whole.shape == (1, rows, 768)
    torch.testing.assert_close(split, whole, atol=1e-2, rtol=1e-2)
    assert torch.equal(other, one_call)


def test_the_probe_reads_one_busy_thread_where_the_runner_has_one():
    """With one thread the call's CPU time is its wall time: the probe reads one thread busy (the
    most of up to 20 reads: a read shares the cores with a VM's neighbours and the other tests'
    processes, and in one CI run beside other work three reads in a row gave the call 41% of one)."""
    linear = _packed(3072, 768)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            reads = [linear_splits.busy_threads(linear, torch.zeros(512, 768))]
            while max(reads) < 0.75 and len(reads) < 20:
                reads.append(linear_splits.busy_threads(linear, torch.zeros(512, 768)))
    finally:
        torch.set_num_threads(threads)
    assert 0.75 <= max(reads) <= 1.5, reads


def test_a_size_one_call_leaves_threads_idle_at_runs_in_pieces(monkeypatch):
    asked = _onednn_idles_between(monkeypatch, 512, 1024)
    pieces = linear_splits._plan_shape(_packed(768, 768), SIZES)
    # the fewest equal pieces of a size that keeps them busy: 512 in 2 of 256, 768 in 2 of 384,
    # 1024 in 3 of 352 (2 of 512 would idle too)
    assert pieces == {512: 256, 768: 384, 1024: 352}
    # a size read busy once is busy; one read idle is read again, READS times in all
    assert sorted(set(asked)) == sorted({*SIZES, 352})
    assert all(asked.count(rows) == (linear_splits.READS if 512 <= rows <= 1024 else 1) for rows in asked)


def test_sizes_whose_pieces_idle_too_stay_whole(monkeypatch):
    _onednn_idles_between(monkeypatch, 1, 4096)
    assert linear_splits._plan_shape(_packed(768, 768), SIZES) == {}


def test_sizes_threaded_well_are_asked_about_once(monkeypatch):
    asked = _onednn_idles_between(monkeypatch, 0, -1)
    assert linear_splits._plan_shape(_packed(768, 768), SIZES) == {}
    assert asked == SIZES


@BF16
def test_a_small_models_linears_are_not_looked_at(monkeypatch):
    """oneDNN keeps small problems on one thread by design: a 64-wide model's linears are not
    looked at."""
    asked = _onednn_idles_between(monkeypatch, 256, 4096)
    model = torch.nn.Sequential(_packed(128, 64, torch.bfloat16))
    assert linear_splits.plan(model, SIZES) == {} and asked == []


def test_a_split_whose_pieces_would_be_too_small_is_not_made(monkeypatch):
    """Nor is a split whose pieces would be too small for threads to matter (float32 weights:
    the plan of a shape reads no dtype, and AVX2 CPUs cannot pack bfloat16)."""
    _onednn_idles_between(monkeypatch, 256, 4096)
    square = _packed(512, 512)  # 256 rows: 2^26 multiply-adds, as few as a call may have
    assert linear_splits._plan_shape(square, [256, 384]) == {}  # its pieces would have fewer
    assert linear_splits._plan_shape(square, [768]) == {}  # 384 and 256 idle too, 192 too few
    _onednn_idles_between(monkeypatch, 512, 4096)
    assert linear_splits._plan_shape(square, [768]) == {768: 384}


@BF16
def test_the_plan_covers_the_layers_and_leaves_the_lm_head(monkeypatch):
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([_packed(768, 768, torch.bfloat16) for _ in range(2)])
            self.wide = _packed(1024, 768, torch.bfloat16)
            self.head = _packed(768, 768, torch.bfloat16)

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.head

    asked = _onednn_idles_between(monkeypatch, 512, 1024)
    model = Model()
    plans = linear_splits.plan(model, [16, 128, *SIZES])
    assert plans == {(768, 768): {512: 256, 768: 384, 1024: 352}, (1024, 768): {512: 256, 768: 384, 1024: 352}}
    assert all(layer.row_pieces == plans[(768, 768)] for layer in model.layers)
    assert model.head.row_pieces == {}
    assert min(asked) == linear_splits.MIN_ROWS  # smaller steps are not looked at


def test_only_bfloat16_runners_with_threads_to_spare_look(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert linear_splits.enabled(torch.bfloat16) and not linear_splits.enabled(torch.float32)
    monkeypatch.setenv("LLMFLEET_ROW_SPLITS", "0")
    assert not linear_splits.enabled(torch.bfloat16)
    monkeypatch.delenv("LLMFLEET_ROW_SPLITS")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not linear_splits.enabled(torch.bfloat16)


@BF16
@pytest.mark.skipif(DEVICE != "cpu", reason="only a CPU runner warms up")
def test_the_warm_up_sets_the_splits_it_found(monkeypatch):
    _onednn_idles_between(monkeypatch, 384, 512)
    monkeypatch.setattr(linear_splits, "enabled", lambda dtype: True)
    monkeypatch.setattr(linear_splits, "MIN_MACS", 0)  # builtin:tiny's linears are below it
    config = EngineConfig(dtype="bfloat16", kv_cache_memory_mb=8, max_num_batched_tokens=512)
    engine, _ = build_engine("builtin:tiny", config, device="cpu")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    head = engine.runner.model.get_output_embeddings()
    assert all(m.row_pieces and set(m.row_pieces) <= set(range(384, 513)) for m in linears if m is not head)
