"""What one replica of a pool serves, in tokens/s at given knobs, learned from the snapshots.

Where pods report step times, capacity comes from the step-time plane (step_model.py: overhead
+ per sequence + per prompt token, fitted online, the same at any knobs), projected at the batch
cap and token budget a run leaves: decode steps of B sequences serve B / (overhead + per_seq x
B) tok/s. A queue then proves nothing about capacity (a batching window or a batch cap makes one
too). Elsewhere capacities start from a default guess and follow an EWMA of the observed
throughput per replica whenever a pool is saturated (a queue of at least one request per pod);
the first such measurement replaces the guess outright (a guess can be off several-fold), and
only knobs that held through the window and will hold are measured. Either way a pool
outrunning its estimate raises it at once; without step times, a pool that violates an owned SLO
with its protecting knob at its limit is saturated for latency: its per-pod load becomes the
estimate's upper bound at once (capacity at the SLO, which for short chat or long RAG prompts is
well below raw throughput). Per-pod rates are only measured once the ready pod count has held
for a whole metric window.

A replica is the unit throughout, however many devices it runs on: a tensor- or pipeline-parallel
replica reports its step times and tokens as one server (its leader), so its capacity is learned
as any other's, and only its cost counts its devices (spend.py). The step-time model of such a
replica is the single-device one: it fits what the replica measures, but knows nothing of the
collectives between its ranks, nor of the pipeline's bubbles.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmfleet.operator.tuner.decision import (
    MAX_BATCH,
    TOKEN_BUDGET,
    PoolInput,
    PoolSettings,
    SLOTargets,
    TunerConfig,
    num,
)
from llmfleet.operator.tuner.memory import Capacity, TunerMemory
from llmfleet.operator.tuner.projection import StepCosts
from llmfleet.operator.tuner.proposal import Proposal, exhausted_knobs, owned_latency_ratio, spent


@dataclass(frozen=True)
class PerReplica:
    """Tokens/s one replica of a pool serves at given knobs, and how that was worked out."""

    prompt_tps: float
    generation_tps: float
    basis: str = ""  # the step plane at those knobs; empty for the stored estimate
    steps: StepCosts | None = None  # for the latency projection; None without step times or a batch cap

    def summary(self) -> dict[str, Any]:
        return {
            "promptTokensPerS": round(self.prompt_tps, 1),
            "generationTokensPerS": round(self.generation_tps, 1),
            **({"basis": self.basis} if self.basis else {}),
        }


class CapacityEstimator:
    """Keeps each pool's Capacity (in TunerMemory) up to date and reads it at given knobs."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def update(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        mem: TunerMemory,
        lines: list[str],
        knobs: Mapping[str, Proposal],
    ) -> tuple[Capacity, bool]:
        """Per-replica throughput: EWMA of what a saturated pool does; an unsaturated pool that
        already outruns the estimate raises it at once (its throughput is a lower bound).

        Per-pod rates are the window's throughput over the pods ready now, so they are only
        measured once the ready count has held for a whole window: right after a new pod joins
        they would under-count (the window's tokens came from fewer pods), right after one left,
        over-count. Returns the capacity and whether this snapshot could measure it."""
        c, m = self.config, pool.metrics
        capacity = mem.capacity.setdefault(
            name, Capacity(prompt_tps=c.prefill_capacity_tps, generation_tps=c.decode_capacity_tps)
        )
        pods = m.ready_pods or 0
        if pods <= 0 or (capacity.updated_at is not None and m.at <= capacity.updated_at):
            return capacity, False
        step = (m.mean_batch_size, m.mean_step_tokens, m.mean_step_seconds)
        if all(v is not None for v in step):  # the plane is knob-free: every window counts
            capacity.steps.observe(m.at, *step)  # type: ignore[arg-type]
        if capacity.pods != pods:  # a fresh memory (pods None) assumes the count it first sees has held
            capacity.pods_since = m.at if capacity.pods is not None else None
            capacity.pods_before, capacity.pods = capacity.pods, pods
        held = math.inf if capacity.pods_since is None else m.at - capacity.pods_since
        if held < m.window_s:
            capacity.updated_at = m.at
            lines.append(
                f"{name}: per-replica capacity not measured: {pods} ready pods for {held:.0f} s "
                f"(< the {m.window_s:.0f} s window)"
            )
            return capacity, False
        saturated = self._saturation(name, pool)
        if saturated:
            # A queue can come from a batching window or a batch cap as much as from a pod at its
            # limit: with step times the plane says what a replica serves at the knobs, and a
            # saturated window's throughput only counts as a lower bound, as it does when the
            # window mixes knobs or this run raises them.
            plane = "the step plane gives it" if capacity.steps.points else ""
            past = plane or self._knobs_of_the_past(name, pool, mem, knobs)
            if past:
                lines.append(f"{name}: {saturated}, but not the pool's capacity: {past}")
                saturated = ""  # still a lower bound: an estimate below the throughput rises to it
        before = self.per_replica(name, capacity, pool.current)  # at the knobs the window ran
        load = _load_per_pod(name, pool, before)
        if load is None:
            return capacity, True
        # The first saturated measurement replaces the default guess outright: an EWMA from a
        # guess that may be off several-fold would keep the guess's error for many runs.
        weight = c.capacity_ewma if capacity.measured else 1.0
        factor = (1 - weight) + weight * load if saturated else max(load, 1.0)
        recovered = ""
        ratio = owned_latency_ratio(name, m, slo)
        cut = not saturated and factor <= 1.0 and bool(capacity.steps.points) and capacity.scale < 1.0
        if cut and 0.0 < ratio < c.latency_margin:
            # A capacity cut to the load that once broke an SLO (saturated for latency) would hold
            # the pods it added for good; with the SLOs met by a margin it relaxes towards the step
            # plane, and the projection in scale-down guards the way back.
            factor = 1.0 + c.capacity_ewma * (1.0 / capacity.scale - 1.0)
            recovered = f"owned latency {ratio:.2f}x its SLO (< {c.latency_margin:g}): back towards the step plane"
        self._rescale(name, capacity, factor)
        if saturated and not capacity.measured:
            capacity.measured = True
            saturated += " (first measurement: replaces the default guess)"
        capacity.updated_at = m.at
        after = self.per_replica(name, capacity, pool.current)
        if (after.prompt_tps, after.generation_tps) != (before.prompt_tps, before.generation_tps):
            capacity.observations += 1
            why = saturated or recovered or "throughput above the estimate"
            lines.append(f"{name}: per-replica capacity {self._moved(name, before, after)} ({why})")
        return capacity, True

    def per_replica(self, name: str, capacity: Capacity, settings: PoolSettings) -> PerReplica:
        """Tokens/s one replica serves at ``settings``' knobs: the step plane's throughput at the
        batch cap (generation) and the token budget (prompts), times the measured scale; the
        stored estimate where no step times were reported."""
        c = self.config
        plane = capacity.steps.plane(c.step_overhead_seqs, c.step_prompt_token_share)
        if plane is None:
            return PerReplica(capacity.prompt_tps, capacity.generation_tps)
        batch, budget = settings.knobs.get(MAX_BATCH), settings.knobs.get(TOKEN_BUDGET)
        prompt = capacity.prompt_tps if budget is None else plane.prompt_tokens_per_s(budget) * capacity.scale
        generation = capacity.generation_tps if batch is None else plane.decode_tokens_per_s(batch) * capacity.scale
        at = ", ".join(f"{knob} {num(v)}" for knob, v in ((MAX_BATCH, batch), (TOKEN_BUDGET, budget)) if v is not None)
        scaled = "" if capacity.scale == 1.0 else f" x{capacity.scale:.2f} measured"
        slots = None if batch is None else int(batch)
        scale = capacity.scale
        costs = StepCosts(
            plane.per_seq_s / scale,
            plane.per_prompt_token_s / scale,
            slots,
            budget,
            plane.overhead_s / scale,
            plane.fewest_seqs,
        )
        return PerReplica(prompt, generation, f"at {at}: {plane.describe()}{scaled}", costs)

    def _rescale(self, name: str, capacity: Capacity, factor: float) -> None:
        """Multiply what one replica serves by ``factor``: the step plane's scale, or the estimate."""
        c = self.config
        if capacity.steps.points:
            capacity.scale = min(max(capacity.scale * factor, 0.1), 10.0)
            return
        if name != "decode":
            capacity.prompt_tps = min(
                max(capacity.prompt_tps * factor, c.prefill_capacity_tps / 100), c.prefill_capacity_tps * 100
            )
        if name != "prefill":
            capacity.generation_tps = min(
                max(capacity.generation_tps * factor, c.decode_capacity_tps / 100), c.decode_capacity_tps * 100
            )

    @staticmethod
    def _moved(name: str, before: PerReplica, after: PerReplica) -> str:
        moved = []
        if name != "decode":
            moved.append(f"{before.prompt_tps:.0f} -> {after.prompt_tps:.0f} prompt tok/s")
        if name != "prefill":
            moved.append(f"{before.generation_tps:.0f} -> {after.generation_tps:.0f} generation tok/s")
        return ", ".join(moved)

    def _knobs_of_the_past(self, name: str, pool: PoolInput, mem: TunerMemory, knobs: Mapping[str, Proposal]) -> str:
        """Why a saturated window does not measure the capacity of the knobs to come, or ''.

        The throughput of a saturated pool is its capacity at the batch cap and token budget it
        ran with. When one of them changed within the window, the window mixes two settings; when
        this run raises one (a full batch with ITL to spare, prefill-bound with a budget to
        grow), the pool is about to serve more per replica. Either way, learning that throughput
        as the capacity would add replicas that the new knobs do not need."""
        m = pool.metrics
        for knob in (MAX_BATCH, TOKEN_BUDGET):
            if knob not in pool.current.knobs:
                continue
            history = mem.keys.get(f"{name}/{knob}")
            since = None if history is None or history.last_change_at is None else m.at - history.last_change_at
            if since is not None and since < m.window_s:
                return f"{knob} changed {since:.0f} s ago (< the {m.window_s:.0f} s window)"
            proposal = knobs.get(knob)
            if proposal is not None and proposal.target > pool.current.knobs[knob]:
                return f"{knob} rises this run ({num(pool.current.knobs[knob])} -> {num(proposal.target)})"
        return ""

    def latency_saturation(
        self,
        name: str,
        pool: PoolInput,
        slo: SLOTargets,
        capacity: Capacity,
        knobs: Mapping[str, Proposal],
        lines: list[str],
    ) -> None:
        """A pool that violates an SLO it owns with the knob that protects it at its limit is
        saturated for latency: one replica cannot serve its current share of the traffic within
        the SLO, so that share is an upper bound on the capacity that counts (capacity at the
        SLO, not raw throughput: short-prompt chat or long-prompt RAG can break a TTFT SLO well
        below a pod's token throughput). The estimate drops to it at once, for the next runs
        (this run's replica decision, one more replica, is already made): without that, the
        replica count computed from throughput alone scales back down to the count that broke
        the SLO as soon as the stabilization window allows. It rises again only when pods are
        seen serving more (``update``). Not for ITL over SLO at the minimum batch
        without a queue: that is the step time, not the load."""
        c, m = self.config, pool.metrics
        exhausted = exhausted_knobs(pool, knobs)
        pods = m.ready_pods or 0
        waiting = (m.waiting or 0.0) / max(pods, 1)
        if not exhausted or pods <= 0 or self._saturation(name, pool):
            return  # nothing exhausted, or a queue already made this run's measurement
        if capacity.steps.points:
            return  # step times: the latency projection sizes the pool for latency, throughput stays throughput
        if all(k == MAX_BATCH for k in exhausted) and waiting < c.queue_per_pod:
            return
        before = self.per_replica(name, capacity, pool.current)
        factor = _load_per_pod(name, pool, before)
        if factor is None or factor >= 1.0:
            return  # the estimate already says one replica is full at this load
        self._rescale(name, capacity, factor)
        capacity.observations += 1
        capacity.measured = True
        ratio = owned_latency_ratio(name, m, slo)
        after = self.per_replica(name, capacity, pool.current)
        lines.append(
            f"{name}: per-replica capacity {self._moved(name, before, after)} (saturated for latency: {ratio:.2f}x "
            f"the SLO with {spent(pool, knobs, exhausted)})"
        )

    def _saturation(self, name: str, pool: PoolInput) -> str:
        """Why the pool counts as saturated (its throughput is its capacity), or '' if it does not."""
        c, m = self.config, pool.metrics
        pods = max(m.ready_pods or 1, 1)
        # A full batch without a queue is not saturation: arrivals may just fill it. A queue is.
        if m.waiting is not None and m.waiting / pods >= c.saturation_queue_per_pod:
            return f"saturated: {m.waiting / pods:.1f} waiting per pod"
        return ""


def _load_per_pod(name: str, pool: PoolInput, estimate: PerReplica) -> float | None:
    """What one pod served over the window, in replicas' worth of ``estimate`` (1.0: exactly the
    estimate): prompt and generation shares summed for a colocated pool, the pool's own kind of
    tokens otherwise. None when the pool served none of what it is measured by."""
    m = pool.metrics
    pods = m.ready_pods or 0
    uncached = m.uncached_prompt_tokens_per_s()  # a prefix-cache hit is no work, nor capacity
    prompt = None if uncached is None else uncached / pods
    generation = None if m.generation_tokens_per_s is None else m.generation_tokens_per_s / pods
    if name == "colocated":
        if prompt is None or generation is None or prompt + generation <= 0:
            return None
        return prompt / estimate.prompt_tps + generation / estimate.generation_tps
    observed, per_replica = (
        (prompt, estimate.prompt_tps) if name == "prefill" else (generation, estimate.generation_tps)
    )
    if observed is None or observed <= 0:
        return None
    return observed / per_replica
