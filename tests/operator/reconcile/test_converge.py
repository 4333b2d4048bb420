"""One reconcile pass (reconcile/converge.py) against the emulated API server, without kopf: the status
write under an optimistic lock keeps the tuner's word, API rejections become Degraded with the
server's message, server trouble is raised for kopf to retry, and recovery is announced."""

from __future__ import annotations

import base64

import pytest
from kmock import ResourceInfo

from llmfleet.operator.reconcile.apply import controller_uid
from llmfleet.operator.reconcile.cluster import CONFIG_MAP, DEPLOYMENT, INFERENCE_SERVICE, POD_MONITOR, SECRET, ApiError
from llmfleet.operator.reconcile.converge import converge
from tests.operator.emulator import Fault

SPEC = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}}


async def create(client, spec=SPEC, name="svc"):
    body = {"apiVersion": "llmfleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": name}, "spec": spec}
    return await client.request("POST", INFERENCE_SERVICE.path("ml"), body=body)


async def fetch(client, name="svc"):
    return await client.get(INFERENCE_SERVICE, "ml", name)


def condition(body, type_):
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)


async def test_a_stale_body_never_overwrites_the_tuners_condition(running, client):
    stale = await create(client)
    tuner_says = {"type": "TunerActive", "status": "True", "reason": "Tuning", "message": "p95 ITL 41 ms"}
    await client.patch_status(INFERENCE_SERVICE, "ml", "svc", {"conditions": [tuner_says]})

    outcome = await converge(client, stale, pod_monitor=False)  # read before the tuner wrote
    assert outcome.status_patch is not None
    fresh = await fetch(client)
    assert condition(fresh, "TunerActive") == tuner_says
    assert condition(fresh, "Degraded")["status"] == "False"
    conflicts = [w for w in running.call(running.cluster.writes) if w.endswith("/status")]
    assert len(conflicts) == 3  # the tuner's, our stale attempt (409), our retry

    settling = await converge(client, fresh, pod_monitor=False)  # Progressing: Applied -> RollingOut
    assert condition(await fetch(client), "Progressing")["reason"] == "RollingOut" and not settling.events
    again = await converge(client, await fetch(client), pod_monitor=False)
    assert again.status_patch is None and not again.applied.changed and again.events == []


async def test_an_object_the_api_server_rejects_degrades_with_its_message(running, client):
    body = await create(client)
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/deployments/", 422, times=1)))
    outcome = await converge(client, body, pod_monitor=False)
    assert outcome.degraded is not None and outcome.degraded.reason == "ApplyFailed"
    assert "injected by the test" in outcome.degraded.message
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "ApplyFailed")]
    body = await fetch(client)
    assert condition(body, "Degraded")["status"] == "True"

    recovered = await converge(client, body, pod_monitor=False)
    assert recovered.degraded is None
    assert [e.reason for e in recovered.events] == ["Applied", "Recovered"]
    assert condition(await fetch(client), "Degraded")["status"] == "False"


async def test_an_edit_the_api_server_refuses_in_part_lands_in_none(running, client):
    """A knob and a pod option in one edit, and the Deployment refused: the ConfigMap, applied
    first, had changed, and the pods took its knobs live beside a status that said otherwise."""
    body = await create(client)
    await converge(client, body, pod_monitor=False)
    config_map = (await client.get(CONFIG_MAP, "ml", "svc-colocated-engine"))["data"]
    edit = {**SPEC, "pools": {"colocated": {"engine": {"maxBatchSize": 48}}}, "pod": {"env": [{"name": "A"}]}}
    await client.request(
        "PATCH", INFERENCE_SERVICE.path("ml", "svc"), body={"spec": edit}, content_type="application/merge-patch+json"
    )
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/deployments/", 422, times=1)))
    outcome = await converge(client, await fetch(client), pod_monitor=False)
    assert outcome.degraded is not None and outcome.degraded.reason == "ApplyFailed"
    assert (await client.get(CONFIG_MAP, "ml", "svc-colocated-engine"))["data"] == config_map

    await converge(client, await fetch(client), pod_monitor=False)  # the API server takes it now
    assert "max_batch_size: 48" in (await client.get(CONFIG_MAP, "ml", "svc-colocated-engine"))["data"]["engine.yaml"]


async def test_server_trouble_is_raised_for_a_retry(running, client, monkeypatch):
    monkeypatch.setattr("llmfleet.operator.reconcile.cluster.RETRY_BACKOFFS", ())
    body = await create(client)
    running.call(lambda: running.cluster.faults.append(Fault("PATCH", "/configmaps/", 503, times=1)))
    with pytest.raises(ApiError) as err:
        await converge(client, body, pod_monitor=False)
    assert err.value.retryable
    assert "status" not in await fetch(client)  # nothing half-reported


