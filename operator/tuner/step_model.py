"""A pod's engine step time as a plane in what the step carries, learned while it serves.

``seconds per step = overhead + per_seq x sequences + per_prompt_token x prompt tokens``, where
a step's sequences are its batch (``llmfleet_batch_size``: each decoding sequence adds one token)
and its prompt tokens the rest of its tokens (``vllm:iteration_tokens_total``). The two costs
differ several-fold (a decode token reads its whole context; a prompt token shares the pass with
its neighbours), so one cost per token would misjudge both a prefill-heavy and a decode-heavy
pool. Each tuner run adds one point, the window's means; means keep a plane exact, so every
window is one equation. The plane does not depend on the knobs, so it projects a pod's throughput
at a batch cap or token budget it has not run yet: a decode step of B sequences yields B tokens
in ``overhead + per_seq x B`` seconds, which is why a bigger batch serves more per replica while
steps are overhead-bound.

Points are kept one per band of (sequences, prompt tokens) per step, the newest winning, so the
operating points a pool has been through stay in the fit after the load settles. Windows of one
load level cannot separate the three costs, so the fit is pulled (ridge) towards a prior split
of the points' own mean: the overhead worth ``overhead_seqs`` decoding sequences and a prompt
token ``prompt_token_share`` of one. Points that spread override the prior.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

MAX_POINTS = 24
BAND_RATIO = 1.25  # points whose sequences and prompt tokens per step are within this factor share a band
PRIOR_WEIGHT = 0.1  # the prior counts as this many points
MIN_SPREAD = 1.5  # the most sequences per step over the fewest before the fit is more than the prior


@dataclass(frozen=True)
class StepPlane:
    overhead_s: float
    per_seq_s: float
    per_prompt_token_s: float
    basis: str  # how it was obtained, for reasons
    fewest_seqs: float = 1.0  # the fewest sequences per step its windows saw

    def decode_tokens_per_s(self, batch: float) -> float:
        """Generated tokens/s of back-to-back decode steps of ``batch`` sequences."""
        seqs = max(batch, 1.0)
        return seqs / (self.overhead_s + self.per_seq_s * seqs)

    def prompt_tokens_per_s(self, budget: float) -> float:
        """Prompt tokens/s of back-to-back prefill steps filling a ``budget``-token step."""
        tokens = max(budget, 1.0)
        return tokens / (self.overhead_s + self.per_seq_s + self.per_prompt_token_s * tokens)

    def describe(self) -> str:
        return (
            f"step {self.overhead_s * 1000:.1f} ms + {self.per_seq_s * 1e6:.0f} us/seq + "
            f"{self.per_prompt_token_s * 1e6:.0f} us/prompt token ({self.basis})"
        )


class StepModel(BaseModel):
    """The points behind the plane: (time, mean sequences, mean tokens, mean seconds) per step."""

    points: list[tuple[float, float, float, float]] = Field(default_factory=list)

    def observe(self, at: float, seqs: float, tokens: float, seconds: float) -> None:
        values = (seqs, tokens, seconds)
        if not all(math.isfinite(v) for v in values) or seqs <= 0 or tokens <= 0 or seconds <= 0:
            return
        band = _band(seqs, tokens)
        self.points = [p for p in self.points if _band(p[1], p[2]) != band]
        self.points.append((at, seqs, max(tokens, seqs), seconds))
        self.points.sort(key=lambda p: p[0])
        del self.points[:-MAX_POINTS]

    def plane(self, overhead_seqs: float, prompt_token_share: float) -> StepPlane | None:
        """The fitted plane, or None before any point."""
        if not self.points:
            return None
        rows = [(1.0, seqs, tokens - seqs) for _, seqs, tokens, _ in self.points]
        times = [p[3] for p in self.points]
        n = len(rows)
        mean_seqs = sum(r[1] for r in rows) / n
        mean_prompt = sum(r[2] for r in rows) / n
        mean_time = sum(times) / n
        # the prior: the mean point's time split as overhead_seqs : seqs : prompt tokens x share
        per_seq = mean_time / (overhead_seqs + mean_seqs + prompt_token_share * mean_prompt)
        prior = (overhead_seqs * per_seq, per_seq, prompt_token_share * per_seq)
        scales = (1.0, max(mean_seqs, 1.0), max(mean_prompt, 1.0))  # each cost's typical share of a step
        fitted = _ridge(rows, times, prior, scales, PRIOR_WEIGHT)
        low, high = min(r[1] for r in rows), max(r[1] for r in rows)
        if fitted is None or min(fitted) < 0:
            fitted = prior
        elif high >= MIN_SPREAD * low:
            return StepPlane(*fitted, f"fit over {n} windows, {low:.0f}-{high:.0f} seqs per step", low)
        basis = f"{n} window(s) of {mean_seqs:.0f} seqs + {mean_prompt:.0f} prompt tokens per step, the prior split"
        return StepPlane(*fitted, basis, low)


def _band(seqs: float, tokens: float) -> tuple[int, int]:
    step = math.log(BAND_RATIO)
    return math.floor(math.log(max(seqs, 1.0)) / step), math.floor(math.log(max(tokens - seqs, 0.0) + 1.0) / step)


def _ridge(
    rows: list[tuple[float, float, float]],
    times: list[float],
    prior: tuple[float, float, float],
    scales: tuple[float, float, float],
    weight: float,
) -> tuple[float, float, float] | None:
    """Least squares of ``times`` on ``rows``, pulled towards ``prior`` as ``weight`` extra points
    would (each cost scaled by its typical share); None when the system is singular."""
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    b = [sum(r[i] * t for r, t in zip(rows, times, strict=True)) for i in range(3)]
    for i in range(3):
        a[i][i] += weight * scales[i] ** 2
        b[i] += weight * scales[i] ** 2 * prior[i]
    return _solve3(a, b)


def _solve3(a: list[list[float]], b: list[float]) -> tuple[float, float, float] | None:
    """Gaussian elimination with partial pivoting for a 3x3 system."""
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x[0], x[1], x[2]
