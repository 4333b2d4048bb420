"""The real operator when the API server fails its reads, watches and throttles it, when Prometheus
answers late, and when the leading one of two replicas dies mid-reconcile.

Faults are injected into the emulated API server (emulator.Fault, emulator.Stall); each test ends
with the operator converged to the spec: every object once, none deleted, nothing rewritten.
"""

from __future__ import annotations

import httpx

from tests.operator.conftest import (
    eventually,
    inference_service,
    operator_running,
    settle,
)
from tests.operator.emulator import Fault, Stall
from tests.operator.test_handlers import COLOCATED, TINY, children, conditions, engine_of

OURS = "llm-fleet-operator"  # the User-Agent of the operator's own client; kopf's starts "kopf/"
DISAGG = {
    **TINY,
    "mode": "disaggregated",
    "pools": {"prefill": TINY["pools"]["colocated"], "decode": TINY["pools"]["colocated"]},
}


def inject(kube, *faults: Fault | Stall) -> None:
    def add() -> None:
        for fault in faults:
            (kube.cluster.stalls if isinstance(fault, Stall) else kube.cluster.faults).append(fault)

    kube.running.call(add)


def clear_faults(kube) -> None:
    kube.running.call(kube.cluster.faults.clear)


def created_once(kube) -> None:
    added = [(c.resource, c.object["metadata"]["name"]) for c in kube.cluster.changes if c.type == "ADDED"]
    assert len(added) == len(set(added)), f"something was created twice: {added}"
    deleted = [(c.resource, c.object["metadata"]["name"]) for c in kube.cluster.changes if c.type == "DELETED"]
    assert deleted == [], f"something was deleted: {deleted}"


def test_failing_lists_and_gets_are_reported_retried_and_converge(kube, operator, monkeypatch):
    """Lists of the children fail (500) for as long as the fault stands: the operator says so in
    Progressing (Unknown, APIServerError) and one Warning, keeps answering its liveness probe,
    creates nothing half-way, and converges once the API server answers again. Then a failing
    GET of the InferenceService itself costs one pass, not the operator."""
    monkeypatch.setattr("llmfleet.operator.reconcile.cluster.RETRY_BACKOFFS", (0.05,))
    failing = Fault("GET", "/deployments", 500, watch=False, agent=OURS)
    inject(kube, failing)
    kube.create(inference_service("tiny", TINY))

    def reported():
        progressing = kube.condition("tiny", "Progressing")
        return progressing if progressing and progressing["reason"] == "APIServerError" else None

    progressing = eventually(reported, timeout=20)
    assert progressing["status"] == "Unknown" and "500 InjectedFault" in progressing["message"]
    eventually(lambda: failing.hits >= 4, timeout=20)  # kopf retried the pass: the client's 2 tries each
    assert httpx.get(operator.liveness_url, timeout=5).status_code == 200
    assert children(kube) == {kind: set() for kind in COLOCATED}, "a pass that could not list applied anyway"
    assert [e["reason"] for e in kube.events("tiny") if e["type"] == "Warning"] == ["APIServerError"]

    clear_faults(kube)
    eventually(lambda: children(kube) == COLOCATED, timeout=20)
    obj = settle(kube, "tiny", 1)
    assert conditions(obj)["Progressing"]["reason"] in ("Applied", "RollingOut", "Converged")
    assert conditions(obj)["Degraded"]["status"] == "False"

    inject(kube, Fault("GET", "/inferenceservices/tiny", 503, watch=False, agent=OURS, times=2))
    kube.patch("InferenceService", "tiny", {"spec": {"pools": {"colocated": {"engine": {"maxBatchSize": 20}}}}})
    settle(kube, "tiny", 2)
    assert engine_of(kube)["max_batch_size"] == 20
    created_once(kube)


def test_failing_and_expiring_watches_are_reopened_and_miss_nothing(kube):
    """kopf's watches fail (503) and expire (the 410 Gone ERROR event of a resourceVersion the API
    server no longer has): it opens them again, lists afresh, and handles what happened meanwhile:
    an InferenceService created and a Deployment deleted while its watches were down."""
    watches = [
        Fault("GET", "/inferenceservices", 503, watch=True, agent="kopf/", times=2),
        Fault("GET", "/inferenceservices", 410, watch=True, agent="kopf/", times=2),
        Fault("GET", "/deployments", 410, watch=True, agent="kopf/", times=3),
    ]
    inject(kube, *watches)
    with operator_running(kube):
        kube.create(inference_service("tiny", TINY))
        eventually(lambda: children(kube) == COLOCATED, timeout=30)
        settle(kube, "tiny", 1)
        assert [fault.hits for fault in watches] == [2, 2, 3]
        inject(kube, Fault("GET", "/deployments", 410, watch=True, agent="kopf/", times=1))
        kube.delete("Deployment", "tiny-colocated")
        eventually(lambda: kube.get("Deployment", "tiny-colocated"), timeout=30)
    added = [c.object["metadata"]["name"] for c in kube.cluster.changes if c.type == "ADDED"]
    assert added.count("tiny-colocated-engine") == 1


def test_throttled_reads_and_writes_wait_and_converge(kube, operator, monkeypatch):
    """429 with Retry-After on the operator's lists, on its applies and on kopf's own reads: the
    pass waits as asked (no TemporaryError, no give-up) and converges."""
    throttled = [
        Fault("GET", "/configmaps", 429, watch=False, agent=OURS, times=2, retry_after=1),
        Fault("PATCH", "/deployments/", 429, agent=OURS, times=2, retry_after=1),
        Fault("GET", "/inferenceservices", 429, watch=False, agent="kopf/", times=1, retry_after=1),
    ]
    inject(kube, *throttled)
    kube.create(inference_service("tiny", TINY))
    eventually(lambda: children(kube) == COLOCATED, timeout=30)
    obj = settle(kube, "tiny", 1)
    assert [fault.hits for fault in throttled[:2]] == [2, 2]
    assert conditions(obj)["Degraded"]["status"] == "False"
    assert not [e for e in kube.events("tiny") if e["type"] == "Warning"]
    created_once(kube)


def test_kopf_heeds_retry_after_even_when_it_is_shorter_than_its_backoff():
    import kopf

    from llmfleet.operator.handlers import configure

    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.networking.enforce_retry_after is True
