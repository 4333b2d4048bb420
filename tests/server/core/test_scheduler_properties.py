"""Properties of the scheduler + block manager + engine loop under random workloads, random
policies, random live config switches and random aborts, driven by a deterministic fake runner."""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmfleet.server.config import EngineConfig, Policy, PrefillMode
from llmfleet.server.core.request import RequestStatus, SamplingParams
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.engine import LLMEngine
from tests.server.core.fakes import FakeClock, FakeRunner, reference_output

configs = st.builds(
    EngineConfig,
    policy=st.sampled_from(list(Policy)),
    prefill_mode=st.sampled_from(list(PrefillMode)),
    scheduling=st.sampled_from(["fcfs", "priority"]),
    max_batch_size=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    batch_timeout_ms=st.sampled_from([0.0, 2.0, 10.0]),
    schedule_interval=st.integers(1, 3),
    waiting_served_ratio=st.sampled_from([0.0, 0.5, 2.0]),
    max_waiting_steps=st.integers(1, 5),
    priority_age_weight=st.sampled_from([0.0, 1.0, 100.0]),
    priority_work_weight=st.sampled_from([0.0, 5.0]),
)


class Spec(NamedTuple):
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    priority: int
    abort_step: int | None  # abort at this step (if still unfinished)


specs = st.builds(
    Spec,
    prompt=st.lists(st.integers(0, 999), min_size=1, max_size=14),
    max_tokens=st.integers(1, 10),
    arrival_step=st.integers(0, 12),
    priority=st.integers(0, 3),
    abort_step=st.none() | st.integers(0, 40),
)
workloads = st.lists(specs, min_size=1, max_size=12)


