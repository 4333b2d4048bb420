"""The tuner inside the real operator (kopf daemon) against the emulated API server, with a
scripted metric source in place of the pods' /metrics: what a run writes (status, ConfigMap,
Deployment, Events, decision metrics) and what it leaves alone."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import yaml
from prometheus_client import generate_latest

from llmfleet.operator import daemon
from llmfleet.operator.decision_metrics import REGISTRY
from llmfleet.operator.metrics.source import PoolMetrics, PoolRef, Quantiles
from llmfleet.operator.reconcile.cluster import INFERENCE_SERVICE
from llmfleet.operator.resource.spec import parse_spec
from llmfleet.operator.tuner import run as tuner_run
from tests.operator.conftest import TEST_IMAGE, eventually, inference_service, settle
from tests.operator.test_handlers import TINY

# The usual tiny fleet, tuned every 5 s with no cooldown.
SPEC = {
    **TINY,
    "pools": {
        "colocated": {
            **TINY["pools"]["colocated"],
            "engine": {"maxBatchSize": 32, "kvCacheMemoryMb": 128},
            "bounds": {"maxBatchSize": {"min": 8, "max": 64}},
        }
    },
    "autotune": {"intervalSeconds": 5, "cooldownSeconds": 0, "scaleUpStabilizationSeconds": 0},
}


def snapshot(pool: PoolRef, *, itl_ms: float | None, stale: bool = False) -> PoolMetrics:
    """``itl_ms`` None: too few observations for an ITL quantile in the window."""

    def q(p95_ms: float | None) -> Quantiles:
        if p95_ms is None:
            return Quantiles(samples=3)
        return Quantiles(p50=p95_ms / 2000, p95=p95_ms / 1000, p99=p95_ms / 1000, samples=500)

    return PoolMetrics(
        pool=pool,
        at=0.0,
        window_s=30.0,
        ttft=q(200.0),
        itl=q(itl_ms),
        queue_time=q(20.0),
        request_rate=40.0,
        prompt_tokens_per_s=4000.0,
        generation_tokens_per_s=1200.0,
        waiting=12.0,
        running=32.0,
        kv_usage_mean=0.5,
        kv_usage_max=0.6,
        mean_batch_size=32.0,
        mean_step_tokens=40.0,
        preemptions_per_s=0.0,
        ready_pods=1,
        stale=stale,
        reason="colocated: no pods to scrape" if stale else "",
    )


class ScriptedSource:
    """Stands in for the pods' /metrics: an ITL p95 far over the SLO, or nothing fresh."""

    itl_ms: float | None = 250.0
    stale = False

    def __init__(self, targets) -> None:
        self.targets = targets

    async def snapshot(self, pool: PoolRef, window_s: float) -> PoolMetrics:
        return snapshot(pool, itl_ms=self.itl_ms, stale=self.stale)


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(daemon, "ScrapeSource", ScriptedSource)
    ScriptedSource.itl_ms, ScriptedSource.stale = 250.0, False
    return ScriptedSource


def engine_of(kube) -> dict:
    return yaml.safe_load(kube.get("ConfigMap", "tiny-colocated-engine")["data"]["engine.yaml"])


def decision_after(kube, previous: dict | None, timeout: float = 20) -> dict:
    """The first lastDecision newer than ``previous``."""

    def newer() -> dict | None:
        decision = kube.get("InferenceService", "tiny")["status"].get("lastDecision")
        return decision if decision and (previous is None or decision["time"] != previous["time"]) else None

    return eventually(newer, timeout=timeout)


