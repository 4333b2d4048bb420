"""A namespace-scoped operator (`llm-fleet operator -n NS`, as the chart runs it with
watchNamespaces): it serves the InferenceServices of its namespaces alone, and makes no call
outside them, so the chart's Roles in those namespaces (and no ClusterRole) are all it needs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from llmfleet.operator.deploy.rbac import RBAC_RULES
from tests.operator.conftest import NAMESPACE, eventually, free_port, inference_service, verbs_of
from tests.operator.test_handlers import TINY


def namespaced_rules_allow(group: str, resource: str, verb: str) -> bool:
    return any(
        rule["scope"] == "namespaced"
        and group in rule["apiGroups"]
        and resource in rule["resources"]
        and verb in rule["verbs"]
        for rule in RBAC_RULES
    )


def test_a_namespaced_operator_serves_its_namespace_and_calls_nothing_outside(kube, tmp_path):
    elsewhere = {**inference_service("other", TINY), "metadata": {"name": "other", "namespace": "elsewhere"}}
    kube.http.post("/apis/llmfleet.io/v1alpha1/namespaces/elsewhere/inferenceservices", json=elsewhere)
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    env = {**os.environ, "LLMFLEET_OPERATOR_RESYNC_SECONDS": "2"}
    argv = ["operator", "--standalone", "-n", NAMESPACE, "--liveness", liveness, "--metrics-port", "0"]
    log = (tmp_path / "operator.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "llmfleet.cli", *argv], env=env, stdout=log, stderr=log)
    try:
        eventually(lambda: httpx.get(liveness, timeout=1).status_code == 200, timeout=30)
        kube.create(inference_service("tiny", TINY))
        eventually(lambda: kube.get("Deployment", "tiny-colocated"), timeout=30)
        eventually(lambda: (kube.get("InferenceService", "tiny").get("status") or {}).get("observedGeneration") == 1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, (tmp_path / "operator.log").read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    other = kube.http.get("/apis/llmfleet.io/v1alpha1/namespaces/elsewhere/inferenceservices/other").json()
    assert "status" not in other and not other["metadata"].get("finalizers"), "it served another namespace"
    deployments = kube.http.get("/apis/apps/v1/deployments").json()["items"]
    assert {d["metadata"]["namespace"] for d in deployments} == {NAMESPACE}

    made = [c for c in kube.calls() if c.user_agent.startswith(("kopf/", "llm-fleet-operator"))]
    assert made, "no calls recorded"
    outside = sorted({(c.method, c.group, c.resource, c.namespace) for c in made if c.namespace != NAMESPACE})
    assert not outside, f"calls outside {NAMESPACE} (a namespaced install's Roles do not grant them): {outside}"
    ungranted = sorted(
        {(c.group, c.resource, verb) for c in made for verb in verbs_of(c)}
        - {
            (c.group, c.resource, verb)
            for c in made
            for verb in verbs_of(c)
            if namespaced_rules_allow(c.group, c.resource, verb)
        }
    )
    assert not ungranted, f"calls the per-namespace Role does not grant: {ungranted}"
