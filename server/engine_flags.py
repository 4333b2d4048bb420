"""Engine settings as command-line flags, under vLLM's names where vLLM has one, so that
`llm-fleet serve --max-num-seqs 64 --max-model-len 4096` reads as `vllm serve` would.

They are start values: a ``--config`` file's keys win over them, at start and on every live
reload (the file is what the operator and the tuner write), and a live knob the file does not set
keeps the flag's value.
"""

from __future__ import annotations

import argparse
import re
import typing
from decimal import Decimal
from typing import Any

_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def human_readable_int(text: str) -> int:
    """A token count as vLLM reads one: 32k is 32000 and 32K is 32768; a decimal takes a
    lowercase suffix (25.6k)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r} (k, m, g multiply by 1000; K, M, G by 1024)")
    number, suffix = match.groups()
    if suffix in _BINARY:
        if "." in number:
            raise argparse.ArgumentTypeError(f"{text!r}: a decimal takes a lowercase suffix (k, m or g)")
        return int(number) * _BINARY[suffix]
    value = Decimal(number) * _DECIMAL[suffix]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def dtype(text: str) -> str:
    """A dtype name as EngineConfig takes it (vLLM's aliases too), checked by EngineConfig itself."""
    from pydantic import ValidationError

    from llmfleet.server.config import DTYPE_ALIASES, EngineConfig

    try:
        return EngineConfig(dtype=text).dtype
    except ValidationError:
        names = [*typing.get_args(EngineConfig.model_fields["dtype"].annotation), *DTYPE_ALIASES]
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}") from None


# flag -> (EngineConfig field, type, help)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--max-num-seqs": ("max_batch_size", int, "most sequences in one step (maxBatchSize)"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", human_readable_int, "token budget of one step (8k, 8K)"),
    "--max-model-len": ("max_model_len", human_readable_int, "context limit (default: the model's; 32k, 32K)"),
    "--dtype": ("dtype", dtype, "auto, float32 (float), bfloat16 or float16 (half)"),
    "--block-size": ("kv_block_size", int, "tokens per KV cache block"),
    "--kv-cache-memory-mb": ("kv_cache_memory_mb", int, "KV cache size"),
    "--scheduling-policy": ("scheduling", str, "fcfs or priority (waiting order and preemption victims)"),
    "--policy": ("policy", str, "static, dynamic or continuous batching"),
    "--prefill-mode": ("prefill_mode", str, "chunked, merged or prefill_first"),
    "--batch-timeout-ms": ("batch_timeout_ms", float, "batching window"),
    "--max-queue-len": ("max_queue_len", int, "waiting requests beyond this get 429"),
    "--prefix-caching-hash-algo": ("prefix_caching_hash_algo", str, "builtin or sha256 (names cached prefixes)"),
    "--tensor-parallel-size": ("tensor_parallel_size", int, "ranks sharding each layer (processes; GPUs on CUDA)"),
    "--pipeline-parallel-size": ("pipeline_parallel_size", int, "pipeline stages, each its own process"),
}

# flag (and its --no- form) -> (EngineConfig field, help)
SWITCHES: dict[str, tuple[str, str]] = {
    "--enable-prefix-caching": ("enable_prefix_caching", "reuse KV of prompt prefixes seen before (default on)"),
    "--enforce-eager": ("enforce_eager", "run every step eagerly, without CUDA graphs (default off)"),
}


class _ChunkedPrefill(argparse.Action):
    """vLLM's switch as a prefill mode: on is chunked; off is merged, whole prompts in the decode
    steps (vLLM v1 without chunking)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, "merged" if option_string.startswith("--no-") else "chunked")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (start values; a --config file's keys win, live)")
    for flag, (field, kind, text) in FLAGS.items():
        metavar = flag.removeprefix("--").upper().replace("-", "_")
        group.add_argument(flag, dest=f"engine_{field}", metavar=metavar, type=kind, help=text)
    for flag, (field, text) in SWITCHES.items():  # each with its --no- form, as vLLM's
        group.add_argument(flag, dest=f"engine_{field}", action=argparse.BooleanOptionalAction, help=text)
    group.add_argument(
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        dest="engine_prefill_mode",
        action=_ChunkedPrefill,
        help="as vLLM's: --prefill-mode chunked (with the --no- prefix: merged)",
    )


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields set on the command line, by EngineConfig field name."""
    fields = [field for field, *_ in [*FLAGS.values(), *SWITCHES.values()]]
    given = {field: getattr(args, f"engine_{field}", None) for field in fields}
    return {field: value for field, value in given.items() if value is not None}
