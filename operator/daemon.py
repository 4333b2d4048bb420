"""The tuner in the operator: one run for one InferenceService, called by a kopf daemon every
``spec.autotune.intervalSeconds``.

A run measures the pools (Prometheus when a URL is configured, else the pods' /metrics scraped
directly), lets the law decide (tuner/run.py), writes the result into ``status`` (``tuner``,
``lastDecision``, ``latency`` and the ``TunerActive`` condition), and then runs the same converge
pass as every other trigger, so knob changes land in the engine ConfigMaps (applied live by the
pods) and replica changes in the Deployments. The tuner never writes a child object itself: the
reconcile path stays the only writer, and spec bounds win there too. With ``autotune.mode:
observe`` the run writes its decision, Events and metrics but no replicas or knobs into
``status.tuner``, so converge applies none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmfleet.operator.metrics.prometheus import DEFAULT_TIMEOUT_S, PrometheusSource
from llmfleet.operator.metrics.scrape import ScrapeSource
from llmfleet.operator.metrics.source import MetricSource, PoolMetrics, PoolRef, stale_snapshot
from llmfleet.operator.reconcile import status as st
from llmfleet.operator.reconcile.cluster import DEPLOYMENT, INFERENCE_SERVICE, LEADER_WORKER_SET, POD, KubeClient
from llmfleet.operator.reconcile.converge import owner_of, tuner_state
from llmfleet.operator.reconcile.desired import METRICS_PORT, Owner, pool_object_name, serving_selector
from llmfleet.operator.reconcile.scaledown import rank_pods_for_scale_down
from llmfleet.operator.resource.conditions import (
    SCALING_LIMITED,
    TUNER_ACTIVE,
    Condition,
    condition_of,
    merge_conditions,
)
from llmfleet.operator.resource.spec import InferenceServiceSpec
from llmfleet.operator.resource.tuner_state import TunerState
from llmfleet.operator.tuner.memory import TunerMemory
from llmfleet.operator.tuner.run import (
    AutotuneOutcome,
    Autotuner,
    InvalidLimits,
    PoolView,
    measured_pools,
    scaling_event,
    views_from_state,
)


@dataclass
class _StatusActuator:
    """The tuner state in status: what the tuner decides here, converge applies to the objects.
    ``running``: replicas an external autoscaler set, which an observing tuner starts from."""

    spec: InferenceServiceSpec
    state: TunerState
    changed: bool = False
    running: dict[str, int] = field(default_factory=dict)

    def observe(self) -> dict[str, PoolView]:
        """What runs, but the tuner's own values as it set them: one the spec's bounds have since
        moved past (reconcile already clamps it) reaches the law unclamped, so its correction is
        recorded and explained like any other change."""
        views = views_from_state(self.spec, self.state)
        for pool, view in views.items():
            if pool in self.running:
                view.replicas = self.running[pool]
            if pool in self.state.replicas:
                view.replicas = int(self.state.replicas[pool])
            set_by_tuner = self.state.knobs.get(pool) or {}
            view.knobs |= {knob: set_by_tuner[knob] for knob in view.knobs if set_by_tuner.get(knob) is not None}
        return views

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        if replicas is not None:
            self.state.replicas[pool] = replicas
        if knobs:
            self.state.knobs[pool] = {**self.state.knobs.get(pool, {}), **knobs}
        self.changed = True


@dataclass
class _PodTargets:
    """The pods' /metrics URLs per pool, refreshed before each run (read by ScrapeSource)."""

    urls: dict[PoolRef, list[str]] = field(default_factory=dict)

    def __call__(self, pool: PoolRef) -> list[str]:
        return self.urls.get(pool, [])


@dataclass
class TunerSession:
    """What one InferenceService's tuner keeps between runs in the operator process."""

    source: MetricSource
    targets: _PodTargets | None  # None when the source is Prometheus
    source_key: str


def _source_key(spec: InferenceServiceSpec, default_url: str | None) -> str:
    return spec.autotune.prometheus_url or default_url or "scrape"


