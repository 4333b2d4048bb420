"""End to end: an InferenceService goes in, serving pods come up, traffic flows, the tuner's
decision lands, and deleting it leaves nothing behind.

- ``test_on_a_real_cluster`` runs against ``$KUBECONFIG`` (kind, k3d, a real cluster) with the
  real helm and kubectl: skipped with a message where no cluster answers.
- ``test_the_cluster_quick_start`` runs docs/cluster-quickstart.md's steps against ``$KUBECONFIG``,
  read from the page and run as written (the image given as ``LLMFLEET_E2E_IMAGE``).
- ``test_on_the_emulator`` runs the same scenario on one machine, in CI: kmock's emulated API
  server, the real operator (kopf), real server processes and a real Prometheus. The emulator
  schedules no pods, so the test plays the kubelet: it starts the servers the reconciled
  Deployment describes, with the ConfigMap's engine.yaml as their config file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.operator.conftest import NAMESPACE, Kube, eventually, inference_service, operator_running
from tests.operator.emulator import kubeconfig, make_cluster, serve
from tests.prometheus_support import PrometheusProcess, TargetGroup, require_prometheus
from tests.quickstart_steps import CLEAN_UP, CLUSTER_STEPS, steps
from tests.support import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]

# The local example, with the tightest ITL SLO the CRD accepts (1 ms), which no server meets, so
# the tuner must act within one interval.
EXAMPLE = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
SPEC = {
    **EXAMPLE["spec"],
    "slo": {"ttftP95Ms": 60000, "itlP95Ms": 1},
    "autotune": {"intervalSeconds": 5, "cooldownSeconds": 0, "scaleDownStabilizationSeconds": 300},
}


async def _traffic(url: str, seconds: float, streams: int = 4) -> int:
    """Streamed completions from ``streams`` clients for ``seconds``; returns how many finished."""
    deadline = time.monotonic() + seconds
    done = 0

    async def client() -> None:
        nonlocal done
        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=5)
        while time.monotonic() < deadline:
            stream = await api.completions.create(model="tiny", prompt="e2e", max_tokens=16, stream=True)
            async for _ in stream:
                pass
            done += 1

    await asyncio.gather(*(client() for _ in range(streams)))
    return done


# -- the emulator variant (CI) ----------------------------------------------------------------


def _server_args(kube: Kube, port: int, config: Path) -> list[str]:
    """The Deployment's container args, bound to loopback and to a local copy of the ConfigMap."""
    (container,) = kube.get("Deployment", "tiny-colocated")["spec"]["template"]["spec"]["containers"]
    args = list(container["args"])
    assert args[0] == "serve"
    # no metrics port: Prometheus scrapes the API port here
    loopback = (("--host", "127.0.0.1"), ("--port", str(port)), ("--metrics-port", "0"), ("--config", str(config)))
    for flag, value in loopback:
        args[args.index(flag) + 1] = value
    return args[1:]


def _project_config_map(kube: Kube, path: Path) -> dict:
    """What the kubelet does for a mounted ConfigMap: the file follows the object."""
    text = kube.get("ConfigMap", "tiny-colocated-engine")["data"]["engine.yaml"]
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return yaml.safe_load(text)


@pytest.mark.prometheus
def test_on_the_emulator(tmp_path, monkeypatch):
    require_prometheus()
    running = serve(make_cluster())
    config_file = tmp_path / "kubeconfig"
    config_file.write_text(kubeconfig(running.url))
    monkeypatch.setenv("KUBECONFIG", str(config_file))
    monkeypatch.setenv("LLMFLEET_POD_SECURITY_ALLOW", "prometheusUrl")  # the spec names its own Prometheus
    kube = Kube(running)
    port = free_port()
    labels = {"namespace": NAMESPACE, "inference_service": "tiny", "pool": "colocated"}
    try:
        with (
            PrometheusProcess([TargetGroup([f"127.0.0.1:{port}"], labels)]) as prometheus,
            operator_running(kube),
        ):
            spec = {**SPEC, "autotune": {**SPEC["autotune"], "prometheusUrl": prometheus.url}}
            kube.create(inference_service("tiny", spec))
            # the operator writes the ConfigMap before the Deployment: wait for both
            eventually(lambda: kube.get("ConfigMap", "tiny-colocated-engine"), timeout=20)
            eventually(lambda: kube.get("Deployment", "tiny-colocated"), timeout=20)
            engine_yaml = tmp_path / "engine.yaml"
            engine = _project_config_map(kube, engine_yaml)
            assert engine["max_batch_size"] == SPEC["pools"]["colocated"]["engine"]["maxBatchSize"]
            with ServerProcess(*_server_args(kube, port, engine_yaml), port=port) as server:
                _mark_ready(kube)
                eventually(lambda: (kube.condition("tiny", "Ready") or {}).get("status") == "True", timeout=20)

                # traffic through the OpenAI API until the tuner's decision lands in status
                deadline = time.monotonic() + 90
                while not _batch_lowered(kube.get("InferenceService", "tiny")):
                    assert time.monotonic() < deadline, kube.get("InferenceService", "tiny").get("status")
                    assert asyncio.run(_traffic(server.url, seconds=5)) > 0
                status = kube.get("InferenceService", "tiny")["status"]
                tuned = status["tuner"]["knobs"]["colocated"]["maxBatchSize"]
                # a run may hold a while (a slow Prometheus answer): the next one acts again
                eventually(lambda: kube.condition("tiny", "TunerActive")["status"] == "True", timeout=30)
                assert kube.condition("tiny", "ScalingLimited")["status"] in ("True", "False")
                # the knob reaches the ConfigMap, the mounted file, and the running server
                eventually(lambda: _project_config_map(kube, engine_yaml)["max_batch_size"] == tuned, timeout=20)
                eventually(lambda: _applied_batch(server) == tuned, timeout=20)
                # deletion: the garbage collector takes every child
                kube.delete("InferenceService", "tiny")
                for kind in ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"):
                    eventually(lambda kind=kind: kube.list(kind) == {}, timeout=20)
                eventually(lambda: kube.get("InferenceService", "tiny") is None, timeout=20)
    finally:
        kube.http.close()
        running.stop()