async def test_the_same_degradation_is_reported_once(running, client):
    body = await create(client, {**SPEC, "mode": "disaggregated"})
    first = await converge(client, body, pod_monitor=False)
    assert [(e.type, e.reason) for e in first.events] == [("Warning", "InvalidSpec")]
    second = await converge(client, await fetch(client), pod_monitor=False)
    assert second.events == [] and second.status_patch is None


@pytest.mark.parametrize("name", ["qwen2.5-7b", "7b-chat", "a" * 54])
async def test_a_name_its_services_could_not_take_degrades_and_creates_nothing(running, client, name):
    """The API server takes these names for the InferenceService (one without CEL, at least), but
    not for its Services: half a fleet would run."""
    body = await create(client, name=name)
    before = running.call(running.cluster.writes)
    outcome = await converge(client, body, pod_monitor=False)
    assert outcome.degraded is not None and outcome.degraded.reason == "InvalidName"
    assert f"name {name!r} cannot name this fleet's Services: use at most 53 characters" in outcome.degraded.message
    assert [(e.type, e.reason) for e in outcome.events] == [("Warning", "InvalidName")]
    writes = running.call(running.cluster.writes)[len(before) :]
    assert writes and all(w.endswith(f"/{name}/status") for w in writes), writes
    assert condition(await fetch(client, name), "Degraded")["reason"] == "InvalidName"


async def test_pod_monitor_only_when_served(running, client):
    body = await create(client)
    without = await converge(client, body, pod_monitor=False)
    assert not [r for r in without.applied.created if r.startswith("PodMonitor/")]
    running.call(lambda: running.cluster.declare("monitoring.coreos.com/v1/podmonitors", _pod_monitor_info()))
    assert await client.serves(POD_MONITOR)
    with_monitor = await converge(client, await fetch(client), pod_monitor=True)
    assert with_monitor.applied.created == ["PodMonitor/svc"]


def _pod_monitor_info():
    return ResourceInfo(kind="PodMonitor", singular="podmonitor", namespaced=True, verbs={"get", "list", "patch"})


