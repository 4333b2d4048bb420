"""The engine with S batches in flight (pipeline parallelism), on the deterministic fake runner:
every policy's output is what a correct engine gives, no request is in two batches in flight,
the pipeline does fill, each batch keeps to its share of the sequences, and requests whose batch
is in flight are never preempted."""

from __future__ import annotations

import random

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.engine import LLMEngine
from tests.server.core.fakes import FakeRunner, reference_output

POLICIES = {
    "chunked": dict(policy="continuous", prefill_mode="chunked", max_num_batched_tokens=8),
    "merged": dict(policy="continuous", prefill_mode="merged", max_num_batched_tokens=64),
    "prefill-first": dict(policy="continuous", prefill_mode="prefill_first"),
    "static": dict(policy="static"),
    "dynamic": dict(policy="dynamic", batch_timeout_ms=1.0),
    "priority": dict(scheduling="priority", priority_work_weight=10.0, max_num_batched_tokens=16),
}


class PipelinedFakeRunner(FakeRunner):
    """The fake runner behind ``submit``/``collect``: tokens are computed at submit (a request's
    tokens cannot change while its batch is in flight) and handed back in order."""

    def __init__(self, depth: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.pipeline_depth = depth
        self.in_flight: list[set[str]] = []
        self.most_in_flight = 0
        self.largest_batch = 0

    def submit(self, output):
        ids = {item.request.request_id for item in output.scheduled}
        for batch in self.in_flight:
            assert not ids & batch, f"requests {sorted(ids & batch)} are in two batches in flight"
        for request in output.preempted:
            assert not any(request.request_id in batch for batch in self.in_flight), "preempted in flight"
        self.in_flight.append(ids)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.largest_batch = max(self.largest_batch, len(ids))
        return self.execute(output)

    def collect(self, result):
        self.in_flight.pop(0)
        return result


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("depth", [2, 3])
def test_outputs_are_exact_with_batches_in_flight(policy, depth):
    rng = random.Random(depth)
    runner = PipelinedFakeRunner(depth, num_kv_blocks=24, kv_block_size=4)
    config = EngineConfig(max_batch_size=6, pipeline_parallel_size=depth, **POLICIES[policy])
    engine = LLMEngine(config, runner)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 30))] for _ in range(14)]
    limits = [rng.randint(1, 30) for _ in prompts]
    outputs: dict[str, list[int]] = {}
    for step in range(100_000):
        if step < len(prompts):  # one arrival per step
            engine.add_request(str(step), prompts[step], SamplingParams(max_tokens=limits[step]), priority=step % 3)
        elif not engine.has_unfinished_requests():
            break
        else:
            engine.flush()
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)] == reference_output(prompt, limits[i]), f"request {i} under {policy}"
    assert runner.most_in_flight == depth
    if config.policy == "continuous":  # a static or dynamic batch admits its prompts in one step
        assert runner.largest_batch <= -(-config.max_batch_size // depth)
    assert engine.stats().preemptions_total > 0  # 24 blocks cannot hold the load
    assert engine.block_manager.usage == 0


def test_an_abort_while_in_flight_drops_the_result_and_frees_the_blocks():
    runner = PipelinedFakeRunner(2, num_kv_blocks=64)
    engine = LLMEngine(EngineConfig(max_batch_size=4, pipeline_parallel_size=2), runner)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5))
    engine.step()  # a and b's prompts: in flight, nothing back yet
    assert engine.batches_in_flight == 1
    engine.abort_request("a")
    events = []
    while engine.has_unfinished_requests():
        events += engine.step()
    tokens = {rid: [t for e in events if e.request_id == rid for t in e.new_token_ids] for rid in ("a", "b")}
    assert tokens["a"] == [] and tokens["b"] == reference_output([4, 5, 6], 5)
    assert [e.finish_reason for e in events if e.request_id == "a"] == ["abort"]
    assert engine.block_manager.usage == 0 and "a" in runner.released
