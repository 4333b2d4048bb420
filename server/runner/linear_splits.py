"""Row splits for oneDNN's bfloat16 linears, found at start-up.

oneDNN's brgemm matmul chooses how to spread a call over threads from its shape alone, and for
some bfloat16 shapes it keeps one thread: a prompt step of such a row count then runs that layer
on one core while the runner's other threads wait, in every layer that has the shape
(docs/engine.md, prompt linears on one thread). The same rows in a few calls of fewer rows each
keep every thread at work.

Which row counts suffer depends on the CPU, the thread count and oneDNN's version, so the runner
looks: after the warm-up, each linear shape of the decoder layers runs once at every padded step
size from ``MIN_ROWS`` up (of ``MIN_MACS`` at least: oneDNN keeps small problems on one thread by
design), and where the process's CPU time shows threads left idle, that size runs in the fewest
equal pieces that keep them busy. The rows are independent, and each row's sums are those oneDNN
gives it at the piece's row count, as at any other step size. It is a matter of using the threads
the runner was given, not of timing: a VM's neighbours move a millisecond's call by more than the
effect, and can make two threads no faster than one.

Only bfloat16 with more than one thread is looked at (float32's kernels thread every shape);
``LLMFLEET_ROW_SPLITS=0`` skips it.
"""

from __future__ import annotations

import os
import time

import torch

from llmfleet.server.runner.cpu_linear import PackedLinear

MIN_ROWS = 256  # smaller steps are not looked at: their pieces would be too few rows to fill the tiles
MIN_MACS = 1 << 26  # nor calls of fewer multiply-adds, too short for idle threads to cost much or to read
BUSY = 0.75  # a call that keeps fewer than this share of the threads busy leaves some idle
MAX_PIECES = 4
READS = 3  # a size is idle only if this many reads all say so: a busy machine delays the pool's threads
NAP = 0.012  # seconds: longer than the pool's threads spin after a call before they sleep


def enabled(dtype: torch.dtype) -> bool:
    """Whether a runner in ``dtype`` looks for row splits at start-up."""
    return dtype == torch.bfloat16 and torch.get_num_threads() > 1 and os.environ.get("LLMFLEET_ROW_SPLITS", "1") != "0"


def busy_threads(linear: PackedLinear, x: torch.Tensor) -> float:
    """How many threads ``linear``'s oneDNN call on the rows of ``x`` keeps busy: process CPU
    seconds per wall second, over the call and a nap after it. The call must start with the pool
    asleep (after a nap: the previous probe's). Linux brings a running thread's CPU time up to date
    only when it sleeps or at a scheduler tick, and the pool's threads spin a while after a call
    before they sleep: so a thread that never woke adds nothing, one that worked adds at least
    the call's time, once the nap has put it to sleep. (Threads that never sleep,
    ``OMP_WAIT_POLICY=active``, read busy always: nothing is split.)"""
    wall, cpu = time.perf_counter(), time.process_time()
    linear.onednn(x)
    wall = time.perf_counter() - wall
    time.sleep(NAP)
    return (time.process_time() - cpu) / wall


def plan(model: torch.nn.Module, sizes: list[int]) -> dict[tuple[int, int], dict[int, int]]:
    """Find and set the row splits of ``model``'s bfloat16 packed linears (all but the LM head,
    which runs on sampled rows only) at the step ``sizes``; returns {(out, in): {rows: piece}}."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: dict[tuple[int, int], list[PackedLinear]] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear) and module is not head and module.weight.dtype == torch.bfloat16:
            shapes.setdefault((module.out_features, module.in_features), []).append(module)
    plans = {}
    with torch.inference_mode():
        for shape, linears in shapes.items():
            checked = sorted(size for size in sizes if size >= MIN_ROWS and _macs(linears[0], size) >= MIN_MACS)
            pieces = _plan_shape(linears[0], checked)
            for linear in linears:
                linear.row_pieces = pieces
            if pieces:
                plans[shape] = pieces
    return plans


def _plan_shape(linear: PackedLinear, sizes: list[int]) -> dict[int, int]:
    """{rows: piece} for the ``sizes`` whose one call leaves threads idle: the fewest equal pieces
    (2 to ``MAX_PIECES``) of a size that keeps them busy, and of ``MIN_MACS`` at least."""
    if not sizes:
        return {}
    threads = torch.get_num_threads()
    x = torch.zeros(sizes[-1], linear.in_features, dtype=linear.weight.dtype)
    known: dict[int, bool] = {}
    time.sleep(NAP)  # the pool asleep before the first probe

    def idle(rows: int) -> bool:
        if rows not in known:
            known[rows] = all(busy_threads(linear, x[:rows]) < BUSY * threads for _ in range(READS))
        return known[rows]

    pieces = {}
    for rows in sizes:
        if not idle(rows):
            continue
        for count in range(2, MAX_PIECES + 1):
            piece = -(-rows // count // 16) * 16  # a count-th of the rows, up to a multiple of 16
            if _macs(linear, piece) < MIN_MACS:
                break
            if not idle(piece):
                pieces[rows] = piece
                break
    return pieces


def _macs(linear: PackedLinear, rows: int) -> int:
    return rows * linear.in_features * linear.out_features
