"""Test doubles for the engine: a deterministic runner and a clock that tests move by hand.

The fake runner's next token is a hash of the request's tokens so far, so any scheduling
bug (wrong positions, lost or repeated tokens, a bad recompute) changes the output, and
``reference_output`` gives what a correct engine must produce. It never emits EOS unless
``eos`` says so. Other test areas may import these.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmfleet.server.core.batch import SchedulerOutput
from llmfleet.server.core.request import SampledToken


def expected_next(tokens: list[int], vocab: int) -> int:
    h = 1469598103
    for t in tokens:
        h = (h * 1099511 + t + 7) % 2147483647
    return h % vocab


def reference_output(prompt: list[int], max_tokens: int, vocab: int = 1000) -> list[int]:
    """The tokens a correct engine generates for ``prompt`` with the fake runner."""
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        nxt = expected_next(tokens, vocab)
        tokens.append(nxt)
        out.append(nxt)
    return out


class FakeRunner:
    """Checks every scheduled chunk against the block tables and returns hash tokens.

    Records, per step, the batch as ``(request id, start position, num tokens)`` and the
    ids preempted in that step."""

    def __init__(
        self,
        num_kv_blocks: int = 64,
        kv_block_size: int = 4,
        max_model_len: int = 4096,
        vocab: int = 1000,
        eos: Iterable[int] = (),
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.kv_block_size = kv_block_size
        self.max_model_len = max_model_len
        self.vocab = vocab
        self.vocab_size = vocab
        self.eos_token_ids = frozenset(eos)
        self.structured_output = False
        self.batches: list[list[tuple[str, int, int]]] = []
        self.preempted: list[list[str]] = []
        self.released: list[str] = []

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        self.batches.append([(s.request.request_id, s.start, s.num_tokens) for s in output.scheduled])
        self.preempted.append([r.request_id for r in output.preempted])
        result: list[SampledToken | None] = []
        for s in output.scheduled:
            r = s.request
            assert s.num_tokens >= 1
            end = s.start + s.num_tokens
            assert end <= r.num_tokens, "scheduled past the known tokens"
            assert len(r.block_table) * self.kv_block_size >= end, "KV slots not allocated"
            assert len(set(r.block_table)) == len(r.block_table), "a block appears twice in one table"
            result.append(SampledToken(expected_next(r.all_token_ids, self.vocab)) if s.sample else None)
        return result

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
