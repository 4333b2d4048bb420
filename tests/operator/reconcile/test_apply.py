"""reconcile/apply.py against the emulated API server (no kopf): create, then nothing; change one field,
then exactly one write; a field we stop setting goes away; what is no longer desired is pruned;
a same-named object another controller owns is never taken over. Plus the comparison rules."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmfleet.operator.reconcile.apply import (
    APPLIED_HASH,
    OwnershipConflict,
    apply_all,
    is_subset,
    list_children,
    quantity,
)
from llmfleet.operator.reconcile.cluster import CONFIG_MAP, DEPLOYMENT, POD, ApiError, child_kinds
from llmfleet.operator.reconcile.desired import Owner, desired_objects, selector
from llmfleet.operator.reconcile.scaledown import DELETION_COST, rank_pods_for_scale_down
from llmfleet.operator.resource.spec import parse_spec
from tests.operator.emulator import Fault

KINDS = child_kinds(pod_monitor=False, leader_worker_sets=False)
SPEC = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}}


def writes(running):
    return running.call(running.cluster.writes)


async def create_owner(client, name="svc"):
    body = {"apiVersion": "llmfleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": SPEC}
    created = await client.request("POST", "/apis/llmfleet.io/v1alpha1/namespaces/ml/inferenceservices", body=body)
    return Owner(name, "ml", created["metadata"]["uid"])


async def apply(client, owner, objects, prune=True):
    live = await list_children(client, "ml", selector(owner), KINDS)
    return await apply_all(client, "ml", owner.uid, live, objects, prune=prune)


async def test_create_then_nothing_then_one_write(running, client):
    owner = await create_owner(client)
    objects = desired_objects(owner, parse_spec(SPEC))
    first = await apply(client, owner, objects)
    assert len(first.created) == len(objects) and not first.updated and not first.deleted
    before = len(writes(running))

    second = await apply(client, owner, objects)
    assert not second.changed and second.summary() == "no changes"
    assert len(writes(running)) == before, "an unchanged object was written"

    changed = copy.deepcopy(objects)
    changed[1]["spec"]["replicas"] = 3  # the Deployment
    third = await apply(client, owner, changed)
    assert third.updated == ["Deployment/svc-colocated"] and not third.created
    assert writes(running)[before:] == ["PATCH /apis/apps/v1/namespaces/ml/deployments/svc-colocated"]
    live = await client.get(DEPLOYMENT, "ml", "svc-colocated")
    assert live["spec"]["replicas"] == 3 and live["metadata"]["annotations"][APPLIED_HASH]


async def test_a_field_we_stop_setting_is_removed(running, client):
    owner = await create_owner(client)
    spec = parse_spec({**SPEC, "pools": {"colocated": {"nodeSelector": {"gpu": "a100"}}}})
    await apply(client, owner, desired_objects(owner, spec))
    live = await client.get(DEPLOYMENT, "ml", "svc-colocated")
    assert live["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "a100"}

    result = await apply(client, owner, desired_objects(owner, parse_spec(SPEC)))
    assert result.updated == ["Deployment/svc-colocated"]  # the subset test alone would miss it
    live = await client.get(DEPLOYMENT, "ml", "svc-colocated")
    assert "nodeSelector" not in live["spec"]["template"]["spec"]


async def test_drift_is_repaired(running, client):
    owner = await create_owner(client)
    objects = desired_objects(owner, parse_spec(SPEC))
    await apply(client, owner, objects)
    await client.patch_merge(CONFIG_MAP, "ml", "svc-colocated-engine", {"data": {"engine.yaml": "max_batch_size: 1"}})
    result = await apply(client, owner, objects)
    assert result.updated == ["ConfigMap/svc-colocated-engine"]
    live = await client.get(CONFIG_MAP, "ml", "svc-colocated-engine")
    assert live["data"] == objects[0]["data"]


async def test_objects_no_longer_desired_are_pruned_and_foreign_ones_kept(running, client):
    owner = await create_owner(client)
    await apply(client, owner, desired_objects(owner, parse_spec(SPEC)))
    # someone else's object carrying our labels, without our controller reference
    stray = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "notes", "namespace": "ml", "labels": selector(owner)},
        "data": {"a": "b"},
    }
    await client.request("POST", CONFIG_MAP.path("ml"), body=stray)
    disaggregated = parse_spec({**SPEC, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}})
    result = await apply(client, owner, desired_objects(owner, disaggregated))
    assert sorted(result.deleted) == [
        "ConfigMap/svc-colocated-engine",
        "Deployment/svc-colocated",
        "NetworkPolicy/svc-colocated",
        "PodDisruptionBudget/svc-colocated",
        "Service/svc-colocated",
    ]
    assert "Deployment/svc-router" in result.updated  # the routers now relay to the new pools
    assert await client.get(CONFIG_MAP, "ml", "notes") is not None
    names = {o["metadata"]["name"] for o in await client.list(DEPLOYMENT, "ml", selector(owner))}
    assert names == {"svc-prefill", "svc-decode", "svc-router"}


async def test_without_prune_the_objects_no_longer_desired_stay(running, client):
    owner = await create_owner(client)
    await apply(client, owner, desired_objects(owner, parse_spec(SPEC)))
    disaggregated = parse_spec({**SPEC, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}})
    handing_over = desired_objects(owner, disaggregated, router_mode="colocated")
    result = await apply(client, owner, handing_over, prune=False)
    assert result.deleted == []
    deployments = {o["metadata"]["name"]: o for o in await client.list(DEPLOYMENT, "ml", selector(owner))}
    assert set(deployments) == {"svc-colocated", "svc-prefill", "svc-decode", "svc-router"}
    router = deployments["svc-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--colocated-service" in router and "--decode-service" not in router  # still relays to the colocated pool


async def test_never_takes_over_another_controllers_object(running, client):
    owner = await create_owner(client)
    other = await create_owner(client, "other")
    squatter = desired_objects(other, parse_spec(SPEC))[0]
    squatter["metadata"]["name"] = "svc-colocated-engine"
    squatter["metadata"]["labels"] = {"app": "other"}
    await client.request("POST", CONFIG_MAP.path("ml"), body=squatter)
    before = len(writes(running))
    with pytest.raises(OwnershipConflict, match="svc-colocated-engine"):
        await apply(client, owner, desired_objects(owner, parse_spec(SPEC)))
    assert len(writes(running)) == before, "wrote something before detecting the conflict"


async def test_never_takes_over_an_object_nobody_controls(running, client):
    """A Service made by hand (say, the vLLM one being replaced) keeps its selector and its life."""
    owner = await create_owner(client)
    by_hand = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "svc", "namespace": "ml"},
        "spec": {"selector": {"app": "vllm"}, "ports": [{"port": 8000}]},
    }
    await client.request("POST", "/api/v1/namespaces/ml/services", body=by_hand)
    before = len(writes(running))
    with pytest.raises(OwnershipConflict, match="no InferenceService controls it"):
        await apply(client, owner, desired_objects(owner, parse_spec(SPEC)))
    assert len(writes(running)) == before


async def test_client_errors_and_retries(running, client, monkeypatch):
    monkeypatch.setattr("llmfleet.operator.reconcile.cluster.RETRY_BACKOFFS", (0.01, 0.01))
    owner = await create_owner(client)
    objects = desired_objects(owner, parse_spec(SPEC))
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/deployments/", 500, times=2)))
    result = await apply(client, owner, objects)  # two 500s, then success: retried inside the client
    assert "Deployment/svc-colocated" in result.created
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/services/", 422, times=1)))
    objects[2]["spec"]["ports"][0]["port"] = 9000
    with pytest.raises(ApiError) as err:
        await apply(client, owner, objects)
    assert err.value.status == 422 and not err.value.retryable
    assert await client.get(DEPLOYMENT, "ml", "absent") is None


def test_quantities():
    assert quantity("500m") == quantity(0.5) == quantity("0.5")
    assert quantity("1Gi") == 1024**3 and quantity("1G") == 10**9
    assert quantity(True) is None and quantity("abc") is None and quantity(None) is None
    # a content hash that reads as a number with a huge exponent: no quantity, no exception
    assert quantity("4711e90210987654") is None


@pytest.mark.parametrize(
    ("want", "have", "same"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),  # the server adds defaults
        ({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": 1}, {}, False),
        ([{"name": "x"}], [{"name": "x", "protocol": "TCP"}], True),
        ([{"name": "x"}], [{"name": "x"}, {"name": "y"}], False),
        ({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": "1"}}, True),  # the server's form
        ({"cpu": "0.5"}, {"cpu": "500m"}, True),
        ({"cpu": "1"}, {"cpu": "2"}, False),
        ({"flag": True}, {"flag": 1}, False),
        ({"x": "1"}, {"x": "01a"}, False),
        ({"hash": "4711e90210987654"}, {"hash": "4711e90210987655"}, False),  # it made reconcile fail
        # zero values the API server does not store match an absent field, never another value
        ({"readOnly": False, "medium": "", "limits": {}, "args": []}, {}, True),
        ({"tolerations": [{"key": "gpu", "value": ""}]}, {"tolerations": [{"key": "gpu"}]}, True),
        ({"readOnly": False}, {"readOnly": True}, False),
        ({"value": ""}, {"value": "x"}, False),
        ({"limits": {}}, {"limits": {"cpu": "1"}}, True),  # as a subset, {} takes what the server adds
        ({"a": 0}, {}, False),
        ({"a": None}, {}, False),
    ],
)
def test_is_subset(want, have, same):
    assert is_subset(want, have) is same


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=12,
)


@given(json_values)
def test_everything_is_a_subset_of_itself(value):
    assert is_subset(value, copy.deepcopy(value))


async def test_zero_values_the_api_server_drops_converge(running, client):
    """readOnly: false, a toleration's value: "" and limits: {} are legal in the spec but not stored:
    the pass after the first must still find nothing to apply."""
    spec = {
        **SPEC,
        "model": {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "m", "readOnly": False}}},
        "pools": {
            "colocated": {
                "resources": {"limits": {}, "requests": {"cpu": "1"}},
                "tolerations": [{"key": "gpu", "operator": "Exists", "value": ""}],
            }
        },
    }
    owner = await create_owner(client)
    objects = desired_objects(owner, parse_spec(spec))
    await apply(client, owner, objects)
    live = await client.get(DEPLOYMENT, "ml", "svc-colocated")
    pod = live["spec"]["template"]["spec"]  # as a real API server stores it
    del pod["volumes"][-1]["persistentVolumeClaim"]["readOnly"]
    del pod["tolerations"][0]["value"]
    del pod["containers"][0]["resources"]["limits"]
    await client.request("PUT", DEPLOYMENT.path("ml", "svc-colocated"), body=live)
    assert not (await apply(client, owner, objects)).changed


async def test_scale_down_ranks_pods_by_in_flight_work(running, client):
    owner = await create_owner(client)
    for name, pool in (("a", "decode"), ("b", "decode"), ("c", "decode"), ("p", "prefill")):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": selector(owner, pool)}}
        await client.request("POST", POD.path("ml"), body=pod)
    changed = await rank_pods_for_scale_down(client, owner, "decode", {"a": 7, "b": 0.4, "p": 3, "gone": 1})
    assert sorted(changed) == ["a", "b"]
    pods = {n: await client.get(POD, "ml", n) for n in "abcp"}
    costs = {n: (pod["metadata"].get("annotations") or {}).get(DELETION_COST) for n, pod in pods.items()}
    assert costs == {"a": "7", "b": "0", "c": None, "p": None}
    before = len(writes(running))
    assert await rank_pods_for_scale_down(client, owner, "decode", {"a": 7, "b": 0}) == []
    assert len(writes(running)) == before


async def test_a_pod_that_cannot_report_loses_an_earlier_deletion_cost(running, client):
    """Scale-down 1 marked "a" busy; now it cannot say (its /load hangs): it goes first, not the idle "b"."""
    owner = await create_owner(client)
    for name in ("a", "b"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": selector(owner, "decode")}}
        await client.request("POST", POD.path("ml"), body=pod)
    await rank_pods_for_scale_down(client, owner, "decode", {"a": 40, "b": 3})
    assert await rank_pods_for_scale_down(client, owner, "decode", {"b": 0}) == ["a", "b"]
    costs = {n: (await client.get(POD, "ml", n))["metadata"]["annotations"][DELETION_COST] for n in "ab"}
    assert costs == {"a": "0", "b": "0"}


async def test_a_pod_gone_since_the_list_is_left_out_of_the_ranking(running, client, monkeypatch):
    """A rollout or an eviction deletes a pod between the list and its patch: the others are
    still ranked, and the scale-down goes on."""
    owner = await create_owner(client)
    for name in ("a", "b"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": selector(owner, "decode")}}
        await client.request("POST", POD.path("ml"), body=pod)
    patch_merge = client.patch_merge

    async def gone_first(kind, namespace, name, patch):
        if name == "a":
            raise ApiError(404, "NotFound", 'pods "a" not found')
        return await patch_merge(kind, namespace, name, patch)

    monkeypatch.setattr(client, "patch_merge", gone_first)
    assert await rank_pods_for_scale_down(client, owner, "decode", {"a": 7, "b": 3}) == ["b"]