def test_a_run_shrinks_the_batch_scales_out_and_explains_itself(kube, operator, scripted):
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    assert engine_of(kube)["max_batch_size"] == 32

    eventually(lambda: kube.get("InferenceService", "tiny")["status"].get("lastDecision"), timeout=20)
    eventually(lambda: engine_of(kube)["max_batch_size"] < 32, timeout=10)
    obj = kube.get("InferenceService", "tiny")
    status = obj["status"]
    decision = status["lastDecision"]
    knobs = {c["knob"] for c in decision["changes"]}
    assert "maxBatchSize" in knobs and "ITL p95 250 ms > SLO 100 ms" in decision["reason"]
    assert status["tuner"]["knobs"]["colocated"]["maxBatchSize"] == engine_of(kube)["max_batch_size"] >= 8
    assert status["latency"]["itlP95Ms"] == 250.0
    tuner_active = kube.condition("tiny", "TunerActive")
    assert (tuner_active["status"], tuner_active["reason"]) == ("True", "Adjusted")
    if "replicas" in knobs:  # 12 waiting over the default capacity: more replicas
        eventually(lambda: kube.get("Deployment", "tiny-colocated")["spec"]["replicas"] > 1)
    eventually(lambda: any(e["reason"] == "Tuned" and "maxBatchSize" in e["message"] for e in kube.events("tiny")))
    exposed = generate_latest(REGISTRY).decode()
    assert 'llmfleet_tuner_decisions_total{direction="down",inference_service="tiny"' in exposed
    assert 'llmfleet_tuner_knob_value{inference_service="tiny",knob="maxBatchSize"' in exposed


def test_an_observing_tuner_reports_its_decisions_and_changes_nothing(kube, operator, scripted):
    """autotune.mode observe beside an external autoscaler: the same decisions in status, Events
    and metrics, from the replicas the autoscaler set; the engine and the Deployment stay as they are."""
    observing = {**SPEC, "autotune": {**SPEC["autotune"], "mode": "observe"}, "externalAutoscaler": True}
    kube.create(inference_service("tiny", observing))
    settle(kube, "tiny", 1)
    kube.patch("Deployment", "tiny-colocated", {"spec": {"replicas": 2}})  # the autoscaler's doing
    decision = decision_after(kube, decision_after(kube, None))
    assert decision["observed"] is True and any(c["knob"] == "maxBatchSize" for c in decision["changes"])
    assert all(c["from"] == 2 for c in decision["changes"] if c["knob"] == "replicas")
    status = kube.get("InferenceService", "tiny")["status"]
    assert set(status["tuner"]) == {"memory"}
    assert kube.condition("tiny", "TunerActive")["reason"] in ("Observing", "Steady")
    eventually(lambda: any(e["reason"] == "WouldTune" for e in kube.events("tiny")))
    assert engine_of(kube)["max_batch_size"] == 32
    assert kube.get("Deployment", "tiny-colocated")["spec"]["replicas"] == 2
    exposed = generate_latest(REGISTRY).decode()
    assert 'llmfleet_tuner_observe_mode{inference_service="tiny",namespace="ml"} 1.0' in exposed


def test_turning_the_tuner_off_drops_its_exported_series(kube, operator, scripted):
    """A tuner that is off has no last decision: its hold, replicas and knob series would freeze
    in the dashboards and keep alerts like LLMFleetTunerStuck firing."""
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    eventually(lambda: 'inference_service="tiny"' in generate_latest(REGISTRY).decode(), timeout=20)
    kube.patch("InferenceService", "tiny", {"spec": {"autotune": {"enabled": False}}})
    eventually(lambda: 'inference_service="tiny"' not in generate_latest(REGISTRY).decode(), timeout=20)
    settle(kube, "tiny", 2)  # a stop amid the status writes the edit brings can race kopf into a late daemon


def test_demand_above_max_replicas_says_scaling_limited_once(kube, operator, scripted):
    """40 requests/s and 12 waiting on one pod whose maxReplicas is 1: ScalingLimited True
    (TooManyReplicas, as HPA says it), one Warning Event however many runs repeat it, the gauge
    the LLMFleetScalingLimited alert reads; then turned off, the condition is no one's word."""
    capped = {**SPEC, "pools": {"colocated": {**SPEC["pools"]["colocated"], "maxReplicas": 1}}}
    kube.create(inference_service("tiny", capped))
    settle(kube, "tiny", 1)
    limited = eventually(lambda: kube.condition("tiny", "ScalingLimited"), timeout=20)
    assert (limited["status"], limited["reason"]) == ("True", "TooManyReplicas")
    assert "held at maxReplicas 1" in limited["message"] and limited["message"].startswith("colocated: ")
    decision_after(kube, decision_after(kube, None))  # two runs more, the same limit
    warnings = eventually(lambda: [e for e in kube.events("tiny") if e["reason"] == "TooManyReplicas"], timeout=10)
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    exposed = generate_latest(REGISTRY).decode()
    assert (
        'llmfleet_tuner_scaling_limited{inference_service="tiny",namespace="ml",pool="colocated",'
        'reason="TooManyReplicas"} 1.0'
    ) in exposed
    kube.patch("InferenceService", "tiny", {"spec": {"autotune": {"enabled": False}}})
    eventually(lambda: kube.condition("tiny", "ScalingLimited")["status"] == "Unknown", timeout=20)
    settle(kube, "tiny", 2)


def test_stale_metrics_hold_with_a_reason_and_touch_nothing(kube, operator, scripted):
    scripted.stale = True
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    before = kube.get("ConfigMap", "tiny-colocated-engine")["metadata"]["resourceVersion"]
    eventually(lambda: (kube.condition("tiny", "TunerActive") or {}).get("reason") == "MetricsUnavailable", timeout=20)
    assert "no pods to scrape" in kube.condition("tiny", "TunerActive")["message"]
    assert kube.get("ConfigMap", "tiny-colocated-engine")["metadata"]["resourceVersion"] == before
    # kopf posts the run's Events in the background, after the status write seen above
    holds = eventually(lambda: [e for e in kube.events("tiny") if e["reason"] == "TunerHolding"], timeout=10)
    assert len(holds) == 1 and holds[0]["type"] == "Warning"


def test_a_manual_edit_is_overwritten_by_the_tuners_value(kube, operator, scripted):
    """Spec bounds win; the tuner owns the current value (a ConfigMap edit does not stick)."""
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    eventually(lambda: engine_of(kube)["max_batch_size"] < 32, timeout=20)
    tuned = kube.get("InferenceService", "tiny")["status"]["tuner"]["knobs"]["colocated"]["maxBatchSize"]
    scripted.stale = True  # hold from now on: only reconcile acts
    edited = dict(engine_of(kube), max_batch_size=60)
    kube.patch("ConfigMap", "tiny-colocated-engine", {"data": {"engine.yaml": yaml.safe_dump(edited)}})
    eventually(lambda: engine_of(kube)["max_batch_size"] == tuned, timeout=10)


def test_a_one_sided_bound_outside_the_default_range_is_tuned(kube, operator, scripted):
    """{min: 300} on maxBatchSize: above the tuner's default range (up to 256), yet a valid range."""
    spec = {**SPEC, "pools": {"colocated": {**SPEC["pools"]["colocated"], "bounds": {"maxBatchSize": {"min": 300}}}}}
    kube.create(inference_service("tiny", spec))
    settle(kube, "tiny", 1)
    eventually(lambda: kube.get("InferenceService", "tiny")["status"].get("lastDecision"), timeout=20)
    assert kube.condition("tiny", "TunerActive")["status"] == "True"
    assert engine_of(kube)["max_batch_size"] == 300


def test_limits_the_tuner_cannot_work_within_hold_it_with_a_reason(kube, operator, scripted, monkeypatch):
    """The safety net behind spec validation: a failure to derive the limits is a condition, not a crash loop."""

    class Unusable:
        @staticmethod
        def from_spec(pool):
            raise ValueError("bounds.maxBatchSize: no valid value in [300, 256]")

    monkeypatch.setattr(tuner_run, "PoolLimits", Unusable)
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    eventually(lambda: (kube.condition("tiny", "TunerActive") or {}).get("reason") == "InvalidBounds", timeout=20)
    condition = kube.condition("tiny", "TunerActive")
    assert condition["status"] == "False"
    assert condition["message"] == "pools.colocated: bounds.maxBatchSize: no valid value in [300, 256]"


