"""The torch model runner: one forward per step over a flattened ragged batch, no padding.

It loads any local HF decoder-only model (Llama, Qwen2, Mistral, ...) with ``from_pretrained``
and ``attn_implementation="llmfleet"`` (server/runner/attention.py), owns the paged KV cache
tensors, and samples. It makes no scheduling decision.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from ..config import EngineConfig
from ..core.batch import SampledToken, SchedulerOutput
from . import attention
from .attention import PagedKVCache, PrefillSpan, StepMetadata
from .sampler import Sampler

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    # bf16 matmuls are fast only where the CPU has native bf16 (AVX512-BF16 / AMX).
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def _cpu_has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class TorchModelRunner:
    def __init__(self, model_dir: str | Path, config: EngineConfig, device: str | None = None) -> None:
        attention.register()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation=attention.ATTN_IMPLEMENTATION
        ).to(self.device)
        self.model.eval()
        hf = self.model.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        model_limit = getattr(hf, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > model_limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit {model_limit}")
        self.max_model_len = config.max_model_len or model_limit
        self.kv_block_size = config.kv_block_size
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_mb)
        self.cache = PagedKVCache(
            self.num_layers,
            self.num_kv_blocks,
            self.kv_block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            self.device,
        )
        self.eos_token_ids = frozenset(_eos_ids(self.model))
        self.sampler = Sampler(self.device)
        log.info(
            "loaded %s: %s on %s, %d KV blocks of %d tokens",
            model_dir,
            self.dtype,
            self.device,
            self.num_kv_blocks,
            self.kv_block_size,
        )

    def _blocks_for_memory(self, megabytes: int) -> int:
        per_block = PagedKVCache.bytes_per_block(
            self.num_layers,
            self.kv_block_size,
            self.num_kv_heads,
            self.head_dim,
            torch.empty((), dtype=self.dtype).element_size(),
        )
        return max(1, megabytes * (1 << 20) // per_block)

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

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        input_ids, positions, meta, sample_rows, sample_index = self._prepare(output)
        logits = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=sample_rows,
            llmfleet_meta=meta,
        ).logits[0]
        sampling = [output.scheduled[i].request for i in sample_index]
        tokens = self.sampler.sample(logits, sampling) if sampling else []
        result: list[SampledToken | None] = [None] * len(output.scheduled)
        for i, token in zip(sample_index, tokens, strict=True):
            result[i] = token
        return result

    def _prepare(self, output: SchedulerOutput):
        """Flatten the step into token ids, positions, KV slots and attention metadata."""
        bs = self.kv_block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        prefills: list[tuple[int, int, int, list[int]]] = []  # row, n, ctx, slots of ctx
        sample_rows: list[int] = []
        sample_index: list[int] = []
        for i, item in enumerate(output.scheduled):
            request, start, n = item.request, item.start, item.num_tokens
            end = start + n
            row = len(ids)
            ids.extend(request.all_token_ids[start:end])
            pos.extend(range(start, end))
            table = request.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lengths.append(end)
            else:
                prefills.append((row, n, end, [table[p // bs] * bs + p % bs for p in range(end)]))
            if item.sample:
                sample_rows.append(row + n - 1)
                sample_index.append(i)

        dev = self.device
        meta = StepMetadata(
            cache=self.cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_rows=None,
            decode_blocks=None,
            decode_mask=None,
            prefills=[],
        )
        if decode_rows:
            blocks = -(-max(decode_lengths) // bs)
            tables = [t[:blocks] + [0] * (blocks - len(t[:blocks])) for t in decode_tables]
            lengths = torch.tensor(decode_lengths)
            pad = torch.arange(blocks * bs)[None, :] >= lengths[:, None]
            mask = torch.zeros(pad.shape, dtype=self.dtype).masked_fill_(pad, float("-inf"))
            meta.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=dev)
            meta.decode_blocks = torch.tensor(tables, dtype=torch.long).flatten().to(dev)
            meta.decode_mask = mask[None, :, None, :].to(dev)
        for row, n, ctx, ctx_slots in prefills:
            mask = None
            if n > 1:
                q_pos = torch.arange(ctx - n, ctx, device=dev)[:, None]
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos
            meta.prefills.append(PrefillSpan(row, n, torch.tensor(ctx_slots, dtype=torch.long, device=dev), mask))
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        positions = torch.tensor([pos], dtype=torch.long, device=dev)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return input_ids, positions, meta, rows, sample_index


def _eos_ids(model) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, list | tuple) else [eos])
    return ids
