"""The real operator refuses what pod_security.py refuses, leaves what runs alone, and lets an
admin's allowlist (--pod-security-allow, here $LLMFLEET_POD_SECURITY_ALLOW) through."""

from __future__ import annotations

from tests.operator.conftest import inference_service, operator_running, settle
from tests.operator.test_handlers import COLOCATED, TINY, children, conditions

HOST_PATH = {"path": "/models/llama", "volume": {"hostPath": {"path": "/"}}}


def test_an_edit_that_reaches_past_the_pod_is_refused_and_what_runs_stays(kube, operator):
    kube.create(inference_service("tiny", TINY))
    settle(kube, "tiny", 1)
    before = {name: obj["metadata"]["resourceVersion"] for name, obj in kube.list("Deployment").items()}

    kube.patch("InferenceService", "tiny", {"spec": {"model": {"builtin": None, **HOST_PATH}}})
    obj = settle(kube, "tiny", 2)
    degraded = conditions(obj)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "Forbidden")
    assert degraded["message"].startswith("spec.model.volume.hostPath: a hostPath volume")
    assert "--pod-security-allow hostPath" in degraded["message"]
    assert conditions(obj)["TunerActive"]["reason"] == "Forbidden"
    assert [e["reason"] for e in kube.events("tiny") if e["type"] == "Warning"] == ["Forbidden"]
    after = {name: obj["metadata"]["resourceVersion"] for name, obj in kube.list("Deployment").items()}
    assert after == before, "a refused spec touched what runs"
    assert children(kube) == COLOCATED

    kube.patch("InferenceService", "tiny", {"spec": {"model": {"builtin": "tiny", "path": None, "volume": None}}})
    obj = settle(kube, "tiny", 3)
    assert conditions(obj)["Degraded"]["status"] == "False"
    assert "Recovered" in [e["reason"] for e in kube.events("tiny")]


def test_an_allowed_key_lets_its_pod_option_through(kube, monkeypatch):
    monkeypatch.setenv("LLMFLEET_POD_SECURITY_ALLOW", "hostPath,secretEnv")
    secret_env = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    allowed = {**TINY, "model": HOST_PATH, "pod": {"env": [secret_env]}}
    refused = {**TINY, "pod": {"hostNetwork": True}}
    with operator_running(kube) as runner:
        kube.create(inference_service("tiny", allowed))
        kube.create(inference_service("other", refused))
        settle(kube, "tiny", 1)
        assert conditions(settle(kube, "other", 1))["Degraded"]["reason"] == "Forbidden"
    assert conditions(kube.get("InferenceService", "tiny"))["Degraded"]["status"] == "False"
    pod = kube.get("Deployment", "tiny-colocated")["spec"]["template"]["spec"]
    assert {"name": "models", "hostPath": {"path": "/"}} in pod["volumes"]
    assert secret_env in pod["containers"][0]["env"]
    assert kube.get("Deployment", "other-colocated") is None
    assert "pod options allowed beyond the defaults: hostPath, secretEnv" in runner.output