class Checked:
    """Runs an engine step by step, checking every invariant around each step."""

    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int) -> None:
        self.clock = FakeClock()
        self.runner = FakeRunner(num_kv_blocks=num_blocks, kv_block_size=block_size)
        self.engine = LLMEngine(config, self.runner, clock=self.clock)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def check_blocks(self) -> None:
        sched = self.engine.scheduler
        self.engine.block_manager.check_consistency([*sched.running, *sched.waiting])
        assert not {id(r) for r in sched.running} & {id(r) for r in sched.waiting}
        for r in sched.waiting:
            assert not r.block_table and r.num_computed_tokens == 0, "a waiting request holds KV"

    def abort(self, request_id: str) -> bool:
        tracked = self.engine._requests.get(request_id)
        aborted = self.engine.abort_request(request_id)
        if aborted:
            assert tracked is not None and not tracked.request.block_table, "abort did not free the blocks at once"
            self.check_blocks()
        return aborted

    def step(self) -> None:
        engine, sched = self.engine, self.engine.scheduler
        cfg = engine.config
        owed_before = {r.request_id: r.num_uncomputed_tokens for r in sched.running}
        oldest_wait_ms = (self.clock() - min(r.arrival_time for r in sched.waiting)) * 1000 if sched.waiting else None
        steps_before = len(self.runner.batches)
        events = engine.step()
        ran = len(self.runner.batches) > steps_before
        batch = self.runner.batches[-1] if ran else []
        preempted = set(self.runner.preempted[-1]) if ran else set()
        ids = [rid for rid, _, _ in batch]

        # budgets
        assert len(batch) <= cfg.max_batch_size
        assert len(set(ids)) == len(ids), "request scheduled twice in a step"
        tokens = sum(n for _, _, n in batch)
        if cfg.policy == Policy.CONTINUOUS:
            if cfg.prefill_mode == PrefillMode.CHUNKED:
                assert tokens <= cfg.max_num_batched_tokens
            else:  # a lone prompt longer than the budget runs whole
                assert tokens <= cfg.max_num_batched_tokens or len(batch) == 1
        assert not preempted & set(ids), "a request ran in the step that preempted it"

        admitted = [rid for rid in ids if rid not in owed_before]
        if cfg.policy != Policy.CONTINUOUS and owed_before:
            # a classic batch runs to completion, every member every step, nobody joins
            assert not admitted, f"{cfg.policy} batching admitted while a batch was running"
            assert set(owed_before) - preempted <= set(ids), "a batch member was skipped"
        prompt_work = admitted or any(n > 1 for _, _, n in batch)
        if cfg.policy == Policy.CONTINUOUS and cfg.prefill_mode != PrefillMode.PREFILL_FIRST and prompt_work:
            # decodes first: prompt tokens only take what the decodes left of the budget
            decodes = {rid for rid, owed in owed_before.items() if owed == 1} - preempted
            assert decodes <= set(ids), "a prompt chunk ran while a decode waited"
        if (
            cfg.policy == Policy.DYNAMIC
            and not owed_before
            and oldest_wait_ms is not None
            and oldest_wait_ms >= cfg.batch_timeout_ms
        ):
            assert batch, "dynamic batching held the oldest request past its window"

        self.check_blocks()
        for ev in events:
            assert ev.request_id not in self.finished, "event after finish"
            self.outputs.setdefault(ev.request_id, []).extend(ev.new_token_ids)
            if ev.finished:
                self.finished[ev.request_id] = ev.finish_reason
                assert ev.metrics.finished_time is not None
        self.clock.advance(0.001)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    workload=workloads,
    switches=st.lists(st.tuples(st.integers(0, 40), configs), max_size=4),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_no_request_lost_no_block_leaked(config, workload, switches, num_blocks, block_size):
    run = Checked(config, num_blocks, block_size)
    accepted: dict[str, Spec] = {}
    aborted: set[str] = set()
    pending = sorted(enumerate(workload), key=lambda item: item[1].arrival_step)
    switch_at = dict(switches)
    step = 0
    while pending or run.engine.has_unfinished_requests():
        while pending and pending[0][1].arrival_step <= step:
            i, spec = pending.pop(0)
            try:
                sampling = SamplingParams(max_tokens=spec.max_tokens, temperature=0)
                run.engine.add_request(str(i), spec.prompt, sampling, priority=spec.priority)
                accepted[str(i)] = spec
            except InvalidRequestError as exc:
                needed = (len(spec.prompt) + spec.max_tokens + block_size - 1) // block_size
                assert needed > num_blocks, exc
        for rid, spec in accepted.items():
            if spec.abort_step == step and run.abort(rid):
                aborted.add(rid)
        if step in switch_at:
            run.engine.update_config(switch_at[step])
        if step % 17 == 16:
            run.engine.flush()  # a static batch that never fills is launched on drain
        run.step()
        step += 1
        assert step < 3000, "no progress"

    assert set(run.finished) == set(accepted), "a request was lost"
    for rid, spec in accepted.items():
        reference = reference_output(spec.prompt, spec.max_tokens)
        got = run.outputs.get(rid, [])
        if rid in aborted:
            assert run.finished[rid] == "abort" and got == reference[: len(got)], f"wrong tokens for {rid}"
        else:
            assert run.finished[rid] == "length" and got == reference, f"wrong tokens for {rid}"
    assert run.engine.block_manager.num_free_blocks == num_blocks
    assert sorted(run.runner.released) == sorted(accepted), "runner.release not called exactly once each"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    workload=st.lists(
        st.tuples(st.lists(st.integers(0, 999), min_size=1, max_size=20), st.integers(1, 12)), min_size=2, max_size=10
    ),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_tiny_block_budget_preempts_and_completes_everything(config, workload, block_size):
    """The cache holds just the largest request: preemption must recompute, never drop or hang."""
    num_blocks = max((len(p) + m + block_size - 1) // block_size for p, m in workload)
    run = Checked(config, num_blocks, block_size)
    for i, (prompt, max_tokens) in enumerate(workload):
        run.engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0), priority=i % 3)
    run.engine.flush()
    for _ in range(5000):
        if not run.engine.has_unfinished_requests():
            break
        run.step()
    else:
        raise AssertionError("no progress")
    for i, (prompt, max_tokens) in enumerate(workload):
        assert run.outputs[str(i)] == reference_output(prompt, max_tokens)
    assert run.engine.block_manager.num_free_blocks == num_blocks


@settings(max_examples=80, deadline=None)
@given(
    workload=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=2, max_size=12),
    age_weight=st.sampled_from([0.0, 1.0]),
    work_weight=st.sampled_from([0.0, 50.0]),
)
def test_priority_order_respected(workload, age_weight, work_weight):
    """Whenever requests are admitted, none still waiting has a higher score."""
    clock = FakeClock()
    runner = FakeRunner(num_kv_blocks=200, kv_block_size=4)
    config = EngineConfig(
        scheduling="priority", max_batch_size=2, priority_age_weight=age_weight, priority_work_weight=work_weight
    )
    engine = LLMEngine(config, runner, clock=clock)
    for i, (priority, max_tokens) in enumerate(workload):
        engine.add_request(str(i), [1, 2, 3], SamplingParams(max_tokens=max_tokens), priority=priority)
        clock.advance(0.01)
    ordering = engine.scheduler._ordering
    while engine.has_unfinished_requests():
        waiting_before = list(engine.scheduler.waiting)
        now = clock()
        scores = {r.request_id: ordering.score(r, now) for r in waiting_before}
        engine.step()
        admitted = [r.request_id for r in waiting_before if r.status != RequestStatus.WAITING]
        still = [r.request_id for r in waiting_before if r.status == RequestStatus.WAITING]
        if admitted and still:
            assert min(scores[r] for r in admitted) >= max(scores[r] for r in still) - 1e-9
        clock.advance(0.001)
