"""A scheduler by hand for runner-level tests: a trivial block allocator (a shuffled free list,
so block tables are scattered) and explicit per-request chunk sizes, with no dependency on the
real scheduler. Each ``step()`` builds one SchedulerOutput with every active request in it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from tests.server.runner.device import DEVICE


@dataclass
class Plan:
    request: Request
    chunk: int  # prompt tokens per step while prefilling (or recomputing)
    max_tokens: int


class HandScheduler:
    def __init__(self, runner, seed: int = 0) -> None:
        self.runner = runner
        self.bs = runner.kv_block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)
        self.plans: dict[str, Plan] = {}
        self.outputs: dict[str, list[int]] = {}
        self.steps = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int, chunk: int = 1 << 30, **sampling) -> Request:
        params = SamplingParams(max_tokens=max_tokens, **({"temperature": 0.0} | sampling))  # greedy by default
        request = Request(request_id, list(prompt), params)
        self.plans[request_id] = Plan(request, chunk, max_tokens)
        self.outputs[request_id] = []
        return request

    def drop_kv(self, request_id: str) -> None:
        """Forget a request's KV (as preemption does): it recomputes prompt and outputs later."""
        request = self.plans[request_id].request
        self.free.extend(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0

    def step(self) -> SchedulerOutput:
        scheduled = []
        for plan in self.plans.values():
            request = plan.request
            owed = request.num_tokens - request.num_computed_tokens
            n = owed if owed == 1 else min(plan.chunk, owed)
            self._allocate(request, request.num_computed_tokens + n)
            scheduled.append(ScheduledRequest(request, n))
        output = SchedulerOutput(scheduled, step=self.steps)
        tokens = self.runner.execute(output)
        assert len(tokens) == len(scheduled)
        for item, token in zip(scheduled, tokens, strict=True):
            request = item.request
            assert (token is not None) == item.sample
            request.num_computed_tokens += item.num_tokens
            if token is not None:
                request.output_token_ids.append(token.token_id)
                self.outputs[request.request_id].append(token.token_id)
                if request.num_output_tokens == self.plans[request.request_id].max_tokens:
                    self._finish(request)
        self.steps += 1
        return output

    def run(self) -> dict[str, list[int]]:
        while self.plans:
            self.step()
        return self.outputs

    def _allocate(self, request: Request, num_tokens: int) -> None:
        while len(request.block_table) * self.bs < num_tokens:
            request.block_table.append(self.free.pop())

    def _finish(self, request: Request) -> None:
        self.free.extend(request.block_table)
        request.block_table = []
        del self.plans[request.request_id]
        self.runner.release(request.request_id)


def hf_greedy(model_dir, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """HF ``generate`` on each request alone, float32, greedy: the oracle."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE)
    outputs = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs
