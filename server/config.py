"""The engine's knobs: one validated model shared by the engine, the server and the operator.

It imports nothing heavy (no torch), so the operator and the simulator can use it.
Field names are snake_case in config files; camelCase aliases match the InferenceService CRD.
Fields marked ``restart=True`` size memory or load weights and only take effect at start-up;
every other field applies live at the engine's next step.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

__all__ = [
    "EngineConfig",
    "Policy",
    "PrefillMode",
    "Role",
    "SchedulingOrder",
    "ValidationError",
    "file_overrides",
    "load_engine_config",
    "read_engine_file",
]


class Policy(StrEnum):
    STATIC = "static"
    DYNAMIC = "dynamic"
    CONTINUOUS = "continuous"


class PrefillMode(StrEnum):
    MERGED = "merged"  # Orca: new prompts and decodes in one forward
    PREFILL_FIRST = "prefill_first"  # TGI / early vLLM: new prompts run alone, then join
    CHUNKED = "chunked"  # Sarathi-Serve: decodes first, prompt chunks fill the token budget


class SchedulingOrder(StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class Role(StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"


def _restart(description: str) -> dict[str, Any]:
    return {"description": description, "json_schema_extra": {"restart": True}}


# vLLM's --dtype spellings beside the torch names
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


class EngineConfig(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        validate_assignment=True,
        frozen=False,
        allow_inf_nan=False,
    )

    # --- live knobs -------------------------------------------------------------------------
    policy: Policy = Field(Policy.CONTINUOUS, description="static | dynamic | continuous batching.")
    prefill_mode: PrefillMode = Field(
        PrefillMode.CHUNKED, description="How continuous batching mixes prefill into decode."
    )
    scheduling: SchedulingOrder = Field(
        SchedulingOrder.FCFS, description="Waiting-queue order and preemption victim choice."
    )
    max_batch_size: int = Field(32, ge=1, le=4096, description="Max running sequences per step.")
    max_num_batched_tokens: int = Field(
        512, ge=1, le=1 << 20, description="Token budget of one step (prefill chunks + decodes)."
    )
    batch_timeout_ms: float = Field(
        0.0,
        ge=0.0,
        le=60_000.0,
        description="Dynamic batching: launch a partial batch once the oldest request waited this long. "
        "Continuous batching: hold new prompts this long so they prefill together.",
    )
    schedule_interval: int = Field(1, ge=1, le=1000, description="Admit new requests only every N steps.")
    waiting_served_ratio: float = Field(
        0.0, ge=0.0, le=1000.0, description="Admit only once waiting/running reaches this ratio (0: off)."
    )
    max_waiting_steps: int = Field(
        20, ge=1, le=100_000, description="Force admission after this many steps below the ratio."
    )
    max_queue_len: int = Field(1024, ge=1, le=1 << 20, description="Waiting requests beyond this get 429.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of a prompt prefix computed before (vLLM's automatic prefix caching)."
    )
    priority_age_weight: float = Field(1.0, ge=0.0, description="Priority scheduling: score added per second waited.")
    priority_work_weight: float = Field(
        0.0, ge=0.0, description="Priority scheduling: score removed per 1000 tokens of remaining work."
    )

    # --- start-up only ----------------------------------------------------------------------
    kv_block_size: int = Field(16, ge=1, le=1024, **_restart("Tokens per KV block."))
    num_kv_blocks: int | None = Field(
        None, ge=1, **_restart("KV blocks to allocate; None sizes the cache from kv_cache_memory_mb.")
    )
    kv_cache_memory_mb: int = Field(1024, ge=1, **_restart("KV cache size when num_kv_blocks is None."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", **_restart("Weights and KV dtype; auto is bfloat16 where fast, else float32.")
    )
    max_model_len: int | None = Field(
        None, ge=1, **_restart("Context limit; None uses the model's max_position_embeddings.")
    )
    enforce_eager: bool = Field(
        False, **_restart("Run every step eagerly, without CUDA graphs (vLLM's --enforce-eager); no effect on a CPU.")
    )
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = Field(
        "builtin",
        **_restart("What names a cached prefix: builtin (64-bit, fast) or sha256 (no collision in practice)."),
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, **_restart("Ranks that shard each layer's heads and MLP columns.")
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, le=64, **_restart("Pipeline stages the layers are split into, each with its own batch in flight.")
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's ``true`` is no batch size: pydantic would read it as 1."""
        if isinstance(value, bool) and cls.model_fields[info.field_name].annotation is not bool:
            raise ValueError("must be a number, not true/false")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @classmethod
    def restart_fields(cls) -> frozenset[str]:
        return frozenset(
            name
            for name, field in cls.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("restart")
        )

    @classmethod
    def live_fields(cls) -> frozenset[str]:
        return frozenset(cls.model_fields) - cls.restart_fields()

    def changed_fields(self, other: EngineConfig) -> dict[str, tuple[Any, Any]]:
        """Fields whose value differs, as ``{name: (self_value, other_value)}``."""
        return {
            name: (getattr(self, name), getattr(other, name))
            for name in type(self).model_fields
            if getattr(self, name) != getattr(other, name)
        }

    def with_live_changes_from(self, new: EngineConfig) -> tuple[EngineConfig, list[str]]:
        """Take ``new``'s live knobs, keep our start-up fields. Returns the result and the
        restart-only fields that differed (ignored until restart)."""
        changed = self.changed_fields(new)
        ignored = sorted(name for name in changed if name in self.restart_fields())
        live = {name: new_value for name, (_, new_value) in changed.items() if name not in ignored}
        return self.model_copy(update=live), ignored

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_none=True), sort_keys=False)


