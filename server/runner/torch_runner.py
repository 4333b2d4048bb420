"""The torch model runner: one forward per step over a flattened ragged batch, no padding.

It loads any local HF decoder-only model (Llama, Qwen2, Mistral, ...) with ``from_pretrained``
and ``attn_implementation="llmfleet"`` (attention.py), owns the paged KV cache tensors
(kv_cache.py), and samples (sampler.py). It makes no scheduling decision: the scheduler has
already chosen the tokens and allocated the blocks of every request in the step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.core.kv_wire import KVLayout
from llmfleet.server.core.request import SampledToken, StructuredOutput
from llmfleet.server.runner import attention, cpu_decode, cpu_kernels, model_prep, request_rope
from llmfleet.server.runner.cuda_graphs import DecodeGraphs
from llmfleet.server.runner.grammar_masks import GrammarMasks
from llmfleet.server.runner.host_memory import keep_freed_host_memory
from llmfleet.server.runner.kv_cache import PagedKVCache
from llmfleet.server.runner.model_support import OWN_ATTENTION, check_supported, refused
from llmfleet.server.runner.piecewise_graphs import TOKEN_BUCKETS, PiecewiseGraphs, token_bucket
from llmfleet.server.runner.sampler import Sampler, token_logprobs
from llmfleet.server.runner.step_inputs import StepInputs, build_step_inputs
from llmfleet.server.runner.step_shapes import padded_step_tokens, pads_steps
from llmfleet.server.runner.warm_up import warm_up

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def resolve_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32.

    Without native bf16 (e.g. AVX2-only CPUs) bf16 matmuls are emulated and several times slower
    than float32 (measured on an AVX2 EPYC: 19 vs 140 GFLOP/s)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, attention.KVShape]:
    """``from_pretrained`` with llm-fleet's attention, in eval mode, after a one-token probe: a
    model this runner would serve wrongly is refused (model_support.py) before or after its weights
    load. Also the KV shape its layers hand the attention, which the cache is sized for."""
    attention.register()
    architecture = check_supported(model_dir)  # before any weights load: a refused model goes in a second
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
        ).to(device)
    except KeyError as exc:  # Falcon, GPT-Neo: layers pick their attention class from a table of their own
        if exc.args != (attention.ATTN_IMPLEMENTATION,):
            raise
        raise refused(architecture, OWN_ATTENTION) from exc
    model.eval()
    return model, attention.probe(model, device)


def context_limit(config: EngineConfig, hf_config) -> int:
    """The context a server takes: ``max_model_len``, at most (and by default) the model's (a
    multimodal model's text decoder's)."""
    model_limit = getattr(hf_config.get_text_config(), "max_position_embeddings", None) or 2048
    if config.max_model_len is not None and config.max_model_len > model_limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {model_limit}")
    return config.max_model_len or model_limit


def imported_kv(
    output: SchedulerOutput, layout: KVLayout, dtype: torch.dtype
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """The KV received from a prefill server that this step writes: for each request scheduled
    for the first time with ``kv_import``, its blocks from ``first_block`` on (the ones before are
    shared ones from the prefix cache, already holding their KV) and the payload over them, in
    the payload layout. The tensors read the payload in place."""
    for item in output.scheduled:
        kv = item.request.kv_import
        if kv is None:
            continue
        blocks = item.request.block_table[kv.first_block : layout.num_blocks(kv.num_tokens)]
        if not blocks:  # every block was cached here
            continue
        with warnings.catch_warnings():  # a read-only buffer: read, then copied
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(kv.payload, dtype=torch.uint8)
        yield blocks, data.view(dtype).view(layout.payload_shape(len(blocks)))


class TorchModelRunner:
    def __init__(self, model_dir: str | Path, config: EngineConfig, device: str | None = None, tokenizer=None) -> None:
        """``tokenizer``: the model's HF tokenizer, for structured output (without it, none)."""
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            # cuDNN attention (SDPA's first choice for bf16 on Hopper) builds a plan for each new
            # shape, and nearly every prompt chunk is one: mixed steps ran several times slower
            # until every shape had been seen. Flash and memory-efficient need no plan.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # prompt steps would page-fault their activations in again
            if cpu_kernels.enabled():
                cpu_kernels.built()  # compile the decode-attention kernel now, not in a first decode step
        self.model, kv_shape = load_model(model_dir, self.dtype, self.device)
        fingerprint = model_fingerprint(self.model)  # reads weights that packing releases
        packed = model_prep.prepare(self.model, self.device, self.dtype, config.max_num_batched_tokens)
        self.pad_steps = pads_steps(self.device.type, DTYPE_NAMES[self.dtype], packed)  # oneDNN's per-shape kernels
        hf = self.model.config
        self.num_layers = hf.get_text_config().num_hidden_layers
        self.num_kv_heads, self.head_dim = kv_shape.kv_heads, kv_shape.head_dim
        self.max_model_len = context_limit(config, hf)
        self.longrope_context = request_rope.longrope_context(hf.get_text_config())
        self.longrope_recomputes = request_rope.recomputes_past_context(type(self.model))
        self.kv_block_size = config.kv_block_size
        self.num_kv_blocks = config.num_kv_blocks or max(
            1, config.kv_cache_memory_mb * (1 << 20) // self.kv_bytes_per_block
        )
        # CUDA graphs unless --enforce-eager; LLMFLEET_CUDA_GRAPHS: "1" (default) captured at
        # start-up, "lazy" on each shape's first step (the GPU tests), "0" none
        graphs_mode = os.environ.get("LLMFLEET_CUDA_GRAPHS", "1")
        if self.device.type != "cuda" or config.enforce_eager:
            graphs_mode = "0"
        elif request_rope.installed(model_prep.decoder_of(self.model)):
            log.info("no CUDA graphs: LongRoPE's table is chosen per request, each step anew")
            graphs_mode = "0"
        use_graphs = graphs_mode != "0"
        self.cache = PagedKVCache(
            self.num_layers,
            self.num_kv_blocks + (1 if use_graphs else 0),  # CUDA graphs: one dummy block for padding rows
            self.kv_block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )
        self.graphs = (
            DecodeGraphs(self.model, self.cache, dummy_block=self.num_kv_blocks, max_model_len=self.max_model_len)
            if use_graphs
            else None
        )
        self.piecewise = PiecewiseGraphs(self.model, self.cache, self.graphs.pool) if use_graphs else None
        if use_graphs and graphs_mode != "lazy":
            self._capture_graphs()
        # on a CPU, decode steps through C instead of the modules where the layers are Llama's (cpu_decode.py)
        self.fused_decode = cpu_decode.fused_decode(self.model, self.cache)
        self.eos_token_ids = frozenset(model_eos_ids(self.model))
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        vocab = self.model.get_output_embeddings().weight.shape[0]  # the logits' width
        grammars = None if tokenizer is None else GrammarMasks(tokenizer, vocab, self.eos_token_ids)
        self.sampler = Sampler(self.device, self.eos_token_ids, grammars)
        self.kv_layout = KVLayout(
            fingerprint=fingerprint,
            dtype=DTYPE_NAMES[self.dtype],
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.kv_block_size,
        )
        log.info(
            "loaded %s: %s on %s, %d KV blocks of %d tokens (%.0f MiB)",
            model_dir,
            self.dtype,
            self.device,
            self.num_kv_blocks,
            self.kv_block_size,
            self.num_kv_blocks * self.kv_bytes_per_block / (1 << 20),
        )
        # the step sizes run before serving: a padded CPU runner builds their kernels now
        # (warm_up.py); LLMFLEET_WARM_UP=0 skips it (start-up time over first requests' latency)
        self.warm_sizes: frozenset[int] = frozenset()
        if self.pad_steps and os.environ.get("LLMFLEET_WARM_UP", "1") != "0":
            self.warm_sizes = warm_up(self, self.model, config.max_num_batched_tokens, config.max_batch_size)

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        """Capture every graph shape now, as vLLM does: a capture while serving would stall its step
        and, in CUDA's global capture mode, fail any other thread's CUDA call (a KV export)."""
        started = time.perf_counter()
        count = self.graphs.capture_all()
        for bucket in TOKEN_BUCKETS:
            self.piecewise.captured(bucket)
        log.info(
            "captured CUDA graphs for %d decode shapes and %d token buckets in %.1f s",
            count,
            len(TOKEN_BUCKETS),
            time.perf_counter() - started,
        )

    @property
    def structured_output(self) -> bool:
        return self.sampler.grammars is not None

    @property
    def kv_bytes_per_block(self) -> int:
        return PagedKVCache.bytes_per_block(
            self.num_layers,
            self.kv_block_size,
            self.num_kv_heads,
            self.head_dim,
            torch.empty((), dtype=self.dtype).element_size(),
        )

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def structured_problem(self, structured: StructuredOutput) -> str | None:
        """Why ``structured`` cannot be followed on this model's vocabulary (GrammarMasks.problem)."""
        grammars = self.sampler.grammars
        return "structured output is not available on this runner" if grammars is None else grammars.problem(structured)

    def export_kv(self, block_table: list[int], num_tokens: int) -> memoryview:
        blocks = block_table[: self.kv_layout.num_blocks(num_tokens)]
        return memoryview(self.cache.export_blocks(blocks).view(torch.uint8).numpy()).cast("B")

    def _import_kv(self, output: SchedulerOutput) -> None:
        """Write KV received from a prefill server into the blocks of requests scheduled for the
        first time (the engine drops ``kv_import`` after this step)."""
        for blocks, data in imported_kv(output, self.kv_layout, self.dtype):
            self.cache.import_blocks(blocks, data)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        if not output.scheduled:
            return []
        self._import_kv(output)
        shape = self.graphs.shape_for(output) if self.graphs is not None else None
        if shape is not None:
            logits = self.graphs.run(output, shape)
            return list(self.sampler.sample(logits, [item.request for item in output.scheduled]))
        step = build_step_inputs(output, self.cache, self.device, rope_lengths=self.longrope_context is not None)
        bucket = None if self.piecewise is None else token_bucket(step.input_ids.shape[1], step.logit_rows.shape[0])
        fused = None if self.fused_decode is None else self.fused_decode.logits(step, pad=self.pad_steps)
        if fused is not None:
            logits = fused
        elif bucket is not None:
            logits = self.piecewise.run(step, bucket)
        else:
            ids, positions = padded_inputs(step) if self.pad_steps else (step.input_ids, step.positions)
            logits = attention.model_logits(self.model, ids, positions, step.logit_rows, step.meta)
        return step_results(self.sampler, output, step.sample_index, step.prompt_spans, logits)


