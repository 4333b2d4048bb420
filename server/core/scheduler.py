"""The scheduler: which requests run this step, and how many tokens each computes.

One mechanism (vLLM v1 token accounting) serves every policy: a request is owed
``num_tokens - num_computed_tokens`` tokens, and a step hands tokens out under the token
budget (``max_num_batched_tokens``) and the sequence budget (``max_batch_size``).
Policies (server/core/policies.py) only decide *when* waiting requests are admitted, in
which *order*, and *who* is preempted when KV blocks run out.

Static and dynamic batching prefill a batch's whole prompts in one step (classic batching
has no chunking), so that step may exceed the token budget; continuous batching never does,
except that ``merged`` and ``prefill_first`` take a prompt longer than the budget whole when
it is the only one admitted in a step (otherwise it could never run).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

from ..config import EngineConfig, Policy, PrefillMode
from .batch import ScheduledRequest, SchedulerOutput
from .block_manager import BlockManager
from .policies import AdmissionGate, Ordering, make_ordering, window_expired
from .request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions = 0
        self._flushing = False
        self._preempted: list[Request] = []
        self._gate = AdmissionGate()
        self.config = config
        self._ordering: Ordering = make_ordering(config)

    # --- requests -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        self.block_manager.free(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def _chunked(self) -> bool:
        return self.config.policy == Policy.CONTINUOUS and self.config.prefill_mode == PrefillMode.CHUNKED

    # --- config ---------------------------------------------------------------------------------
    def update_config(self, config: EngineConfig) -> None:
        self.config = config
        self._ordering = make_ordering(config)

    def flush(self) -> None:
        """Static/dynamic batching: launch whatever waits as a partial batch (drain)."""
        self._flushing = True

    def next_wakeup(self) -> float | None:
        """When a time-based admission rule could next fire, if nothing can run now."""
        if not self.waiting or self.config.batch_timeout_ms <= 0:
            return None
        if self.config.policy == Policy.STATIC:
            return None
        oldest = min(r.arrival_time for r in self.waiting)
        return oldest + self.config.batch_timeout_ms / 1000.0

    # --- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        self.step_index += 1
        out = SchedulerOutput(step=self.step_index)

        self._ordering.sort_running(self.running, now)
        self._shed_excess_running()

        if cfg.policy == Policy.CONTINUOUS:
            self._schedule_continuous(out, now)
        else:
            self._schedule_batch(out, now)

        out.preempted, self._preempted = self._preempted, []
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        if not self.waiting:
            self._flushing = False
        return out

    # --- static and dynamic ---------------------------------------------------------------------
    def _schedule_batch(self, out: SchedulerOutput, now: float) -> None:
        cfg = self.config
        if not self.running:
            self._ordering.sort_waiting(self.waiting, now)
            ready = len(self.waiting) >= cfg.max_batch_size or self._flushing
            if not ready and self.waiting and cfg.policy == Policy.DYNAMIC:
                oldest = min(r.arrival_time for r in self.waiting)
                ready = window_expired(oldest, now, cfg.batch_timeout_ms)
            if not ready and self.waiting and self.waiting[0].num_preemptions:
                ready = True  # a preempted request never waits for a new batch to form
            if ready:
                self._admit(out, budget=None, limit=cfg.max_batch_size)
                return
        self._schedule_running(out, budget=None)  # a classic batch runs every member each step

    # --- continuous -----------------------------------------------------------------------------
    def _schedule_continuous(self, out: SchedulerOutput, now: float) -> None:
        cfg = self.config
        budget: int | None = cfg.max_num_batched_tokens
        admit = self._gate.should_admit(cfg, self.waiting, self.running, now)
        if admit:
            self._ordering.sort_waiting(self.waiting, now)

        if cfg.prefill_mode == PrefillMode.PREFILL_FIRST and admit:
            # New prompts run alone; running requests wait one step, then decode with them.
            self._admit(out, budget=budget, limit=cfg.max_batch_size - len(self.running))
            if out.scheduled:
                self._gate.admitted()
                return

        budget = self._schedule_running(out, budget)
        if admit and cfg.prefill_mode != PrefillMode.PREFILL_FIRST:
            before = len(out.scheduled)
            self._admit(out, budget=budget, limit=cfg.max_batch_size - len(self.running))
            if len(out.scheduled) > before:
                self._gate.admitted()
                return
        self._gate.held()

    # --- shared mechanism -----------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int | None) -> int | None:
        """Give each running request its owed tokens (all of them, or up to the budget),
        preempting victims when KV blocks run out. Returns the budget left."""
        # The hot loop of every step (hundreds of decodes): plain attribute access, no properties.
        chunked = self._chunked
        block_size = self.block_manager.block_size
        scheduled: set[int] = set()
        running = RequestStatus.RUNNING
        for request in list(self.running):
            if request.status is not running:
                continue  # preempted as a victim earlier in this loop
            computed = request.num_computed_tokens
            owed = len(request.prompt_token_ids) + len(request.output_token_ids) - computed
            if budget is None:
                n = owed
            elif budget <= 0:
                break
            elif chunked:
                n = min(owed, budget)
            elif owed <= budget or not out.scheduled:
                n = owed
            else:
                continue  # whole prompts only; this one runs in a later step
            fits = len(request.block_table) * block_size >= computed + n
            if not fits and not self._reserve(request, n, scheduled):
                continue
            out.scheduled.append(ScheduledRequest(request, n))
            scheduled.add(id(request))
            if budget is not None:
                budget -= n
        return budget

    def _reserve(self, request: Request, n: int, scheduled: set[int]) -> bool:
        """Allocate KV slots for ``n`` more tokens of ``request``, preempting other running
        requests (never ones already scheduled this step) while blocks are short. When no
        victim is left, the request itself goes back to wait."""
        target = request.num_computed_tokens + n
        while not self.block_manager.allocate(request, target):
            candidates = [r for r in self.running if id(r) not in scheduled and r is not request]
            victim = self._ordering.pick_victim(candidates, self.clock())
            if victim is None:
                self._preempt(request)
                return False
            self._preempt(victim)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        self._preempted.append(request)

    def _shed_excess_running(self) -> None:
        """After a live decrease of max_batch_size, send the excess back to wait (recompute)."""
        while len(self.running) > self.config.max_batch_size:
            victim = self._ordering.pick_victim(self.running, self.clock())
            assert victim is not None
            self._preempt(victim)

    def _admit(self, out: SchedulerOutput, budget: int | None, limit: int) -> int | None:
        """Move waiting requests (in queue order) into the running set while budgets and KV
        blocks allow. Never preempts to admit."""
        chunked = self._chunked
        admitted = 0
        while self.waiting and admitted < limit:
            if budget is not None and budget <= 0:
                break
            request = self.waiting[0]
            owed = request.num_uncomputed_tokens
            if budget is None:
                n = owed
            elif chunked:
                n = min(owed, budget)
            elif owed <= budget or not out.scheduled:
                n = owed  # whole prompt; a lone over-budget prompt runs whole
            else:
                break
            if not self.block_manager.allocate(request, request.num_computed_tokens + n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            admitted += 1
            if budget is not None:
                budget -= n
        return budget
