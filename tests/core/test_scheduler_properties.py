"""Properties of the scheduler + block manager + engine loop under random workloads, random
policies and random live config switches, driven by a deterministic fake runner."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmfleet.server.config import EngineConfig, Policy, PrefillMode
from llmfleet.server.core.request import RequestStatus, SamplingParams
from llmfleet.server.engine.engine import LLMEngine

from .fakes import FakeClock, FakeRunner, reference_output

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
    priority_work_weight=st.sampled_from([0.0, 5.0]),
)

requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 999), min_size=1, max_size=14),  # prompt
        st.integers(1, 10),  # max_tokens
        st.integers(0, 12),  # arrival step
        st.integers(0, 3),  # priority
    ),
    min_size=1,
    max_size=10,
)


class Checked:
    """Runs an engine step by step and checks every invariant around each step."""

    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int) -> None:
        self.clock = FakeClock()
        self.runner = FakeRunner(num_kv_blocks=num_blocks, kv_block_size=block_size)
        self.engine = LLMEngine(config, self.runner, clock=self.clock)
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def step(self) -> None:
        engine, sched = self.engine, self.engine.scheduler
        cfg = engine.config
        running_before = len(sched.running)
        oldest_wait_ms = (self.clock() - min(r.arrival_time for r in sched.waiting)) * 1000 if sched.waiting else None
        batches_before = len(self.runner.batches)
        events = engine.step()
        batch = self.runner.batches[-1] if len(self.runner.batches) > batches_before else []

        # budgets
        assert len(batch) <= cfg.max_batch_size
        if cfg.policy == Policy.CONTINUOUS:
            tokens = sum(n for _, _, n in batch)
            if cfg.prefill_mode == PrefillMode.CHUNKED:
                assert tokens <= cfg.max_num_batched_tokens
            else:
                assert tokens <= cfg.max_num_batched_tokens or len(batch) == 1
        assert len({rid for rid, _, _ in batch}) == len(batch), "request scheduled twice in a step"
        # static runs a batch to completion before admitting
        admitted = [rid for rid, start, _ in batch if start == 0]
        if cfg.policy == Policy.STATIC and admitted:
            assert running_before == 0, "static batching admitted while a batch was running"
        # dynamic never holds the oldest request past the window while capacity is free
        if (
            cfg.policy == Policy.DYNAMIC
            and running_before == 0
            and oldest_wait_ms is not None
            and oldest_wait_ms >= cfg.batch_timeout_ms
        ):
            assert batch, "dynamic batching held the oldest request past its window"
        # blocks
        live = [*sched.running, *sched.waiting]
        engine.block_manager.check_consistency(live)
        assert not {id(r) for r in sched.running} & {id(r) for r in sched.waiting}
        for r in sched.waiting:
            assert not r.block_table and r.num_computed_tokens == 0
        for ev in events:
            assert ev.request_id not in self.finished, "event after finish"
            self.outputs.setdefault(ev.request_id, []).extend(ev.new_token_ids)
            if ev.finished:
                self.finished[ev.request_id] = ev.finish_reason
        self.clock.advance(0.001)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=configs,
    workload=requests,
    switches=st.lists(st.tuples(st.integers(0, 40), configs), max_size=4),
    num_blocks=st.integers(8, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
)
def test_no_request_lost_no_block_leaked(config, workload, switches, num_blocks, block_size):
    run = Checked(config, num_blocks, block_size)
    accepted: dict[str, tuple[list[int], int]] = {}
    pending = sorted(enumerate(workload), key=lambda item: item[1][2])
    switch_at = dict(switches)
    step = 0
    while pending or run.engine.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, priority) = pending.pop(0)
            try:
                run.engine.add_request(
                    str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0), priority=priority
                )
                accepted[str(i)] = (prompt, max_tokens)
            except ValueError:
                assert (len(prompt) + max_tokens + block_size - 1) // block_size > num_blocks
        if step in switch_at:
            run.engine.update_config(switch_at[step])
        if step % 17 == 16:
            run.engine.flush()  # a static batch that never fills is launched on drain
        run.step()
        step += 1
        assert step < 3000, "no progress"

    assert set(run.finished) == set(accepted), "a request was lost"
    for rid, (prompt, max_tokens) in accepted.items():
        assert run.outputs[rid] == reference_output(prompt, max_tokens), f"wrong tokens for {rid}"
        assert run.finished[rid] == "length"
    assert run.engine.block_manager.num_free_blocks == num_blocks
    assert sorted(run.runner.released) == sorted(accepted)


@settings(max_examples=60, deadline=None)
@given(
    workload=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8)), min_size=2, max_size=12),
    age_weight=st.sampled_from([0.0, 1.0]),
)
def test_priority_order_respected(workload, age_weight):
    """Whenever requests are admitted, none still waiting has a higher score."""
    clock = FakeClock()
    runner = FakeRunner(num_kv_blocks=200, kv_block_size=4)
    config = EngineConfig(scheduling="priority", max_batch_size=2, priority_age_weight=age_weight)
    engine = LLMEngine(config, runner, clock=clock)
    for i, (priority, max_tokens) in enumerate(workload):
        engine.add_request(str(i), [1, 2, 3], SamplingParams(max_tokens=max_tokens), priority=priority)
        clock.advance(0.01)
    ordering = engine.scheduler._ordering
    while engine.has_unfinished_requests():
        waiting_before = list(engine.scheduler.waiting)
        engine.step()
        admitted = [r for r in waiting_before if r.status != RequestStatus.WAITING]
        still = [r for r in waiting_before if r.status == RequestStatus.WAITING]
        now = clock()
        if admitted and still:
            assert min(ordering.score(r, now) for r in admitted) >= max(ordering.score(r, now) for r in still)
        clock.advance(0.001)