DISAGGREGATED = {**SPEC, "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}}


def token_env(deployment):
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return next(e for e in container["env"] if e["name"] == "LLMFLEET_KV_TRANSFER_TOKEN")["valueFrom"]


async def test_a_disaggregated_fleet_without_a_token_secret_gets_one_of_its_own(running, client):
    body = await create(client, DISAGGREGATED)
    first = await converge(client, body, pod_monitor=False)
    assert first.degraded is None and first.applied.created[0] == "Secret/svc-kv-transfer"
    secret = await client.get(SECRET, "ml", "svc-kv-transfer")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex: it travels in a header
    assert controller_uid(secret) == body["metadata"]["uid"]  # it goes with the InferenceService
    for pool in ("prefill", "decode", "router"):
        deployment = await client.get(DEPLOYMENT, "ml", f"svc-{pool}")
        assert token_env(deployment) == {"secretKeyRef": {"name": "svc-kv-transfer", "key": "token"}}

    again = await converge(client, await fetch(client), pod_monitor=False)
    assert "Secret/svc-kv-transfer" not in again.applied.created + again.applied.updated
    assert (await client.get(SECRET, "ml", "svc-kv-transfer"))["data"] == secret["data"]  # running pods keep theirs

    await client.delete(SECRET, "ml", "svc-kv-transfer")  # by hand: made again, with a new token
    remade = await converge(client, await fetch(client), pod_monitor=False)
    assert remade.applied.created == ["Secret/svc-kv-transfer"]
    assert (await client.get(SECRET, "ml", "svc-kv-transfer"))["data"]["token"] != secret["data"]["token"]


async def test_a_named_token_secret_or_a_colocated_fleet_makes_none(running, client):
    named = await create(client, {**DISAGGREGATED, "kvTransferSecret": {"name": "mine"}}, name="named")
    await converge(client, named, pod_monitor=False)
    assert token_env(await client.get(DEPLOYMENT, "ml", "named-router"))["secretKeyRef"]["name"] == "mine"
    colocated = await create(client, name="plain")
    await converge(client, colocated, pod_monitor=False)
    for name in ("named", "plain"):
        assert await client.get(SECRET, "ml", f"{name}-kv-transfer") is None
    (container,) = (await client.get(DEPLOYMENT, "ml", "plain-colocated"))["spec"]["template"]["spec"]["containers"]
    assert "LLMFLEET_KV_TRANSFER_TOKEN" not in str(container["env"])


SPANNING = {
    **SPEC,
    "gpusPerNode": 8,
    "pools": {
        "colocated": {"parallelism": {"tensor": 8, "pipeline": 2}, "resources": {"limits": {"nvidia.com/gpu": 8}}}
    },
}


async def test_a_name_too_long_for_a_pool_that_spans_nodes_degrades_before_anything_is_written(running, client):
    """The worker pods of a LeaderWorkerSet named "<name>-colocated" carry a label of the worker
    StatefulSet's name and its hash: past 63 characters the API server refuses every one of them."""
    name = "n" * 40  # a Deployment's Services take it; "<name>-colocated-<group>-<hash>" is 64+
    body = await create(client, SPANNING, name=name)
    outcome = await converge(client, body, pod_monitor=False, leader_worker_sets=True)
    assert outcome.degraded is not None and outcome.degraded.reason == "InvalidName"
    assert "use at most 39 characters" in outcome.degraded.message
    assert not [w for w in running.call(running.cluster.writes) if "/deployments" in w or "leaderworkersets" in w]

    fits = await create(client, SPANNING, name="n" * 39)
    outcome = await converge(client, fits, pod_monitor=False, leader_worker_sets=True)
    assert outcome.degraded is None or outcome.degraded.reason != "InvalidName"
    single = await create(client, SPEC, name="m" * 40)  # one node a replica: a Deployment, no group
    outcome = await converge(client, single, pod_monitor=False)
    assert outcome.degraded is None


async def test_while_degraded_ready_follows_what_runs(running, client):
    """An unservable edit leaves what runs in place; its pods then fail. Ready and status.ready
    said True and 2/2 for as long as the spec stayed unservable: kubectl wait and health checks
    read a service that was down as healthy."""
    from llmfleet.operator.reconcile.cluster import DEPLOYMENT

    async def pods_ready(count: int) -> None:
        for name in ("svc-colocated", "svc-router"):
            status = {"replicas": 1, "readyReplicas": count, "updatedReplicas": 1, "availableReplicas": count}
            await client.patch_status(DEPLOYMENT, "ml", name, status)

    body = await create(client)
    await converge(client, body, pod_monitor=False)
    await pods_ready(1)
    await converge(client, await fetch(client), pod_monitor=False)
    assert condition(await fetch(client), "Ready")["status"] == "True"

    broken = {**SPEC, "pools": {"colocated": {"minReplicas": 5, "maxReplicas": 2}}}  # past the CRD (no CEL)
    await client.request(
        "PATCH", INFERENCE_SERVICE.path("ml", "svc"), body={"spec": broken}, content_type="application/merge-patch+json"
    )
    outcome = await converge(client, await fetch(client), pod_monitor=False)
    assert outcome.degraded is not None and outcome.degraded.reason == "InvalidSpec"
    status = (await fetch(client))["status"]
    assert (condition({"status": status}, "Ready")["status"], status["ready"]) == ("True", "2/2")

    await pods_ready(0)
    await converge(client, await fetch(client), pod_monitor=False)
    status = (await fetch(client))["status"]
    ready = condition({"status": status}, "Ready")
    assert (ready["status"], ready["reason"], status["ready"]) == ("False", "PoolsNotReady", "0/2")
    assert condition({"status": status}, "Degraded")["reason"] == "InvalidSpec"  # still the spec's word


async def test_a_fixed_spec_clears_the_tuners_wait_at_once(running, client):
    """TunerActive said "the tuner waits for a servable spec" until the tuner's next run (30 s by
    default) after the fix; the pass that finds the spec servable again says so itself."""
    body = await create(client)
    await converge(client, body, pod_monitor=False)
    tuner_says = {"type": "TunerActive", "status": "True", "reason": "Tuning", "message": "p95 ITL 41 ms"}
    await client.patch_status(INFERENCE_SERVICE, "ml", "svc", {"conditions": [tuner_says]})

    async def edit(spec: dict) -> None:
        await client.request(
            "PATCH",
            INFERENCE_SERVICE.path("ml", "svc"),
            body={"spec": spec},
            content_type="application/merge-patch+json",
        )
        await converge(client, await fetch(client), pod_monitor=False)

    await edit({"pools": {"colocated": {"minReplicas": 5, "maxReplicas": 2}}})
    assert condition(await fetch(client), "TunerActive")["reason"] == "InvalidSpec"
    await edit({"pools": {"colocated": {"minReplicas": 1, "maxReplicas": 2}}})
    tuner = condition(await fetch(client), "TunerActive")
    assert (tuner["status"], tuner["reason"]) == ("Unknown", "AwaitingMetrics")
    assert "waits for a servable spec" not in tuner["message"]
