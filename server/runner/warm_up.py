"""Start-up warm-up of a padded CPU runner: every step size it will run, once, before it serves.

oneDNN builds kernels for each new matmul shape on first use (bfloat16 on CPU): 7-50 ms per new
step size for builtin:small, which a fresh server would otherwise pay in its first requests'
steps, just when a scale-up needs it. vLLM warms its sizes before reporting ready for the same
reason (on a GPU this runner captures CUDA graphs instead). Two kinds of shapes matter:

- the step's token count (every layer's weight matmuls): each padded size up to the step budget;
- the rows the LM head computes, one per sampled request: 1 up to the batch cap.

The dummy steps write KV into blocks no request holds yet (the block manager allocates nothing
before the engine starts), and their requests are never seen by a scheduler.
"""

from __future__ import annotations

import logging
import time

from ..core.batch import ModelRunner, ScheduledRequest, SchedulerOutput
from ..core.request import Request, SamplingParams
from .step_shapes import prompt_warm_up_sizes, warm_up_limits, warmed_step_sizes

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0)


def warm_up(runner: ModelRunner, max_tokens: int, max_seqs: int) -> frozenset[int]:
    """Run a prompt step of each padded size up to ``max_tokens`` and a decode step of each batch
    size up to ``max_seqs`` (both within the KV cache); returns the step sizes run."""
    started = time.perf_counter()
    block_size = runner.kv_block_size
    max_tokens, seqs = warm_up_limits(max_tokens, max_seqs, runner.num_kv_blocks, block_size, runner.max_model_len)
    sizes = prompt_warm_up_sizes(max_tokens)
    for size in sizes:
        tokens = min(size, max_tokens)  # the runner pads it to ``size``
        prompt = _request("prompt", [0] * tokens, computed=0, blocks=list(range(-(-tokens // block_size))))
        _run(runner, [ScheduledRequest(prompt, tokens)])
    for batch in range(1, seqs + 1):  # one token each at position 1: decodes, one LM-head row each
        decodes = [_request(f"decode-{i}", [0, 0], computed=1, blocks=[i]) for i in range(batch)]
        _run(runner, [ScheduledRequest(r, 1) for r in decodes])
    log.info(
        "warmed up %d step sizes (up to %d tokens) and %d batch sizes in %.1f s",
        len(sizes),
        max_tokens,
        seqs,
        time.perf_counter() - started,
    )
    return warmed_step_sizes(max_tokens, seqs)


def _request(name: str, tokens: list[int], *, computed: int, blocks: list[int]) -> Request:
    request = Request(f"warm-up-{name}", tokens, _GREEDY)
    request.num_computed_tokens = computed
    request.block_table = blocks
    return request


def _run(runner: ModelRunner, scheduled: list[ScheduledRequest]) -> None:
    runner.execute(SchedulerOutput(scheduled))
    for item in scheduled:
        runner.release(item.request.request_id)
