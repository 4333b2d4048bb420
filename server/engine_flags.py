"""Engine settings as command-line flags, under vLLM's names where vLLM has one, so that
`llm-fleet serve --max-num-seqs 64 --max-model-len 4096` reads as `vllm serve` would.

They are start values: a ``--config`` file's keys win over them, at start and on every live
reload (the file is what the operator and the tuner write), and a live knob the file does not set
keeps the flag's value.

:data:`VLLM_FLAGS` are the rest of vLLM's common flags, which a vLLM Deployment's ``args:`` carry:
accepted where they change nothing here (named in one line at start), refused where they would
change answers or memory in a way llm-fleet cannot honour (see docs/serving.md, "Moving from vLLM").
"""

from __future__ import annotations

import argparse
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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

# vLLM's short forms of the flags above
SHORT: dict[str, str] = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp"}

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
        names = [flag, SHORT[flag]] if flag in SHORT else [flag]
        group.add_argument(*names, dest=f"engine_{field}", metavar=metavar, type=kind, help=text)
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


NO_EFFECT = "no effect"  # accepted; a value other than the neutral ones is named in one info line at start
REFUSED = "refused"  # a value other than the neutral ones is an argument error


@dataclass(frozen=True)
class VLLMFlag:
    """One of vLLM's flags that llm-fleet takes only so that a `vllm serve` command line runs."""

    names: tuple[str, ...]  # vLLM's spellings; messages name the first
    effect: str  # NO_EFFECT or REFUSED
    why: str  # what llm-fleet does instead
    read: Callable[[str], Any] | None = str  # the value's type; None: a switch
    neutral: tuple = ()  # values that ask for what llm-fleet does anyway: accepted without a word
    negatable: bool = True  # a switch with vLLM's --no- form
    several: bool = False  # takes one value or more (nargs="+")

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[0].removeprefix("--").replace("-", "_")

    def is_neutral(self, value: Any) -> bool:
        # vLLM reads "" and "None" as unset (its optional_type)
        return value in self.neutral or value == () or (isinstance(value, str) and value.lower() in ("", "none"))


_KV = "the KV cache is sized by --kv-cache-memory-mb (or kv_cache_memory_mb in --config)"
_GRAPHS = "llm-fleet has no compilation levels: CUDA graphs are captured unless --enforce-eager"
_NO_REQUEST_LOG = "llm-fleet keeps no per-request log (/metrics counts requests)"
_TLS = "llm-fleet serve speaks plain HTTP: terminate TLS in front of it (an Ingress, a Gateway, a mesh)"
_LORA = "llm-fleet serves the base model alone, without LoRA adapters"

# vLLM's flags and what `llm-fleet serve` does with each. Those it acts on (--revision, CORS,
# --root-path, --uvicorn-log-level, --enable-request-id-headers, several --api-key values) are
# arguments of their own in cli.py; --tokenizer is checked against the model there.
VLLM_FLAGS: tuple[VLLMFlag, ...] = (
    # tune what vLLM manages and change no answer here
    VLLMFlag(("--gpu-memory-utilization", "--device-memory-utilization"), NO_EFFECT, _KV, float),
    VLLMFlag(("--swap-space",), NO_EFFECT, "preempted requests recompute their KV here: no CPU swap space", float),
    VLLMFlag(
        ("--seed",),
        NO_EFFECT,
        "an unseeded request samples from a randomly seeded generator; a request's own seed makes it reproducible",
        int,
    ),
    VLLMFlag(
        ("--max-logprobs",), NO_EFFECT, "logprobs and top_logprobs are capped at 20, vLLM's default", int, neutral=(20,)
    ),
    VLLMFlag(
        ("--trust-remote-code",),
        NO_EFFECT,
        "llm-fleet never runs a model repository's own code: it loads "
        "the architectures transformers ships, and a model that needs remote code fails to load",
        None,
        neutral=(False,),
    ),
    VLLMFlag(("--enable-log-requests",), NO_EFFECT, _NO_REQUEST_LOG, None, neutral=(False,)),
    VLLMFlag(("--disable-log-requests",), NO_EFFECT, _NO_REQUEST_LOG, None, neutral=(True,), negatable=False),
    VLLMFlag(
        ("--disable-log-stats",),
        NO_EFFECT,
        "llm-fleet logs no periodic stats (/metrics has them)",
        None,
        neutral=(True,),
        negatable=False,
    ),
    VLLMFlag(("--disable-uvicorn-access-log",), NO_EFFECT, "llm-fleet writes no access log", None, neutral=(True,)),
    VLLMFlag(
        ("--distributed-executor-backend",),
        NO_EFFECT,
        "tensor- and pipeline-parallel workers are processes here, joined by torch.distributed",
        neutral=("mp",),
    ),
    VLLMFlag(
        ("--disable-custom-all-reduce",), NO_EFFECT, "all-reduce is torch.distributed's here", None, neutral=(True,)
    ),
    VLLMFlag(
        ("--disable-frontend-multiprocessing",),
        NO_EFFECT,
        "the API and the engine share one process here",
        None,
        neutral=(True,),
        negatable=False,
    ),
    VLLMFlag(("--api-server-count", "-asc"), NO_EFFECT, "one process serves the API here", int, neutral=(1,)),
    VLLMFlag(
        ("--max-num-partial-prefills",),
        NO_EFFECT,
        "prompt chunks are scheduled within --max-num-batched-tokens",
        int,
        neutral=(1,),
    ),
    VLLMFlag(
        ("--structured-outputs-config.backend",),
        NO_EFFECT,
        "every grammar compiles with llguidance here, vLLM's guidance backend",
        neutral=("auto", "guidance"),
    ),
    VLLMFlag(("--compilation-config", "-cc"), NO_EFFECT, _GRAPHS),
    VLLMFlag(("--optimization-level", "-O"), NO_EFFECT, _GRAPHS),
    # would change answers or memory in ways llm-fleet cannot honour
    VLLMFlag(("--quantization", "-q"), REFUSED, "llm-fleet serves unquantized weights", neutral=("None",)),
    VLLMFlag(("--kv-cache-dtype",), REFUSED, "the KV cache holds the model's dtype (--dtype)", neutral=("auto",)),
    VLLMFlag(
        ("--tokenizer-mode",),
        REFUSED,
        "llm-fleet tokenizes with the model's Hugging Face tokenizer",
        neutral=("auto", "hf"),
    ),
    VLLMFlag(("--speculative-config", "-sc"), REFUSED, "llm-fleet has no speculative decoding", neutral=("null", "{}")),
    VLLMFlag(("--enable-lora",), REFUSED, _LORA, None, neutral=(False,)),
    VLLMFlag(("--lora-modules",), REFUSED, _LORA, several=True),
    VLLMFlag(
        ("--data-parallel-size", "-dp"),
        REFUSED,
        "one engine per server here: run more replicas (the Deployment's replicas, or the operator's scaling)",
        int,
        neutral=(1,),
    ),
    VLLMFlag(("--ssl-keyfile",), REFUSED, _TLS),
    VLLMFlag(("--ssl-certfile",), REFUSED, _TLS),
    VLLMFlag(("--ssl-ca-certs",), REFUSED, _TLS),
)