async def test_a_stored_memory_it_cannot_read_starts_afresh(running, client, scripted):
    """An old or hand-edited status.tuner.memory: the run goes on with a fresh memory."""
    await client.request("POST", INFERENCE_SERVICE.path("ml"), body=inference_service("tiny", SPEC))
    unreadable = {"version": 0, "keys": {"colocated/replicas": {"recommendations": "many"}}}
    await client.patch_status(INFERENCE_SERVICE, "ml", "tiny", {"tuner": {"memory": unreadable}})
    body = await client.get(INFERENCE_SERVICE, "ml", "tiny")

    outcome, _ = await daemon.autotune_once(client, {}, body, parse_spec(SPEC), None, now=1000.0)
    assert outcome.condition.reason == "Adjusted"
    memory = (await client.get(INFERENCE_SERVICE, "ml", "tiny"))["status"]["tuner"]["memory"]
    assert memory["version"] == 1 and memory["keys"]


def test_a_spec_edit_made_while_the_daemon_waits_counts_at_its_next_run(kube, operator, scripted):
    """The run reads the spec afresh: a bound raised meanwhile is not crossed, and autotune turned
    off meanwhile means no run."""
    kube.create(inference_service("tiny", SPEC))  # ITL 2.5x the SLO: every run shrinks the batch
    settle(kube, "tiny", 1)
    # a run that has just landed: the edit then comes a whole interval before the next one (the
    # decision found at once may be seconds old, and the next run may read the spec before the edit)
    first = decision_after(kube, decision_after(kube, None))
    floor = {"spec": {"pools": {"colocated": {"bounds": {"maxBatchSize": {"min": 30, "max": 64}}}}}}
    kube.patch("InferenceService", "tiny", floor)
    second = decision_after(kube, first)
    assert all(c["to"] >= 30 for c in second["changes"] if c["knob"] == "maxBatchSize")
    assert kube.get("InferenceService", "tiny")["status"]["tuner"]["knobs"]["colocated"]["maxBatchSize"] >= 30

    kube.patch("InferenceService", "tiny", {"spec": {"autotune": {"enabled": False}}})
    eventually(lambda: kube.condition("tiny", "TunerActive")["reason"] == "Disabled", timeout=10)
    time.sleep(7)  # past the next run's time
    assert kube.get("InferenceService", "tiny")["status"]["lastDecision"]["time"] == second["time"]


def test_a_shorter_interval_takes_effect_without_waiting_out_the_old_one(kube, operator, scripted):
    kube.create(inference_service("tiny", {**SPEC, "autotune": {**SPEC["autotune"], "intervalSeconds": 3600}}))
    settle(kube, "tiny", 1)
    kube.patch("InferenceService", "tiny", {"spec": {"autotune": {"intervalSeconds": 5}}})
    decision_after(kube, None, timeout=20)


def test_turned_on_again_the_tuner_starts_from_the_spec(kube, operator, scripted):
    """What the tuner had set is released when it is turned off, not applied again on its return
    before any run has explained it."""
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    eventually(lambda: engine_of(kube)["max_batch_size"] < 32, timeout=20)
    off = {"autotune": {"enabled": False}, "pools": {"colocated": {"engine": {"maxBatchSize": 48}}}}
    assert kube.get("InferenceService", "tiny")["status"]["latency"]
    kube.patch("InferenceService", "tiny", {"spec": off})
    eventually(lambda: "tuner" not in kube.get("InferenceService", "tiny")["status"], timeout=10)
    assert engine_of(kube)["max_batch_size"] == 48
    status = kube.get("InferenceService", "tiny")["status"]
    assert "latency" not in status  # kubectl get's TTFT-p95/ITL-p95 columns: nobody measures them now
    assert status["lastDecision"]  # what it last did, with its time
    scripted.stale = True  # runs from now on hold: only reconcile could move the knob
    kube.patch("InferenceService", "tiny", {"spec": {"autotune": {"enabled": True}}})
    eventually(lambda: kube.condition("tiny", "TunerActive")["reason"] == "MetricsUnavailable", timeout=20)
    assert settle(kube, "tiny") and engine_of(kube)["max_batch_size"] == 48