def _session(
    sessions: dict,
    key: tuple[str, str],
    spec: InferenceServiceSpec,
    default_url: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    wanted = _source_key(spec, default_url)
    session = sessions.get(key)
    if session is None or session.source_key != wanted:
        if wanted == "scrape":
            targets = _PodTargets()
            session = TunerSession(ScrapeSource(targets), targets, wanted)
        else:
            session = TunerSession(PrometheusSource(wanted, timeout_s=timeout_s), None, wanted)
        sessions[key] = session
    return session


class Measured:
    """A MetricSource that keeps each snapshot it takes. A tuner run measures through it outside
    the InferenceService's lock (``measure``); the run that decides, under the lock, replays what
    was taken: no query waits there, where every reconcile pass of the object would wait with it."""

    def __init__(self, source: MetricSource | None) -> None:
        self.source = source  # None: replaying, nothing new is measured
        self.taken: dict[tuple[PoolRef, float], PoolMetrics] = {}

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        key = (pool, window_s)
        if key not in self.taken:
            if self.source is None:  # the spec changed between measuring and deciding
                return stale_snapshot(pool, time.time(), window_s, f"{pool.pool}: the spec changed while measuring")
            self.taken[key] = await self.source.snapshot(pool, window_s)
        return self.taken[key]

    def replay(self) -> Measured:
        replaying = Measured(None)
        replaying.taken = dict(self.taken)
        return replaying


async def measure(
    client: KubeClient,
    sessions: dict,
    body: dict[str, Any],
    spec: InferenceServiceSpec,
    default_prometheus_url: str | None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    now: float | None = None,
) -> Measured:
    """Every snapshot a run of ``spec`` reads, taken now (a dry run of the law with a throwaway
    actuator asks for them): pass the result to autotune_once as ``measured``."""
    owner = owner_of(body)
    session = _session(sessions, (owner.namespace, owner.name), spec, default_prometheus_url, timeout_s)
    if session.targets is not None:
        await _refresh_targets(client, session.targets, body, spec)
    measured = Measured(session.source)
    current = body.get("status") or {}
    memory = TunerMemory.load((current.get("tuner") or {}).get("memory"))
    refs = {pool: PoolRef(owner.namespace, owner.name, pool) for pool in measured_pools(spec)}
    actuator = _StatusActuator(spec, tuner_state(spec, current) or TunerState())
    with contextlib.suppress(InvalidLimits):  # the run that decides says so
        await Autotuner(spec, measured, refs, memory=memory).step(actuator, now or time.time())
    return measured.replay()


async def _refresh_targets(client: KubeClient, targets: _PodTargets, body: dict, spec: InferenceServiceSpec) -> None:
    owner = owner_of(body)
    for pool in measured_pools(spec):
        pods = await client.list(POD, owner.namespace, serving_selector(owner, spec, pool))
        urls = []
        for pod in pods:
            status = pod.get("status") or {}
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
            if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                urls.append(f"http://{status['podIP']}:{METRICS_PORT}/metrics")
        targets.urls[PoolRef(owner.namespace, owner.name, pool)] = urls


async def autotune_once(
    client: KubeClient,
    sessions: dict,
    body: dict[str, Any],
    spec: InferenceServiceSpec,
    default_prometheus_url: str | None,
    now: float | None = None,
    measured: Measured | None = None,
) -> tuple[AutotuneOutcome, dict[str, Any]]:
    """Run the tuner once and write its status. Returns the outcome and the body with that status.
    Raises InvalidLimits, after setting TunerActive=False (InvalidBounds), when the spec leaves a
    knob no valid value. ``measured``: the snapshots ``measure`` took, read instead of measuring."""
    owner = owner_of(body)
    current = body.get("status") or {}
    source: MetricSource
    if measured is not None:
        source = measured
    else:
        session = _session(sessions, (owner.namespace, owner.name), spec, default_prometheus_url)
        if session.targets is not None:
            await _refresh_targets(client, session.targets, body, spec)
        source = session.source
    memory = TunerMemory.load((current.get("tuner") or {}).get("memory"))  # unreadable: start afresh
    refs = {pool: PoolRef(owner.namespace, owner.name, pool) for pool in measured_pools(spec)}
    # Observing, the tuner starts from what runs (the spec's values, or an autoscaler's replicas)
    # and its decision stays in lastDecision: status.tuner keeps only its memory.
    actuator = _StatusActuator(spec, tuner_state(spec, current) or TunerState())
    if spec.autotune.mode == "observe" and spec.external_autoscaler:
        actuator.running = await _running_replicas(client, owner, spec)
    generation = body["metadata"].get("generation")
    try:
        outcome = await Autotuner(spec, source, refs, memory=memory).step(actuator, now or time.time())
    except InvalidLimits as exc:  # hold, and say why where users look
        condition = Condition(TUNER_ACTIVE, "False", "InvalidBounds", str(exc))
        conditions = merge_conditions(current.get("conditions") or [], [condition], generation, st.now())
        await client.patch_status(INFERENCE_SERVICE, owner.namespace, owner.name, {"conditions": conditions})
        raise
    patch = {
        # whole: what an earlier run wrote and this one did not (a pool of the old mode, a
        # quantity it could not measure, a hold's reason) must not stay beside this run's word
        **{key: st.replacing(current.get(key), value) for key, value in outcome.status.items()},
        "conditions": merge_conditions(
            current.get("conditions") or [],
            [outcome.condition, *([outcome.scaling] if outcome.scaling is not None else [])],
            generation,
            st.now(),
        ),
    }
    await client.patch_status(INFERENCE_SERVICE, owner.namespace, owner.name, patch)
    return outcome, {**body, "status": st.merge_patched(current, patch)}


async def _running_replicas(client: KubeClient, owner: Owner, spec: InferenceServiceSpec) -> dict[str, int]:
    """Each pool's Deployment (or LeaderWorkerSet) replicas, as an external autoscaler left them."""
    running = {}
    for pool in spec.active_pools:
        kind = LEADER_WORKER_SET if spec.layout(pool).spans_nodes else DEPLOYMENT
        deployment = await client.get(kind, owner.namespace, pool_object_name(owner, pool))
        replicas = ((deployment or {}).get("spec") or {}).get("replicas")
        if isinstance(replicas, int):
            running[pool] = replicas
    return running


def new_events(outcome: AutotuneOutcome, previous_status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The run's Events, less a hold warning already given for the same reason, and a Warning
    where ScalingLimited turns to a reason the user acts on (run.scaling_event)."""
    was = condition_of(previous_status, TUNER_ACTIVE) or {}
    repeated = was.get("reason") == outcome.condition.reason and was.get("message") == outcome.condition.message
    events = [e for e in outcome.events if not (e[1] == "TunerHolding" and repeated)]
    limited = condition_of(previous_status, SCALING_LIMITED) or {}
    limit = scaling_event(outcome.scaling, limited.get("reason") if limited.get("status") == "True" else None)
    return events + ([limit] if limit is not None else [])


async def prepare_scale_down(
    client: KubeClient, body: dict[str, Any], outcome: AutotuneOutcome, spec: InferenceServiceSpec
) -> None:
    """For each pool the run scales down: mark its pods' in-flight work as their deletion cost, so
    the ReplicaSet removes the idlest (each then drains on SIGTERM). Not a LeaderWorkerSet's: it
    removes the groups of the highest indexes, whatever their cost."""
    owner = owner_of(body)
    for change in outcome.decision.changes:
        if change.knob != "replicas" or change.new >= change.old or spec.layout(change.pool).spans_nodes:
            continue
        pods = await client.list(POD, owner.namespace, serving_selector(owner, spec, change.pool))
        loads = await asyncio.gather(*(_in_flight(pod) for pod in pods))
        in_flight = {pod["metadata"]["name"]: n for pod, n in zip(pods, loads, strict=True) if n is not None}
        await rank_pods_for_scale_down(client, owner, change.pool, in_flight)


async def _in_flight(pod: dict[str, Any]) -> float | None:
    """Running plus waiting requests from the pod's /load; None if it cannot say (it then goes first)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    try:
        async with httpx.AsyncClient(timeout=1.0) as http:
            load = (await http.get(f"http://{ip}:{METRICS_PORT}/load")).json()
        return float(load["running"]) + float(load["waiting"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
