"""A decode step's decoder layers through C, on a CPU, without the model's modules.

A decode step of a few requests streams every weight of the model from DRAM, a linear at a
time, and each linear's stream evicts what the CPU's caches held: the interpreter's and torch's
code and data that run the norms, the rotary embedding, the residual adds and the module calls
between two linears. On builtin:small (bfloat16, 1 thread, batch 1) they took 4.3-4.6 ms a step
longer with a read of the weights' bytes between them than without (docs/engine.md). So for the
architectures whose layer is Llama's or close to it (Llama, Qwen2, Mistral, Qwen3, Gemma 1-3,
Granite, Phi-3: ``ARCHITECTURES`` says how close) a decode step runs the same C kernels the module
path calls (RMSNorm, the few-row linears, the rotary embedding, the cache write, paged
attention), with the modules' roundings, and nothing else:

- where the few-row linear reads every weight (float32; bfloat16 on CPUs with AVX512-BF16 or
  AMX), all layers in one C call;
- elsewhere (plain linears, more rows than the few-row linear takes) Python runs each linear's
  own forward and one C call between two of them: four a layer.

Left in Python: the embedding, the rotary angles and the LM head, with the scalars and caps
around them. A model takes this path only where every piece is the one the module path runs
(``_refusal``), and at load a decode of two requests must give the module path's logits, or the
modules stay. A step takes it where every request decodes one token; prompt chunks go through
the modules. ``LLMFLEET_FUSED_DECODE=0`` keeps the modules for every step.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import sys

import torch

from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.runner import cpu_kernels, request_rope
from llmfleet.server.runner.attention import DecodeGroup, Scoring, layer_scorings, model_logits
from llmfleet.server.runner.cpu_linear import PackedLinear
from llmfleet.server.runner.fused_mlp import is_torchs_gelu_tanh, kernel_for
from llmfleet.server.runner.fused_norms import FusedRMSNorm, is_gemma_norm
from llmfleet.server.runner.fused_rotary import NAME as ROTARY_NAME
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.model_prep import decoder_of
from llmfleet.server.runner.step_inputs import StepInputs, plan_step
from llmfleet.server.runner.step_shapes import padded_step_tokens

log = logging.getLogger(__name__)

# Architectures whose decoder layer, attention, MLP and model forward are Llama's, read in
# transformers 5.23 and 5.25, give or take what the kernels take: Qwen2's q/k/v biases and window
# per layer, Qwen3's RMSNorm of each query and key head before the rotary embedding; Gemma's
# RMSNorm (times 1 + weight) and GeLU (tanh), Gemma 2's and 3's norms of the attention's and the
# MLP's outputs, Gemma 2's logit caps and Gemma 3's rotary table per layer type; Granite's
# scalars on the embeddings, on each branch before its residual add, and dividing the logits;
# Phi-3's q, k and v in one linear, and its gate and up.
ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # Gemma 3 from 4B on: its text decoder's steps
    "GraniteForCausalLM",
    "Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4 (14B); not Phi-4-mini, whose rotary turns 3/4 of a head
)
_PROBE_PROMPTS = ([11, 12, 13], [21, 22, 23, 24, 25])  # decoded once each at load, both ways


class FusedDecode:
    """Runs the decode steps it takes for one loaded model and its cache (``logits``)."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache) -> None:
        self.library = cpu_kernels.decode_kernels()
        self.inner = _decoder(model)
        self.lm_head = model.lm_head
        config = model.config.get_text_config()
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # Granite's scalars, where its modules read them (None: the model has none)
        self.embedding_multiplier = getattr(self.inner, "embedding_multiplier", None)
        self.logits_scaling = getattr(config, "logits_scaling", None)
        self.dtype = cache.dtype
        layers = self.inner.layers
        first = layers[0]
        keys = cache.keys[0]
        # the rotary tables the layers read: one, or one per layer type (Gemma 3)
        self.rotary_types = _rotary_types(model)
        self.sizes = cpu_kernels.DecodeModel(
            config.hidden_size,
            config.num_attention_heads,
            cache.num_kv_heads,
            first.self_attn.head_dim,
            first.mlp.down_proj.in_features,
            cache.num_blocks,
            cache.block_size,
            keys.stride(0),
            keys.stride(1),
            int(cache.dtype == torch.bfloat16),
            gemma_norms=int(is_gemma_norm(first.input_layernorm)),
            gelu_tanh=int(is_torchs_gelu_tanh(_activation(first.mlp))),
            residual_scale=getattr(first, "residual_multiplier", 0.0),
            fused_qkv=int(_slots(first)[1] is None),
            fused_gate_up=int(_slots(first)[5] is None),
        )
        self.linears = [_slots(layer) for layer in layers]
        sizes = self.sizes
        self.qkv_widths = [sizes.heads * sizes.dim, sizes.kv_heads * sizes.dim, sizes.kv_heads * sizes.dim]
        scorings = layer_scorings(model, cache.device)
        # the rows every weight's few-row kernel takes (0: some weight only oneDNN reads), all
        # weights in one packing
        linears = _model_linears(model)
        blocks = {getattr(linear, "small_block", 0) for linear in linears}
        one_packing = len(blocks) == 1
        self.c_rows = min(getattr(linear, "small_rows", 0) for linear in linears) if one_packing else 0
        self.sizes.packed_block = blocks.pop() if one_packing else 0
        self.layers = (cpu_kernels.DecodeLayer * len(layers))(
            *[
                _layer_struct(model, cache, i, scorings[i], self.c_rows > 0, self.rotary_types)
                for i in range(len(layers))
            ]
        )

    def logits(self, step: StepInputs, pad: bool = False) -> torch.Tensor | None:
        """The logits of ``step.logit_rows`` for a step of decodes only; None for any other step.
        ``pad``: oneDNN's linears take the step padded to its size in step_shapes.py, whose kernels
        were built at start-up."""
        meta = step.meta
        rows = meta.slot_mapping.shape[0]
        if meta.prefills or not meta.decode_groups or step.input_ids.shape[1] != rows:
            return None
        hidden = self.inner.embed_tokens(step.input_ids[0])  # (rows, hidden): the residual stream, in place
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        tables = []  # (cos, sin) of each rotary type, kept alive through the C calls
        with request_rope.step_lengths(meta.rope_lengths):
            for layer_type in self.rotary_types:
                cos, sin = self.inner.rotary_emb(hidden, step.positions, *([layer_type] if layer_type else []))
                tables.append((cos[0].contiguous(), sin[0].contiguous()))
        second = tables[-1]
        groups = (cpu_kernels.DecodeGroupArgs * len(meta.decode_groups))(*map(_group_struct, meta.decode_groups))
        args = cpu_kernels.DecodeStep(
            rows,
            tables[0][0].data_ptr(),
            tables[0][1].data_ptr(),
            meta.slot_mapping.data_ptr(),
            groups,
            len(groups),
            torch.get_num_threads(),
            second[0].data_ptr(),
            second[1].data_ptr(),
        )
        if rows <= self.c_rows:
            normed = self._in_c(hidden, args)
        else:
            normed = self._with_linears(hidden, args, padded_step_tokens(rows) if pad else rows)
        logits = self.lm_head(normed[:rows].index_select(0, step.logit_rows))
        if self.logits_scaling is not None:  # Granite's, as its model's forward divides
            logits = logits / self.logits_scaling
        if self.final_softcap:  # Gemma 2's cap on the logits, as its model's forward applies it
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _in_c(self, hidden: torch.Tensor, args) -> torch.Tensor:
        normed = torch.empty_like(hidden)
        norm = self.inner.norm
        status = self.library.llmfleet_decode_layers(
            self.sizes,
            self.layers,
            len(self.layers),
            args,
            hidden.data_ptr(),
            normed.data_ptr(),
            norm.weight.data_ptr(),
            _epsilon(norm),
        )
        if status:
            _raise(status, args)
        return normed

    def _with_linears(self, hidden: torch.Tensor, args, padded: int) -> torch.Tensor:
        """The layers with each linear's own forward over ``padded`` rows (the rows past the
        step's are zeros or stale; no kernel of the C pieces reads them)."""
        lib, sizes = self.library, self.sizes
        rows, size = hidden.shape
        heads_width = sizes.heads * sizes.dim
        normed = torch.zeros((padded, size), dtype=self.dtype)
        attended = torch.zeros((padded, heads_width), dtype=self.dtype)
        q_rot = torch.empty((rows, heads_width), dtype=self.dtype)
        k_rot = torch.empty((rows, sizes.kv_heads * sizes.dim), dtype=self.dtype)
        first = self.layers[0]
        lib.llmfleet_add_norm(
            sizes, args, hidden.data_ptr(), None, None, 0.0, first.input_norm, first.input_eps, normed.data_ptr()
        )
        last = len(self.layers) - 1
        for i, (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) in enumerate(self.linears):
            layer = self.layers[i]
            q, k, v = _project(normed, (q_proj, k_proj, v_proj), self.qkv_widths)
            status = lib.llmfleet_decode_attend(
                sizes, layer, args, q.data_ptr(), k.data_ptr(), v.data_ptr(), q_rot.data_ptr(), k_rot.data_ptr(),
                attended.data_ptr()
            )  # fmt: skip
            if status:
                _raise(status, args)
            projected = o_proj.forward(attended)
            lib.llmfleet_add_norm(
                sizes, args, hidden.data_ptr(), projected.data_ptr(), layer.attention_out_norm, layer.attention_out_eps,
                layer.post_norm, layer.post_eps, normed.data_ptr()
            )  # fmt: skip
            gate, up = _project(normed, (gate_proj, up_proj), [sizes.intermediate] * 2)
            lib.llmfleet_gate_times_up(sizes, args, gate.data_ptr(), up.data_ptr())
            projected = down_proj.forward(gate)
            norm, eps = (
                (self.inner.norm.weight.data_ptr(), _epsilon(self.inner.norm))
                if i == last
                else (self.layers[i + 1].input_norm, self.layers[i + 1].input_eps)
            )
            lib.llmfleet_add_norm(
                sizes, args, hidden.data_ptr(), projected.data_ptr(), layer.mlp_out_norm, layer.mlp_out_eps, norm, eps,
                normed.data_ptr()
            )  # fmt: skip
        return normed


