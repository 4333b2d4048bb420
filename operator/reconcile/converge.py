"""One reconcile pass for one InferenceService: parse the spec, compute the desired objects
(desired.py), apply the differences (apply.py), and write the status only if it changed.

No kopf here: handlers.py calls this from kopf's handlers and posts the returned events. The tuner
calls it too, after it has written its decision into ``status.tuner`` (see handlers.reconcile_now).
Level-triggered: a pass over an unchanged spec and unchanged cluster makes no write at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from llmfleet.operator.reconcile import status as st
from llmfleet.operator.reconcile.apply import ApplyResult, OwnershipConflict, apply_all, list_children
from llmfleet.operator.reconcile.cluster import (
    DEPLOYMENT,
    INFERENCE_SERVICE,
    LEADER_WORKER_SET,
    POD,
    ApiError,
    KubeClient,
    child_kinds,
)
from llmfleet.operator.reconcile.desired import (
    POOL_LABEL,
    WORKLOAD_KINDS,
    Owner,
    client_url,
    desired_objects,
    live_workload,
    selector,
)
from llmfleet.operator.reconcile.handover import Handover, pending_handover
from llmfleet.operator.reconcile.kv_secret import ensure_kv_secret
from llmfleet.operator.reconcile.pod_trouble import PodTrouble, pod_trouble
from llmfleet.operator.reconcile.wake import cold_starts, unapplied_wakes, wakes_from_zero
from llmfleet.operator.resource import pod_security
from llmfleet.operator.resource.conditions import (
    DEGRADED,
    PROGRESSING,
    READY,
    SCALING_LIMITED,
    TUNER_ACTIVE,
    Condition,
    condition_of,
    merge_conditions,
)
from llmfleet.operator.resource.spec import (
    InferenceServiceSpec,
    SpecError,
    group_name_problem,
    name_problem,
    parse_spec,
    require_image,
)
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine

STATUS_ATTEMPTS = 3
LWS_MISSING = "LeaderWorkerSetMissing"


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Outcome:
    applied: ApplyResult | None = None
    degraded: Condition | None = None
    status_patch: dict[str, Any] | None = None  # what was written to status (None: nothing)
    events: list[Event] = field(default_factory=list)


def owner_of(body: dict[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def tuner_state(spec: InferenceServiceSpec, status: dict[str, Any]) -> TunerState | None:
    """The tuner's replicas and knobs count only while autotuning is on and acting (an observing
    tuner changes nothing)."""
    return TunerState.from_status(status) if spec.autotune.enabled and spec.autotune.mode == "act" else None


async def converge(
    client: KubeClient,
    body: dict[str, Any],
    *,
    pod_monitor: bool,
    pod_monitor_labels: dict[str, str] | None = None,
    metrics_peers: dict[str, str] | None = None,
    allow: Iterable[str] = (),
    leader_worker_sets: bool = False,
) -> Outcome:
    """``allow``: the pod_security keys the operator allows; a spec breaking another is refused.
    ``leader_worker_sets``: the cluster serves the LeaderWorkerSet CRD; without it, a spec with a
    pool whose replicas span nodes is refused (LeaderWorkerSetMissing), and what runs stays."""
    owner = owner_of(body)
    status = body.get("status") or {}
    generation = body["metadata"].get("generation")
    problem = name_problem(owner.name)
    if problem is not None:  # the CRD's rule rejects it where the API server runs CEL (1.25+)
        return await _degrade(client, owner, body, "InvalidName", problem)
    try:
        spec = parse_spec(body.get("spec") or {})
        require_image(spec)
    except SpecError as err:
        return await _degrade(client, owner, body, err.reason, str(err), stops_tuner=True)
    refused = pod_security.refusals(body.get("spec") or {}, owner.name, allow)
    if refused:  # nothing is applied; what runs (from before) keeps running
        return await _degrade(client, owner, body, pod_security.REASON, "; ".join(refused), stops_tuner=True)

    problem = group_name_problem(owner.name, spec)
    if problem is not None:
        return await _degrade(client, owner, body, "InvalidName", problem)
    spanning = [pool for pool in spec.active_pools if spec.layout(pool).spans_nodes]
    if spanning and not leader_worker_sets:
        return await _degrade(client, owner, body, LWS_MISSING, _lws_missing(spec, spanning))
    tuner = tuner_state(spec, status)
    kinds = child_kinds(pod_monitor=pod_monitor, leader_worker_sets=leader_worker_sets)
    try:
        live = await list_children(client, owner.namespace, selector(owner), kinds)
        handover = pending_handover(owner, spec, live, status.get("handoverPool"))
        objects = desired_objects(
            owner,
            spec,
            tuner,
            pod_monitor=pod_monitor,
            pod_monitor_labels=pod_monitor_labels,
            serving=handover.serving if handover else None,
            router_mode=handover.router_mode if handover else None,
            scaled=_replicas(live),
            metrics_peers=metrics_peers,
        )
        secret = await ensure_kv_secret(client, owner, spec)  # before the pods that read it
        applied = await apply_all(client, owner.namespace, owner.uid, live, objects, prune=handover is None)
        if secret is not None:
            applied.created.insert(0, secret)
    except OwnershipConflict as err:
        return await _degrade(client, owner, body, "NameConflict", str(err))
    except ApiError as err:
        if err.retryable:
            raise
        return await _degrade(client, owner, body, "ApplyFailed", f"{err.reason}: {err.message}")

    pools = _pool_states(owner, spec, applied)
    trouble = await _pods_trouble(client, owner, pools)
    serving = st.serving_conditions(
        pools,
        applied.summary() if applied.changed else None,
        trouble,
        handover.message if handover else None,
        wakes=wakes_from_zero(spec),
    )
    serving.append(Condition(DEGRADED, "False", "AsExpected", ""))

    def build(current: dict[str, Any]) -> dict[str, Any]:
        conditions = serving + _tuner_condition(spec, current)
        # A tuner turned off lets go of what it owned: turned on again, it starts from the spec's
        # values, not from what it had set back then (applied at once, with no run to explain it).
        # Its latencies and spend go too: nobody measures them any more, yet kubectl get would show them.
        # lastDecision stays, with its time: what it last did.
        released = {key: None for key in ("tuner", "latency", "cost") if not spec.autotune.enabled and current.get(key)}
        pool_status, wake = cold_starts(current, _pool_status(owner, spec, tuner, pools), pools)
        return {
            "observedGeneration": generation,
            "conditions": merge_conditions(current.get("conditions") or [], conditions, generation, st.now()),
            "ready": st.ready_summary(pools),
            "url": client_url(owner),
            "pools": pool_status,
            "batch": _batch(spec, tuner),
            **released,
            **_handover_record(handover, current),
            **wake,
        }

    outcome = Outcome(applied=applied)
    outcome.status_patch = await write_status(client, owner, body, build)
    if applied.reverted:
        outcome.events.append(Event("Warning", "EditReverted", _reverted_message(spec, applied.reverted)))
    if applied.changed:
        outcome.events.append(Event("Normal", "Applied", applied.summary()))
    was = condition_of(status, DEGRADED)
    if was and was.get("status") == "True":
        outcome.events.append(Event("Normal", "Recovered", f"no longer degraded ({was.get('reason')})"))
    return outcome


def _lws_missing(spec: InferenceServiceSpec, spanning: list[str]) -> str:
    sizes = ", ".join(f"{pool} {spec.pool(pool).parallelism.devices} GPUs a replica" for pool in spanning)
    return (
        f"{sizes}: more than a node's {spec.gpus_per_node} (gpusPerNode), so each replica runs as a "
        f"LeaderWorkerSet group ({LEADER_WORKER_SET.api_version}), and this cluster does not serve that CRD: "
        "install LeaderWorkerSet (lws.sigs.k8s.io), or keep a replica within one node"
    )


def _handover_record(handover: Handover | None, current: dict[str, Any]) -> dict[str, Any]:
    """status.handoverPool while a mode switch holds (handover.py), removed once it is over."""
    if handover is not None:
        return {"handoverPool": handover.record}
    return {"handoverPool": None} if current.get("handoverPool") else {}


TUNER_WAITS = "the tuner waits for a servable spec"  # TunerActive while the spec cannot be read


async def _degrade(
    client: KubeClient, owner: Owner, body: dict[str, Any], reason: str, message: str, *, stops_tuner: bool = False
) -> Outcome:
    """Report a spec or object the operator cannot serve; existing objects keep serving, and
    Ready and ``status.ready`` keep following them (a pool that lost its pods while the spec is
    unservable must not read as ready). ``stops_tuner``: the spec cannot be read, so the tuner
    does not run either."""
    generation = body["metadata"].get("generation")
    degraded = Condition(DEGRADED, "True", reason, message)
    pools = await _live_pools(client, owner, body.get("status") or {})

    def build(current: dict[str, Any]) -> dict[str, Any]:
        updates = [degraded, Condition(PROGRESSING, "False", reason, "waiting for a servable spec")]
        if stops_tuner:  # the tuner's last word would stand for ever, though it no longer runs
            updates += _tuner_stopped(current, reason, TUNER_WAITS)
        serving = {}
        if pools:  # what the last servable spec deployed; a pool the tuner put at zero still wakes
            tuned = TunerState.from_status(current).replicas
            wakes = any(tuned.get(p.name) == 0 for p in pools if p.replicas == 0)
            updates.append(st.serving_conditions(pools, None, wakes=wakes)[0])
            serving["ready"] = st.ready_summary(pools)
        elif condition_of(current, READY) is None:
            updates.append(Condition(READY, "False", reason, "nothing deployed yet"))
        return {
            "observedGeneration": generation,
            "conditions": merge_conditions(current.get("conditions") or [], updates, generation, st.now()),
            **serving,
        }

    outcome = Outcome(degraded=degraded)
    outcome.status_patch = await write_status(client, owner, body, build)
    was = condition_of(body.get("status"), DEGRADED) or {}
    if (was.get("status"), was.get("reason"), was.get("message")) != ("True", reason, message):
        outcome.events.append(Event("Warning", reason, message))
    return outcome


API_TROUBLE = "APIServerError"


async def report_api_trouble(client: KubeClient, body: dict[str, Any], error: ApiError) -> Event | None:
    """A pass the API server cut short once the client's own retries were spent (throttled, 5xx,
    unreachable): say so in Progressing (Unknown: what runs is unknown), where status can still be
    written, and return the Warning to post when that is news. The caller retries the pass; a
    409 is a race, not trouble, and says nothing. A status write that fails too is left unsaid."""
    if error.status == 409 or not error.retryable or "uid" not in (body.get("metadata") or {}):
        return None
    owner = owner_of(body)
    message = f"the API server failed a request: {error}; retrying"
    progressing = Condition(PROGRESSING, "Unknown", API_TROUBLE, message)

    def build(current: dict[str, Any]) -> dict[str, Any]:
        generation = body["metadata"].get("generation")
        return {"conditions": merge_conditions(current.get("conditions") or [], [progressing], generation, st.now())}

    try:
        written = await write_status(client, owner, body, build)
    except ApiError:
        return None
    return Event("Warning", API_TROUBLE, message) if written is not None else None


async def write_status(
    client: KubeClient, owner: Owner, body: dict[str, Any], build: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any] | None:
    """Write build(status) if it differs, under an optimistic lock (the resourceVersion we read):
    the tuner writes status too, and a blind write could drop its latest word. On a conflict,
    read again and rebuild from the fresh status. The passes write through it, and so does the
    wake handler, which kopf (an event handler's) would never retry."""
    current = body
    for attempt in range(STATUS_ATTEMPTS):
        status = current.get("status") or {}
        patch = st.status_patch(status, build(status))
        if patch is None:
            return None
        version = current["metadata"].get("resourceVersion")
        try:
            await client.patch_status(INFERENCE_SERVICE, owner.namespace, owner.name, patch, resource_version=version)
            return patch
        except ApiError as err:
            if err.status != 409 or attempt == STATUS_ATTEMPTS - 1:
                raise
        fresh = await client.get(INFERENCE_SERVICE, owner.namespace, owner.name)
        if fresh is None or fresh["metadata"].get("uid") != owner.uid:
            return None  # deleted meanwhile
        current = fresh
    return None


def _replicas(live: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Each live Deployment's (or LeaderWorkerSet's: groups) replica count, by pool."""
    return {
        obj["metadata"]["labels"][POOL_LABEL]: int(obj["spec"].get("replicas", 1))
        for obj in live.values()
        if obj["kind"] in WORKLOAD_KINDS and POOL_LABEL in (obj["metadata"].get("labels") or {})
    }


def _reverted_message(spec: InferenceServiceSpec, reverted: list[str]) -> str:
    owner = (
        "the tuner owns replicas and knobs while spec.autotune.enabled is true: steer it through the spec "
        "(slo, minReplicas/maxReplicas, bounds)"
        if spec.autotune.enabled
        else "the InferenceService's spec owns them: edit it instead"
    )
    return f"set back what was edited outside the InferenceService ({'; '.join(reverted)}); {owner}"


async def _live_pools(client: KubeClient, owner: Owner, status: dict[str, Any]) -> list[st.PoolState]:
    """Each pool's live workload as it stands, whatever the spec says (a degraded pass):
    Deployments, and LeaderWorkerSets where the cluster serves them. A pool a router woke
    (wake.py) that still runs nothing is scaled here: a degraded pass applies nothing else, and
    the requests the routers hold must not wait for a fix of the spec."""
    workloads = list(await client.list(DEPLOYMENT, owner.namespace, selector(owner)))
    try:
        workloads += await client.list(LEADER_WORKER_SET, owner.namespace, selector(owner))
    except ApiError as err:
        if err.retryable:
            raise  # not served (a 404) is no LeaderWorkerSet
    by_pool = {
        w["metadata"]["labels"][POOL_LABEL]: w for w in workloads if POOL_LABEL in w["metadata"].get("labels", {})
    }
    replicas = {pool: int((w.get("spec") or {}).get("replicas") or 0) for pool, w in by_pool.items()}
    for pool, woken in unapplied_wakes(status, replicas).items():
        kind = LEADER_WORKER_SET if by_pool[pool]["kind"] == LEADER_WORKER_SET.kind else DEPLOYMENT
        await client.patch_merge(
            kind, owner.namespace, by_pool[pool]["metadata"]["name"], {"spec": {"replicas": woken}}
        )
        replicas[pool] = woken
    return [st.PoolState.of(pool, replicas[pool], by_pool[pool]) for pool in sorted(by_pool)]


def _pool_states(owner: Owner, spec: InferenceServiceSpec, applied: ApplyResult) -> list[st.PoolState]:
    states = []
    for pool in spec.deployed_pools:
        workload = live_workload(applied.live, owner, pool)
        replicas = int(((workload or {}).get("spec") or {}).get("replicas") or 0)
        states.append(st.PoolState.of(pool, replicas, workload))
    return states


async def _pods_trouble(client: KubeClient, owner: Owner, pools: list[st.PoolState]) -> PodTrouble | None:
    """Why the first pool short of ready pods is stuck, read from its pods (None: only starting)."""
    for pool in pools:
        if pool.ready >= pool.replicas:
            continue
        try:
            pods = await client.list(POD, owner.namespace, selector(owner, pool.name))
        except ApiError as err:
            if err.retryable:
                raise
            return None  # the counts alone still say it is not ready
        trouble = pod_trouble(pool.name, pods)
        if trouble is not None:
            return trouble
    return None


def _pool_status(
    owner: Owner, spec: InferenceServiceSpec, tuner: TunerState | None, pools: list[st.PoolState]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool in pools:
        entry: dict[str, Any] = {"replicas": pool.replicas, "readyReplicas": pool.ready}
        if pool.name != "router":
            engine = effective_engine(spec, pool.name, tuner)
            entry["knobs"] = {knob: getattr(engine, attr) for knob, attr in st.REPORTED_KNOBS.items()}
        out[pool.name] = entry
    return out


def _batch(spec: InferenceServiceSpec, tuner: TunerState | None) -> int:
    pool = "decode" if spec.mode == "disaggregated" else "colocated"
    return effective_engine(spec, pool, tuner).max_batch_size


def _tuner_stopped(status: dict[str, Any], reason: str, message: str) -> list[Condition]:
    """TunerActive False, and ScalingLimited Unknown where a run wrote it: no run revises it now."""
    stopped = [Condition(TUNER_ACTIVE, "False", reason, message)]
    if condition_of(status, SCALING_LIMITED) is not None:
        stopped.append(Condition(SCALING_LIMITED, "Unknown", reason, message))
    return stopped


def _tuner_condition(spec: InferenceServiceSpec, status: dict[str, Any]) -> list[Condition]:
    if not spec.autotune.enabled:
        return _tuner_stopped(status, "Disabled", "spec.autotune.enabled is false")
    current = condition_of(status, TUNER_ACTIVE)
    if current is None or current.get("reason") == "Disabled":
        return [Condition(TUNER_ACTIVE, "Unknown", "AwaitingMetrics", "the tuner has not reported yet")]
    if current.get("message") == TUNER_WAITS:  # a degraded pass's word, not the tuner's: the spec serves now
        return [Condition(TUNER_ACTIVE, "Unknown", "AwaitingMetrics", "the spec serves again; the tuner reports next")]
    return []  # the tuner's own word stands
