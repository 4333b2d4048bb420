"""Two operator replicas with kopf peering against the emulated API server: the leader dies
mid-reconcile and the other one takes over. Each replica is an `llm-fleet operator --peering`
process of its own, so the leader can be SIGKILLed, as a node going away would end it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.operator.conftest import assert_calls_covered_by_rbac, eventually, free_port, inference_service
from tests.operator.emulator import Stall
from tests.operator.test_handlers import DISAGGREGATED, children, conditions
from tests.operator.test_read_faults import DISAGG, created_once, inject


class OperatorProcess:
    """`llm-fleet operator --peering` as a process of its own, which a test may SIGKILL."""

    def __init__(self, kube, tmp_path: Path, name: str, priority: int) -> None:
        self.name = name
        self.log_path = tmp_path / f"{name}.log"
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        env = {
            **os.environ,
            "POD_ID": name,  # kopf's identity among its peers
            "LLMFLEET_OPERATOR_RESYNC_SECONDS": "2",
        }
        argv = [
            *("operator", "-A", "--peering", "llm-fleet", "--priority", str(priority)),
            *("--peering-lifetime", "3", "--liveness", self.liveness, "--metrics-port", "0", "--verbose"),
        ]
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmfleet.cli", *argv], env=env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


@pytest.fixture
def cluster_options():
    return {"peering": True}


def peers(kube) -> set[str]:
    response = kube.http.get("/apis/kopf.dev/v1/clusterkopfpeerings/llm-fleet")
    response.raise_for_status()
    return set((response.json().get("status") or {}).keys())


@pytest.mark.slow
def test_the_leader_dies_mid_reconcile_and_the_survivor_converges(kube, tmp_path):
    """Two replicas: the leader (priority 200) serves, the other pauses. The leader is SIGKILLed
    while its apply of a Deployment hangs in the API server; once its keep-alive lapses (3 s
    here, --peering-lifetime), the survivor resumes, finishes the job from the leader's half-done
    state and converges: every object once, none deleted, the status observed."""
    body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "llm-fleet"}}
    kube.http.post("/apis/kopf.dev/v1/clusterkopfpeerings", json=body).raise_for_status()
    stall = Stall("PATCH", "/deployments/tiny-")
    leader = OperatorProcess(kube, tmp_path, "leader", 200)
    survivor = None
    try:
        eventually(lambda: httpx.get(leader.liveness, timeout=1).status_code == 200, timeout=30)
        eventually(lambda: "leader" in peers(kube), timeout=20)
        survivor = OperatorProcess(kube, tmp_path, "survivor", 100)
        eventually(lambda: "survivor" in peers(kube), timeout=30)  # it is there, and paused since its start
        inject(kube, stall)
        kube.create(inference_service("tiny", DISAGG))
        eventually(lambda: stall.held == 1, timeout=30)  # the leader is mid-pass
        assert kube.get("Deployment", "tiny-prefill") is None and kube.get("Deployment", "tiny-decode") is None
        assert kube.get("ConfigMap", "tiny-prefill-engine") is not None  # what the leader did before
        assert "Resuming operations" not in survivor.log()  # kopf pauses a replica until it sees its peers
        leader.process.kill()
        leader.process.wait(10)
        stall.release()  # the answer goes to a dead connection

        eventually(lambda: "Resuming operations after the pause" in survivor.log(), timeout=30)
        eventually(lambda: children(kube) == DISAGGREGATED, timeout=30)
        eventually(lambda: kube.get("InferenceService", "tiny")["status"].get("observedGeneration") == 1)
        eventually(lambda: [w for w in kube.quiet(1.0) if "/kopf.dev/" not in w] == [], timeout=20)  # keep-alives aside
        obj = kube.get("InferenceService", "tiny")
        assert conditions(obj)["Degraded"]["status"] == "False"
        assert kube.get("Secret", "tiny-kv-transfer") is not None
        created_once(kube)
        assert survivor.process.poll() is None, survivor.log()[-3000:]
    finally:
        leader.stop()
        if survivor is not None:
            survivor.stop()
    assert survivor.process.returncode == 0, survivor.log()[-3000:]
    assert_calls_covered_by_rbac(kube)