class _VLLMFlagAction(argparse.Action):
    """Stores a :class:`VLLMFlag`'s value; a refused one's non-neutral value is an argument error."""

    def __init__(self, option_strings, dest, flag: VLLMFlag, **kwargs) -> None:
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if self.flag.read is None:
            value, shown = not option_string.startswith("--no-"), option_string
        elif self.flag.several:
            value, shown = tuple(v for v in values if v not in ("", "None")), f"{option_string} {' '.join(values)}"
        else:
            value, shown = values, f"{option_string} {values}"
        if self.flag.effect == REFUSED and not self.flag.is_neutral(value):
            parser.error(f"{shown}: {self.flag.why}")
        setattr(namespace, self.dest, value)


def add_vllm_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """:data:`VLLM_FLAGS` in their own group, returned for the vLLM flags llm-fleet acts on."""
    group = parser.add_argument_group(
        "vLLM flags (accepted for compatibility)",
        "vLLM's flags, so that a `vllm serve` command line runs: each acts, has no effect here (named in one "
        "line at start) or is refused where it would change answers or memory",
    )
    for flag in VLLM_FLAGS:
        names = list(flag.names)
        if flag.read is None and flag.negatable:
            names.append("--no-" + flag.names[0].removeprefix("--"))
        kind = "no effect" if flag.effect == NO_EFFECT else _refusal_text(flag)
        keywords: dict[str, Any] = {"nargs": 0} if flag.read is None else {"type": flag.read}
        if flag.several:
            keywords["nargs"] = "+"
        if flag.read is not None:
            keywords["metavar"] = "VALUE"
        group.add_argument(
            *names, dest=flag.dest, action=_VLLMFlagAction, flag=flag, help=f"{kind}: {flag.why}", **keywords
        )
    return group


def _refusal_text(flag: VLLMFlag) -> str:
    if flag.read is None or not flag.neutral:
        return "refused"
    return f"refused unless {' or '.join(str(value) for value in flag.neutral)}"


def no_effect_note(args: argparse.Namespace, more: Iterable[str] = ()) -> str | None:
    """The one line that names the vLLM flags given that change nothing here, and why (``more``:
    others the caller found, written as ``--flag value (why)``); None: none given."""
    named = []
    for flag in VLLM_FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.effect != NO_EFFECT or value is None or flag.is_neutral(value):
            continue
        shown = flag.names[0] if flag.read is None else f"{flag.names[0]} {value}"
        if value is False:
            shown = "--no-" + flag.names[0].removeprefix("--")
        named.append(f"{shown} ({flag.why})")
    named += more
    return "vLLM flags with no effect in llm-fleet: " + "; ".join(named) if named else None
