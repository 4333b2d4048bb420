"""A pool at zero, woken by its router: the real operator (kopf through KopfRunner) against the
emulated API server. The test plays the router (it stamps the wake ConfigMap, as its Role
allows) and the Deployment controller (readiness)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import kopf

from llmfleet.operator import handlers
from llmfleet.operator.reconcile.cluster import INFERENCE_SERVICE, KubeClient
from llmfleet.operator.reconcile.wake import wake_patch, wakes_from_zero
from llmfleet.operator.resource.spec import parse_spec
from llmfleet.server.wire.wake import WAKE_ANNOTATION, wake_stamp
from tests.operator.conftest import eventually, inference_service, settle
from tests.operator.test_handlers import TINY, conditions, mark_ready

SCALES_TO_ZERO = {
    **TINY,
    "pools": {"colocated": {**TINY["pools"]["colocated"], "minReplicas": 0}},
    # no tuner run during the test: the test sets what the tuner would (status.tuner)
    "autotune": {"intervalSeconds": 3600},
}


def replicas(kube, name: str = "tiny-colocated") -> int:
    return kube.get("Deployment", name)["spec"]["replicas"]


def scaled_to_zero(kube) -> None:
    """tiny, created warm (a pool that may go to zero starts at one), then found idle by the tuner:
    zero replicas (zero.py), written where the tuner writes them."""
    kube.create(inference_service("tiny", SCALES_TO_ZERO))
    eventually(lambda: kube.get("Deployment", "tiny-colocated") is not None)
    assert replicas(kube) == 1
    settle(kube, "tiny", 1)
    kube.patch("InferenceService", "tiny", {"status": {"tuner": {"replicas": {"colocated": 0}}}}, subresource="status")
    kube.patch("InferenceService", "tiny", {"metadata": {"annotations": {"poke": "1"}}})
    eventually(lambda: replicas(kube) == 0)


def test_a_wake_request_brings_a_pool_at_zero_back_at_once_and_its_cold_start_lands_in_status(kube, operator):
    scaled_to_zero(kube)
    mark_ready(kube, "tiny-colocated")
    mark_ready(kube, "tiny-router")
    ready = eventually(lambda: (c := kube.condition("tiny", "Ready"))["status"] == "True" and c)
    assert ready["reason"] == "ScaledToZero" and "the routers hold the next request and wake it" in ready["message"]

    # a router holds a request: it stamps its wake ConfigMap
    stamp = wake_stamp()
    asked = time.monotonic()
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: stamp}}})
    eventually(lambda: replicas(kube) == 1, timeout=10)
    reacted = time.monotonic() - asked
    print(f"the operator scaled the pool from zero {reacted:.2f} s after the wake request", file=sys.__stdout__)
    assert reacted < 5  # at once, not at the tuner's next run (an hour away here)
    status = kube.get("InferenceService", "tiny")["status"]
    assert status["tuner"]["replicas"] == {"colocated": 1}
    assert status["wake"] == {"requestedAt": stamp, "pools": ["colocated"]}
    eventually(lambda: any(e["reason"] == "Woken" for e in kube.events("tiny")))

    time.sleep(1.0)  # the pod loads its model
    mark_ready(kube, "tiny-colocated")
    pools = eventually(lambda: (s := kube.get("InferenceService", "tiny")["status"])["wake"]["pools"] == [] and s)
    cold = pools["pools"]["colocated"]["lastColdStartSeconds"]
    print(f"status.pools.colocated.lastColdStartSeconds: {cold}", file=sys.__stdout__)
    assert 1.0 <= cold < 30
    assert conditions(kube.get("InferenceService", "tiny"))["Ready"]["reason"] == "AllPoolsReady"

    # the same stamp seen again (the operator restarting lists it) wakes nothing
    kube.patch("InferenceService", "tiny", {"status": {"tuner": {"replicas": {"colocated": 0}}}}, subresource="status")
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: stamp, "again": "1"}}})
    eventually(lambda: replicas(kube) == 0)
    time.sleep(2)
    assert replicas(kube) == 0


def test_a_wake_that_loses_a_race_to_another_writer_reads_again_and_wakes(kube, operator, monkeypatch):
    """kopf never retries an event handler: a wake whose status write met a 409 (kopf's own
    annotations, an edit, landing between its read and its write) was dropped until the router
    asked again. It reads again and writes."""
    scaled_to_zero(kube)

    raced: list[str | None] = []
    write_status = KubeClient.patch_status

    async def another_writer_first(self, kind, namespace, name, status, resource_version=None):
        if "wake" in status and not raced:  # someone writes between the wake's read and its write
            raced.append(resource_version)
            await self.patch_merge(INFERENCE_SERVICE, namespace, name, {"metadata": {"annotations": {"edit": "1"}}})
        await write_status(self, kind, namespace, name, status, resource_version=resource_version)

    monkeypatch.setattr(KubeClient, "patch_status", another_writer_first)
    stamp = wake_stamp()
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: stamp}}})
    eventually(lambda: replicas(kube) == 1, timeout=10)  # from this one stamp: no router asks again here
    assert raced and raced[0] is not None  # the first write was conditional, and lost
    assert kube.get("InferenceService", "tiny")["status"]["wake"] == {"requestedAt": stamp, "pools": ["colocated"]}


def test_a_wake_whose_pass_met_api_trouble_passes_again_when_the_router_asks_again(kube, operator, monkeypatch):
    """The wake's status write landed and its pass met API trouble: the pool stayed at zero until
    the resync (60 s by default), as a stamp again found no pool at zero and did nothing. While the
    wake waits for its pods, each stamp runs the pass."""
    scaled_to_zero(kube)
    outage = [True]
    asked: list[str] = []
    real_pass, real_reconcile = handlers.pass_from_an_event, handlers.reconcile_now

    async def reconcile_in_an_outage(body, memo, logger):
        if outage[0]:
            raise kopf.TemporaryError("API server: 503 ServiceUnavailable", delay=5)
        return await real_reconcile(body, memo, logger)

    async def recorded(body, memo, logger):
        asked.append(body["metadata"]["name"])
        await real_pass(body, memo, logger)

    monkeypatch.setattr(handlers, "reconcile_now", reconcile_in_an_outage)
    monkeypatch.setattr(handlers, "pass_from_an_event", recorded)
    first = wake_stamp()
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: first}}})
    eventually(lambda: kube.get("InferenceService", "tiny")["status"].get("wake", {}).get("requestedAt") == first)
    eventually(lambda: "tiny" in asked)  # the wake's pass, which failed
    assert replicas(kube) == 0
    passes = len(asked)

    time.sleep(0.01)  # a later stamp, as the router's next one
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: wake_stamp()}}})
    eventually(lambda: len(asked) > passes)  # asked for the pass again
    outage[0] = False
    eventually(lambda: replicas(kube) == 1, timeout=10)


def test_an_observing_tuner_wakes_no_pool_its_replicas_do_not_run() -> None:
    # status.tuner.replicas left at zero by an acting tuner: observing, reconcile reads none of it
    # (the spec's replicas run), so a wake written there would bring nothing back
    status = {"tuner": {"replicas": {"colocated": 0}}}
    acting = parse_spec(SCALES_TO_ZERO)
    observing = parse_spec({**SCALES_TO_ZERO, "autotune": {**SCALES_TO_ZERO["autotune"], "mode": "observe"}})
    assert wakes_from_zero(acting) and wake_patch(acting, status, wake_stamp()) is not None
    assert not wakes_from_zero(observing) and wake_patch(observing, status, wake_stamp()) is None


def test_a_pool_at_zero_wakes_while_the_spec_cannot_be_served(kube, operator):
    """An unservable edit (past the CRD where CEL does not run) left a pool at zero for good: the
    wake handler stopped at the spec, and the degraded pass applies nothing, so the requests the
    routers held timed out. What ran before serves, and wakes."""
    scaled_to_zero(kube)
    broken = {"pools": {"colocated": {"engine": {"policy": "fastest"}}}}
    kube.patch("InferenceService", "tiny", {"spec": broken})
    eventually(lambda: kube.condition("tiny", "Degraded")["status"] == "True")
    mark_ready(kube, "tiny-router")
    kube.patch("InferenceService", "tiny", {"metadata": {"annotations": {"poke": "2"}}})
    # it wakes: the service answers, after a cold start
    eventually(
        lambda: (
            (kube.condition("tiny", "Ready")["status"], kube.condition("tiny", "Ready")["reason"])
            == ("True", "ScaledToZero")
        )
    )

    stamp = wake_stamp()
    kube.patch("ConfigMap", "tiny-wake", {"metadata": {"annotations": {WAKE_ANNOTATION: stamp}}})
    eventually(lambda: replicas(kube) == 1, timeout=10)
    status = kube.get("InferenceService", "tiny")["status"]
    assert status["wake"] == {"requestedAt": stamp, "pools": ["colocated"]}
    assert kube.condition("tiny", "Degraded")["reason"] == "InvalidEngineConfig"  # the spec still says why


def test_a_pass_an_event_asked_for_that_meets_api_trouble_warns_and_names_the_resync(monkeypatch, caplog) -> None:
    """kopf never retries an event handler (a wake, a Deployment's readiness): the pass's
    TemporaryError was logged as a handler that "failed temporarily", a retry that never came."""

    async def api_trouble(body, memo, logger):
        raise kopf.TemporaryError("API server: 503 ServiceUnavailable: etcd leader changed", delay=5)

    monkeypatch.setattr(handlers, "reconcile_now", api_trouble)
    with caplog.at_level(logging.WARNING, logger="wake-test"):
        asyncio.run(handlers.pass_from_an_event({"metadata": {}}, None, logging.getLogger("wake-test")))
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "503 ServiceUnavailable" in record.message
    assert f"the resync, within {handlers.RESYNC_SECONDS:g} s, runs it again" in record.message
