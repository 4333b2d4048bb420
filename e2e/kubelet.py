"""What the emulated API server lacks for pods to run: a kubelet, the Deployment and EndpointSlice
controllers, and a PodMonitor's targets, played for one namespace on loopback.

Each Deployment's replicas run as `llm-fleet serve` processes with the pod's container args (its
host and ports made loopback ones, its engine ConfigMap projected into a file as the kubelet
mounts it, a router's API calls sent to the emulator without credentials); a pod turns ready when
its /ready answers, and drains on SIGTERM when the Deployment scales down. The Deployments'
status, the headless pool Services' EndpointSlices (one per pod, ready while it serves) and a
Prometheus file_sd target list follow, every ``PERIOD_S``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.operator.conftest import NAMESPACE, Kube
from tests.support import ServerProcess, free_port

PERIOD_S = 0.25
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


@dataclass
class Pod:
    name: str
    pool: str
    process: ServerProcess
    metrics_port: int
    ready: bool = False
    terminating: bool = False


@dataclass
class Kubelet:
    kube: Kube
    api_url: str
    run_dir: Path
    targets_file: Path
    pods: dict[str, list[Pod]] = field(default_factory=dict)  # Deployment name -> its pods
    _count: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    errors: list[BaseException] = field(default_factory=list)

    def __enter__(self) -> Kubelet:
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for pods in self.pods.values():
            for pod in pods:
                pod.process.stop()

    def ready_pods(self, deployment: str) -> list[Pod]:
        return [p for p in self.pods.get(deployment, []) if p.ready and not p.terminating]

    def running_pods(self, deployment: str) -> list[Pod]:
        return [p for p in self.pods.get(deployment, []) if p.process.proc.poll() is None]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # reported by the test, which would otherwise wait for nothing
                self.errors.append(exc)
            self._stop.wait(PERIOD_S)

    def sync(self) -> None:
        deployments = self.kube.list("Deployment")
        for name in list(self.pods):
            if name not in deployments:  # deleted: its pods go
                for pod in self.pods.pop(name):
                    pod.process.terminate()
        for name, deployment in deployments.items():
            self._converge(name, deployment)
        self._publish()

    def _converge(self, name: str, deployment: dict) -> None:
        pods = self.pods.setdefault(name, [])
        for pod in [p for p in pods if p.process.proc.poll() is not None]:
            pods.remove(pod)
            self._delete_slice(pod)
        serving = [p for p in pods if not p.terminating]
        want = int(deployment["spec"]["replicas"])
        while len(serving) < want:
            serving.append(self._start(name, deployment))
            pods.append(serving[-1])
        for pod in sorted(serving, key=lambda p: p.ready)[: len(serving) - want]:  # unready ones first
            pod.terminating = True
            pod.process.terminate(signal.SIGTERM)  # the pod's drain
        for pod in pods:
            if not pod.ready and not pod.terminating:
                with contextlib.suppress(httpx.HTTPError):
                    pod.ready = httpx.get(f"{pod.process.url}/ready", timeout=0.5).status_code == 200
        ready = len([p for p in pods if p.ready and not p.terminating])
        status = {
            "replicas": len(pods),
            "updatedReplicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "observedGeneration": deployment["metadata"]["generation"],
        }
        if {k: (deployment.get("status") or {}).get(k, 0) for k in status} != status:
            self.kube.patch("Deployment", name, {"status": status}, subresource="status")

    def _start(self, name: str, deployment: dict) -> Pod:
        self._count += 1
        pod_name = f"{name}-{self._count}"
        pool = deployment["metadata"]["labels"]["llmfleet.io/pool"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = list(container["args"])[1:]  # [0] is `serve`
        port, metrics_port = free_port(), free_port()
        replace = {"--host": "127.0.0.1", "--metrics-port": str(metrics_port)}
        if "--config" in args:  # the engine ConfigMap, mounted
            config = self.run_dir / f"{pod_name}-engine.yaml"
            config_map = self.kube.get("ConfigMap", f"{name}-engine")
            config.write_text(config_map["data"]["engine.yaml"])
            replace["--config"] = str(config)
        for flag, value in replace.items():
            args[args.index(flag) + 1] = value
        at = args.index("--port")
        del args[at : at + 2]  # ServerProcess gives the port itself
        if pool == "router":
            args += ["--kube-api", self.api_url]
        process = ServerProcess(
            *args,
            port=port,
            log_path=self.run_dir / f"{pod_name}.log",
            env={"POD_NAMESPACE": NAMESPACE, "OMP_NUM_THREADS": "1"},
        )
        return Pod(pod_name, pool, process, metrics_port)

    def _publish(self) -> None:
        """EndpointSlices of the pools' headless Services, and the scrape targets."""
        groups = []
        for name, pods in self.pods.items():
            for pod in pods:
                if pod.pool != "router":
                    self._put_slice(name, pod)
                if pod.ready and not pod.terminating:
                    labels = {"namespace": NAMESPACE, "inference_service": name.rsplit("-", 1)[0], "pool": pod.pool}
                    groups.append({"targets": [f"127.0.0.1:{pod.metrics_port}"], "labels": {**labels, "pod": pod.name}})
        text = json.dumps(groups)
        if not self.targets_file.exists() or self.targets_file.read_text() != text:
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(self.targets_file)

    def _put_slice(self, service: str, pod: Pod) -> None:
        ready = pod.ready and not pod.terminating
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": pod.name, "namespace": NAMESPACE, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": pod.process.port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": ready}}],
        }
        current = self.kube.http.get(f"{SLICES}/{pod.name}")
        if current.status_code == 404:
            self.kube.http.post(SLICES, json=body).raise_for_status()
        elif current.json()["endpoints"] != body["endpoints"]:
            body["metadata"]["resourceVersion"] = current.json()["metadata"]["resourceVersion"]
            self.kube.http.put(f"{SLICES}/{pod.name}", json=body).raise_for_status()

    def _delete_slice(self, pod: Pod) -> None:
        self.kube.http.delete(f"{SLICES}/{pod.name}")

    def wait(self, check, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert not self.errors, self.errors
            if result := check():
                return result
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
