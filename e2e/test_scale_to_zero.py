"""Scale to zero and back on the emulator: the real operator (kopf), the real router and server
processes (run as the reconciled Deployments describe, by e2e/kubelet.py) and a real Prometheus.

The pool goes idle, the tuner scales it to zero, the server drains away; requests sent then are
held by the router, which stamps its wake ConfigMap; the operator scales the pool back at once;
the server starts, its EndpointSlice turns ready, the router releases the requests. None is
lost, and the cold start is printed as the clients, the router and the status measured it."""

from __future__ import annotations

import concurrent.futures
import sys
import time

import httpx
import pytest
import yaml

from e2e.kubelet import Kubelet
from e2e.test_fleet_e2e import REPO
from tests.operator.conftest import Kube, inference_service, operator_running
from tests.operator.emulator import kubeconfig, make_cluster, serve
from tests.prometheus_support import PrometheusProcess, require_prometheus

EXAMPLE = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())


@pytest.mark.prometheus
@pytest.mark.timeout(420)
def test_scale_to_zero_and_back_on_the_emulator(tmp_path, monkeypatch):
    require_prometheus()
    running = serve(make_cluster())
    config_file = tmp_path / "kubeconfig"
    config_file.write_text(kubeconfig(running.url))
    monkeypatch.setenv("KUBECONFIG", str(config_file))
    monkeypatch.setenv("LLMFLEET_POD_SECURITY_ALLOW", "prometheusUrl")  # the spec names its own Prometheus
    kube = Kube(running)
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    try:
        with (
            PrometheusProcess([], file_sd=[targets]) as prometheus,
            operator_running(kube),
            Kubelet(kube, running.url, tmp_path, targets) as kubelet,
        ):
            pool = {**EXAMPLE["spec"]["pools"]["colocated"], "minReplicas": 0}
            spec = {
                **EXAMPLE["spec"],
                "pools": {"colocated": pool},
                "autotune": {"intervalSeconds": 5, "scaleToZeroAfterSeconds": 10, "prometheusUrl": prometheus.url},
            }
            kube.create(inference_service("tiny", spec))
            kubelet.wait(
                lambda: kubelet.ready_pods("tiny-router") and kubelet.ready_pods("tiny-colocated"), 180, "pods"
            )
            router = kubelet.ready_pods("tiny-router")[0].process.url
            body = {"model": "tiny", "prompt": "warm", "max_tokens": 4}
            assert httpx.post(f"{router}/v1/completions", json=body, timeout=60).status_code == 200

            # idle: the tuner scales the pool to zero and its server drains away
            kubelet.wait(lambda: kube.get("Deployment", "tiny-colocated")["spec"]["replicas"] == 0, 180, "zero")
            kubelet.wait(lambda: not kubelet.running_pods("tiny-colocated"), 60, "the server to drain")
            status = kube.get("InferenceService", "tiny")["status"]
            ready = next(c for c in status["conditions"] if c["type"] == "Ready")
            assert (ready["status"], ready["reason"]) == ("True", "ScaledToZero"), ready
            tuned = [e["message"] for e in kube.events("tiny") if e["reason"] == "Tuned" and "-> 0" in e["message"]]
            print(f"at zero: {tuned[-1]}", file=sys.__stdout__)  # kopf's runner holds sys.stdout

            # requests at zero: held, the pool woken, all answered
            sent = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(3) as clients:
                replies = list(
                    clients.map(lambda i: httpx.post(f"{router}/v1/completions", json=body, timeout=300), range(3))
                )
            waited = time.monotonic() - sent
            assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
            held = httpx.get(f"{router}/load", timeout=5).json()["last_cold_start_s"]
            status = kubelet.wait(
                lambda: (
                    (s := kube.get("InferenceService", "tiny")["status"])["pools"]["colocated"].get(
                        "lastColdStartSeconds"
                    )
                    and s
                ),
                30,
                "the cold start in status",
            )
            cold = status["pools"]["colocated"]["lastColdStartSeconds"]
            print(
                f"from zero on the emulator: 3 requests answered after {waited:.1f} s; the router held them "
                f"{held:.1f} s; status.pools.colocated.lastColdStartSeconds {cold}",
                file=sys.__stdout__,
            )
            assert 0 < held <= waited and 0 < cold <= waited + 5  # status: at the pass after readiness
            assert status["wake"]["pools"] == []
            events = [e["reason"] for e in kube.events("tiny")]
            assert "Woken" in events
    finally:
        kube.http.close()
        running.stop()
