"""The step sizes a CPU runner pads to (no torch here: the simulator's cost model reads it too).

On a CPU, bfloat16 and float16 matmuls go through oneDNN, which builds a kernel for every new
matrix shape on first use: 5-40 ms for a first step of a new token count of builtin:small, on
steps of 30-150 ms. With prompts of every length nearly every prompt step is a new count, and
oneDNN's cache (1024 kernels by default, about six per count) cannot hold them all, so a
long-running server would keep paying it. Padded to multiples of 16 tokens, and above 256 to 16
sizes per octave, a step runs at one of 47 sizes up to 512 tokens (111 up to 8192) and wastes at
most 15 rows or 1/16 of its tokens on padding (no attention reads or writes those rows, and the
rest of the model treats rows independently, so they change no real row); a bfloat16 matmul of
32 rows costs about what one of 17 does. Steps of up to 16 tokens (decodes) run at their size:
there are few such sizes, and they are the steps that run most.

float32 linears go through oneDNN too (packed, cpu_linear.py), with the same per-shape kernels,
so float32 steps pad as well; only a runner with plain linears (``LLMFLEET_PACKED_LINEAR=0``) runs
float32 steps unpadded, since MKL builds no per-shape kernel.
"""

from __future__ import annotations

EXACT_UP_TO = 16  # steps of at most this many tokens run at their size
SIZES_PER_OCTAVE = 16


def pads_steps(device: str, dtype: str, packed_linears: bool = True) -> bool:
    """Whether a runner on ``device`` ("cpu", "cuda") in ``dtype`` pads its steps;
    ``packed_linears``: whether its linears are oneDNN's (the default on a CPU)."""
    return device == "cpu" and (packed_linears or dtype in ("bfloat16", "float16"))


def padded_step_tokens(num_tokens: int) -> int:
    """The token count a step of ``num_tokens`` runs at when padded."""
    if num_tokens <= EXACT_UP_TO:
        return num_tokens
    octave = 1 << (num_tokens.bit_length() - 1)  # the largest power of two <= num_tokens
    granule = max(EXACT_UP_TO, octave // SIZES_PER_OCTAVE)
    return -(-num_tokens // granule) * granule


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Every size a padded step of 1 to ``max_tokens`` tokens runs at: what a runner warms up at
    start-up (warm_up.py), prompt and decode steps alike."""
    return sorted({padded_step_tokens(n) for n in range(1, max_tokens + 1)})


def warm_up_tokens(max_tokens: int, num_kv_blocks: int, kv_block_size: int, max_model_len: int) -> int:
    """The largest step a runner warms up: its budget's, within its KV cache and context limit
    (a warm-up step is one prompt)."""
    return min(max_tokens, num_kv_blocks * kv_block_size, max_model_len)
