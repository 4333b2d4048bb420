"""Built-in models: made locally from a config with seeded random weights and a locally trained
byte-level BPE tokenizer, saved once to a cache directory and then loaded through the ordinary
``from_pretrained`` path, exactly like a user's model. Nothing is downloaded.

Their weights are random, so the text they generate is gibberish: they exist to exercise the
serving stack end to end.
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmfleet.cache import cache_root
from llmfleet.server.core.model_uri import HF_SCHEME, HubModel, hub_reference
from llmfleet.server.runner.hub import fetch

BUILTIN_PREFIX = "builtin:"
# Bump when _build changes what it writes: cached copies made by an older build are remade.
BUILD_VERSION = 3
STAMP_FILE = "llmfleet-builtin.json"
# Special tokens' output rows are shrunk by this factor so that greedy decoding (almost) never
# picks EOS: tests and benchmarks want long generations from random weights.
SPECIAL_TOKEN_LOGIT_SCALE = 0.1

CHAT_TEMPLATE = (  # tools, where a request gives them, go first as real models' templates put them
    "{% if tools %}<|tools|>\n{{ tools | tojson }}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|end|>"]


@dataclass(frozen=True)
class BuiltinSpec:
    architecture: str  # a transformers model_type: llama | qwen2 | mistral | qwen3 | gemma3_text (tests build others)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    init_std: float  # wider than HF's 0.02 so greedy argmax is decided by clear margins
    seed: int
    sliding_window: int | None = None  # mistral/qwen2 only; None: a window wider than the context
    extra_config: tuple[tuple[str, Any], ...] = ()  # more config fields (other architectures, in tests)
    dtype: str = "float32"  # the weights' dtype on disk (a checkpoint's torch_dtype)


BUILTINS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec("llama", 512, 64, 2, 4, 2, 128, 2048, 0.08, 1234),
    "tiny-qwen2": BuiltinSpec("qwen2", 512, 64, 2, 4, 2, 128, 2048, 0.08, 2345),
    "tiny-mistral": BuiltinSpec("mistral", 512, 64, 2, 4, 2, 128, 2048, 0.08, 3456),
    # ~125M parameters, Llama-shaped, for benchmarks
    "small": BuiltinSpec("llama", 8192, 768, 12, 12, 12, 3072, 4096, 0.04, 4567),
    # builtin:small's sizes in Qwen3's layers (a norm on each query and key head) and in Gemma 3's
    # (Gemma's norms, four a layer, GeLU, five sliding-window layers to each full one): for
    # benchmarks of the architectures whose layers differ from Llama's
    "small-qwen3": BuiltinSpec(
        "qwen3", 8192, 768, 12, 12, 12, 3072, 4096, 0.04, 4568, extra_config=(("head_dim", 64),)
    ),
    "small-gemma3": BuiltinSpec(
        "gemma3_text",
        8192,
        768,
        12,
        12,
        12,
        3072,
        4096,
        0.04,
        4569,
        extra_config=(
            ("head_dim", 64),
            ("query_pre_attn_scalar", 64),
            (
                "layer_types",
                ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 5 + ("full_attention",),
            ),
            ("sliding_window", 512),
        ),
    ),
    # Llama-3.2-1B's shape (1.24B parameters, tied embeddings, llama3 RoPE), stored in bfloat16 as
    # Meta ships it: for GPU benchmarks against the hardware's roofline
    "llama-1b": BuiltinSpec(
        "llama",
        128256,
        2048,
        16,
        32,
        8,
        8192,
        131072,
        0.02,
        5678,
        extra_config=(
            ("head_dim", 64),
            ("tie_word_embeddings", True),
            (
                "rope_parameters",
                (
                    ("rope_type", "llama3"),
                    ("rope_theta", 500000.0),
                    ("factor", 32.0),
                    ("low_freq_factor", 1.0),
                    ("high_freq_factor", 4.0),
                    ("original_max_position_embeddings", 8192),
                ),
            ),
        ),
        dtype="bfloat16",
    ),
}


def cache_dir() -> Path:
    return cache_root() / "models"


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def resolve_model(model: str, download_dir: str | Path | None = None) -> Path:
    """Return a local directory for ``model``: a built-in name (made on first use), a local path,
    or a Hub repository (``hf://org/name[@rev]`` or ``org/name``), downloaded into ``download_dir``
    (default: the Hugging Face cache) where it is not there yet."""
    problem = model_problem(model)
    if problem is not None:
        raise (ValueError if is_builtin(model) else FileNotFoundError)(problem)
    if is_builtin(model):
        return ensure_builtin(model[len(BUILTIN_PREFIX) :])
    hub = _hub_model(model)
    if hub is not None:
        return fetch(hub, download_dir)
    return Path(model).expanduser()


def download_if_hub(model: str, download_dir: str | Path | None = None) -> str:
    """The local directory of the Hub model ``model`` names, downloaded where the cache lacks it;
    any other model (a built-in, a path) as it is, made or checked when it loads."""
    hub = None if is_builtin(model) else _hub_model(model)
    return model if hub is None else str(fetch(hub, download_dir))


def model_problem(model: str) -> str | None:
    """Why ``model`` names no model here, or None: checked without making a built-in."""
    if is_builtin(model):
        name = model[len(BUILTIN_PREFIX) :]
        return None if name in BUILTINS else f"unknown built-in model {name!r}; choose one of {sorted(BUILTINS)}"
    if (Path(model).expanduser() / "config.json").is_file():
        return None
    try:
        if _hub_model(model) is not None:
            return None  # whether the Hub has it shows when it is fetched
    except ValueError as exc:
        return str(exc)
    return (
        f"model {model!r} is neither a built-in ({', '.join(BUILTIN_PREFIX + n for n in BUILTINS)}), "
        "a local directory with a config.json, nor a Hugging Face repository (org/name or hf://org/name)"
    )


def _hub_model(model: str) -> HubModel | None:
    """The Hub repository ``model`` names where it is no local directory (ValueError: a bad hf:// one)."""
    if not model.startswith(HF_SCHEME) and Path(model).expanduser().exists():
        return None
    return hub_reference(model)


def ensure_builtin(name: str) -> Path:
    """The cached directory of built-in ``name``, made on first use (or when its spec changed)."""
    problem = model_problem(BUILTIN_PREFIX + name)
    if problem is not None:
        raise ValueError(problem)
    target = cache_dir() / name
    if not _is_current(target, BUILTINS[name]):
        build_model_dir(BUILTINS[name], target)
    return target


def build_model_dir(spec: BuiltinSpec, target: Path) -> Path:
    """Write the model of ``spec`` to ``target`` atomically: built in a private directory next to
    it, then renamed into place, so concurrent first uses never see half a model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-new-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
    stale: Path | None = None
    try:
        _build(spec, staging)
        (staging / STAMP_FILE).write_text(json.dumps(_stamp(spec), indent=1))
        if target.exists() and not _is_current(target, spec):
            # an outdated copy: move it aside first (rename is atomic), delete it afterwards
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            with contextlib.suppress(OSError):  # another process moved or replaced it first
                target.rename(stale / "model")
        try:
            staging.rename(target)
        except OSError:
            if not _is_current(target, spec):  # lost the race to a process that built the same spec
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _stamp(spec: BuiltinSpec) -> dict[str, Any]:
    return json.loads(json.dumps({"build_version": BUILD_VERSION, "spec": asdict(spec)}))  # as read back


def _is_current(directory: Path, spec: BuiltinSpec) -> bool:
    try:
        return json.loads((directory / STAMP_FILE).read_text()) == _stamp(spec)
    except (OSError, ValueError):
        return False


def _build(spec: BuiltinSpec, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = AutoConfig.for_model(
        spec.architecture,
        **_config_kwargs(spec),
        bos_token_id=ids["<|bos|>"],
        eos_token_id=[ids["<|eos|>"], ids["<|end|>"]],
        pad_token_id=ids["<|pad|>"],
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    unit_norm = 0.0 if spec.architecture.startswith("gemma") else 1.0  # Gemma's norms scale by 1 + weight
    with torch.no_grad():
        generator = torch.Generator().manual_seed(spec.seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(unit_norm)
            else:
                param.normal_(0.0, spec.init_std, generator=generator)
        special = [i for token, i in tokenizer.get_vocab().items() if token.startswith("<|")]
        model.get_output_embeddings().weight[special] *= SPECIAL_TOKEN_LOGIT_SCALE
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    model.to(getattr(torch, spec.dtype)).save_pretrained(out)


def _config_kwargs(spec: BuiltinSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    if spec.architecture == "mistral":
        # by default a window as wide as the context: sliding-window attention never applies
        kwargs["sliding_window"] = spec.sliding_window or spec.max_position_embeddings
    if spec.architecture == "qwen2":
        kwargs["use_sliding_window"] = spec.sliding_window is not None
        kwargs["sliding_window"] = spec.sliding_window
        kwargs["max_window_layers"] = 1  # layers from this index on use the window
    return kwargs | {name: _thawed(value) for name, value in spec.extra_config}


def _thawed(value: Any) -> Any:
    """A frozen spec holds a mapping (such as ``rope_parameters``) as (name, value) pairs, and a
    list (such as ``layer_types``) as a tuple."""
    if not isinstance(value, tuple):
        return value
    pairs = value and all(isinstance(v, tuple) and len(v) == 2 for v in value)
    return dict(value) if pairs else list(value)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE trained on a seeded synthetic corpus, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Fill any unused ids so the tokenizer covers the model's whole vocabulary.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<|unused{i}|>" for i in range(missing)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|end|>"],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu", "st"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += [
        "the",
        "a",
        "of",
        "to",
        "and",
        "in",
        "is",
        "it",
        "you",
        "that",
        "he",
        "was",
        "for",
        "on",
        "are",
        "with",
        "as",
        "I",
        "his",
        "they",
        "be",
        "at",
    ]
    out = []
    for _ in range(lines):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        out.append(sentence.capitalize() + rng.choice([".", "!", "?", ",", ";"]) + f" {rng.randint(0, 999)}")
    return out
