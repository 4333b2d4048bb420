"""Benchmark workloads, defined in code with their parameters (DESIGN §6)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass
class RequestSpec:
    """One request of a workload or trace. ``blocks``: where a trace says what its prompts share,
    ids naming the prompt's content block by block, ``block_tokens`` tokens each (Mooncake's
    ``hash_ids``): two prompts that open with the same ids open with the same tokens. Empty: the
    prompt shares nothing with any other."""

    arrival_s: float
    prompt_len: int
    output_len: int
    blocks: tuple[int, ...] = ()
    block_tokens: int = 0


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    seed: int = 0
    rate_per_s: float | None = None  # Poisson arrivals; None: all at t=0
    prompt_len: tuple[int, int] = (128, 128)  # uniform inclusive
    output_len: tuple[int, int] = (16, 256)  # uniform inclusive, unless output_mean is set
    output_mean: float | None = None  # exponential with this mean, clipped to output_len
    description: str = ""

    def requests(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        t = 0.0
        out = []
        for _ in range(self.num_requests):
            if self.rate_per_s:
                t += rng.expovariate(self.rate_per_s)
            out.append(_request(rng, t, self.prompt_len, self.output_len, self.output_mean))
        return out

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class PhasedWorkload:
    """Poisson arrivals whose rate steps through ``phases`` of (seconds, requests/s): rate steps
    and spikes, for the tuner. Lengths are drawn as in ``Workload``."""

    name: str
    phases: tuple[tuple[float, float], ...]
    seed: int = 0
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (1, 256)
    output_mean: float | None = 128.0
    description: str = ""

    @property
    def duration_s(self) -> float:
        return sum(seconds for seconds, _ in self.phases)

    def requests(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        out = []
        start = 0.0
        for seconds, rate in self.phases:
            t = start  # arrivals are memoryless: restarting the clock at a phase boundary is exact
            while rate > 0:
                t += rng.expovariate(rate)
                if t >= start + seconds:
                    break
                out.append(_request(rng, t, self.prompt_len, self.output_len, self.output_mean))
            start += seconds
        return out

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _request(
    rng: random.Random, t: float, prompt_len: tuple[int, int], output_len: tuple[int, int], mean: float | None
) -> RequestSpec:
    lo, hi = output_len
    n = round(rng.expovariate(1.0 / mean)) if mean is not None else rng.randint(lo, hi)
    return RequestSpec(t, rng.randint(*prompt_len), min(max(n, lo), hi))


def prompt_tokens(spec: RequestSpec, index: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(hash((seed, index)) & 0xFFFFFFFF)
    return [rng.randrange(10, vocab) for _ in range(spec.prompt_len)]


OFFLINE_32 = Workload(
    "offline-32",
    32,
    prompt_len=(128, 128),
    output_len=(16, 256),
    description="32 requests, 128-token prompts, outputs uniform 16..256, all at t=0",
)


def anyscale_online(rate_per_s: float, num_requests: int, output_cap: int = 256) -> Workload:
    return Workload(
        "anyscale-online",
        num_requests,
        seed=1,
        rate_per_s=rate_per_s,
        prompt_len=(1, 512),
        output_len=(1, output_cap),
        output_mean=128,
        description=f"Poisson {rate_per_s}/s; inputs uniform 1..512; outputs exponential mean 128, cap {output_cap}",
    )


SHAPES = {
    "chat": Workload("chat", 64, seed=2, rate_per_s=2.0, prompt_len=(16, 96), output_len=(8, 64)),
    "long-prompt": Workload("long-prompt", 32, seed=3, rate_per_s=0.5, prompt_len=(768, 1536), output_len=(8, 32)),
    "creative": Workload("creative", 32, seed=4, rate_per_s=0.5, prompt_len=(8, 48), output_len=(128, 384)),
}

BURSTY = PhasedWorkload(
    "bursty",
    phases=((120, 1.0), (90, 3.0), (120, 1.0), (30, 6.0), (150, 1.5), (90, 0.5)),
    seed=5,
    description="anyscale-online lengths; Poisson rate steps 1 -> 3 -> 1 req/s, a 30 s spike to 6, then 1.5 and 0.5",
)
