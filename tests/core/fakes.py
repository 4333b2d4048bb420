"""A deterministic stand-in for the model runner: the next token is a hash of the request's
tokens so far, so any scheduling bug (wrong positions, lost tokens) changes the output."""

from __future__ import annotations

from llmfleet.server.core.batch import SampledToken, SchedulerOutput


def expected_next(tokens: list[int], vocab: int) -> int:
    h = 1469598103
    for t in tokens:
        h = (h * 1099511 + t + 7) % 2147483647
    return h % vocab


class FakeRunner:
    """Checks every scheduled chunk against block tables and returns hash tokens."""

    def __init__(self, num_kv_blocks=64, kv_block_size=4, max_model_len=4096, vocab=1000, eos=()):
        self.num_kv_blocks = num_kv_blocks
        self.kv_block_size = kv_block_size
        self.max_model_len = max_model_len
        self.vocab = vocab
        self.eos_token_ids = frozenset(eos)
        self.steps: list[SchedulerOutput] = []
        self.batches: list[list[tuple[str, int, int]]] = []  # (request id, start, n) per step
        self.released: list[str] = []

    def execute(self, output: SchedulerOutput) -> list[SampledToken | None]:
        self.batches.append([(s.request.request_id, s.start, s.num_tokens) for s in output.scheduled])
        result: list[SampledToken | None] = []
        for s in output.scheduled:
            r = s.request
            assert s.num_tokens >= 1
            end = s.start + s.num_tokens
            assert end <= r.num_tokens, "scheduled past the known tokens"
            assert len(r.block_table) * self.kv_block_size >= end, "KV slots not allocated"
            result.append(SampledToken(expected_next(r.all_token_ids, self.vocab)) if s.sample else None)
        return result

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def reference_output(prompt: list[int], max_tokens: int, vocab: int = 1000) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        nxt = expected_next(tokens, vocab)
        tokens.append(nxt)
        out.append(nxt)
    return out


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