def load_engine_config(path: str | Path | None, defaults: Mapping[str, Any] | None = None) -> EngineConfig:
    """Read an engine config file (YAML or JSON, snake_case or camelCase keys) over ``defaults``
    (the command line's engine flags): a key the file sets wins, so a live knob the file does
    not set keeps the flag's value through every reload.

    Raises ``ValueError`` with a readable message on a missing, malformed or invalid file.
    """
    data: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if v is not None}
    if path is not None:
        loaded = read_engine_file(path)
        overridden = file_overrides(loaded, data)  # the file's key wins
        data = {k: v for k, v in data.items() if k not in overridden}
        data.update(loaded)
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid engine config: {_short_errors(exc)}") from exc


# An engine config is a screenful of keys; a larger file is refused unread (20 MB of YAML took 16 s
# to parse, and every reload of the watcher would parse it again)
MAX_CONFIG_BYTES = 1 << 20


def config_file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be an engine config file, without reading it: not a regular file (a
    directory, say), or larger than ``MAX_CONFIG_BYTES``; None where it may be one."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        return f"cannot read engine config {path}: {exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"engine config {path} is not a file" + (" (a directory)" if stat.S_ISDIR(st.st_mode) else "")
    if st.st_size > MAX_CONFIG_BYTES:
        return f"engine config {path} has {st.st_size} bytes; at most {MAX_CONFIG_BYTES} are read"
    return None


def read_engine_file(path: str | Path) -> dict[str, Any]:
    """An engine config file's keys, as written. Raises ``ValueError`` on a missing, unreadable,
    oversized or malformed file (or a directory in its place)."""
    problem = config_file_problem(path)
    if problem is not None:
        raise ValueError(problem)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read engine config {path}: {exc}") from exc
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"engine config {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"engine config {path} must be a mapping, got {type(loaded).__name__}")
    return loaded


def file_overrides(loaded: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The fields in ``given`` (the command line's) that the file sets too, whichever its spelling
    (snake_case or camelCase), with the file's value: the file wins, so ``serve`` warns of each."""
    overridden = {}
    for name in given:
        for key in (name, to_camel(name)):
            if key in loaded:
                overridden[name] = loaded[key]
    return overridden


def _short_errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "config"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
