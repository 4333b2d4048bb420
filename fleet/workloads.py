"""Benchmark workloads, defined in code with their parameters (DESIGN §6)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass
class RequestSpec:
    arrival_s: float
    prompt_len: int
    output_len: int


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
            lo, hi = self.output_len
            if self.output_mean is not None:
                n = round(rng.expovariate(1.0 / self.output_mean))
            else:
                n = rng.randint(lo, hi)
            out.append(RequestSpec(t, rng.randint(*self.prompt_len), min(max(n, lo), hi)))
        return out

    def params(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


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
