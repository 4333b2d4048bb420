"""The simulator's step-time model: how long one engine step takes, from what the scheduler put in it.

A step's time is linear in a few features of its ``SchedulerOutput`` (the same object the real
runner receives), with non-negative coefficients fitted by ``llm-fleet calibrate`` from
``engine.step()`` timings of the real engine on this machine:

    seconds = intercept + tokens * T + seqs * S + decode_groups * G + kv_read * K
              + prefill_attn * P + prefills * C

- ``intercept``: the floor of a step (one forward call through every layer, the scheduler);
- ``tokens``: the weight matmuls, per token in the step;
- ``seqs``: per request in the step (step inputs, the sampled logits row, sampling, detokenizing);
- ``decode_groups``: decodes are attended per group of similar context length
  (server/runner/step_inputs.py), a fixed number of torch calls per layer and group;
- ``kv_read``: the KV slots decode attention reads, padded to the group's longest context;
- ``prefill_attn``: the query-key pairs of prompt chunks (causal, with their earlier context);
- ``prefills``: per prompt chunk (one SDPA call per layer, the cache gather of a later chunk);
- ``new_shape``: 1 when the engine process has not run a step of this size before. oneDNN
  builds kernels per matmul shape on first use (on a CPU, where the linears are oneDNN's in
  every dtype: server/runner/cpu_linear.py). A CPU runner pads its steps to a few dozen sizes
  (server/runner/step_shapes.py), the size counted
  here, and runs each size up to its first budget before it serves (warm_up.py), so only steps
  beyond it (a budget the tuner grew) pay it. Each simulated pod keeps its own set, warmed up as
  the real one.

The fit is a non-negative least squares on relative error, so every term keeps its physical sign
and short decode steps count as much as long prefills; samples the fit cannot explain at all (a
step slowed down by another process on the machine) are trimmed and counted in the fit report.

Nothing here imports torch: the simulator, the tests and the fit run without it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from llmfleet.cache import cache_root
from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.runner.step_shapes import padded_step_tokens, pads_steps
from llmfleet.sim.paths import write_atomically

FEATURES = ("intercept", "tokens", "seqs", "decode_groups", "kv_read", "prefill_attn", "prefills", "new_shape")
PROFILE_VERSION = 2

# server/runner/step_inputs.py (which imports torch, so it is mirrored here; a runner test checks
# they agree): on a CPU a decode group costs about as much as this many padding blocks, so a new
# group starts only when it saves more; on a GPU every decode goes into one group.
CPU_GROUP_COST_BLOCKS = 16


def decode_group_sizes(contexts: Sequence[int], block_size: int, group_cost: int | None) -> list[tuple[int, int]]:
    """(members, padded context in tokens) of each decode group, as the torch runner forms them:
    sorted longest first, a new group starts where the padding it saves the remaining requests,
    (group's blocks - this request's blocks) x remaining, outweighs ``group_cost`` blocks."""
    if not contexts:
        return []
    ordered = sorted(contexts, reverse=True)
    if group_cost is None:
        return [(len(ordered), -(-ordered[0] // block_size) * block_size)]
    groups: list[list[int]] = [[1, -(-ordered[0] // block_size)]]
    for i, ctx in enumerate(ordered[1:], start=1):
        blocks = -(-ctx // block_size)
        if (groups[-1][1] - blocks) * (len(ordered) - i) > group_cost:
            groups.append([0, blocks])
        groups[-1][0] += 1
    return [(members, blocks * block_size) for members, blocks in groups]


@dataclass(frozen=True)
class StepFeatures:
    """What one step computes: the cost model's inputs."""

    tokens: int  # tokens in the step (prompt chunks and decodes)
    seqs: int  # requests in the step
    decode_groups: int  # groups the decodes are attended in
    kv_read: int  # KV slots the decodes read (each padded to its group's longest context)
    prefill_attn: int  # query-key pairs of the prompt chunks (causal, with their earlier context)
    prefills: int  # prompt chunks (including recomputes)
    new_shape: int = 0  # 1: the first step of this many tokens the engine process runs

    @classmethod
    def of(
        cls,
        output: SchedulerOutput,
        block_size: int = 16,
        group_cost: int | None = CPU_GROUP_COST_BLOCKS,
        seen: set[int] | None = None,
        padded: bool = False,
    ) -> StepFeatures:
        """The features of a step; ``seen``: the step sizes this engine process has run before
        (updated), for ``new_shape``; ``padded``: the runner pads step sizes (step_shapes.py), so
        a size is new when its padded size is."""
        tokens = attn = prefills = 0
        contexts: list[int] = []
        for item in output.scheduled:
            n = item.num_tokens
            start = item.request.num_computed_tokens
            tokens += n
            if n == 1 and start > 0:  # a decode (the runner's own test, step_inputs.py)
                contexts.append(start + 1)
            else:
                prefills += 1
                attn += n * start + n * (n + 1) // 2
        groups = decode_group_sizes(contexts, block_size, group_cost)
        kv = sum(members * padded for members, padded in groups)
        new = 0
        size = padded_step_tokens(tokens) if padded else tokens
        if seen is not None and size not in seen:
            seen.add(size)
            new = 1
        return cls(tokens, len(output.scheduled), len(groups), kv, attn, prefills, new)

    def vector(self) -> list[float]:
        return [1.0, *(float(getattr(self, name)) for name in FEATURES[1:])]


# A fit worse than these makes the simulator wrong: the reference profile has R^2 0.987, a mean
# error of 11% and 19% on its worst kind of step.
MIN_R2 = 0.95
MAX_MEAN_ERROR = 0.2
MAX_KIND_ERROR = 0.3
MAX_TERM_ERROR = 0.5
MIN_TERM_SHARE = 0.05


@dataclass
class FitQuality:
    samples: int  # samples the coefficients were fitted on
    r2: float
    mean_abs_rel_error: float  # mean |predicted - measured| / measured, over the fitted samples
    p90_abs_rel_error: float
    by_kind: dict[str, float] = field(default_factory=dict)  # mean |rel error| per sample kind
    trimmed: int = 0  # samples left out as outliers (e.g. slowed down by another process)
    # per term: its coefficient's standard error over the coefficient, and its share of the mean
    # fitted step (a term that carries little time may be loose without harm)
    by_term: dict[str, dict[str, float]] = field(default_factory=dict)

    def problems(self) -> list[str]:
        """Why this fit would make the simulator wrong, in words; empty for a good fit."""
        out = []
        if self.r2 < MIN_R2:
            out.append(f"R^2 {self.r2:.3f} < {MIN_R2}")
        if self.mean_abs_rel_error > MAX_MEAN_ERROR:
            out.append(f"mean |error| {self.mean_abs_rel_error:.0%} > {MAX_MEAN_ERROR:.0%}")
        out += [
            f"{kind} steps off by {err:.0%} on average (> {MAX_KIND_ERROR:.0%})"
            for kind, err in self.by_kind.items()
            if err > MAX_KIND_ERROR
        ]
        out += [
            f"the {term} term is uncertain: +-{t['rel_error']:.0%} of its value, {t['share']:.0%} of a step"
            for term, t in self.by_term.items()
            if t["share"] >= MIN_TERM_SHARE and t["rel_error"] > MAX_TERM_ERROR
        ]
        return out


