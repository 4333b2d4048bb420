"""kopf handlers: every trigger runs the same level-triggered pass (reconcile/converge.py) for one
InferenceService, serialized per object.

Triggers: create, update and resume (operator start) of an InferenceService; a periodic resync
timer that repairs drift (e.g. a deleted Service); changes of the Deployments it owns, so status
follows readiness and a deleted Deployment comes back; and a router's wake request (its fleet's
wake ConfigMap stamped), which brings pools at zero back at once. Deletion needs no handler: every
child carries an owner reference and the garbage collector removes it. (kopf adds its finalizer
only because timers need one; it removes it itself when the object goes.)

Run: ``llm-fleet operator`` (cli.py) or ``kopf run --standalone -m llmfleet.operator.handlers``.

The tuner (a daemon per InferenceService, daemon.py) writes its decision into ``status.tuner``
({replicas: {pool: n}, knobs: {pool: {maxBatchSize: ...}}}), then runs ``reconcile_now``.
Knobs land in the engine ConfigMaps (pods apply them live), replicas in the Deployments; spec
bounds and min/max replicas are enforced by reconcile, whatever the tuner asks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from llmfleet.arguments import positive
from llmfleet.operator import decision_metrics
from llmfleet.operator.daemon import autotune_once, measure, new_events, prepare_scale_down
from llmfleet.operator.metrics.prometheus import DEFAULT_TIMEOUT_S, redacted
from llmfleet.operator.reconcile.cluster import (
    INFERENCE_SERVICE,
    LEADER_WORKER_SET,
    POD_MONITOR,
    ApiError,
    KubeClient,
    load_configuration,
)
from llmfleet.operator.reconcile.converge import (
    LWS_MISSING,
    Outcome,
    converge,
    owner_of,
    report_api_trouble,
    write_status,
)
from llmfleet.operator.reconcile.desired import MANAGED_BY, MANAGED_BY_LABEL, OWNER_LABEL, POOL_LABEL
from llmfleet.operator.reconcile.wake import wake_patch
from llmfleet.operator.resource import pod_security
from llmfleet.operator.resource.spec import InferenceServiceSpec, SpecError, parse_spec
from llmfleet.operator.tuner.run import InvalidLimits
from llmfleet.server.wire.wake import WAKE_ANNOTATION

GROUP, VERSION, PLURAL = INFERENCE_SERVICE.group, INFERENCE_SERVICE.version, INFERENCE_SERVICE.plural
RESYNC_ENV = "LLMFLEET_OPERATOR_RESYNC_SECONDS"
PROMETHEUS_TIMEOUT_ENV = "LLMFLEET_PROMETHEUS_TIMEOUT_SECONDS"
POD_SECURITY_ALLOW_ENV = "LLMFLEET_POD_SECURITY_ALLOW"  # comma-separated pod_security keys


def seconds_from_env(name: str, default: float) -> float:
    """A number of seconds from the environment: one that is not a positive number ("1m") stops
    the operator with one line, not a traceback."""
    text = os.environ.get(name, str(default))
    try:
        return positive(text)
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"llm-fleet operator: {name}: {exc} (seconds, e.g. {default:g})") from None


RESYNC_SECONDS = seconds_from_env(RESYNC_ENV, 60)
SPEC_RECHECK_SECONDS = 5.0  # how soon the tuner daemon sees a new interval or autotune turned off
POD_MONITOR_CHECK_SECONDS = 300.0
ANNOTATION_PREFIX = "operator.llmfleet.io"
FINALIZER = "operator.llmfleet.io/finalizer"


@dataclass
class OperatorState:
    """Shared by all handlers of one operator process (kopf's memo holds it)."""

    client: KubeClient
    prometheus_url: str | None = None
    prometheus_timeout: float = DEFAULT_TIMEOUT_S  # seconds for one pool's queries
    allow: frozenset[str] = frozenset()  # the pod_security keys an admin allows
    pod_monitor_labels: dict[str, str] = field(default_factory=dict)
    metrics_peers: dict[str, str] = field(default_factory=dict)  # namespace labels that may scrape the servers
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    tuner_sessions: dict[tuple[str, str], Any] = field(default_factory=dict)  # metric sources kept between runs
    _pod_monitor: tuple[float, bool] | None = None
    _leader_worker_sets: tuple[float, bool] | None = None

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    async def pod_monitor_served(self) -> bool:
        """Is the Prometheus operator's PodMonitor CRD installed? Rechecked every few minutes."""
        if self._pod_monitor is None or time.monotonic() - self._pod_monitor[0] > POD_MONITOR_CHECK_SECONDS:
            self._pod_monitor = (time.monotonic(), await self.client.serves(POD_MONITOR))
        return self._pod_monitor[1]

    async def leader_worker_sets_served(self) -> bool:
        """Is the LeaderWorkerSet CRD installed? Rechecked every few minutes, and at the next pass
        after one that needed it and found none (forget_leader_worker_sets)."""
        cached = self._leader_worker_sets
        if cached is None or time.monotonic() - cached[0] > POD_MONITOR_CHECK_SECONDS:
            self._leader_worker_sets = (time.monotonic(), await self.client.serves(LEADER_WORKER_SET))
        return self._leader_worker_sets[1]

    def forget_leader_worker_sets(self) -> None:
        self._leader_worker_sets = None


def configure(settings: kopf.OperatorSettings, memo: Mapping[str, Any] | None = None) -> None:
    # kopf's bookkeeping goes into annotations under our prefix, never into our status schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = FINALIZER
    # Only our own events reach the API (kopf would post one per handler run otherwise).
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = "llm-fleet-operator"
    # On deletion kopf releases its finalizer once the object's daemon and timers have exited. A
    # resync caught mid-pass is given a few seconds to finish, then checked again shortly: kopf's
    # default would wait 60 s before looking again, and the delete would hang that long.
    settings.background.instant_exit_timeout = 5.0
    settings.background.cancellation_polling = 2.0
    # A throttled request waits as long as the API server asks, shorter or longer than kopf's own
    # backoff (kopf's default heeds Retry-After only when it is the longer).
    settings.networking.enforce_retry_after = True
    # A watch that goes quiet is reconnected rather than trusted forever.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo = memo or {}
    if memo.get("peering_lifetime"):  # how long a replica that stopped answering keeps the others paused
        settings.peering.lifetime = int(memo["peering_lifetime"])
    if memo.get("exact_namespaces"):  # watching listed namespaces: no cluster-wide reads at all
        settings.scanning.disabled = True


@kopf.on.login()
def login(logger: logging.Logger, **_: Any) -> kopf.ConnectionInfo | None:
    """kopf's connection, with the same credentials as our client (cluster.load_configuration),
    looked up when kopf logs in (again, on a 401), not when this module is imported."""
    try:
        configuration = load_configuration()
    except Exception as exc:  # no credentials, or a kubeconfig it cannot read (cli.py checks at start)
        logger.error(f"no Kubernetes credentials: {exc}")
        return None
    return connection_info(configuration)


def connection_info(configuration: Any) -> kopf.ConnectionInfo:
    """A kubernetes.client.Configuration in kopf's terms, read as kopf's own login_via_client
    reads it: the token through get_api_key_with_prefix, where refresh hooks and auth plugins
    put it; files the loader wrote (inline certificates) are temporary files."""
    header = configuration.get_api_key_with_prefix("BearerToken") or ""
    scheme, _, token = header.partition(" ")
    if not token:  # a bare token, no scheme
        scheme, token = "", scheme
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    configure(settings, memo)
    url = memo.get("prometheus_url") or os.environ.get("LLMFLEET_PROMETHEUS_URL") or None
    timeout = memo.get("prometheus_timeout") or seconds_from_env(PROMETHEUS_TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    labels = dict(memo.get("pod_monitor_labels") or {})
    peers = dict(memo.get("metrics_peers") or {})
    allow = memo.get("pod_security_allow")
    if allow is None:  # kopf run -m llmfleet.operator.handlers: the CLI checked nothing
        allow = [key for key in os.environ.get(POD_SECURITY_ALLOW_ENV, "").replace(",", " ").split() if key]
        if unknown := pod_security.unknown_keys(allow):
            logger.error(f"{POD_SECURITY_ALLOW_ENV}: no such pod security keys {unknown}; they allow nothing")
    client = await asyncio.to_thread(KubeClient.from_environment)  # reads files, may run a kubeconfig's exec plugin
    memo.llmfleet = OperatorState(
        client, url, timeout, frozenset(allow), pod_monitor_labels=labels, metrics_peers=peers
    )
    if allow:
        logger.warning(f"pod options allowed beyond the defaults: {', '.join(sorted(allow))}")
    if memo.get("metrics_port"):
        from prometheus_client import start_http_server

        start_http_server(memo.metrics_port, registry=decision_metrics.REGISTRY)
        logger.info(f"tuner metrics on :{memo.metrics_port}/metrics")
    shown = redacted(url) if url else "direct scraping"
    logger.info(f"llm-fleet operator ready (prometheus: {shown}, resync: {RESYNC_SECONDS}s)")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState | None = memo.get("llmfleet")
    if state is not None:
        await state.client.close()


async def reconcile_now(body: Mapping[str, Any], memo: kopf.Memo, logger: logging.Logger) -> Outcome:
    """One pass for one InferenceService, posting Events for what changed. Safe to call any time:
    the pass converges to the object as the API server has it now, read under the lock, so a pass
    that waited there (behind a tuner run, say) never applies an older spec over a newer one's."""
    state: OperatorState = memo.llmfleet
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return Outcome()  # going away: the garbage collector takes the children
    async with state.lock(meta["namespace"], meta["name"]):
        raw: dict[str, Any] = dict(body)
        try:
            raw = await state.client.get(INFERENCE_SERVICE, meta["namespace"], meta["name"])
            if raw is None or raw["metadata"].get("deletionTimestamp"):
                return Outcome()
            served = await state.pod_monitor_served()
            outcome = await converge(
                state.client,
                raw,
                pod_monitor=served,
                pod_monitor_labels=state.pod_monitor_labels,
                metrics_peers=state.metrics_peers,
                allow=state.allow,
                leader_worker_sets=await state.leader_worker_sets_served(),
            )
            if outcome.degraded is not None and outcome.degraded.reason == LWS_MISSING:
                state.forget_leader_worker_sets()  # installed meanwhile? the next pass looks again
        except ApiError as exc:  # retryable: kopf retries its tracked handlers; event handlers wait for resync
            trouble = await report_api_trouble(state.client, raw, exc)
            if trouble is not None:
                kopf.event(raw, type=trouble.type, reason=trouble.reason, message=trouble.message)
            raise kopf.TemporaryError(f"API server: {exc}", delay=5) from exc
    for event in outcome.events:
        kopf.event(raw, type=event.type, reason=event.reason, message=event.message)
        (logger.warning if event.type == "Warning" else logger.info)(f"{event.reason}: {event.message}")
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=10)
@kopf.on.update(GROUP, VERSION, PLURAL, backoff=10)
async def reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    await reconcile_now(body, memo, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=10)
async def resync(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    await reconcile_now(body, memo, logger)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10, backoff=10)
async def autotune(
    body: kopf.Body, meta: kopf.Meta, memo: kopf.Memo, logger: logging.Logger, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """The tuner, every spec.autotune.intervalSeconds. The daemon's body is live: it looks at the
    spec every few seconds, so a shorter interval or autotune turned off takes effect then, not
    after the old interval has run out. Stale metrics or a failed run hold everything until the
    next one."""
    state: OperatorState = memo.llmfleet
    key = (meta.namespace, meta.name)
    loop = asyncio.get_running_loop()
    last_run = loop.time()
    try:
        while not stopped:
            spec = _tunable_spec(body, state.allow)
            if spec is None:
                decision_metrics.forget(*key)  # a tuner that is off has no last decision to plot or alert on
                await pause(stopped, SPEC_RECHECK_SECONDS)
                continue
            due_in = last_run + spec.autotune.interval_seconds - loop.time()
            if due_in > 0:
                await pause(stopped, min(due_in, SPEC_RECHECK_SECONDS))
                continue
            last_run = loop.time()
            await tune_now(copy.deepcopy(dict(body)), memo, logger)
    finally:
        state.tuner_sessions.pop(key, None)
        decision_metrics.forget(*key)


async def pause(stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Wait until the daemon is stopped or ``seconds`` pass. Not ``stopped.wait(seconds)``: that
    waits in a task of its own which ends in TimeoutError, and where the daemon outlives kopf's
    daemon killer at exit, kopf re-raises what its leftover tasks ended with: the operator
    exited 1 on SIGTERM. Cancelling this wait ends that task cancelled, which kopf lets be."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stopped.wait()


def _tunable_spec(body: Mapping[str, Any], allow: frozenset[str]) -> InferenceServiceSpec | None:
    """The parsed spec when autotune is on; None when it is off, invalid or refused (converge
    reports those as Degraded)."""
    raw = dict(body.get("spec") or {})
    try:
        spec = parse_spec(raw)
    except SpecError:
        return None
    if pod_security.refusals(raw, body["metadata"]["name"], allow):
        return None
    return spec if spec.autotune.enabled else None


async def tune_now(raw: dict[str, Any], memo: kopf.Memo, logger: logging.Logger) -> None:
    """One tuner run for one InferenceService, then the converge pass that applies it. The spec is
    read afresh under the lock: an edit made while the daemon waited (bounds, autotune off) counts."""
    state: OperatorState = memo.llmfleet
    meta = raw["metadata"]
    if meta.get("deletionTimestamp"):
        return
    client = state.client
    try:
        # Measured outside the lock: a slow Prometheus (or pods' /metrics) holds up no reconcile
        # pass of this object, which waits on that lock.
        before = await client.get(INFERENCE_SERVICE, meta["namespace"], meta["name"])
        spec = (
            None
            if before is None or before["metadata"].get("deletionTimestamp")
            else _tunable_spec(before, state.allow)
        )
        if spec is None:
            return
        measured = await measure(
            client, state.tuner_sessions, before, spec, state.prometheus_url, state.prometheus_timeout
        )
    except ApiError as exc:
        logger.warning(f"tuner run skipped, API server: {exc}")
        return
    async with state.lock(meta["namespace"], meta["name"]):
        fresh = await client.get(INFERENCE_SERVICE, meta["namespace"], meta["name"])
        spec = (
            None if fresh is None or fresh["metadata"].get("deletionTimestamp") else _tunable_spec(fresh, state.allow)
        )
        if spec is None:
            return
        try:
            outcome, raw = await autotune_once(
                client, state.tuner_sessions, fresh, spec, state.prometheus_url, measured=measured
            )
        except ApiError as exc:
            logger.warning(f"tuner run skipped, API server: {exc}")
            return
        except InvalidLimits as exc:  # in status as TunerActive=False; retrying now would fail the same way
            logger.warning(f"tuner run skipped: {exc}")
            return
    decision_metrics.record(meta["namespace"], meta["name"], outcome, spec.slo)
    for type_, reason, message in new_events(outcome, fresh.get("status") or {}):
        kopf.event(raw, type=type_, reason=reason, message=message)
    logger.info(f"tuner: {outcome.condition.reason}: {outcome.status['lastDecision']['reason']}")
    if outcome.decision.changes and not outcome.observed:
        try:
            await prepare_scale_down(state.client, raw, outcome, spec)
        except ApiError as exc:  # ranking only picks which pods go: the scale-down itself must land
            logger.warning(f"could not rank pods for the scale-down, the ReplicaSet picks: {exc}")
        await reconcile_now(raw, memo, logger)


def _owner_name(body: kopf.Body) -> str | None:
    """The InferenceService that controls a child, by its owner reference."""
    return next(
        (
            ref["name"]
            for ref in body.metadata.get("ownerReferences") or []
            if ref.get("controller") and ref.get("kind") == INFERENCE_SERVICE.kind
        ),
        None,
    )


@kopf.on.event(
    "",
    "v1",
    "configmaps",
    labels={OWNER_LABEL: kopf.PRESENT, MANAGED_BY_LABEL: MANAGED_BY, POOL_LABEL: "router"},
    annotations={WAKE_ANNOTATION: kopf.PRESENT},
)
async def wake_requested(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """A router holds requests for a pool with no server: bring the pools at zero back now."""
    owner_name = _owner_name(body)
    if owner_name is None or body.metadata.namespace is None or body.get("type") == "DELETED":
        return
    stamp = body.metadata.annotations[WAKE_ANNOTATION]
    await wake_now(body.metadata.namespace, owner_name, stamp, memo, logger)


async def wake_now(namespace: str, name: str, stamp: str, memo: kopf.Memo, logger: logging.Logger) -> None:
    """The pools at zero go to their floor in ``status.tuner`` (under the object's lock, as the
    tuner writes it), then the pass that scales their Deployments. A request stamped again while a
    wake waits for its pods runs that pass again."""
    state: OperatorState = memo.llmfleet
    async with state.lock(namespace, name):
        try:
            fresh = await state.client.get(INFERENCE_SERVICE, namespace, name)
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return
            try:
                spec = parse_spec(dict(fresh.get("spec") or {}))
            except SpecError:  # what ran before still serves, and wakes (wake.py)
                spec = None
            # a conflict (kopf's own annotations, an edit) reads again and writes again
            patch = await write_status(
                state.client, owner_of(fresh), fresh, lambda status: wake_patch(spec, status, stamp) or {}
            )
        except ApiError as exc:  # kopf never retries an event handler: the router asks again
            logger.warning(f"could not wake {namespace}/{name} (requested {stamp}): API server: {exc}")
            return
    if patch is None:
        if ((fresh.get("status") or {}).get("wake") or {}).get("pools"):
            # woken already, not served yet: the pass that scales the pools may have met API trouble
            # (it is not retried), and the router asks again every few seconds while it holds requests
            await pass_from_an_event(fresh, memo, logger)
        return
    woken = ", ".join(f"{pool} 0 -> {n}" for pool, n in patch["tuner"]["replicas"].items())
    logger.info(f"woken by a router holding requests (requested {stamp}): {woken}")
    kopf.event(fresh, type="Normal", reason="Woken", message=f"a router holds requests: {woken}")
    await pass_from_an_event(fresh, memo, logger)


@kopf.on.event("apps", "v1", "deployments", labels={OWNER_LABEL: kopf.PRESENT, MANAGED_BY_LABEL: MANAGED_BY})
@kopf.on.event(
    LEADER_WORKER_SET.group,
    LEADER_WORKER_SET.version,
    LEADER_WORKER_SET.plural,
    labels={OWNER_LABEL: kopf.PRESENT, MANAGED_BY_LABEL: MANAGED_BY},
)
async def deployment_changed(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Readiness changed, or the Deployment (or a pool's LeaderWorkerSet) was deleted: re-run the
    owner's pass. kopf watches LeaderWorkerSets only where their CRD is installed."""
    owner_name = _owner_name(body)
    if owner_name is None or body.metadata.namespace is None:
        return
    # the pass reads the owner itself, and does nothing for one that is gone or going away
    await pass_from_an_event({"metadata": {"namespace": body.metadata.namespace, "name": owner_name}}, memo, logger)


async def pass_from_an_event(body: Mapping[str, Any], memo: kopf.Memo, logger: logging.Logger) -> None:
    """reconcile_now for an event handler, which kopf never retries: API trouble is a warning
    that says what comes back to it (the resync timer), not an error promising a retry."""
    try:
        await reconcile_now(body, memo, logger)
    except kopf.TemporaryError as exc:
        logger.warning(f"pass not done: {exc}; the resync, within {RESYNC_SECONDS:g} s, runs it again")