def step_results(
    sampler: Sampler,
    output: SchedulerOutput,
    sample_index: list[int],
    prompt_spans: list[tuple[int, int]],
    logits: torch.Tensor,
) -> list[SampledToken | None]:
    """Sample the step's next tokens from its logit rows (the sampled rows first, then the prompt
    rows of ``prompt_spans``), and record the prompt logprobs asked for."""
    result: list[SampledToken | None] = [None] * len(output.scheduled)
    sampled = len(sample_index)
    if sampled:
        requests = [output.scheduled[i].request for i in sample_index]
        for i, token in zip(sample_index, sampler.sample(logits[:sampled], requests), strict=True):
            result[i] = token
    row = sampled
    for i, count in prompt_spans:
        item = output.scheduled[i]
        targets = item.request.prompt_token_ids[item.start + 1 : item.start + 1 + count]
        n = item.request.sampling.prompt_logprobs
        item.prompt_logprobs = token_logprobs(logits[row : row + count], targets, n, ranks=True)
        row += count
    return result


def padded_inputs(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's ids and positions padded to its size in step_shapes.py (rows of token 0 at
    position 0: attention skips them and their logits are never kept)."""
    tokens = step.input_ids.shape[1]
    extra = padded_step_tokens(tokens) - tokens
    if not extra:
        return step.input_ids, step.positions
    pad = torch.nn.functional.pad
    return pad(step.input_ids, (0, extra)), pad(step.positions, (0, extra))


def model_fingerprint(model) -> str:
    """Identifies the weights (and so the meaning of their KV): the architecture's sizes and a
    sample of the embedding and last layers' values. Two servers of the same checkpoint agree,
    whatever path they loaded it from."""
    digest = hashlib.sha256()
    config = model.config.get_text_config()
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
    ):
        digest.update(f"{key}={getattr(config, key, None)};".encode())
    params = list(model.parameters())
    for tensor in (params[0], params[-1]):
        sample = tensor.detach().reshape(-1)[:4096].to("cpu", torch.float32)
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def model_eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, list | tuple) else [eos])
    return ids