def _project(x: torch.Tensor, linears, widths: list[int]) -> list[torch.Tensor]:
    """Each linear's output of ``x``; where the first is a fused one (the others None) its output
    split into contiguous parts of ``widths``, as the C pieces read them."""
    if linears[1] is None:
        return [part.contiguous() for part in linears[0].forward(x).split(widths, dim=-1)]
    return [linear.forward(x) for linear in linears]


def fused_decode(model: torch.nn.Module, cache: PagedKVCache) -> FusedDecode | None:
    """A ``FusedDecode`` for ``model`` where it takes the model and agrees with its modules on a
    probe; otherwise None: the modules run every step."""
    if os.environ.get("LLMFLEET_FUSED_DECODE", "1") == "0" or cache.device.type != "cpu":
        return None
    reason = _refusal(model, cache)
    if reason is not None:
        log.info("decode steps run through the model's modules: %s", reason)
        return None
    fused = FusedDecode(model, cache)
    if not _agrees(fused, model, cache):
        log.warning("decode steps run through the model's modules: the fused decode disagreed with them on a probe")
        return None
    how = f"every layer in one call for up to {fused.c_rows} requests" if fused.c_rows else "the linears' own forwards"
    log.info("decode steps run through C without the model's modules: %s", how)
    return fused


def _refusal(model: torch.nn.Module, cache: PagedKVCache) -> str | None:
    """Why ``model`` cannot take the fused decode, or None."""
    if type(model).__name__ not in ARCHITECTURES:
        return f"{type(model).__name__} is not among {', '.join(ARCHITECTURES)}"
    if cache.dtype not in (torch.float32, torch.bfloat16) or cpu_kernels.decode_kernels() is None:
        return "no C kernels for this dtype"
    probe_blocks = sum(-(-(len(prompt) + 1) // cache.block_size) for prompt in _PROBE_PROMPTS)
    if cache.num_blocks < probe_blocks:
        return f"its cache has fewer than the {probe_blocks} blocks the probe at load takes"
    inner = _decoder(model)
    if len(cache.layers) != len(inner.layers):
        return "its cache's layers are not its decoder layers"
    norms = [inner.norm, *(norm for layer in inner.layers for norm in _layer_norms(layer) if norm is not None)]
    kinds = {_norm_kind(norm) for norm in norms}
    if len(kinds) != 1 or None in kinds:
        return "its RMSNorms are not all the fused ones, nor all Gemma's"
    if len(_rotary_types(model)) > 2:
        return "its layers read more than two rotary tables"
    if _rotary_widths(model) != {inner.layers[0].self_attn.head_dim}:
        return "its rotary embedding turns part of each head"
    expected_shapes = _expected_shapes(model, cache)
    for layer in inner.layers:
        attention = layer.self_attn
        if not all(
            norm is None or (_norm_kind(norm) in kinds and norm.weight.shape == (attention.head_dim,))
            for norm in _head_norms(attention)
        ):
            return "its query and key norms are not its other RMSNorms' kind over each head"
        if not all(type(linear) in (PackedLinear, torch.nn.Linear) for linear in _layer_linears(layer)):
            return "its linears are not plain or packed linears"
        if _shapes(layer) != expected_shapes:
            return "its linears' sizes are not those of its heads, its cache and its first layer's"
        activation = _activation(layer.mlp)
        if kernel_for(activation) is None:
            return f"its MLP's activation is {type(activation).__name__}, not SiLU or torch's GeLU (tanh)"
        if type(activation) is not type(_activation(inner.layers[0].mlp)):
            return "its MLPs' activations differ"
        rotary = getattr(sys.modules[type(attention).__module__], ROTARY_NAME, None)
        if not getattr(rotary, "llmfleet_fused", False):
            return "its rotary embedding is not the fused one"
        if attention.head_dim != cache.head_dim:
            return "its heads do not match its cache"
    if any(scoring.sinks is not None for scoring in layer_scorings(model, cache.device)):
        return "its attention has sinks"
    return None


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    decoder = decoder_of(model)
    assert decoder is not None  # every architecture the path takes has one
    return decoder


def _layer_norms(
    layer: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module | None, torch.nn.Module, torch.nn.Module | None]:
    """A layer's norms: of its input, of the attention's output before the residual add (None:
    none), of the MLP's input, and of the MLP's output (None: none). Gemma 2 and 3 norm both
    outputs and call the MLP's input norm ``pre_feedforward_layernorm``; Llama norms neither."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return (
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        )
    return layer.input_layernorm, None, layer.post_attention_layernorm, None


def _norm_kind(norm: torch.nn.Module) -> str | None:
    """The kind of RMSNorm ``norm`` is: "llama" (the fused one), "gemma" (times 1 + weight), or None."""
    if isinstance(norm, FusedRMSNorm):
        return "llama"
    return "gemma" if is_gemma_norm(norm) else None


def _epsilon(norm: torch.nn.Module) -> float:
    return norm.variance_epsilon if isinstance(norm, FusedRMSNorm) else norm.eps


def _rotary_types(model: torch.nn.Module) -> tuple[str | None, ...]:
    """The layer types whose rotary tables the layers read, in a fixed order: ``(None,)`` where the
    model has one table (its rotary embedding takes no layer type; Gemma 3's does)."""
    if "layer_type" not in inspect.signature(_decoder(model).rotary_emb.forward).parameters:
        return (None,)
    return tuple(sorted(set(model.config.get_text_config().layer_types)))


def _rotary_widths(model: torch.nn.Module) -> set[int]:
    """How much of each head the rotary tables turn, over all of them: a head's size, or less for
    a partial rotary (Phi-4-mini's 3/4), which the C rotary does not take."""
    inner = _decoder(model)
    anchor = next(inner.parameters())
    x, positions = torch.zeros((1, 1), dtype=anchor.dtype), torch.zeros((1, 1), dtype=torch.long)
    with torch.inference_mode():
        tables = [inner.rotary_emb(x, positions, *([t] if t else [])) for t in _rotary_types(model)]
    return {cos.shape[-1] for cos, _ in tables}


def _head_norms(attention: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The attention's norms of each query and key head (Qwen3's, Gemma 3's), or None where it has none."""
    return getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)


def _slots(layer: torch.nn.Module) -> list[torch.nn.Module | None]:
    """A layer's linears in the C layer's seven places (q, k, v, o, gate, up, down); a fused one
    (Phi-3's qkv_proj, its gate_up_proj) in the first of the places it fills, None in the others."""
    attention, mlp = layer.self_attn, layer.mlp
    if hasattr(attention, "qkv_proj"):
        qkv = [attention.qkv_proj, None, None]
    else:
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
    gate_up = [mlp.gate_up_proj, None] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return [*qkv, attention.o_proj, *gate_up, mlp.down_proj]


def _layer_linears(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [linear for linear in _slots(layer) if linear is not None]


def _shapes(layer: torch.nn.Module) -> list[tuple[int, int] | None]:
    """(in, out) features of each of a layer's seven places; None where a fused linear fills it."""
    return [None if linear is None else (linear.in_features, linear.out_features) for linear in _slots(layer)]


def _expected_shapes(model: torch.nn.Module, cache: PagedKVCache) -> list[tuple[int, int] | None]:
    """The shapes the C layers read their seven places at, from the model's sizes, its cache's and
    its first layer's (fused or not, the MLP's width): a linear of other sizes would have them
    read past a weight."""
    config, first = model.config.get_text_config(), _decoder(model).layers[0]
    slots, hidden, dim = _slots(first), config.hidden_size, cache.head_dim
    inter = slots[6].in_features
    q_width, kv_width = config.num_attention_heads * dim, cache.num_kv_heads * dim
    qkv = (
        [(hidden, q_width + 2 * kv_width), None, None]
        if slots[1] is None
        else [(hidden, q_width), *[(hidden, kv_width)] * 2]
    )
    gate_up = [(hidden, 2 * inter), None] if slots[5] is None else [(hidden, inter)] * 2
    return [*qkv, (q_width, hidden), *gate_up, (inter, hidden)]


def _activation(mlp: torch.nn.Module) -> torch.nn.Module | None:
    """The MLP's activation: ``act_fn`` (Llama's name) or ``activation_fn`` (Phi-3's)."""
    return getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)


def _model_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [linear for layer in _decoder(model).layers for linear in _layer_linears(layer)]


def _layer_struct(
    model: torch.nn.Module, cache: PagedKVCache, index: int, scoring: Scoring, in_c: bool, rotary_types: tuple
):
    """Layer ``index``'s addresses and scoring; its weights only where the few-row linear reads them all."""
    layer = _decoder(model).layers[index]
    linears = _slots(layer)
    weights = [torch.ops.mkldnn.data_ptr(linear.packed) if in_c and linear is not None else None for linear in linears]
    biases = [getattr(linear, "small_bias", None) for linear in linears]
    input_norm, attention_out_norm, mlp_norm, mlp_out_norm = _layer_norms(layer)
    head_norms = _head_norms(layer.self_attn)
    out_norms = (attention_out_norm, mlp_out_norm)
    rotary = 0 if rotary_types == (None,) else rotary_types.index(model.config.get_text_config().layer_types[index])
    return cpu_kernels.DecodeLayer(
        input_norm.weight.data_ptr(),
        mlp_norm.weight.data_ptr(),
        _epsilon(input_norm),
        _epsilon(mlp_norm),
        *weights,
        *[None if bias is None or not in_c else bias.data_ptr() for bias in biases],
        cache.keys[index].data_ptr(),
        cache.values[index].data_ptr(),
        scoring.scale,
        scoring.window or 0,
        *[None if norm is None else norm.weight.data_ptr() for norm in head_norms],
        *[0.0 if norm is None else _epsilon(norm) for norm in head_norms],
        *[None if norm is None else norm.weight.data_ptr() for norm in out_norms],
        *[0.0 if norm is None else _epsilon(norm) for norm in out_norms],
        scoring.softcap or 0.0,
        rotary,
    )


def _group_struct(group: DecodeGroup):
    return cpu_kernels.DecodeGroupArgs(
        group.rows.data_ptr(),
        group.blocks.data_ptr(),
        group.lengths.data_ptr(),
        group.rows.shape[0],
        group.blocks_per_request,
    )


def _raise(status: int, args) -> None:
    if status == -1:
        slots = (ctypes.c_int64 * args.m).from_address(args.slots)
        raise IndexError(f"a cache slot outside the cache: {list(slots)}")
    raise MemoryError("the decode layers could not allocate their scratch")


def _agrees(fused: FusedDecode, model: torch.nn.Module, cache: PagedKVCache) -> bool:
    """Whether a decode of two short requests gives the module path's logits, through each of the
    fused paths this model takes. Writes the first blocks of the cache, which is empty at load."""
    bs = cache.block_size
    needed = [-(-(len(prompt) + 1) // bs) for prompt in _PROBE_PROMPTS]
    requests, first = [], 0
    for i, prompt in enumerate(_PROBE_PROMPTS):
        request = Request(f"probe-{i}", list(prompt), SamplingParams(max_tokens=2, temperature=0))
        request.block_table = list(range(first, first + needed[i]))
        first += needed[i]
        requests.append(request)
    with torch.inference_mode():
        for request in requests:  # each prompt into the cache through the modules
            prefill = SchedulerOutput([ScheduledRequest(request, request.num_prompt_tokens)])
            step = plan_step(prefill, bs, "cpu").to_inputs(cache, cache.device)
            model_logits(model, step.input_ids, step.positions, step.logit_rows, step.meta)
            request.num_computed_tokens = request.num_prompt_tokens
            request.output_token_ids.append(7)
        decode = SchedulerOutput([ScheduledRequest(r, 1) for r in requests])
        step = plan_step(decode, bs, "cpu").to_inputs(cache, cache.device)
        expected = model_logits(model, step.input_ids, step.positions, step.logit_rows, step.meta).float()
        c_rows, results = fused.c_rows, []
        for fused.c_rows in {c_rows, 0}:  # all in C where it can be, and with the linears' forwards
            results.append(fused.logits(step))  # writes the same slots again, with the same keys and values
        fused.c_rows = c_rows
    tolerance = 1e-2 if cache.dtype == torch.bfloat16 else 1e-4
    return all(torch.allclose(got.float(), expected, rtol=tolerance, atol=tolerance) for got in results)
