"""The step sizes a bfloat16 CPU runner pads to: few, never smaller, little waste."""

from __future__ import annotations

from llmfleet.server.runner.step_shapes import (
    EXACT_UP_TO,
    padded_step_tokens,
    pads_steps,
    warm_up_sizes,
    warm_up_tokens,
)


def test_decode_sized_steps_run_at_their_size() -> None:
    assert [padded_step_tokens(n) for n in range(1, EXACT_UP_TO + 1)] == list(range(1, EXACT_UP_TO + 1))


def test_padding_wastes_at_most_15_rows_or_a_sixteenth() -> None:
    for n in range(1, 20_000):
        padded = padded_step_tokens(n)
        assert padded >= n
        assert padded - n <= max(15, n // 16)
        assert padded_step_tokens(padded) == padded  # a padded size pads to itself


def test_sizes_stay_within_onednns_kernel_cache() -> None:
    # about six matmul shapes per step size; oneDNN caches 1024 kernels by default
    assert len({padded_step_tokens(n) for n in range(1, 513)}) == 47
    assert len({padded_step_tokens(n) for n in range(1, 8193)}) * 6 < 1024


def test_cpu_steps_pad_unless_linears_are_plain_float32() -> None:
    assert pads_steps("cpu", "bfloat16") and pads_steps("cpu", "float16")
    assert pads_steps("cpu", "float32")  # packed linears: oneDNN's kernels too
    assert not pads_steps("cpu", "float32", packed_linears=False)
    assert not pads_steps("cuda", "bfloat16")  # CUDA graphs pad to their own buckets


def test_warm_up_covers_every_size_within_the_budget() -> None:
    sizes = warm_up_sizes(512)
    assert len(sizes) == 47 and sizes[-1] == 512
    assert {padded_step_tokens(n) for n in range(1, 513)} == set(sizes)
    assert warm_up_sizes(500)[-1] == 512  # a 500-token step runs as 512


def test_warm_up_stays_within_the_kv_cache_and_context() -> None:
    assert warm_up_tokens(512, num_kv_blocks=10, kv_block_size=16, max_model_len=2048) == 160
    assert warm_up_tokens(512, num_kv_blocks=1000, kv_block_size=16, max_model_len=128) == 128
