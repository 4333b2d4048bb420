"""Who holds what: the ranks of a T x S layout, each stage's layers and each shard's heads.

Rank 0 is the engine process (no weights); worker ranks follow stage by stage, the T tensor
shards of a stage side by side, as torchrun and vLLM number them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Architectures whose decoder layers take ``inputs_embeds`` unchanged and whose projections are
# named as Llama's: the stages and shards below split them without touching their code.
SPLITTABLE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1

    @property
    def num_workers(self) -> int:
        return self.tensor * self.pipeline

    @property
    def world_size(self) -> int:
        """The engine process and every worker."""
        return 1 + self.num_workers

    def rank(self, stage: int, shard: int) -> int:
        return 1 + stage * self.tensor + shard

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, shard) of a worker rank."""
        return divmod(rank - 1, self.tensor)

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, shard) for shard in range(self.tensor)]

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """The layers of ``stage``: an even split, the first stages taking one more where it is uneven."""
        base, extra = divmod(num_layers, self.pipeline)
        first = stage * base + min(stage, extra)
        return range(first, first + base + (1 if stage < extra else 0))

    def max_stage_layers(self, num_layers: int) -> int:
        return -(-num_layers // self.pipeline)

    def shard_heads(self, num_heads: int, shard: int) -> range:
        per = num_heads // self.tensor
        return range(shard * per, shard * per + per)


def layout_problem(layout: ParallelLayout, hf_config) -> str | None:
    """Why this model cannot be split this way, or None."""
    model_type = getattr(hf_config, "model_type", "?")
    if layout.num_workers > 1 and model_type not in SPLITTABLE_MODEL_TYPES:
        return (
            f"tensor and pipeline parallelism support {', '.join(sorted(SPLITTABLE_MODEL_TYPES))} models; "
            f"this one is {model_type!r}"
        )
    text = hf_config.get_text_config()  # a multimodal model's text decoder, which the layout splits
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    sizes = {
        "attention heads": heads,
        "KV heads": kv_heads,
        "MLP columns (intermediate_size)": text.intermediate_size,
    }
    for what, size in sizes.items():
        if size % layout.tensor:
            return f"tensor parallel size {layout.tensor} does not divide the model's {size} {what}"
    layers = text.num_hidden_layers
    if layout.pipeline > layers:
        return f"pipeline parallel size {layout.pipeline} exceeds the model's {layers} layers"
    return None
