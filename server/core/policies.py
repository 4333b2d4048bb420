"""Policies: the order of the waiting queue, the preemption victim, and when continuous
batching admits new requests. The mechanism (token accounting, blocks) stays in the scheduler.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from llmfleet.server.config import EngineConfig, SchedulingOrder
from llmfleet.server.core.request import Request, RequestStatus


class Ordering:
    """First come, first served. Preempted requests sit at the head of the queue; the victim
    is the request that arrived last."""

    def sort_waiting(self, waiting: deque[Request], now: float) -> None:
        pass  # arrival order, preempted requests already at the head

    def sort_running(self, running: list[Request], now: float) -> None:
        pass  # admission order

    def pick_victim(self, candidates: Sequence[Request], now: float) -> Request | None:
        return max(candidates, key=lambda r: r.arrival_time, default=None)

    def adopt(self, waiting: deque[Request], running: list[Request]) -> None:
        """Put queues another ordering left (a live switch from priority) back in this one's
        order, which it keeps by appending rather than by sorting each step."""
        ordered = sorted(waiting, key=lambda r: (r.status is not RequestStatus.PREEMPTED, r.arrival_time))
        waiting.clear()
        waiting.extend(ordered)
        running.sort(key=lambda r: r.arrival_time)


class PriorityOrdering(Ordering):
    """Score = user priority + age_weight * seconds waited - work_weight * remaining kilotokens.

    Higher scores are served first and preempted last. The age term keeps low-priority
    requests from starving; the work term favours short jobs (shortest-remaining-first).
    Remaining work is the prompt still to compute plus the output still to generate:
    ``num_prompt_tokens - num_computed_tokens + max_tokens`` (a recompute after preemption
    counts its outputs again, since they are part of the uncomputed tokens).
    """

    def __init__(self, age_weight: float, work_weight: float) -> None:
        self.age_weight = age_weight
        self.work_weight = work_weight

    def score(self, request: Request, now: float) -> float:
        return -self._sort_key(now)(request)[0]

    def _sort_key(self, now: float):
        # The score, inlined (this runs over every running request each step); ties go to the earlier arrival.
        age, work = self.age_weight, self.work_weight / 1000.0

        def key(r: Request) -> tuple[float, float]:
            remaining = len(r.prompt_token_ids) - r.num_computed_tokens + r.sampling.max_tokens
            return -(r.priority + age * (now - r.arrival_time) - work * remaining), r.arrival_time

        return key

    def sort_waiting(self, waiting: deque[Request], now: float) -> None:
        if len(waiting) > 1:
            ordered = sorted(waiting, key=self._sort_key(now))
            waiting.clear()
            waiting.extend(ordered)

    def sort_running(self, running: list[Request], now: float) -> None:
        if len(running) > 1:
            running.sort(key=self._sort_key(now))

    def pick_victim(self, candidates: Sequence[Request], now: float) -> Request | None:
        return min(candidates, key=lambda r: (self.score(r, now), -r.arrival_time), default=None)

    def adopt(self, waiting: deque[Request], running: list[Request]) -> None:
        pass  # both are sorted before each use


def make_ordering(config: EngineConfig) -> Ordering:
    if config.scheduling == SchedulingOrder.PRIORITY:
        return PriorityOrdering(config.priority_age_weight, config.priority_work_weight)
    return Ordering()


def window_expired(since: float, now: float, window_ms: float) -> bool:
    """True once ``window_ms`` has passed since ``since`` (with a nanosecond of float slack,
    so a wake-up at exactly the deadline is not held for another round)."""
    return now - since >= window_ms / 1000.0 - 1e-9


def oldest_arrival(waiting: deque[Request]) -> float:
    return min(r.arrival_time for r in waiting)


class AdmissionGate:
    """When continuous batching lets waiting requests join the running set.

    - ``schedule_interval``: join only every N steps (while something runs);
    - ``waiting_served_ratio`` (TGI): join only once waiting/running reaches the ratio, or
      after ``max_waiting_steps`` steps of holding;
    - ``batch_timeout_ms``: hold new prompts until the oldest has waited this long or enough
      wait to fill the free slots, so they prefill together.

    Recomputes of preempted requests are never held, nor is anything after ``flush`` (drain).
    With nothing running, only the coalescing window applies.
    """

    def __init__(self) -> None:
        self.steps_since_admission = 1 << 30

    def admitted(self) -> None:
        self.steps_since_admission = 0

    def held(self) -> None:
        self.steps_since_admission += 1

    def should_admit(
        self,
        cfg: EngineConfig,
        waiting: deque[Request],
        num_running: int,
        now: float,
        *,
        urgent: bool = False,
    ) -> bool:
        """``urgent``: a preempted request waits, or the engine is draining: admit now."""
        free_slots = cfg.max_batch_size - num_running
        if not waiting or free_slots <= 0:
            return False
        if urgent:
            return True
        if num_running:
            waited = self.steps_since_admission + 1
            if waited < cfg.schedule_interval:
                return False
            if (
                cfg.waiting_served_ratio > 0
                and len(waiting) < cfg.waiting_served_ratio * num_running
                and waited < cfg.max_waiting_steps
            ):
                return False
        if cfg.batch_timeout_ms > 0 and len(waiting) < free_slots:
            return window_expired(oldest_arrival(waiting), now, cfg.batch_timeout_ms)
        return True