def _batch_lowered(resource: dict) -> bool:
    """The tuner's maxBatchSize in status is below the spec's. Its knobs, not lastDecision: the
    next run (a replica for the queue) overwrites that, maybe within one burst of traffic."""
    knobs = (resource.get("status") or {}).get("tuner", {}).get("knobs", {}).get("colocated", {})
    spec = SPEC["pools"]["colocated"]["engine"]["maxBatchSize"]
    return knobs.get("maxBatchSize", spec) < spec


def _mark_ready(kube: Kube) -> None:
    """The pool's Deployment and the routers' (the traffic here goes straight to the server)."""
    for name in ("tiny-colocated", "tiny-router"):
        deployment = kube.get("Deployment", name)
        n = deployment["spec"]["replicas"]
        status = {
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
            "observedGeneration": deployment["metadata"]["generation"],
        }
        kube.patch("Deployment", name, {"status": status}, subresource="status")


def _applied_batch(server: ServerProcess) -> float | None:
    return server.metrics().get("llmfleet_config_knob{knob=max_batch_size}")


# -- the real-cluster variant ------------------------------------------------------------------


def _cluster_or_skip() -> tuple[str, str]:
    if not os.environ.get("KUBECONFIG"):
        pytest.skip("no KUBECONFIG: set it to a test cluster (kind, k3d) to run the real-cluster e2e")
    tools = REPO / ".tools" / "bin"
    kubectl = shutil.which("kubectl") or str(tools / "kubectl")
    helm = shutil.which("helm") or str(tools / "helm")
    probe = subprocess.run([kubectl, "version", "--request-timeout=5s", "-o", "json"], capture_output=True, text=True)
    if probe.returncode != 0 or "serverVersion" not in probe.stdout:
        pytest.skip(f"KUBECONFIG is set but no cluster answers: {probe.stderr.strip()[:200]}")
    return kubectl, helm


def image_parts(image: str) -> tuple[str, str]:
    """(repository, tag) of an image reference; a colon inside the registry's host:port is no tag."""
    repository, colon, tag = image.rpartition(":")
    if not colon or "/" in tag:
        return image, "latest"
    return repository, tag


def test_image_references_split_as_the_chart_takes_them():
    assert image_parts("registry.local:5000/llm-fleet:0.2") == ("registry.local:5000/llm-fleet", "0.2")
    assert image_parts("registry.local:5000/llm-fleet") == ("registry.local:5000/llm-fleet", "latest")
    assert image_parts("llm-fleet:dev") == ("llm-fleet", "dev")


def _image_or_skip() -> str:
    image = os.environ.get("LLMFLEET_E2E_IMAGE")  # the operator and server image your cluster can pull
    if not image:
        pytest.skip(
            "set LLMFLEET_E2E_IMAGE to an llm-fleet image your cluster can pull (built from the Dockerfile, "
            "or a release's ghcr.io/<owner>/llm-fleet:<version>-cuda)"
        )
    return image


