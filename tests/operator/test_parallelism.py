"""Pools whose replicas span nodes, against the emulated API server with the real operator: a
LeaderWorkerSet made, scaled by the tuner's replicas and the spec's, and read back into status; a
cluster without the LeaderWorkerSet CRD, and a layout no node can hold, refused with a reason."""

from __future__ import annotations

import copy

import pytest

from tests.operator.conftest import eventually, inference_service, settle

GPU = {"limits": {"nvidia.com/gpu": 8}}
BIG = {
    "model": {"builtin": "tiny"},
    "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
    "gpusPerNode": 8,
    "pools": {
        "colocated": {
            "minReplicas": 1,
            "maxReplicas": 3,
            "parallelism": {"tensor": 8, "pipeline": 2},
            "resources": GPU,
            "engine": {"kvCacheMemoryMb": 128},
        }
    },
}


def conditions(obj) -> dict[str, dict]:
    return {c["type"]: c for c in obj["status"]["conditions"]}


def groups(kube, name: str = "big-colocated") -> dict | None:
    return kube.get("LeaderWorkerSet", name)


def mark_ready(kube, kind: str, name: str) -> None:
    """Play the controller: every desired replica (group) updated and ready."""
    obj = eventually(lambda: kube.get(kind, name))
    replicas = obj["spec"]["replicas"]
    status = {
        "replicas": replicas,
        "updatedReplicas": replicas,
        "readyReplicas": replicas,
        "observedGeneration": obj["metadata"]["generation"],
    }
    kube.patch(kind, name, {"status": status}, subresource="status")


@pytest.mark.parametrize("cluster_options", [{"leader_worker_set": True}])
def test_a_pool_over_nodes_is_a_leader_worker_set_that_scales(kube, operator, cluster_options):
    kube.create(inference_service("big", BIG))
    group = eventually(lambda: groups(kube))
    assert group["spec"]["replicas"] == 1 and group["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert "big-colocated" not in kube.list("Deployment")  # the router alone is a Deployment
    service = eventually(lambda: kube.get("Service", "big-colocated"))  # applied after the group
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

    mark_ready(kube, "LeaderWorkerSet", "big-colocated")
    mark_ready(kube, "Deployment", "big-router")
    obj = eventually(lambda: (o := kube.get("InferenceService", "big"))["status"]["ready"] == "2/2" and o)
    assert conditions(obj)["Ready"]["reason"] == "AllPoolsReady"
    assert obj["status"]["pools"]["colocated"] == {**obj["status"]["pools"]["colocated"], "readyReplicas": 1}

    # the tuner's replicas (status.tuner) scale the groups, within maxReplicas
    kube.patch("InferenceService", "big", {"status": {"tuner": {"replicas": {"colocated": 5}}}}, subresource="status")
    eventually(lambda: groups(kube)["spec"]["replicas"] == 3)
    obj = settle(kube, "big")
    assert obj["status"]["pools"]["colocated"]["replicas"] == 3
    assert conditions(obj)["Progressing"]["reason"] in ("Applied", "RollingOut")

    # the tuner off, the spec's replicas stand
    off = {"autotune": {"enabled": False}, "pools": {"colocated": {"replicas": 2}}}
    kube.patch("InferenceService", "big", {"spec": off})
    eventually(lambda: groups(kube)["spec"]["replicas"] == 2)

    # within a node again: a Deployment takes over and the group goes
    kube.patch("InferenceService", "big", {"spec": {"pools": {"colocated": {"parallelism": {"pipeline": 1}}}}})
    deployment = eventually(lambda: kube.get("Deployment", "big-colocated"))
    eventually(lambda: groups(kube) is None)
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 8


def test_without_the_leader_worker_set_crd_a_pool_over_nodes_is_refused_with_a_reason(kube, operator):
    kube.create(inference_service("big", BIG))
    obj = settle(kube, "big", 1)
    degraded = conditions(obj)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert "colocated 16 GPUs a replica" in degraded["message"] and "install LeaderWorkerSet" in degraded["message"]
    assert kube.list("Deployment") == {}, "nothing is deployed for a spec the cluster cannot run"

    # one node's worth: a Deployment, no LeaderWorkerSet needed
    kube.patch("InferenceService", "big", {"spec": {"pools": {"colocated": {"parallelism": {"pipeline": 1}}}}})
    obj = settle(kube, "big", 2)
    assert conditions(obj)["Degraded"]["status"] == "False"
    assert kube.get("Deployment", "big-colocated") is not None


def test_a_layout_no_node_can_hold_is_an_invalid_spec(kube, operator):
    spec = copy.deepcopy(BIG)
    spec["pools"]["colocated"]["parallelism"] = {"tensor": 4, "pipeline": 3}
    kube.create(inference_service("big", spec))
    obj = settle(kube, "big", 1)
    degraded = conditions(obj)["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "pools.colocated.parallelism" in degraded["message"] and "multiple of 8 GPUs" in degraded["message"]
    assert kube.list("Deployment") == {}
