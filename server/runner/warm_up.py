"""Start-up warm-up of a padded CPU runner: every step size it will run, once, before it serves.

oneDNN builds kernels for each new matmul shape on first use (bfloat16 on CPU): 7-50 ms per new
step size for builtin:small, which a fresh server would otherwise pay in its first requests'
steps, just when a scale-up needs it. vLLM warms its sizes before reporting ready for the same
reason (on a GPU this runner captures CUDA graphs instead). Two kinds of shapes matter:

- the step's token count (every layer's weight matmuls): a prompt step of each padded size up to
  the step budget, which covers decode steps too (a step of any kind is at most the budget),
  through one decoder layer of each kind (below);
- the rows the LM head computes, one per sampled request: 1 up to the batch cap. The head alone
  is called for these (a decode step of each batch size would cost a whole forward each).

Between the two, a bfloat16 runner looks for the step sizes at which oneDNN leaves some of its
threads idle, and runs those linears in pieces (linear_splits.py).

The prompt steps write KV into blocks no request holds yet (the block manager allocates nothing
before the engine starts), and their requests are never seen by a scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from llmfleet.server.core.batch import ModelRunner, ScheduledRequest, SchedulerOutput
from llmfleet.server.core.request import Request, SamplingParams
from llmfleet.server.runner import linear_splits
from llmfleet.server.runner.step_shapes import warm_up_sizes, warm_up_tokens

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0)


def warm_up(runner: ModelRunner, model: torch.nn.Module, max_tokens: int, max_seqs: int) -> frozenset[int]:
    """Run a prompt step of each padded size up to ``max_tokens`` (within the KV cache), and
    ``model``'s LM head on each row count up to ``max_seqs``; returns the step sizes run."""
    started = time.perf_counter()
    block_size = runner.kv_block_size
    max_tokens = warm_up_tokens(max_tokens, runner.num_kv_blocks, block_size, runner.max_model_len)
    sizes = warm_up_sizes(max_tokens)
    with _one_layer_of_each_kind(model):
        for size in sizes:
            tokens = min(size, max_tokens)  # the runner pads it to ``size``
            prompt = Request("warm-up", [0] * tokens, _GREEDY)
            prompt.block_table = list(range(-(-tokens // block_size)))
            runner.execute(SchedulerOutput([ScheduledRequest(prompt, tokens)]))
            runner.release(prompt.request_id)
    head = model.get_output_embeddings()
    splits = linear_splits.plan(model, sizes) if linear_splits.enabled(head.weight.dtype) else {}
    for (out_features, in_features), pieces in splits.items():
        log.info(
            "oneDNN leaves threads idle on the %dx%d linears at %s rows: those steps run them in pieces of %s",
            out_features,
            in_features,
            ", ".join(map(str, pieces)),
            ", ".join(map(str, pieces.values())),
        )
    rows = min(max_seqs, max_tokens)  # a step samples at most one row per token
    hidden = torch.zeros(1, rows, head.in_features, dtype=head.weight.dtype, device=head.weight.device)
    with torch.inference_mode():
        for count in range(1, rows + 1):
            head(hidden[:, :count])
    log.info(
        "warmed up %d step sizes (up to %d tokens) and the LM head for up to %d rows in %.1f s",
        len(sizes),
        max_tokens,
        rows,
        time.perf_counter() - started,
    )
    return frozenset(sizes)


@contextmanager
def _one_layer_of_each_kind(model: torch.nn.Module) -> Iterator[None]:
    """The model with one decoder layer of each kind (as its repr shows: the same submodules and
    sizes) in place of all of them. oneDNN keys its kernels by shape, not by weights, so one layer
    builds them for every layer like it, at a fraction of the compute (1/28 for a 28-layer model).
    A model whose layers are not ``model.model.layers`` runs whole."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        yield
        return
    body.layers = torch.nn.ModuleList({repr(layer): layer for layer in layers}.values())
    try:
        yield
    finally:
        body.layers = layers
