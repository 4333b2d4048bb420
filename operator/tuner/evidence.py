"""What a pool's own history says against its latency projection: counts that broke the owned
SLO with every knob spent keep the pool above them while the load that broke them lasts, and
counts that held it well within, at no less load, lower the projection's floor. A projection
extrapolates from the pods there are; evidence was measured at the count itself."""

from __future__ import annotations

from dataclasses import replace

from llmfleet.operator.tuner.decision import REPLICAS, PoolInput, TunerConfig
from llmfleet.operator.tuner.decision import num as _num
from llmfleet.operator.tuner.memory import KeyHistory, TunerMemory
from llmfleet.operator.tuner.proposal import Proposal


class Evidence:
    """The replica proposal held against the counts that broke or held."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config

    def above_counts_that_broke(
        self, name: str, pool: PoolInput, proposal: Proposal, mem: TunerMemory, now: float
    ) -> Proposal:
        """The proposal, its latency floor lowered to a count that held this load
        (_below_projection_where_held), then floored one above the most pods at which the owned
        SLO broke with every knob spent (or a busy window projected ITL far past it,
        LatencySizing.busy_itl), within ``break_memory_s`` and at a load level that today's, with
        headroom, still reaches. A projection extrapolates from the pods there are; a break
        measured fewer: long prompts whose steps stall the decodes of a busy minute, which the p95
        at more pods never shows, break a count again at the same load. Levels (requests/s
        smoothed over the scale-down window), not windows, are compared: the minute that broke was
        a busy one, and a quiet one says nothing of the next. Requests, not replica-equivalents: a
        break revises the capacity a replica-equivalent stands for."""
        if proposal.load is None:
            return proposal
        c, cur = self.config, pool.current.replicas
        history = mem.key(name, REPLICAS)
        level = history.follow_load(now, proposal.load, c.scale_down_stabilization_s)
        if proposal.broke:
            history.broke(now, int(cur), level, c.break_memory_s)
        if proposal.held:
            history.held(now, int(cur), proposal.load, c.break_memory_s)
        proposal = self._below_projection_where_held(proposal, history, now, level)
        sized_for = level / (1.0 - c.headroom)
        binding = history.broken_within(now, c.break_memory_s, sized_for)
        if binding is None:
            return proposal
        when, pods, then = binding
        floor = min(pods + 1, int(cur))  # a break at today's count or more keeps today's: fewer break sooner
        if proposal.needed >= floor:
            return proposal
        why = (
            f"; {pods} pods fell short of the SLO {now - when:.0f} s ago at {then:.2f} requests/s, within the "
            f"{sized_for:.2f} today's {level:.2f} is sized for (headroom {c.headroom:g}) -> {floor}"
        )
        return replace(proposal, floor=float(floor), why=proposal.why + why)

    def _below_projection_where_held(
        self, proposal: Proposal, history: KeyHistory, now: float, level: float
    ) -> Proposal:
        """The latency projection's floor, lowered to the fewest pods (not below demand) at which the
        owned SLOs held, well within, over a window measured at that count, within
        ``break_memory_s`` and at a load level no lower than today's: evidence outweighs a
        projection. Also the floor that waits for the window to see the pods after a step down:
        a hold was measured at its own count, not read from a window that held more."""
        if proposal.floor is None or proposal.floor <= proposal.target:
            return proposal
        hold = history.held_within(now, self.config.break_memory_s, level, below=int(proposal.floor))
        if hold is None:
            return proposal
        when, pods, then = hold
        floor = max(float(pods), proposal.target)
        why = (
            f"; but {pods} pods held the SLOs {now - when:.0f} s ago at {then:.2f} requests/s, no less than "
            f"today's {level:.2f} -> {_num(floor)}"
        )
        return replace(proposal, floor=floor, why=proposal.why + why)
