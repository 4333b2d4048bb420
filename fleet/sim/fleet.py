"""The fleet simulation: a discrete-event loop over pods, a router, scaling and a controller.

Events, in simulated time:

- ``arrival``: the router sends a request to the least-loaded ready pod of the entry pool
  (``colocated``, or ``prefill`` in disaggregated mode); with no ready pod it waits at the router
  (held). A pool with no pod starting either (scaled to zero) is woken at once (``wake_hook``:
  the controller brings it to its floor, as the operator's wake handler does), and the time to
  its first ready pod is a cold start. Pods are picked as the router picks servers (``load_score``:
  the requests a pod holds, those whose first token has not come back yet weighing more).
- ``step_end``: a pod's step is over; its tokens become visible (client records, pool metrics),
  and the pod starts its next step. A prefill pod's finished request goes to the decode pod the
  router calls then, after the delay of the KV it fetches: all of it, less the blocks that pod's
  prefix cache holds (``transfer``).
- ``wake``: a batching window of an idle pod runs out.
- ``ready``: a new pod has started (``startup_s`` after the scale-up) and joins the router.
- ``drain_deadline``: a draining pod still holding requests is killed; they are reported aborted.
- ``scrape``: every pool's gauges and cumulative metrics are sampled (what Prometheus or the
  direct-scrape source sees); the timeline for the plot is recorded.
- ``control``: the controller (the real tuner, an HPA baseline, or none) runs.

Scale-up adds pods in ``starting`` state (paid for, not serving); scale-down cancels starting
pods first, then drains the ready pods with the least in-flight work (the operator's
pod-deletion-cost ranking): they leave the router at once and stop when their last request
ends, or after ``drain_timeout_s``. Every arrival ends as finished, rejected (queue full, or too
long for the model), aborted (drain timeout) or unfinished (still open ``tail_s`` after the last
arrival); ``SimResult.conserved`` checks it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmfleet.operator.metrics.source import PoolRef
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import effective_engine, effective_replicas
from llmfleet.operator.tuner.law import KNOB_FIELDS
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.validation import InvalidRequestError
from llmfleet.server.engine.engine import QueueFullError
from llmfleet.server.router.load import Server, load_score
from llmfleet.server.router.policies import POLICIES, Policy, chained_hashes
from llmfleet.sim.cost_model import CostModel
from llmfleet.sim.metric_source import PodGauges, PoolSeries, RequestRecord, SimMetricSource
from llmfleet.sim.pod import PodConfigError, PodState, SimPod, pod_max_model_len
from llmfleet.workloads import RequestSpec

NAMESPACE = "sim"


@dataclass(frozen=True)
class SimOptions:
    startup_s: float = 30.0  # pod start-up delay on scale-up (schedule, pull, load the model)
    scrape_interval_s: float = 1.0
    kv_transfer_latency_s: float = 0.002  # per request, prefill -> decode
    kv_transfer_bytes_per_s: float = 1.25e9  # 10 Gbit/s between pods
    drain_timeout_s: float | None = None  # `serve --drain-timeout`; None: the pool's, as the operator renders it
    tail_s: float = 600.0  # after the last arrival, how long requests may still finish
    initial_pods_ready: bool = True  # the fleet starts warm: its first pods are up at t=0
    record_runs: bool = False  # every tuner run's reasons, holds included (`llm-fleet sim --runs`)


class Controller(Protocol):
    """Runs every ``interval_s`` of simulated time and acts on the fleet."""

    name: str
    interval_s: float

    def control(self, now: float) -> None: ...


@dataclass
class ControlRecord:
    """One controller run that changed something or held (for the decision history)."""

    at: float
    controller: str
    changes: list[dict[str, Any]]
    hold: bool = False
    reason: str = ""


@dataclass
class TunerRun:
    """One tuner run, whatever it did: the replicas it left each pool at, its changes, and every
    line of its reasoning (what held a knob or a count included), as ``status.lastDecision`` and
    the TunerActive condition show them."""

    at: float
    replicas: dict[str, int]
    changes: list[dict[str, Any]]
    hold: bool
    reasons: list[str]


@dataclass
class ColdStart:
    """A pool woken from zero: when the first request for it arrived, how long until its first
    pod was ready, and how many requests the router held meanwhile."""

    pool: str
    at: float
    seconds: float
    held: int


@dataclass(frozen=True)
class Handoff:
    """A request on its way from a prefill pod to the decode pod the router called at ``sent``,
    which found its first ``cached_blocks`` blocks in its own prefix cache (None: none was ready)."""

    record: RequestRecord
    sent: float
    pod: SimPod | None
    cached_blocks: int


@dataclass
class TimelinePoint:
    at: float
    pools: dict[str, dict[str, float]]  # pool -> ready/starting/draining/waiting/running and knobs


@dataclass
class SimResult:
    name: str
    mode: str
    slo_ttft_s: float
    slo_itl_s: float
    controller: str
    end: float
    last_arrival: float
    records: list[RequestRecord]
    timeline: list[TimelinePoint]
    decisions: list[ControlRecord]
    pod_lifetimes: list[tuple[str, str, float, float]]  # pod, pool, created, stopped (or the end)
    options: SimOptions
    notes: dict[str, Any] = field(default_factory=dict)
    measure_from: float = 0.0  # the report leaves out what came before (a warm-up)
    cold_starts: list[ColdStart] = field(default_factory=list)
    devices: dict[str, int] = field(default_factory=dict)  # per pool: a replica's devices, where above one
    runs: list[TunerRun] = field(default_factory=list)  # with SimOptions.record_runs

    @property
    def conserved(self) -> bool:
        """Every arrival is accounted for exactly once."""
        return all(r.status in ("finished", "rejected", "aborted", "unfinished") for r in self.records)

    def replica_seconds(self, pool: str | None = None, since: float = 0.0) -> float:
        """Pod-seconds paid for (starting, ready and draining pods), from ``since`` on."""
        return sum(
            max(0.0, stop - max(start, since)) for _, p, start, stop in self.pod_lifetimes if pool is None or p == pool
        )

    def device_seconds(self, pool: str | None = None, since: float = 0.0) -> float:
        """Device-seconds paid for: each replica's seconds times the devices it runs on (tensor x
        pipeline parallel; one simulated pod is one replica)."""
        pools = {p for _, p, _, _ in self.pod_lifetimes if pool is None or p == pool}
        return sum(self.replica_seconds(p, since) * self.devices.get(p, 1) for p in pools)


@dataclass
class SimPool:
    name: str
    config: EngineConfig
    series: PoolSeries
    pods: list[SimPod] = field(default_factory=list)
    # waiting at the router: the request, its arrival at this pool, since when it waits
    backlog: list[tuple[RequestRecord, float, float]] = field(default_factory=list)
    turn: int = 0
    created: int = 0

    def with_state(self, *states: PodState) -> list[SimPod]:
        return [p for p in self.pods if p.state in states]

    @property
    def replicas(self) -> int:
        """Pods counted against the desired replicas: starting and ready, not draining."""
        return len(self.with_state(PodState.STARTING, PodState.READY))


def check_spec(spec: InferenceServiceSpec, cost: CostModel) -> None:
    """Refuse, before anything runs, a spec whose pods the real engine would not start (a pool's
    pods may start only later, on a scale-up). Raises ``PodConfigError``."""
    for pool in spec.active_pools:
        try:
            pod_max_model_len(effective_engine(spec, pool, None), cost)
        except PodConfigError as exc:
            raise PodConfigError(f"pool {pool}: engine.{exc}") from exc


class Fleet:
    def __init__(
        self,
        spec: InferenceServiceSpec,
        cost: CostModel,
        requests: list[RequestSpec],
        options: SimOptions | None = None,
        controller: Callable[[Fleet], Controller] | None = None,
        *,
        name: str = "sim",
    ) -> None:
        check_spec(spec, cost)
        self.spec = spec
        self.cost = cost
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.caches = any(r.blocks for r in self.requests)  # prompts say what they share: pods cache
        self.options = options or SimOptions()
        self.name = name
        self.now = 0.0
        self.disaggregated = spec.mode == "disaggregated"
        self.entry = "prefill" if self.disaggregated else "colocated"
        self.pools = {}
        self.policies: dict[str, Policy] = {}  # the router's policy per pool, where it is not `load`
        for p in spec.active_pools:
            if spec.router.policy != "load":
                self.policies[p] = POLICIES[spec.router.policy]()
            engine = effective_engine(spec, p, None)
            self.pools[p] = SimPool(p, engine, PoolSeries(p, pod_max_model_len(engine, cost)))
        self.records: list[RequestRecord] = []
        self.timeline: list[TimelinePoint] = []
        self.decisions: list[ControlRecord] = []
        self.runs: list[TunerRun] = []
        self.metric_source = SimMetricSource(
            lambda pool: self.pools[pool].series,
            lambda pool: len(self.pools[pool].with_state(PodState.READY)),
            lambda: self.now,
        )
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._live: dict[tuple[str, str], RequestRecord] = {}  # (pod, request id) -> record
        self._open = 0
        self._next_arrival = 0
        self.wake_hook: Callable[[], None] | None = None  # brings the pools at zero back (the controller's)
        self.cold_starts: list[ColdStart] = []
        self._waking: dict[str, float] = {}  # pool -> when its wake began
        for pool in self.pools.values():
            self.scale(pool.name, effective_replicas(spec, pool.name, None), initial=True)
        self.controller = controller(self) if controller is not None else None

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> SimResult:
        last_arrival = self.requests[-1].arrival_s if self.requests else 0.0
        deadline = last_arrival + self.options.tail_s
        self._push_next_arrival()
        self._push(0.0, "scrape", None)
        if self.controller is not None:
            self._push(self.controller.interval_s, "control", None)
        while self._events:
            at, _, kind, payload = heapq.heappop(self._events)
            if at > deadline:
                break
            self.now = at
            getattr(self, f"_on_{kind}")(payload)
            if self._next_arrival >= len(self.requests) and self._open == 0:
                break
        self._scrape()
        end = self.now
        lifetimes = [
            (p.name, p.pool, p.created_at, p.stopped_at if p.stopped_at is not None else end)
            for pool in self.pools.values()
            for p in pool.pods
        ]
        return SimResult(
            name=self.name,
            mode=self.spec.mode,
            slo_ttft_s=self.spec.slo.ttft_p95_ms / 1000.0,
            slo_itl_s=self.spec.slo.itl_p95_ms / 1000.0,
            controller=self.controller.name if self.controller is not None else "fixed",
            end=end,
            last_arrival=last_arrival,
            records=self.records,
            timeline=self.timeline,
            decisions=self.decisions,
            runs=self.runs,
            pod_lifetimes=lifetimes,
            options=self.options,
            cold_starts=self.cold_starts,
            devices=self._devices(),
            notes={
                "cost_model": self.cost.describe(),
                "profile": f"{self.cost.model} {self.cost.dtype} {self.cost.device} {self.cost.threads} threads",
                **self._parallel_note(),
            },
        )

    def _devices(self) -> dict[str, int]:
        devices = {pool: self.spec.pool(pool).parallelism.devices for pool in self.pools}
        return {pool: n for pool, n in devices.items() if n > 1}

    def _parallel_note(self) -> dict[str, str]:
        """What the run says of a parallel pool: its costs count every device, its step times are
        the profile's, one device's (the cost model knows no collectives or pipeline stages)."""
        if not self._devices():
            return {}
        pools = ", ".join(f"{pool} {n}" for pool, n in self._devices().items())
        return {
            "parallelism": f"devices per replica: {pools}; device-minutes count them all, step times are "
            "the profile's single-device ones"
        }

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, payload))

    def _push_next_arrival(self) -> None:
        if self._next_arrival < len(self.requests):
            self._push(self.requests[self._next_arrival].arrival_s, "arrival", self._next_arrival)

    # -- events ---------------------------------------------------------------------------------

    def _on_arrival(self, index: int) -> None:
        spec = self.requests[index]
        record = RequestRecord(index, spec.arrival_s, spec.prompt_len, spec.output_len)
        self.records.append(record)
        self._open += 1
        self._next_arrival = index + 1
        self._push_next_arrival()
        # a one-token prompt has no KV to transfer: the router sends it to a decode server at once
        entry = "decode" if self.disaggregated and record.prompt_len < 2 else self.entry
        self._dispatch(entry, record, record.arrival)

    def _on_step_end(self, pod: SimPod) -> None:
        pod.busy_until = None
        if pod.state == PodState.STOPPED:
            pod.take_outputs()  # killed mid-step: nothing of it reaches anyone
            return
        self._publish(pod)
        self._kick(pod)

    def _on_wake(self, pod: SimPod) -> None:
        if pod.wake_at is not None and pod.wake_at <= self.now:
            pod.wake_at = None
        self._kick(pod)

    def _on_ready(self, pod: SimPod) -> None:
        if pod.state != PodState.STARTING:
            return  # cancelled while starting
        pod.state = PodState.READY
        pool = self.pools[pod.pool]
        began = self._waking.pop(pod.pool, None)
        if began is not None:
            self.cold_starts.append(ColdStart(pod.pool, began, self.now - began, len(pool.backlog)))
        self._dispatch_backlog(pool)

    def _dispatch_backlog(self, pool: SimPool) -> None:
        """The requests that waited for a ready pod go to the pool's pods."""
        waiting, pool.backlog = pool.backlog, []
        for record, arrived, since in waiting:
            record.held_s += self.now - since
            self._dispatch(pool.name, record, arrived)

    def _wake(self) -> None:
        """A request waits for a pool with no pod ready or starting: ask for the pools at zero now."""
        asleep = [name for name, pool in self.pools.items() if pool.replicas == 0 and name not in self._waking]
        if not asleep or self.wake_hook is None:
            return
        for name in asleep:
            self._waking[name] = self.now
        self.wake_hook()

    def _on_transfer(self, handoff: Handoff) -> None:
        # the decode server's clock runs from the router's call, the KV fetch in it
        if handoff.pod is not None:
            handoff.pod.incoming -= 1
        pod = handoff.pod if handoff.pod is not None and handoff.pod.state == PodState.READY else None
        self._dispatch("decode", handoff.record, handoff.sent, pod, handoff.cached_blocks if pod else 0)

    def _on_drain_deadline(self, pod: SimPod) -> None:
        if pod.state != PodState.DRAINING:
            return
        pod.abort_all()
        pod.take_outputs()  # the step in flight dies with the pod: its tokens never reach anyone
        why = f"{pod.name} killed at the end of its {self.drain_s(pod.pool):g} s drain"
        for key in [k for k in self._live if k[0] == pod.name]:
            self._close(self._live.pop(key), "aborted", why)
        self._stop(pod)

    def _on_scrape(self, _: Any) -> None:
        self._scrape()
        self._push(self.now + self.options.scrape_interval_s, "scrape", None)

    def _on_control(self, _: Any) -> None:
        assert self.controller is not None
        self.controller.control(self.now)
        self._push(self.now + self.controller.interval_s, "control", None)

    # -- requests -------------------------------------------------------------------------------

    def _hand_off(self, record: RequestRecord, sent: float, tokens: int) -> None:
        """A prefill pod has computed ``tokens`` of the prompt: the router calls a decode server
        now, and that server fetches their KV less the leading blocks its own prefix cache holds
        (server/openai/kv_transfer.py), so the transfer takes as long as those bytes. The router
        counts the request on that pod from the call, so the picks made during the transfer see
        it. With no decode pod ready, the whole KV is charged and the pick waits for the
        transfer's end."""
        spec = self.requests[record.index]
        pod = self._pick(self.pools["decode"], spec.blocks)
        cached = cached_tokens = 0
        if pod is not None:
            cached = pod.cached_prefix_blocks(record.prompt_len, spec.blocks, spec.block_tokens, record.index)
            cached_tokens = cached * pod.block_size
            pod.incoming += 1  # the router counts it sent from now: the next pick sees it
            pod.unstarted.add(str(record.index))
        delay = self.options.kv_transfer_latency_s + (
            max(tokens - cached_tokens, 0) * self.cost.kv_bytes_per_token / self.options.kv_transfer_bytes_per_s
        )
        self._push(sent + delay, "transfer", Handoff(record, sent, pod, cached))

    def _dispatch(
        self,
        pool_name: str,
        record: RequestRecord,
        arrived: float,
        pod: SimPod | None = None,
        cached_blocks: int = 0,
    ) -> None:
        """Send a request to ``pod``, or to the pod the router picks in the pool; with none ready it
        waits at the router."""
        pool = self.pools[pool_name]
        spec = self.requests[record.index]
        pod = pod or self._pick(pool, spec.blocks)
        if pod is None:
            pool.backlog.append((record, arrived, self.now))
            if not pool.with_state(PodState.STARTING):
                self._wake()
            return
        try:
            pod.add(
                str(record.index),
                record.prompt_len,
                record.output_len,
                arrived,
                spec.blocks,
                spec.block_tokens,
                record.index,
                cached_blocks,
            )
        except QueueFullError as exc:
            self._close(record, "rejected", f"429 from {pod.name}: {exc}")
            return
        except InvalidRequestError as exc:
            self._close(record, "rejected", f"400 from {pod.name}: {exc}")
            return
        self._live[(pod.name, str(record.index))] = record
        pod.unstarted.add(str(record.index))
        record.pod, record.dispatched_at = pod.name, self.now
        self._kick(pod)

    def _pick(self, pool: SimPool, blocks: tuple[int, ...] = ()) -> SimPod | None:
        """Least loaded ready pod by the router's load score, then fewest requests held, then round
        robin (the router's own counts, exact at every pick: a lone router needs no poll for them).
        Under another router policy (``spec.router.policy``), the router's own policy picks: round
        robin, or prefix affinity over the request's content ``blocks``."""
        ready = pool.with_state(PodState.READY)
        if not ready:
            return None
        policy = self.policies.get(pool.name)
        if policy is not None:
            return self._pick_by(policy, ready, blocks)
        pool.turn += 1
        n = len(ready)

        def load(ip: tuple[int, SimPod]) -> tuple[float, float, int]:
            i, pod = ip
            return load_score(pod.assigned, len(pod.unstarted), pod.kv_usage), pod.assigned, (i - pool.turn) % n

        return min(enumerate(ready), key=load)[1]

    @staticmethod
    def _pick_by(policy: Policy, ready: list[SimPod], blocks: tuple[int, ...]) -> SimPod:
        """The router policy's pick among ``ready``, each shown as the router sees a server."""
        servers = [
            Server(pod.name, pod.pool, kv_usage=pod.kv_usage, assigned=pod.assigned, unstarted=len(pod.unstarted))
            for pod in ready
        ]
        chosen = policy(servers, chained_hashes(blocks))  # as the router hashes text chunks
        return next(pod for pod in ready if pod.name == chosen.url)

    def _publish(self, pod: SimPod) -> None:
        """The step that just ended: its tokens reach the clients and the pool's metrics."""
        series = self.pools[pod.pool].series
        at = self.now
        for out in pod.take_outputs():
            record = self._live.get((pod.name, out.request_id))
            if record is None:
                continue
            if out.new_token_ids or out.finished:
                pod.unstarted.discard(out.request_id)
            if out.new_token_ids:
                # a prefill pod's one token goes nowhere (its server's TTFT alone); the rest are the
                # client's. Each pod's metrics count from its own arrival, as each server's do.
                to_client = pod.pool != "prefill"
                if to_client and record.token_times:
                    series.next_token(at - record.token_times[-1])
                else:
                    series.first_token(at - out.metrics.arrival_time, out.num_prompt_tokens)
                if to_client:
                    record.token_times.append(at)
            if not out.finished:
                continue
            del self._live[(pod.name, out.request_id)]
            m = out.metrics
            queued = None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time
            series.finished(queued, out.num_prompt_tokens)
            if out.finish_reason == "abort":
                self._close(record, "aborted", f"aborted on {pod.name}")
            elif pod.pool == "prefill":
                self._hand_off(record, at, out.num_prompt_tokens)
            else:
                self._close(record, "finished")

    def _close(self, record: RequestRecord, status: str, detail: str = "") -> None:
        record.status, record.detail = status, detail
        self._open -= 1

    # -- pods -----------------------------------------------------------------------------------

    def _kick(self, pod: SimPod) -> None:
        """Start the pod's next step if it is free and has work; else wait for its window."""
        if pod.busy_until is not None or pod.state in (PodState.STARTING, PodState.STOPPED):
            return
        step = pod.run_step(self.now)
        if step is not None:
            series = self.pools[pod.pool].series
            series.step(step.batch, step.tokens, step.seconds)
            new = pod.new_preemptions()
            if new:
                series.preempted(new)
            hits = pod.new_prefix_hits()
            if hits:
                series.prefix_hit(hits)
            self._push(step.end, "step_end", pod)
            return
        self._publish(pod)  # aborts only
        wake = pod.engine.next_wakeup()
        if wake is not None and (pod.wake_at is None or wake < pod.wake_at):
            pod.wake_at = max(wake, self.now + 1e-6)  # never a wake-up in the past: time must move
            self._push(pod.wake_at, "wake", pod)
        if pod.state == PodState.DRAINING and pod.idle:
            self._stop(pod)

    def _stop(self, pod: SimPod) -> None:
        pod.state = PodState.STOPPED
        pod.stopped_at = self.now

    def scale(self, pool_name: str, replicas: int, *, initial: bool = False) -> None:
        """Start or drain pods until ``replicas`` are starting or ready."""
        pool = self.pools[pool_name]
        have = pool.replicas
        for _ in range(replicas - have):
            pool.created += 1
            startup = 0.0 if initial and self.options.initial_pods_ready else self.options.startup_s
            pod = SimPod.create(
                f"{pool_name}-{pool.created}",
                pool_name,
                pool.config,
                self.cost,
                now=self.now,
                startup_s=startup,
                caches=self.caches,
            )
            pool.pods.append(pod)
            if pod.state == PodState.STARTING:
                self._push(pod.ready_at, "ready", pod)
        if pool.backlog and pool.with_state(PodState.READY):  # pods ready at once (no start-up delay)
            self._dispatch_backlog(pool)
        excess = have - replicas
        if excess <= 0:
            return
        for pod in sorted(pool.with_state(PodState.STARTING), key=lambda p: -p.created_at)[:excess]:
            self._stop(pod)  # not ready yet: removed first, as a ReplicaSet does
            excess -= 1
        ranked = sorted(pool.with_state(PodState.READY), key=lambda p: (p.in_flight, -p.created_at))
        for pod in ranked[:excess]:
            pod.drain(self.now, self.drain_s(pool_name))
            self._push(self.now + self.drain_s(pool_name), "drain_deadline", pod)
            self._kick(pod)

    def drain_s(self, pool: str) -> float:
        """How long a draining pod of ``pool`` may finish its requests: the option, else the spec's."""
        given = self.options.drain_timeout_s
        return float(self.spec.drain_seconds(pool)) if given is None else given

    def set_engine(self, pool_name: str, config: EngineConfig) -> None:
        """New live knobs for the pool: every pod applies them at its next step (as from the ConfigMap)."""
        pool = self.pools[pool_name]
        pool.config = config
        for pod in pool.pods:
            if pod.alive:
                pod.update_config(config)
                self._kick(pod)

    # -- views ----------------------------------------------------------------------------------

    def pool_ref(self, pool: str) -> PoolRef:
        return PoolRef(NAMESPACE, self.name, pool)

    def _scrape(self) -> None:
        point: dict[str, dict[str, float]] = {}
        for pool in self.pools.values():
            reporting = pool.with_state(PodState.READY, PodState.DRAINING)
            gauges = [
                PodGauges(p.engine.scheduler.num_waiting, p.engine.scheduler.num_running, p.kv_usage) for p in reporting
            ]
            pool.series.scrape(self.now, gauges)
            point[pool.name] = {
                "ready": len(pool.with_state(PodState.READY)),
                "starting": len(pool.with_state(PodState.STARTING)),
                "draining": len(pool.with_state(PodState.DRAINING)),
                "waiting": float(sum(g.waiting for g in gauges) + len(pool.backlog)),
                "running": float(sum(g.running for g in gauges)),
                **{knob: float(getattr(pool.config, attr)) for knob, attr in KNOB_FIELDS.items()},
            }
            if self.caches:  # counted so far, for the hit rate from the report's start
                counters = pool.series.counters
                point[pool.name] |= {
                    "prompt_tokens": counters["prompt_tokens"],
                    "prefix_cache_hits": counters["prefix_cache_hits"],
                }
        self.timeline.append(TimelinePoint(self.now, point))
