"""The scheduler: which requests run this step, and how many tokens each computes.

One mechanism (vLLM v1 token accounting) serves every policy: a request is owed
``num_tokens - num_computed_tokens`` tokens, and a step hands tokens out under the token
budget (``max_num_batched_tokens``) and the sequence budget (``max_batch_size``).
Policies (server/core/policies.py) only decide *when* waiting requests are admitted, in
which *order*, and *who* is preempted when KV blocks run out.

Budget rules:

- static and dynamic batching prefill a batch's whole prompts in one step (classic batching
  has no chunking), so that step may exceed the token budget; every later step of the batch
  is one decode per member;
- continuous ``chunked`` never exceeds the budget: decodes first, then prompt chunks (down to
  one token) fill what is left;
- continuous ``merged`` and ``prefill_first`` admit whole prompts only, and a prompt longer
  than the budget only when it is the sole request of its step (otherwise it could never run).
  A running request still owing several tokens (left mid-prompt by a live switch from
  ``chunked``) gets chunks of the budget left after the decodes, as in ``chunked``.

Preemption is by recompute: the victim's blocks are freed, its computed tokens reset to 0,
and it goes back to the head of the waiting queue (never dropped). A LongRoPE model's request
whose sequence passes the pre-training context goes back the same way, to compute its KV again
with the long table, as HF ``generate`` drops its cache there (request_rope.py).

With ``pipeline_depth`` S > 1 (pipeline parallelism) up to S batches are in the stages at once,
as vLLM's virtual engines: a request whose batch is still in flight is skipped (and never a
preemption victim) until that batch comes back, and each batch takes at most
``ceil(max_batch_size / S)`` sequences, so the running set splits into S batches that take
turns instead of one batch that leaves the other stages idle.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmfleet.server.config import EngineConfig, Policy, PrefillMode
from llmfleet.server.core.batch import ScheduledRequest, SchedulerOutput
from llmfleet.server.core.block_manager import BlockManager
from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.policies import AdmissionGate, Ordering, make_ordering, oldest_arrival, window_expired
from llmfleet.server.core.request import Request, RequestStatus


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        pipeline_depth: int = 1,
        rope_recompute: bool = False,
    ) -> None:
        """``rope_recompute``: the model is one whose HF ``generate`` computes a sequence's KV again
        when it passes the LongRoPE context (``block_manager.rope_switch``), as Phi-3's does."""
        self.block_manager = block_manager
        self.rope_recompute = rope_recompute
        self.pipeline_depth = pipeline_depth
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_index = 0
        self.num_preemptions = 0  # for want of KV blocks: what vllm:num_preemptions counts
        self.num_shed = 0  # sent back to wait by a live decrease of max_batch_size
        self.num_imports_recomputed = 0  # imports dropped: the cached blocks they left out were gone
        self.num_rope_recomputes = 0  # LongRoPE: sequences that passed the pre-training context
        self._num_preempted_waiting = 0  # waiting requests with status PREEMPTED
        self._flushing = False
        self._preempted: list[Request] = []
        self._gate = AdmissionGate()
        self.config = config
        self._ordering: Ordering = make_ordering(config)
        self._batch_cap = config.max_batch_size  # sequences one batch may take (set each step)

    # --- requests -------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out and free its blocks."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            if request.status == RequestStatus.PREEMPTED:
                self._num_preempted_waiting -= 1
        self.block_manager.free(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- config ---------------------------------------------------------------------------------
    def update_config(self, config: EngineConfig) -> None:
        """Applies at the next ``schedule()``; requests in flight keep their state."""
        ordering = make_ordering(config)
        if type(ordering) is not type(self._ordering):
            ordering.adopt(self.waiting, self.running)
        self.config = config
        self._ordering = ordering

    def flush(self) -> None:
        """Drain: launch whatever waits now, as a partial static/dynamic batch and past the
        continuous coalescing window. Lasts until the waiting queue is empty."""
        self._flushing = True

    def next_wakeup(self) -> float | None:
        """When a time-based admission rule could next fire, if nothing can run now."""
        cfg = self.config
        if not self.waiting or cfg.batch_timeout_ms <= 0 or cfg.policy == Policy.STATIC:
            return None
        return oldest_arrival(self.waiting) + cfg.batch_timeout_ms / 1000.0

    # --- the step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        self.step_index += 1
        out = SchedulerOutput(step=self.step_index)
        self._batch_cap = -(-cfg.max_batch_size // self.pipeline_depth)

        self._ordering.sort_running(self.running, now)
        self._shed_excess_running(now)

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
        if not self.running and self.waiting:
            # A preempted request never waits for a new batch to form. The waiting queue never
            # grows past max_queue_len, so that many make a full batch when it is the smaller.
            full = min(cfg.max_batch_size, cfg.max_queue_len)
            ready = len(self.waiting) >= full or self._flushing or self._num_preempted_waiting > 0
            if not ready and cfg.policy == Policy.DYNAMIC:
                ready = window_expired(oldest_arrival(self.waiting), now, cfg.batch_timeout_ms)
            if ready:
                self._ordering.sort_waiting(self.waiting, now)
                self._admit(out, budget=None, limit=cfg.max_batch_size)
                return
        self._schedule_running(out, budget=None)  # a classic batch runs every member

    # --- continuous -----------------------------------------------------------------------------
    def _schedule_continuous(self, out: SchedulerOutput, now: float) -> None:
        cfg = self.config
        chunked = cfg.prefill_mode == PrefillMode.CHUNKED
        urgent = self._flushing or self._num_preempted_waiting > 0
        admit = self._gate.should_admit(cfg, self.waiting, len(self.running), now, urgent=urgent)
        if admit:
            self._ordering.sort_waiting(self.waiting, now)

        if admit and cfg.prefill_mode == PrefillMode.PREFILL_FIRST:
            # New prompts run alone; running requests wait this step, then decode with them.
            self._admit(out, budget=cfg.max_num_batched_tokens, limit=self._admit_limit(out))
            if out.scheduled:
                self._gate.admitted()
                return
            admit = False

        budget = self._schedule_running(out, budget=cfg.max_num_batched_tokens)
        if admit and not self._preempted:  # blocks just ran short: admitting more would thrash (vLLM v1)
            before = len(out.scheduled)
            self._admit(out, budget=budget, limit=self._admit_limit(out), chunked=chunked)
            if len(out.scheduled) > before:
                self._gate.admitted()
                return
        self._gate.held()

    # --- shared mechanism -----------------------------------------------------------------------
    def _admit_limit(self, out: SchedulerOutput) -> int:
        """New requests this step may take: room in the running set and in this batch."""
        return min(self.config.max_batch_size - len(self.running), self._batch_cap - len(out.scheduled))

    def _idle(self) -> list[Request]:
        """The running requests not in a batch in flight: those a step may schedule or preempt."""
        if self.pipeline_depth == 1:
            return self.running
        return [r for r in self.running if not r.in_flight]

    def _schedule_running(self, out: SchedulerOutput, budget: int | None) -> int | None:
        """Give each running request its owed tokens, preempting when KV blocks run out.

        Without a budget (classic batches) everyone gets everything. With one, decodes go
        first in running order, then requests still owing several tokens (mid-prompt) get
        chunks of what the budget has left. Returns the budget left."""
        # The hot loop of every step (hundreds of decodes): plain attribute access, no properties.
        block_size = self.block_manager.block_size
        running_status = RequestStatus.RUNNING
        scheduled = out.scheduled
        deferred: list[Request] = []
        cap = self._batch_cap
        rope_switch = self.block_manager.rope_switch if self.rope_recompute else None
        for request in list(self._idle()):
            if request.status is not running_status:
                continue  # preempted as a victim earlier in this loop
            if len(scheduled) >= cap:
                break
            computed = request.num_computed_tokens
            total = len(request.prompt_token_ids) + len(request.output_token_ids)
            if rope_switch is not None and total > rope_switch >= request.rope_length:  # set at admission
                self._preempt(request, reason="rope")  # its short-table KV is computed again
                continue
            n = total - computed
            if budget is not None:
                if n > 1:
                    deferred.append(request)  # a prompt chunk: after the decodes
                    continue
                if budget <= 0:
                    break
            if len(request.block_table) * block_size < computed + n:
                reserved, returned = self._reserve(request, computed + n, out)
                if budget is not None:
                    budget += returned
                if not reserved:
                    continue
            scheduled.append(ScheduledRequest(request, n))
            if budget is not None:
                budget -= n
        for request in deferred:
            if budget is None or budget <= 0 or len(scheduled) >= cap:
                break
            if request.status is not running_status:
                continue
            computed = request.num_computed_tokens
            n = min(request.num_uncomputed_tokens, budget)
            reserved, returned = self._reserve(request, computed + n, out)
            budget += returned
            if reserved:
                scheduled.append(ScheduledRequest(request, n))
                budget -= n
        return budget

    def _reserve(self, request: Request, num_slots: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Grow ``request``'s block table to ``num_slots`` slots, preempting while blocks are
        short. The victim is picked by the ordering among all running requests, ``request``
        included (vLLM v1's rule): decodes are scheduled before prompt chunks, so a victim may
        already be in this step, and then it is taken out again. Returns whether ``request``
        got its slots (False: it was the victim and went back to wait) and the tokens the
        victims taken out of the step had."""
        returned = 0
        while not self.block_manager.allocate(request, num_slots):
            victim = self._ordering.pick_victim(self._idle(), self.clock())
            assert victim is not None  # ``request`` itself is idle
            if victim is not request:
                returned += self._unschedule(victim, out)
            self._preempt(victim)
            if victim is request:
                return False, returned
        return True, returned

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput) -> int:
        """Take ``request`` out of this step's batch; the tokens it had there (0: not in it)."""
        for i, item in enumerate(out.scheduled):  # only when blocks ran out: rare
            if item.request is request:
                del out.scheduled[i]
                return item.num_tokens
        return 0

    def _preempt(self, request: Request, *, reason: str = "blocks") -> None:
        """Send ``request`` back to the head of the queue to recompute: for want of KV blocks, shed
        by a lower max_batch_size, or (``rope``) past a LongRoPE model's pre-training context."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self._num_preempted_waiting += 1
        if reason == "rope":  # not for want of blocks: admitted again as soon as a preempted one is
            self.num_rope_recomputes += 1
            return
        request.num_preemptions += 1
        if reason == "shed":
            self.num_shed += 1
        else:
            self.num_preemptions += 1
        self._preempted.append(request)

    def _shed_excess_running(self, now: float) -> None:
        """After a live decrease of max_batch_size, send the excess back to wait (recompute)."""
        while len(self.running) > self.config.max_batch_size:
            victim = self._ordering.pick_victim(self._idle(), now)
            if victim is None:  # every one is in flight: the next step sheds
                return
            self._preempt(victim, reason="shed")

    def _note_rope_table(self, request: Request) -> None:
        """For a LongRoPE model, the length ``request`` (holding no KV) takes its table at from
        here: its sequence's where ``generate`` computes the whole of it again past the context,
        else its prompt's. Its prefix hashes are of that table's chain."""
        blocks = self.block_manager
        if blocks.rope_switch is None:
            return
        length = request.num_tokens if self.rope_recompute else request.num_prompt_tokens
        if blocks.long_rope(length) != blocks.long_rope(request.rope_length or request.num_prompt_tokens):
            request.block_hashes = []
        request.rope_length = length

    def _reuse_prefix(self, request: Request) -> int | None:
        """Start ``request`` after its longest cached prefix; the tokens that covers, or None
        where it is not looked up: it has KV already, or it asks for its prompt's logprobs,
        which only computing the prompt gives."""
        kv = request.kv_import
        switch = self.block_manager.rope_switch
        if kv is not None and switch is not None and kv.num_tokens <= switch < request.num_tokens:
            # LongRoPE: the prefill server turned these keys with the short table, and this
            # sequence (the prompt and its first token) takes the long one: computed here again
            request.kv_import = None
            request.num_computed_tokens = 0
            self.num_imports_recomputed += 1
        elif kv is not None:
            return self._reuse_for_import(request, kv)
        if not self.block_manager.prefix_caching:
            return None
        if request.num_computed_tokens or request.sampling.prompt_logprobs is not None:
            return None
        hit = self.block_manager.match_prefix(request)
        request.num_computed_tokens = hit
        return hit

    def _reuse_for_import(self, request: Request, kv: KVImport) -> int | None:
        """Share the cached blocks an import left out (the decode server had them when it fetched
        the rest). Where some were evicted since (or prefix caching was turned off), the import is
        dropped and the request computes its prompt from what is still cached: slower, the same
        tokens."""
        blocks = self.block_manager
        hit = blocks.match_prefix(request, max_blocks=kv.first_block) if kv.first_block else 0
        if hit < kv.first_block * blocks.block_size:
            request.kv_import = None
            request.num_computed_tokens = hit
            self.num_imports_recomputed += 1
        return hit if blocks.prefix_caching else None

    def _admit(self, out: SchedulerOutput, budget: int | None, limit: int, chunked: bool = False) -> int | None:
        """Move waiting requests (in queue order) into the running set while budgets and KV
        blocks allow. Never preempts to admit; stops at the first request that does not fit,
        so the queue order is kept."""
        admitted = 0
        while self.waiting and admitted < limit:
            if budget is not None and budget <= 0:
                break
            request = self.waiting[0]
            self._note_rope_table(request)
            hit = self._reuse_prefix(request)
            n = request.num_uncomputed_tokens
            fits = True
            if budget is not None and n > budget:
                if chunked:
                    n = budget
                elif out.scheduled:
                    fits = False  # whole prompts only; a lone over-budget prompt runs whole
            if not (fits and self.block_manager.allocate(request, request.num_computed_tokens + n)):
                if hit:  # it waits holding nothing: the shared blocks go back
                    self.block_manager.free(request)
                    request.num_computed_tokens = request.kv_import.num_tokens if request.kv_import else 0
                break
            if hit is not None and request.status != RequestStatus.PREEMPTED:
                # as vLLM's counters: new requests only (a preempted one finds its own blocks again;
                # the tuner reads hits as prompt work saved, which that is not)
                self.block_manager.count_lookup(request.num_tokens, hit)
            self.waiting.popleft()
            if request.status == RequestStatus.PREEMPTED:
                self._num_preempted_waiting -= 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n))
            admitted += 1
            if budget is not None:
                budget -= n
        return budget
