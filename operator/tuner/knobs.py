"""The knob rules: per pool, what each engine knob should be for the SLOs, from one metrics
snapshot. ``maxBatchSize`` follows AIMD against the ITL SLO, ``batchTimeoutMs`` (the prefill
coalescing window) answers TTFT and queue time, and ``maxNumBatchedTokens`` (the step's token
budget) trades between the two, each in its own module (batch_rule.py, window_rule.py,
budget_rule.py). Each rule returns a Proposal; law.py stabilizes and gates it."""

from __future__ import annotations

from llmfleet.operator.tuner.batch_rule import BatchRule
from llmfleet.operator.tuner.budget_rule import BudgetRule
from llmfleet.operator.tuner.decision import MAX_BATCH, POOL_KNOBS, TOKEN_BUDGET, PoolInput, SLOTargets, TunerConfig
from llmfleet.operator.tuner.projection import StepCosts
from llmfleet.operator.tuner.proposal import Proposal
from llmfleet.operator.tuner.window_rule import WindowRule


class KnobRules:
    """The knobs' proposals for one pool and one snapshot; stateless apart from the config."""

    def __init__(self, config: TunerConfig) -> None:
        self.config = config
        self.batch = BatchRule(config)
        self.window = WindowRule(config)
        self.budget = BudgetRule(config)

    def propose(
        self, name: str, pool: PoolInput, slo: SLOTargets, steps: StepCosts | None, lone_step_s: float | None = None
    ) -> dict[str, Proposal]:
        """One proposal per knob the pool has, in the order POOL_KNOBS decides them (the batch
        rule reads the budget's). ``steps``: the step costs at the current knobs, or None;
        ``lone_step_s``: a decode step of one sequence, as the replica rule averages it, or None."""
        proposals: dict[str, Proposal] = {}
        for knob in POOL_KNOBS[name]:
            if knob not in pool.current.knobs:
                continue
            if knob == TOKEN_BUDGET:
                proposals[knob] = self.budget.propose(name, pool, slo, steps)
            elif knob == MAX_BATCH:
                proposals[knob] = self.batch.propose(name, pool, slo, proposals.get(TOKEN_BUDGET), steps, lone_step_s)
            else:
                proposals[knob] = self.window.propose(name, pool, slo)
        return proposals