@dataclass
class CostModel:
    """A fitted profile: coefficients (seconds per unit of each feature) and the engine it describes."""

    coefficients: dict[str, float]
    model: str = "unknown"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    kv_bytes_per_token: int = 0  # KV cache bytes per token (all layers, K and V)
    max_model_len: int = 2048
    kv_block_size: int = 16  # the block size the profile was measured with (decode groups depend on it)
    quality: FitQuality | None = None
    created: str = ""
    host: str = ""
    version: int = PROFILE_VERSION
    samples: list[dict[str, Any]] = field(default_factory=list)  # the measurements, for refits

    @property
    def pads_steps(self) -> bool:
        """Whether the profiled runner pads its step sizes (and so warms them up at start-up)."""
        return pads_steps(self.device, self.dtype)

    @property
    def group_cost(self) -> int | None:
        return None if self.device.startswith("cuda") else CPU_GROUP_COST_BLOCKS

    def features(
        self, output: SchedulerOutput, block_size: int | None = None, seen: set[int] | None = None
    ) -> StepFeatures:
        return StepFeatures.of(output, block_size or self.kv_block_size, self.group_cost, seen, self.pads_steps)

    def step_seconds(self, features: StepFeatures) -> float:
        c = self.coefficients
        return c.get("intercept", 0.0) + sum(c.get(name, 0.0) * getattr(features, name) for name in FEATURES[1:])

    def slowed(self, factor: float) -> CostModel:
        """This profile on a machine running ``factor`` times slower: every term scaled."""
        return replace(self, coefficients={k: v * factor for k, v in self.coefficients.items()})

    def num_kv_blocks(self, kv_cache_memory_mb: int, block_size: int) -> int:
        """As the torch runner sizes its cache: memory over bytes per block."""
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"profile of {self.model} has no kv_bytes_per_token; set num_kv_blocks")
        return max(1, kv_cache_memory_mb * (1 << 20) // (self.kv_bytes_per_token * block_size))

    def describe(self) -> str:
        c = self.coefficients
        return (
            f"{c.get('intercept', 0) * 1e3:.2f} ms + {c.get('tokens', 0) * 1e6:.1f} us/token"
            f" + {c.get('seqs', 0) * 1e6:.1f} us/seq + {c.get('decode_groups', 0) * 1e6:.0f} us/decode group"
            f" + {c.get('kv_read', 0) * 1e9:.1f} ns/KV slot read + {c.get('prefill_attn', 0) * 1e9:.3f} ns/prefill"
            f" q-k pair + {c.get('prefills', 0) * 1e6:.0f} us/chunk"
            f" + {c.get('new_shape', 0) * 1e3:.1f} ms/new step size"
        )

    # -- files ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        return write_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """A profile from its JSON; every field checked, so a hand-edited file fails here, naming
        the field, not later in a step."""
        if not isinstance(data, dict):
            raise ValueError("a cost profile is a JSON object with coefficients")
        version = data.get("version", 1)
        if version != PROFILE_VERSION:
            raise ValueError(
                f"cost profile version {version} is not {PROFILE_VERSION} (its features changed): "
                "run `llm-fleet calibrate` again"
            )
        coefficients = _coefficients(data.get("coefficients"))
        fields: dict[str, Any] = {k: _text(k, data[k]) for k in _TEXT_FIELDS if k in data}
        fields |= {k: _count(k, data[k]) for k in _COUNT_FIELDS if k in data}
        if "kv_bytes_per_token" not in data:  # no default: a pod could not size its KV cache
            raise ValueError("kv_bytes_per_token is missing (KV cache bytes per token, all layers)")
        if data.get("threads") is not None:
            fields["threads"] = _count("threads", data["threads"])
        return cls(
            coefficients=coefficients,
            quality=_quality(data.get("quality")),
            samples=_samples(data.get("samples", [])),
            **fields,
        )

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read cost profile {path}: {exc}") from exc
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad cost profile {path}: {exc}") from exc


def profile_error(path: str | Path) -> str | None:
    """Why ``path`` holds no cost profile to run on, in one line; None where it loads."""
    try:
        CostModel.load(path)
    except ValueError as exc:
        return str(exc)
    return None


_TEXT_FIELDS = ("model", "device", "dtype", "created", "host")
_COUNT_FIELDS = ("kv_bytes_per_token", "max_model_len", "kv_block_size")


def _text(name: str, value: Any) -> str:
    required = name in ("device", "dtype")  # they decide step padding and decode grouping
    if not isinstance(value, str) or (required and not value):
        raise ValueError(f"{name} must be a{' non-empty' if required else ''} string, got {value!r}")
    return value


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _coefficients(value: Any) -> dict[str, float]:
    if not isinstance(value, dict) or not value or set(value) - set(FEATURES):
        raise ValueError(
            f"cost profile coefficients must be an object, its keys a non-empty subset of {list(FEATURES)}, "
            f"got {value!r}"
        )
    for name, v in value.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0 or not math.isfinite(v):
            raise ValueError(f"cost profile coefficients must be finite and >= 0, got {name}: {v!r}")
    return {name: float(v) for name, v in value.items()}


def _quality(value: Any) -> FitQuality | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"quality must be an object (the fit's report), got {value!r}")
    try:
        return FitQuality(**value)
    except TypeError as exc:
        raise ValueError(f"quality: {exc}") from exc


def _samples(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(s, dict) for s in value):
        raise ValueError("samples must be a list of objects (the measured steps)")
    return value


def default_profile_path(model: str) -> Path:
    """``$LLMFLEET_CACHE/calibration/<model>.json`` (``builtin:small`` -> ``builtin-small.json``)."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", model.strip("/")).strip("-") or "model"
    return cache_root() / "calibration" / f"{name}.json"


# --- fitting -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One measured step (the median of repeated steps of one shape)."""

    features: StepFeatures
    seconds: float
    kind: str = "step"  # decode | prefill | mixed: for the fit report

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self.features), "seconds": self.seconds, "kind": self.kind}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        names = FEATURES[1:]
        values = {k: int(data.get(k, 0)) for k in names}
        return cls(StepFeatures(**values), float(data["seconds"]), data.get("kind", "step"))