def test_a_spec_the_operator_cannot_read_stops_the_tuner_and_says_so(kube, operator, scripted):
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    decision_after(kube, None)
    kube.patch(
        "InferenceService", "tiny", {"spec": {"pod": {"labels": {"llmfleet.io/team": "a"}}}}
    )  # a reserved prefix
    eventually(lambda: kube.condition("tiny", "TunerActive")["status"] == "False", timeout=10)
    tuner_active = kube.condition("tiny", "TunerActive")
    assert tuner_active["reason"] == kube.condition("tiny", "Degraded")["reason"] == "InvalidSpec"
    assert tuner_active["message"] == "the tuner waits for a servable spec"
    settle(kube, "tiny")


async def test_a_run_replaces_what_earlier_runs_wrote(running, client, scripted):
    """status.tuner, lastDecision and latency hold the last run's word alone: not a pool of the
    old mode, a hold's reason beside fresh inputs, or a p95 this run could not measure."""
    await client.request("POST", INFERENCE_SERVICE.path("ml"), body=inference_service("tiny", SPEC))
    old_mode = {"replicas": {"prefill": 2}, "knobs": {"prefill": {"maxBatchSize": 8}}}
    await client.patch_status(INFERENCE_SERVICE, "ml", "tiny", {"tuner": old_mode})
    sessions: dict = {}

    async def run(now: float) -> dict:
        body = await client.get(INFERENCE_SERVICE, "ml", "tiny")
        _, returned = await daemon.autotune_once(client, sessions, body, parse_spec(SPEC), None, now=now)
        stored = (await client.get(INFERENCE_SERVICE, "ml", "tiny"))["status"]
        assert returned["status"] == stored  # what the converge pass after it reads
        return stored

    assert (await run(1000.0))["latency"]["itlP95Ms"] == 250.0
    scripted.stale = True
    assert (await run(1010.0))["lastDecision"]["inputs"]["colocated"]["reason"] == "colocated: no pods to scrape"
    scripted.stale, scripted.itl_ms = False, None
    status = await run(1020.0)
    assert "itlP95Ms" not in status["latency"] and status["latency"]["ttftP95Ms"] == 200.0
    assert "reason" not in status["lastDecision"]["inputs"]["colocated"]
    assert set(status["tuner"]["replicas"]) == set(status["tuner"]["knobs"]) == {"colocated"}


def test_a_spec_edit_made_during_a_tuner_run_is_not_undone_by_it(kube, operator, scripted, monkeypatch):
    """The edit's pass waits behind the run's lock; the run's own pass, after it, applied the spec
    the run had read: an image rolled 0.1.0 -> 0.2.0 -> 0.1.0 -> 0.2.0, two rollouts too many."""
    started = threading.Event()

    class Slow(ScriptedSource):  # a slow Prometheus or slow pods' /metrics
        async def snapshot(self, pool, window_s):
            started.set()
            await asyncio.sleep(1.0)
            return await super().snapshot(pool, window_s)

    monkeypatch.setattr(daemon, "ScrapeSource", Slow)
    kube.create(inference_service("tiny", SPEC))
    settle(kube, "tiny", 1)
    started.clear()
    assert started.wait(20)
    kube.patch("InferenceService", "tiny", {"spec": {"image": "registry.example/llm-fleet:0.2.0-cpu"}})
    settle(kube, "tiny", 2)
    time.sleep(2)  # the run's own pass comes after the edit's
    images = [
        change.object["spec"]["template"]["spec"]["containers"][0]["image"]
        for change in kube.cluster.changes
        if change.resource.endswith("deployments") and change.type in ("ADDED", "MODIFIED")
    ]
    rollouts = [image for n, image in enumerate(images) if n == 0 or images[n - 1] != image]
    assert rollouts == [TEST_IMAGE, "registry.example/llm-fleet:0.2.0-cpu"]
    assert kube.get("InferenceService", "tiny")["status"]["observedGeneration"] == 2
