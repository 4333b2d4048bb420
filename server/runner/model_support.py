"""Which HF decoder-only models the runner can serve exactly, so that a model it would serve
wrongly is refused at load with the reason instead.

The runner plugs its paged attention into transformers' attention interface and runs each step
as one flattened batch without HF's cache (attention.py). That is exact for a model whose only
per-sequence state is each layer's keys and values, and whose every layer's attention goes
through that interface. Measured on tiny seeded models of 43 architectures in transformers 5.24
against HF ``generate``, the others crashed or, worse, gave other tokens without an error (Bloom,
XGLM, Jamba, LFM2, RecurrentGemma, Llama 4). The config shows most of them before any weights
load (here); a one-token probe forward after loading shows the rest (``attention.probe``).
"""

from __future__ import annotations

from pathlib import Path

# Entries of a config's `layer_types` the paged attention implements; the MLP kinds say nothing
# about attention. Anything else (linear attention, Mamba, conv, hybrid, chunked, indexed...)
# keeps a state or a mask the runner does not.
SUPPORTED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "sparse", "dense"})


class UnsupportedModel(ValueError):
    """A model the runner cannot serve exactly (a ValueError: the CLIs report it in one line)."""


OWN_ATTENTION = (
    "it computes attention in its own code, not through transformers' attention interface, "
    "where llm-fleet's paged KV cache plugs in"
)


def check_supported(model_dir: str | Path) -> str:
    """The model's architecture name; raises UnsupportedModel, naming the reason, for a model the
    runner would serve wrongly."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    architecture = ", ".join(getattr(config, "architectures", None) or [config.model_type])
    reason = unsupported_reason(config)
    if reason is not None:
        raise refused(architecture, reason)
    return architecture


def refused(architecture: str, reason: str) -> UnsupportedModel:
    return UnsupportedModel(f"{architecture} cannot be served by llm-fleet: {reason}")


def unsupported_reason(config) -> str | None:
    """Why the runner cannot serve a model of ``config`` exactly, or None. A multimodal model's
    config is read for its text decoder, the part that serves text."""
    model_class = causal_lm_class(config)
    config = config.get_text_config()
    other = sorted(set(getattr(config, "layer_types", None) or ()) - SUPPORTED_LAYER_TYPES)
    if other:
        return (
            f"its layer types include {', '.join(other)}: layers other than full or sliding-window attention "
            "(recurrent, state-space, convolution, chunked or sparse), which llm-fleet's paged attention "
            "does not implement"
        )
    if model_class is not None and getattr(model_class, "_is_stateful", False):
        return "its layers keep a recurrent state per sequence, which a paged KV cache does not hold"
    if getattr(config, "kv_lora_rank", None) or _values_differ_in_size(config):
        return "its keys and values differ in size (multi-head latent attention); the KV cache holds one head size"
    if getattr(config, "attention_chunk_size", None):
        return "chunked attention (attention_chunk_size) is not implemented"
    if getattr(config, "attn_temperature_tuning", False):
        return "attn_temperature_tuning reads positions from HF's cache, which llm-fleet's runner does not use"
    if getattr(config, "num_kv_shared_layers", 0):
        return "some layers reuse another layer's keys and values (num_kv_shared_layers)"
    return None


def causal_lm_class(config):
    """The causal LM class transformers loads ``config`` with, or None where it knows none."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, ValueError):  # not a causal LM transformers knows: from_pretrained says so
        return None


def _values_differ_in_size(config) -> bool:
    value_dim = getattr(config, "v_head_dim", None)
    if value_dim is None:
        return False
    return value_dim != (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
