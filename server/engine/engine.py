"""The engine loop: ``step()`` = schedule, run, postprocess.

Single-threaded and deterministic for a given clock: the server runs it in its own thread,
tests and the simulator drive it directly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from llmfleet.server.config import EngineConfig
from llmfleet.server.core import grammar
from llmfleet.server.core.batch import ModelRunner, SchedulerOutput
from llmfleet.server.core.block_manager import BlockManager
from llmfleet.server.core.kv_wire import KVImport
from llmfleet.server.core.request import Request, RequestStatus, SampledToken, SamplingParams, StructuredOutput
from llmfleet.server.core.scheduler import Scheduler
from llmfleet.server.core.validation import (
    InvalidRequestError,
    check_can_sample,
    check_context_length,
    check_token_ids,
)
from llmfleet.server.engine.detokenizer import Decoder, IncrementalDetokenizer

log = logging.getLogger(__name__)


class StepFailedError(RuntimeError):
    """The runner failed on a step; that step's requests were aborted, the engine is usable."""


class QueueFullError(Exception):
    """The waiting queue is at max_queue_len: the API answers 429."""


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[SampledToken] | None
    metrics: RequestMetrics
    kv_export: Any = None  # on the final event of an ``export_kv`` request: its KV (runner.export_kv)
    max_tokens: int | None = None  # the request's max_tokens (for vllm:request_params_max_tokens)
    prompt_logprobs: list[SampledToken] | None = None  # with the first token, where asked (see Request)
    # vLLM's: what stopped it, on the final event: the stop string, or a stop_token_ids token
    # (None at EOS, at the length, or aborted)
    stop_reason: str | int | None = None
    # Why the request ended on its own failure (finish_reason "abort"): no token could be sampled
    # for it (see SampledToken.error). The API hands it to the client as an error.
    error: str | None = None
    # On the final event of a request aborted because its client gave up on it (AsyncEngine.abort
    # with by_client): vLLM records no finished request for those (server_metrics.py)
    client_aborted: bool = False


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_kv_blocks: int
    steps: int
    preemptions_total: int  # for want of KV blocks
    shed_total: int  # running requests sent back to wait by a live decrease of max_batch_size
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, and found there
    prefix_cache_hits: int
    kv_imports_recomputed: int  # imports dropped: cached blocks they left out were gone at admission
    last_batch_size: int
    last_num_tokens: int
    last_step_seconds: float
    last_schedule_seconds: float
    config_generation: int


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer | None
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    export_kv: bool = False


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        *,
        detokenizer: Decoder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.runner = runner
        self.clock = clock
        self._decoder = detokenizer
        self.block_manager = BlockManager(
            runner.num_kv_blocks,
            runner.kv_block_size,
            config.enable_prefix_caching,
            config.prefix_caching_hash_algo,
            rope_switch=getattr(runner, "longrope_context", None),
        )
        # Pipeline parallelism: batches handed to the stages and not yet back, oldest first
        self.pipeline_depth = getattr(runner, "pipeline_depth", 1)
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            clock,
            self.pipeline_depth,
            rope_recompute=getattr(runner, "longrope_recomputes", False),
        )
        self._in_flight: deque[tuple[SchedulerOutput, Any, float]] = deque()
        self._requests: dict[str, _Tracked] = {}
        self._aborted: list[Request] = []
        self._config_generation = 1
        self._steps = 0
        self._last = (0, 0, 0.0, 0.0)  # batch size, tokens, step s, schedule s
        self._generate_batches = itertools.count()

    # --- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        kv_import: KVImport | None = None,
        export_kv: bool = False,
    ) -> Request:
        """Queue a request. ``kv_import``: KV computed elsewhere (a prefill server) for its first
        ``kv_import.num_tokens`` prompt tokens; they count as computed, as a prefix-cache hit
        would. ``export_kv``: when it finishes, its final event carries the KV of every token it
        computed (``RequestOutput.kv_export``), copied out before its blocks are freed."""
        self._validate(request_id, prompt_token_ids, sampling)
        if kv_import is not None:
            self._validate_import(kv_import, len(prompt_token_ids))
        if self.scheduler.num_waiting >= self.config.max_queue_len:
            raise QueueFullError(f"waiting queue is full ({self.config.max_queue_len} requests); retry later")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
        )
        if kv_import is not None:
            request.num_computed_tokens = kv_import.num_tokens
            request.kv_import = kv_import
        detok = None
        if self._decoder is not None:
            detok = IncrementalDetokenizer(
                self._decoder,
                sampling.stop,
                sampling.include_stop_str_in_output,
                sampling.skip_special_tokens,
                context=prompt_token_ids,
            )
        stop_ids = sampling.stop_ids(self.runner.eos_token_ids)
        self._requests[request_id] = _Tracked(request, detok, stop_ids, export_kv)
        self.scheduler.add(request)
        return request

    def _validate_import(self, kv: KVImport, num_prompt_tokens: int) -> None:
        if not 0 < kv.num_tokens < num_prompt_tokens:
            raise InvalidRequestError(
                f"imported KV covers {kv.num_tokens} tokens; it must cover fewer than the "
                f"{num_prompt_tokens} prompt tokens (the last one is computed here)",
                "kv_transfer_params",
            )
        if not 0 <= kv.first_block <= kv.num_tokens // self.block_manager.block_size:
            raise InvalidRequestError(
                f"imported KV's first block {kv.first_block} is not one of its full blocks", "kv_transfer_params"
            )

    def _validate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("prompt must contain at least one token", "prompt")
        vocab = self.runner.vocab_size
        check_token_ids(prompt, vocab, "prompt", "prompt token ids")
        check_token_ids(sampling.logit_bias, vocab, "logit_bias", "logit_bias token ids")
        if sampling.allowed_token_ids is not None:
            check_token_ids(sampling.allowed_token_ids, vocab, "allowed_token_ids", "allowed_token_ids")
        stop_ids = sampling.stop_ids(self.runner.eos_token_ids)
        check_can_sample(stop_ids, sampling.allowed_token_ids, sampling.min_tokens, vocab)
        if sampling.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {sampling.max_tokens}", "max_tokens")
        check_context_length(self.runner.max_model_len, len(prompt), sampling.max_tokens)
        if sampling.structured is not None:
            if not self.runner.structured_output:
                raise InvalidRequestError("structured output is not available on this server's runner")
            error = grammar.check(sampling.structured)
            if error is not None:
                raise InvalidRequestError(f"invalid {sampling.structured.kind} for structured output: {error}")
        blocks = self.block_manager.blocks_for(len(prompt) + sampling.max_tokens)
        if blocks > self.block_manager.num_blocks:
            raise InvalidRequestError(
                f"request needs {blocks} KV cache blocks but the cache has only "
                f"{self.block_manager.num_blocks}; reduce the prompt or max_tokens",
                "max_tokens",
            )

    def structured_problem(self, structured: StructuredOutput) -> str | None:
        """Why ``structured`` could not be followed on this model (its grammar breaks a limit of the
        grammar engine, or allows no text), or None; the runner's check, where it has one. Seconds
        for a pathological grammar, and safe off the engine thread: the API calls it there."""
        check = getattr(self.runner, "structured_problem", None)
        return None if check is None else check(structured)

    def abort_request(self, request_id: str) -> bool:
        tracked = self._requests.get(request_id)
        if tracked is None:
            return False
        self._finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(tracked.request)
        return True

    @property
    def batches_in_flight(self) -> int:
        """Batches handed to the pipeline's stages and not yet back."""
        return len(self._in_flight)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted) or bool(self._in_flight)

    def next_wakeup(self) -> float | None:
        return self.scheduler.next_wakeup()

    def flush(self) -> None:
        self.scheduler.flush()

    # --- config ---------------------------------------------------------------------------------
    def update_config(self, config: EngineConfig) -> list[str]:
        applied, ignored = self.config.with_live_changes_from(config)
        self.config = applied
        self.scheduler.update_config(applied)
        self.block_manager.prefix_caching = applied.enable_prefix_caching
        self._config_generation += 1
        return ignored

    @property
    def config_generation(self) -> int:
        return self._config_generation

    # --- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        aborted, self._aborted = self._aborted, []
        events = [self._event(r, [], "", None) for r in aborted]

        started = time.perf_counter()
        out = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        if self.pipeline_depth > 1:
            return events + self._pipelined_step(out, started, scheduled_at)
        if out.is_empty:
            self._last = (0, 0, 0.0, scheduled_at - started)
            return events

        try:
            sampled = self.runner.execute(out)
        except Exception as exc:
            self._step_failed(out, aborted, exc)
        self._steps += 1
        self._postprocess(out, sampled, events)
        self._last = (
            len(out.scheduled),
            out.num_tokens,
            time.perf_counter() - started,
            scheduled_at - started,
        )
        return events

    def _step_failed(self, out: SchedulerOutput, aborted: list[Request], exc: Exception) -> NoReturn:
        """One bad step must not take the server down: its requests end, the rest go on. The
        final events of earlier aborts go out with the next step, not nowhere."""
        self._aborted[:0] = aborted
        for item in out.scheduled:
            if not item.request.status.is_finished:
                self.abort_request(item.request.request_id)
        raise StepFailedError(f"step {out.step} failed; its {len(out.scheduled)} requests were aborted") from exc

    def _pipelined_step(self, out: SchedulerOutput, started: float, scheduled_at: float) -> list[RequestOutput]:
        """Hand ``out`` to the first stage, and take back the oldest batch once the pipeline is
        full (or nothing new could be scheduled): the stages work on up to ``pipeline_depth``
        batches at once. A runner failure here is fatal: the stages' state is unknown."""
        if not out.is_empty:
            for item in out.scheduled:
                item.request.in_flight = True
            self._in_flight.append((out, self.runner.submit(out), started))
        if not self._in_flight or (len(self._in_flight) < self.pipeline_depth and not out.is_empty):
            if out.is_empty:
                self._last = (0, 0, 0.0, scheduled_at - started)
            return []
        done, handle, submitted = self._in_flight.popleft()
        sampled = self.runner.collect(handle)
        for item in done.scheduled:
            item.request.in_flight = False
        self._steps += 1
        events: list[RequestOutput] = []
        live = [i for i, item in enumerate(done.scheduled) if not item.request.status.is_finished]
        if len(live) < len(done.scheduled):  # aborted while in flight: their results are dropped
            for item in done.scheduled:
                if item.request.status.is_finished:
                    self.runner.release(item.request.request_id)
            done.scheduled = [done.scheduled[i] for i in live]
            sampled = [sampled[i] for i in live]
        self._postprocess(done, sampled, events)
        self._last = (len(done.scheduled), done.num_tokens, time.perf_counter() - submitted, scheduled_at - started)
        return events

    def _postprocess(
        self, out: SchedulerOutput, sampled: list[SampledToken | None], events: list[RequestOutput]
    ) -> None:
        """Account a computed step: advance each request, cache its full blocks, append its token."""
        now = self.clock()
        for item, token in zip(out.scheduled, sampled, strict=True):
            request = item.request
            if item.prompt_logprobs:
                _record_prompt_logprobs(request, item.start, item.prompt_logprobs)
            request.num_computed_tokens += item.num_tokens
            request.kv_import = None  # the runner wrote it into the request's blocks
            self.block_manager.cache_computed(request)
            if token is not None and token.error is not None:
                # Its sampler row failed (NaN, no candidate, a grammar that cannot go on): that
                # request ends with the reason, the step's others go on
                log.warning("request %s failed in step %d: %s", request.request_id, out.step, token.error)
                events.append(self._abort_now(request, token.error))
            elif token is not None:
                try:
                    events.append(self._append_token(request, token, now))
                except Exception:
                    # Detokenizing or exporting its KV failed: that request ends, the step's others go on
                    log.exception("request %s failed after its step; it was aborted", request.request_id)
                    events.append(self._abort_now(request))

    def _append_token(self, request: Request, token: SampledToken, now: float) -> RequestOutput:
        tracked = self._requests[request.request_id]
        request.output_token_ids.append(token.token_id)
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now

        # The first min_tokens tokens never stop it: the sampler keeps stop tokens out of them,
        # and stop strings in their text do not count (as in vLLM)
        stopping = request.num_output_tokens > request.sampling.min_tokens
        stop_token = stopping and token.token_id in tracked.stop_token_ids
        text, hit_stop = "", False
        # a stop token's text is left out, unless asked for (as vLLM's include_stop_str_in_output)
        if tracked.detok is not None and (not stop_token or request.sampling.include_stop_str_in_output):
            text, hit_stop = tracked.detok.add(token.token_id, stops=stopping)

        status = None
        if hit_stop or stop_token:
            status = RequestStatus.FINISHED_STOPPED
        elif (
            request.num_output_tokens >= request.sampling.max_tokens or request.num_tokens >= self.runner.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            if tracked.detok is not None and not hit_stop:
                held, hit_stop = tracked.detok.flush()
                text += held
                status = RequestStatus.FINISHED_STOPPED if hit_stop else status
            self._finish(request, status)
        logprobs = [token] if request.sampling.logprobs is not None else None
        event = self._event(request, [token.token_id], text, logprobs)
        if hit_stop:
            event.stop_reason = tracked.detok.stopped_by
        elif stop_token and token.token_id in request.sampling.stop_token_ids:
            # EOS first, as vLLM checks it: a token that is both leaves stop_reason None
            is_eos = not request.sampling.ignore_eos and token.token_id in self.runner.eos_token_ids
            event.stop_reason = None if is_eos else token.token_id
        if request.sampling.prompt_logprobs is not None and request.num_output_tokens == 1:
            event.prompt_logprobs = list(request.prompt_logprobs)
        return event

    def _abort_now(self, request: Request, error: str | None = None) -> RequestOutput:
        if not request.status.is_finished:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        event = self._event(request, [], "", None)
        event.error = error
        return event

    def _finish(self, request: Request, status: RequestStatus) -> None:
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.export_kv and status != RequestStatus.FINISHED_ABORTED:
            request.kv_export = self.runner.export_kv(request.block_table, request.num_computed_tokens)
        self.scheduler.remove(request)
        request.status = status
        request.finished_time = self.clock()
        self._requests.pop(request.request_id, None)
        self.runner.release(request.request_id)

    def _event(
        self, request: Request, tokens: list[int], text: str, logprobs: list[SampledToken] | None
    ) -> RequestOutput:
        finished = request.status.is_finished
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_text=text,
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            logprobs=logprobs,
            kv_export=request.kv_export,
            max_tokens=request.sampling.max_tokens,
            metrics=RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                last_token_time=request.last_token_time,
                finished_time=request.finished_time,
                num_preemptions=request.num_preemptions,
            ),
        )

    # --- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        batch, tokens, step_s, sched_s = self._last
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=self.block_manager.usage,
            num_kv_blocks=self.block_manager.num_blocks,
            steps=self._steps,
            preemptions_total=self.scheduler.num_preemptions,
            shed_total=self.scheduler.num_shed,
            prefix_cache_queries=self.block_manager.prefix_queries,
            prefix_cache_hits=self.block_manager.prefix_hits,
            kv_imports_recomputed=self.scheduler.num_imports_recomputed,
            last_batch_size=batch,
            last_num_tokens=tokens,
            last_step_seconds=step_s,
            last_schedule_seconds=sched_s,
            config_generation=self._config_generation,
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline helper: run ``prompts`` to completion, return output token ids per prompt.

        It flushes (drain semantics), so no batching window holds the prompts back and the
        loop never waits on the clock."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        batch = next(self._generate_batches)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        try:
            for rid, prompt, sp in zip(ids, prompts, params, strict=True):
                self.add_request(rid, prompt, sp)
        except Exception:
            for rid in ids:
                self.abort_request(rid)
            self._aborted = [r for r in self._aborted if r.request_id not in outputs]
            raise
        pending = set(ids)
        while pending:
            self.flush()
            events = self.step()
            if not events and not self.has_unfinished_requests():
                raise RuntimeError(f"generate: requests {sorted(pending)} ended without a final event")
            for ev in events:
                if ev.request_id in outputs:
                    outputs[ev.request_id].extend(ev.new_token_ids)
                    if ev.finished:
                        pending.discard(ev.request_id)
        return [outputs[rid] for rid in ids]


def _record_prompt_logprobs(request: Request, start: int, logprobs: list[SampledToken]) -> None:
    """Keep the chunk's prompt logprobs (positions ``start..``) that are new: a request preempted
    and recomputed goes over positions it has already recorded."""
    for position, logprob in enumerate(logprobs, start):
        if position == len(request.prompt_logprobs):
            request.prompt_logprobs.append(logprob)
