"""A pool's parallelism: one pod with T x S GPUs where a replica fits on a node, a LeaderWorkerSet
group of full nodes where it does not, a CPU pool's replica one pod; the layouts refused and why;
what selects only the leaders of a group."""

from __future__ import annotations

import copy

import pytest
import yaml

from llmfleet.operator.reconcile import leader_worker_set as lws
from llmfleet.operator.reconcile.desired import Owner, desired_objects, restart_checksum
from llmfleet.operator.reconcile.network_policy import admits
from llmfleet.operator.resource.layout import LayoutError, gpu_resource, layout, with_gpu_count
from llmfleet.operator.resource.spec import SpecError, parse_spec

OWNER = Owner("big", "ml", "0c0ffee0-0000-4000-8000-000000000002")
BASE = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}, "gpusPerNode": 8}
GPU = {"limits": {"nvidia.com/gpu": 1}}


def spec_with(tensor: int = 1, pipeline: int = 1, resources=None, **pool):
    raw = copy.deepcopy(BASE)
    colocated = {"parallelism": {"tensor": tensor, "pipeline": pipeline}, "resources": resources or {}, **pool}
    raw["pools"] = {"colocated": colocated}
    return parse_spec(raw)


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(template):
    return template["spec"]["containers"][0]


def test_a_gpu_replica_within_a_node_is_one_pod_with_all_its_gpus():
    objects = desired_objects(OWNER, spec_with(tensor=2, pipeline=2, resources=GPU))
    deployment = by_kind(objects, "Deployment")["big-colocated"]
    resources = container(deployment["spec"]["template"])["resources"]
    assert resources == {"limits": {"nvidia.com/gpu": 4}, "requests": {"nvidia.com/gpu": 4}}
    engine = yaml.safe_load(by_kind(objects, "ConfigMap")["big-colocated-engine"]["data"]["engine.yaml"])
    assert (engine["tensor_parallel_size"], engine["pipeline_parallel_size"]) == (2, 2)
    assert not by_kind(objects, lws.KIND)


def test_a_cpu_pool_stays_one_pod_however_many_ranks():
    objects = desired_objects(OWNER, spec_with(tensor=16, pipeline=2, resources={"requests": {"cpu": "4"}}))
    deployment = by_kind(objects, "Deployment")["big-colocated"]
    assert container(deployment["spec"]["template"])["resources"] == {"requests": {"cpu": "4"}}
    assert "--nnodes" not in container(deployment["spec"]["template"])["args"]


def test_a_single_device_pool_renders_as_before():
    """No parallel field in the engine file nor in the restart checksum: no pod rolls on upgrade."""
    spec = spec_with(resources={"limits": {"nvidia.com/gpu": 1}})
    objects = desired_objects(OWNER, spec)
    engine = yaml.safe_load(by_kind(objects, "ConfigMap")["big-colocated-engine"]["data"]["engine.yaml"])
    assert "tensor_parallel_size" not in engine and "pipeline_parallel_size" not in engine
    parallel = spec_with(tensor=2, resources=GPU).pool("colocated").engine_config()
    assert restart_checksum(spec.pool("colocated").engine_config()) != restart_checksum(parallel)
    assert container(by_kind(objects, "Deployment")["big-colocated"]["spec"]["template"])["resources"] == GPU


@pytest.mark.parametrize(
    "written",
    [
        {"limits": {"nvidia.com/gpu": 2}},
        {"limits": {"nvidia.com/gpu": "-1"}},
        {"limits": {"nvidia.com/gpu": "0.5"}},
        {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}},
        {"requests": {"nvidia.com/gpu": 1}},
    ],
)
def test_a_single_device_pool_asks_for_one_gpu_whatever_count_was_written(written):
    """One rank uses one GPU: a pod asking for more would hold the rest idle, and a count the
    scheduler refuses (negative, a fraction, requests and limits apart) would fail only at apply."""
    placed = layout(written, 1, 1, 8)
    assert with_gpu_count(written, placed) == {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}