def fit(
    samples: Sequence[Sample], features: Iterable[str] = FEATURES, *, trim: float = 4.0
) -> tuple[dict[str, float], FitQuality]:
    """Non-negative least squares of step seconds on the features, weighted by 1/seconds (the fit
    minimises relative error). Then samples whose relative error lies more than ``trim`` robust
    standard deviations (1.4826 x the median absolute deviation, at least 5%) from the median are
    dropped and the fit repeated, twice at most: a step slowed down by another process says
    nothing about the engine. ``trim=0`` keeps every sample."""
    import numpy as np

    names = list(features)
    if len(samples) < len(names):
        raise ValueError(f"need at least {len(names)} samples to fit {names}, got {len(samples)}")
    index = [FEATURES.index(n) for n in names]
    x_all = np.array([[s.features.vector()[i] for i in index] for s in samples], dtype=float)
    y_all = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y_all <= 0) or not np.all(np.isfinite(y_all)):
        raise ValueError("measured step times must be positive and finite")
    keep = np.ones(len(samples), dtype=bool)
    for _round in range(3):
        x, y = x_all[keep], y_all[keep]
        w = 1.0 / y
        beta = nnls(x * w[:, None], y * w)
        if trim <= 0 or _round == 2:
            break
        rel_all = (x_all @ beta - y_all) / y_all
        center = np.median(rel_all[keep])
        spread = max(1.4826 * np.median(np.abs(rel_all[keep] - center)), 0.05)
        new_keep = np.abs(rel_all - center) <= trim * spread
        if new_keep.sum() < max(len(names), len(samples) // 2) or np.array_equal(new_keep, keep):
            break
        keep = new_keep
    x, y = x_all[keep], y_all[keep]
    predicted = x @ beta
    rel = np.abs(predicted - y) / y
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum((y - predicted) ** 2)) / total if total > 0 else 1.0
    kinds: dict[str, list[float]] = {}
    for sample, err in zip((s for s, k in zip(samples, keep, strict=True) if k), rel, strict=True):
        kinds.setdefault(sample.kind, []).append(float(err))
    quality = FitQuality(
        samples=int(keep.sum()),
        r2=r2,
        mean_abs_rel_error=float(rel.mean()),
        p90_abs_rel_error=float(np.quantile(rel, 0.9)),
        by_kind={k: sum(v) / len(v) for k, v in sorted(kinds.items())},
        trimmed=int((~keep).sum()),
        by_term=_term_errors(names, x, y, beta),
    )
    return {n: float(b) for n, b in zip(names, beta, strict=True)}, quality


def _term_errors(names: list[str], x, y, beta) -> dict[str, dict[str, float]]:
    """Each fitted term's standard error relative to its coefficient (weighted least squares over
    the terms the fit kept above zero), and its share of the mean fitted step."""
    import numpy as np

    active = [i for i, b in enumerate(beta) if b > 0]
    w = 1.0 / y
    xa = x[:, active] * w[:, None]
    residual = (x @ beta - y) * w
    dof = len(y) - len(active)
    if dof <= 0:
        return {}
    sigma2 = float(residual @ residual) / dof
    try:
        cov = sigma2 * np.linalg.inv(xa.T @ xa)
    except np.linalg.LinAlgError:
        return {}
    mean_step = float((x @ beta).mean())
    out = {}
    for j, i in enumerate(active):
        se = float(np.sqrt(max(cov[j, j], 0.0)))
        share = float((x[:, i] * beta[i]).mean()) / mean_step if mean_step > 0 else 0.0
        out[names[i]] = {"rel_error": se / float(beta[i]), "share": share}
    return out


def nnls(a, b, max_iter: int | None = None):
    """Lawson-Hanson non-negative least squares: argmin ||a x - b|| subject to x >= 0.
    Columns are scaled to unit norm first, so features of very different magnitudes (one per
    step, thousands of q-k pairs) stay well conditioned."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    s = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(s.T @ b).max(initial=0.0)))
    for _ in range(max_iter or 3 * n + 10):
        gradient = s.T @ (b - s @ x)
        candidates = ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(s[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            bad = passive & (z <= 0)
            denominator = x[bad] - z[bad]
            alpha = float(np.min(np.where(denominator > 0, x[bad] / np.where(denominator > 0, denominator, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x / scale
