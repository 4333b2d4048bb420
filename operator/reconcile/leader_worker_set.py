"""A pool whose replica spans nodes, as a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): one group
of pods per replica, one pod per node, made and scaled as a unit by the LWS controller.

A group's leader (worker index 0) runs the HTTP API and rank 0 of torch.distributed; its workers
run ``--headless``: model ranks only, and ``/health`` on the HTTP port for their probes. Every pod
learns where its leader is and its own index from the env LWS injects (``LWS_LEADER_ADDRESS``,
``LWS_WORKER_INDEX``), which the kubelet expands in the arguments. A pod that restarts recreates
its whole group (``RecreateGroupOnPodRestart``): the ranks of a model cannot rejoin one by one.

What sends requests (the pool's Service, so the router) and what scrapes them (the PodMonitor)
selects the leaders only: LWS labels them ``leaderworkerset.sigs.k8s.io/worker-index: "0"``, and
the workers carry ``llmfleet.io/headless`` (a PodMonitor over every pool cannot ask for "index 0
or no index at all").
"""

from __future__ import annotations

import copy
from typing import Any

from llmfleet.operator.resource.layout import Layout
from llmfleet.operator.resource.spec import PodOptions

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on the leader, LWS's own
HEADLESS_LABEL = "llmfleet.io/headless"  # on the workers: no HTTP API, nothing to scrape
MASTER_PORT = 29500  # torch.distributed's rendezvous on the leader (torchrun's default)
LEADER_ADDRESS = "$(LWS_LEADER_ADDRESS)"
WORKER_INDEX = "$(LWS_WORKER_INDEX)"


def leader_only(pod_selector: dict[str, str], placed: Layout) -> dict[str, str]:
    """A pool's pod selector narrowed to the pods that serve requests: the leaders of a pool
    whose replicas span nodes, every pod of any other."""
    return {**pod_selector, WORKER_INDEX_LABEL: "0"} if placed.spans_nodes else dict(pod_selector)


def distributed_args(placed: Layout, *, leader: bool) -> list[str]:
    """The server's flags for its place in the group (torchrun's names, vLLM's --headless)."""
    rank = ["--node-rank", "0"] if leader else ["--headless", "--node-rank", WORKER_INDEX]
    return [
        "--nnodes",
        str(placed.nodes),
        *rank,
        "--master-addr",
        LEADER_ADDRESS,
        "--master-port",
        str(MASTER_PORT),
    ]


def _member(template: dict[str, Any], placed: Layout, *, leader: bool) -> dict[str, Any]:
    out = copy.deepcopy(template)
    container = out["spec"]["containers"][0]
    container["args"].extend(distributed_args(placed, leader=leader))
    container["ports"].append({"name": "dist", "containerPort": MASTER_PORT, "protocol": "TCP"})
    if not leader:  # no API, so no /ready: the probes ask whether the process lives
        out["metadata"]["labels"][HEADLESS_LABEL] = "true"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            container[probe]["httpGet"]["path"] = "/health"
    return out


def leader_worker_set(
    metadata: dict[str, Any], replicas: int, template: dict[str, Any], placed: Layout, pod: PodOptions
) -> dict[str, Any]:
    """``replicas`` groups of ``placed.nodes`` pods made from one server pod ``template`` (its
    container's resources already hold one node's GPUs)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": pod.max_unavailable, "maxSurge": pod.max_surge},
            },
            "leaderWorkerTemplate": {
                "size": placed.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _member(template, placed, leader=True),
                "workerTemplate": _member(template, placed, leader=False),
            },
        },
    }