def test_a_replica_over_nodes_is_a_leader_worker_set_of_full_nodes():
    spec = spec_with(tensor=8, pipeline=2, resources={"limits": {"example.com/gpu": 8}}, replicas=3)
    objects = desired_objects(OWNER, spec, pod_monitor=True)
    assert "big-colocated" not in by_kind(objects, "Deployment")
    group = by_kind(objects, lws.KIND)["big-colocated"]
    assert group["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert group["spec"]["replicas"] == 3
    template = group["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = container(template["leaderTemplate"]), container(template["workerTemplate"])
    for member in (leader, worker):
        assert member["resources"]["limits"] == {"example.com/gpu": 8}
        assert member["resources"]["requests"] == {"example.com/gpu": 8}
    assert leader["args"][-8:] == [
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--master-port",
        "29500",
    ]
    assert "--headless" not in leader["args"]
    assert worker["args"][-9:] == [
        "--nnodes",
        "2",
        "--headless",
        "--node-rank",
        "$(LWS_WORKER_INDEX)",
        "--master-addr",
        "$(LWS_LEADER_ADDRESS)",
        "--master-port",
        "29500",
    ]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert {worker[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"/health"}
    # API traffic and scrapes reach the leaders only
    service = by_kind(objects, "Service")["big-colocated"]
    assert service["spec"]["selector"][lws.WORKER_INDEX_LABEL] == "0"
    monitor = by_kind(objects, "PodMonitor")["big"]["spec"]["selector"]
    assert monitor["matchExpressions"] == [{"key": lws.HEADLESS_LABEL, "operator": "DoesNotExist"}]
    assert lws.HEADLESS_LABEL in template["workerTemplate"]["metadata"]["labels"]
    assert lws.HEADLESS_LABEL not in template["leaderTemplate"]["metadata"]["labels"]


def test_the_pods_of_a_group_reach_each_other_and_clients_do_not():
    objects = desired_objects(OWNER, spec_with(tensor=8, pipeline=2, resources=GPU))
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    template = by_kind(objects, lws.KIND)["big-colocated"]["spec"]["leaderWorkerTemplate"]
    leader = template["leaderTemplate"]["metadata"]["labels"]
    worker = template["workerTemplate"]["metadata"]["labels"]
    assert admits(policies, leader, "dist", worker) and admits(policies, worker, "dist", leader)
    router = {"llmfleet.io/inference-service": "big", "llmfleet.io/pool": "router"}
    assert admits(policies, leader, "http", router)
    assert not admits(policies, leader, "dist", router)
    assert not admits(policies, leader, "http", {"app": "some-client"})


def test_an_external_autoscaler_owns_a_groups_replicas():
    raw = copy.deepcopy(BASE) | {"externalAutoscaler": True, "autotune": {"enabled": False}}
    raw["pools"] = {"colocated": {"parallelism": {"tensor": 16}, "resources": GPU}}
    objects = desired_objects(OWNER, parse_spec(raw), scaled={"colocated": 5})
    group = by_kind(objects, lws.KIND)["big-colocated"]
    assert group["spec"]["replicas"] == 5
    assert group["metadata"]["annotations"]["llmfleet.io/replicas"] == "external"


@pytest.mark.parametrize(
    ("tensor", "pipeline", "gpus_per_node", "nodes"),
    [(1, 1, 8, 1), (2, 4, 8, 1), (4, 4, 8, 2), (8, 4, 8, 4), (3, 2, 2, 3), (6, 1, 4, None), (3, 3, 8, None)],
)
def test_a_layout_takes_whole_nodes_or_is_refused(tensor, pipeline, gpus_per_node, nodes):
    if nodes is None:
        with pytest.raises(LayoutError, match=f"multiple of {gpus_per_node} GPUs"):
            layout(GPU, tensor, pipeline, gpus_per_node)
    else:
        placed = layout(GPU, tensor, pipeline, gpus_per_node)
        assert placed.nodes == nodes and placed.devices == tensor * pipeline
        assert placed.gpus_per_pod == placed.devices // nodes


def test_the_gpu_kind_is_any_vendors_and_only_one():
    assert gpu_resource({"limits": {"nvidia.com/gpu": 1}}) == "nvidia.com/gpu"
    assert gpu_resource({"requests": {"amd.com/gpu": 1, "cpu": "2"}}) == "amd.com/gpu"
    assert gpu_resource({"limits": {"cpu": "2", "memory": "8Gi"}}) is None
    with pytest.raises(LayoutError, match="several GPU kinds"):
        gpu_resource({"limits": {"nvidia.com/gpu": 1, "amd.com/gpu": 1}})


def test_a_layout_that_leaves_a_node_part_empty_is_an_invalid_spec():
    with pytest.raises(SpecError) as err:
        spec_with(tensor=4, pipeline=3, resources=GPU)
    assert err.value.reason == "InvalidSpec"
    assert "pools.colocated.parallelism" in str(err.value) and "12 GPUs span 2 nodes" in str(err.value)


@pytest.mark.parametrize("key", ["tensorParallelSize", "pipeline_parallel_size"])
def test_the_engines_parallel_sizes_are_set_through_parallelism_only(key):
    raw = copy.deepcopy(BASE)
    raw["pools"] = {"colocated": {"engine": {key: 2}}}
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert err.value.reason == "InvalidSpec"
    assert f"engine.{key}: set parallelism." in str(err.value)


def test_gpus_per_node_defaults_to_the_operators(monkeypatch):
    raw = {k: v for k, v in BASE.items() if k != "gpusPerNode"}
    raw["pools"] = {"colocated": {"parallelism": {"tensor": 8}, "resources": GPU}}
    monkeypatch.setenv("LLMFLEET_GPUS_PER_NODE", "4")
    assert parse_spec(raw).layout("colocated").nodes == 2
    monkeypatch.delenv("LLMFLEET_GPUS_PER_NODE")
    assert parse_spec(raw).layout("colocated").nodes == 1