@pytest.mark.timeout(1800)  # an image's first pull, the model's download, the rollout, the cleanup
def test_the_cluster_quick_start(tmp_path):
    """docs/cluster-quickstart.md, steps 2 to 5, each command as the page writes it, in the
    kubeconfig's current namespace (the example's InferenceService lands there) with the image
    exported as step 1 would. Run it against a test cluster: step 2 installs the release
    llm-fleet in llm-fleet-system and step 5 removes it."""
    _cluster_or_skip()
    repository, tag = image_parts(_image_or_skip())
    env = {**os.environ, "IMAGE_REPOSITORY": repository, "IMAGE_TAG": tag}
    env["PATH"] = (
        f"{REPO / '.tools' / 'bin'}{os.pathsep}{env['PATH']}"  # kubectl and helm, as _cluster_or_skip finds them
    )
    page = steps()
    background: list[subprocess.Popen] = []

    def run(step: str, check: bool = True) -> None:
        for command in page[step].commands:
            if command.endswith("&"):  # the port-forward: it runs while the later steps do
                background.append(subprocess.Popen(["bash", "-c", command[:-1]], cwd=REPO, env=env))
                eventually(lambda: httpx.get("http://127.0.0.1:8000/v1/models", timeout=2).status_code == 200, 60)
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200
            )
            assert not check or done.returncode == 0, f"{step}: {command}\n{done.stdout}\n{done.stderr}"

    try:
        for step in CLUSTER_STEPS:
            if page[step].lang == "python":
                client = subprocess.run(
                    [sys.executable, "-c", page[step].code], cwd=REPO, capture_output=True, text=True, timeout=300
                )
                assert client.returncode == 0, client.stderr
                assert client.stdout.strip(), "the model answered nothing"
            else:
                run(step)
    finally:
        for process in background:
            process.terminate()
        run(CLEAN_UP, check=False)


@pytest.mark.timeout(1800)  # an image's first pull, the rollout, the tuner's interval, the cleanup
def test_on_a_real_cluster(tmp_path):
    kubectl, helm = _cluster_or_skip()
    namespace = os.environ.get("LLMFLEET_E2E_NAMESPACE", "llm-fleet-e2e")
    image = _image_or_skip()

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        # longer than any --timeout given to kubectl or helm, so their own message is what fails
        result = subprocess.run(args, capture_output=True, text=True, timeout=900)
        assert not check or result.returncode == 0, f"{' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    repository, tag = image_parts(image)
    install = [
        helm,
        "upgrade",
        "--install",
        "llm-fleet-e2e",
        str(REPO / "charts" / "llm-fleet"),
        "-n",
        f"{namespace}-system",
        "--create-namespace",
        "--wait",
        "--timeout",
        "5m",
        "--set",
        f"watchNamespaces={{{namespace}}}",
        "--set",
        f"image.repository={repository}",
        "--set",
        f"image.tag={tag}",
    ]
    run(kubectl, "apply", "--server-side", "-f", str(REPO / "crds"))
    run(kubectl, "create", "namespace", namespace, check=False)  # before the chart's Role lands in it
    run(*install)
    # no spec.image: the servers run the chart's image, as the operator hands it on
    resource = {**EXAMPLE, "metadata": {"name": "tiny", "namespace": namespace}, "spec": SPEC}
    manifest = tmp_path / "tiny.yaml"
    manifest.write_text(yaml.safe_dump(resource))
    forward = None
    try:
        run(kubectl, "apply", "-f", str(manifest))
        run(kubectl, "wait", "-n", namespace, "llmis/tiny", "--for=condition=Ready", "--timeout=600s")
        local = free_port()
        forward = subprocess.Popen(
            [kubectl, "port-forward", "-n", namespace, "svc/tiny", f"{local}:8000"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{local}"
        eventually(lambda: httpx.get(f"{url}/v1/models", timeout=2).status_code == 200, timeout=60)
        deadline = time.monotonic() + 300
        while True:
            assert asyncio.run(_traffic(url, seconds=10)) > 0
            got = json.loads(run(kubectl, "get", "-n", namespace, "llmis/tiny", "-o", "json").stdout)
            if _batch_lowered(got):
                break
            assert time.monotonic() < deadline, f"no tuner decision landed: {got.get('status')}"
    finally:
        if forward is not None:
            forward.terminate()
        run(kubectl, "delete", "-f", str(manifest), "--wait=true", "--timeout=300s", check=False)

        def leftovers() -> str:
            # the garbage collector removes the children after their owner, pods after their grace period
            kinds = "all,configmaps,pdb,serviceaccounts,roles,rolebindings"
            labelled = "llmfleet.io/inference-service=tiny"
            return run(kubectl, "get", kinds, "-n", namespace, "-l", labelled, "-o", "name", check=False).stdout.strip()

        deadline = time.monotonic() + 180
        while (left := leftovers()) and time.monotonic() < deadline:
            time.sleep(5)
        run(helm, "uninstall", "llm-fleet-e2e", "-n", f"{namespace}-system", check=False)
    assert left == "", f"left behind: {left}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
