"""Status: conditions keep their lastTransitionTime until they flip, the tuner's condition is left
alone, readiness and rollout come from the Deployments, and an unchanged status is no patch."""

from __future__ import annotations

from llmfleet.operator.reconcile import status as st
from llmfleet.operator.reconcile.pod_trouble import pod_trouble
from llmfleet.operator.resource.conditions import MESSAGE_MAX, Condition, merge_conditions


def deployment(replicas=2, ready=2, updated=2, current=2, generation=3, observed=3):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "replicas": current,
            "observedGeneration": observed,
        },
    }


def test_transition_time_moves_only_on_a_flip():
    first = merge_conditions([], [Condition("Ready", "False", "PoolsNotReady", "0/1")], 1, "T1")
    assert first == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "PoolsNotReady",
            "message": "0/1",
            "lastTransitionTime": "T1",
            "observedGeneration": 1,
        }
    ]
    same = merge_conditions(first, [Condition("Ready", "False", "PoolsNotReady", "0/2")], 2, "T2")
    assert same[0]["lastTransitionTime"] == "T1" and same[0]["message"] == "0/2"
    flipped = merge_conditions(same, [Condition("Ready", "True", "AllPoolsReady", "")], 2, "T3")
    assert flipped[0]["lastTransitionTime"] == "T3"


def test_a_message_past_its_cap_is_cut():
    (long,) = merge_conditions([], [Condition("TunerActive", "False", "MetricsUnavailable", "x" * 10**6)], 1, "T1")
    assert len(long["message"]) == MESSAGE_MAX and long["message"].endswith("...")


def test_others_conditions_are_kept_in_order():
    tuner = {"type": "TunerActive", "status": "True", "reason": "Tuning", "lastTransitionTime": "T0"}
    custom = {"type": "Zeta", "status": "True"}
    merged = merge_conditions([custom, tuner], [Condition("Degraded", "False", "AsExpected")], 4, "T1")
    assert [c["type"] for c in merged] == ["Degraded", "TunerActive", "Zeta"]
    assert merged[1] == tuner


def test_pool_states():
    assert st.PoolState.of("decode", 2, deployment()).rolled_out
    assert not st.PoolState.of("decode", 2, deployment(observed=2)).rolled_out  # controller lags
    assert not st.PoolState.of("decode", 2, deployment(updated=1)).rolled_out
    assert not st.PoolState.of("decode", 2, deployment(current=3)).rolled_out  # old pod draining
    assert not st.PoolState.of("decode", 2, None).rolled_out


def test_serving_conditions():
    ready = [st.PoolState.of("prefill", 1, deployment(1, 1, 1, 1)), st.PoolState.of("decode", 2, deployment())]
    assert [(c.type, c.status, c.reason) for c in st.serving_conditions(ready, None)] == [
        ("Ready", "True", "AllPoolsReady"),
        ("Progressing", "False", "Converged"),
    ]
    assert st.ready_summary(ready) == "3/3"
    starting = [st.PoolState.of("decode", 2, deployment(ready=0))]
    conditions = st.serving_conditions(starting, None)
    assert (conditions[0].status, conditions[0].reason, conditions[0].message) == (
        "False",
        "PoolsNotReady",
        "decode 0/2 ready",
    )
    assert (conditions[1].status, conditions[1].reason) == ("True", "RollingOut")
    # a scale-up (the tuner's, say) waiting for its pod: still serving, so Ready does not flap
    scaling = st.serving_conditions([st.PoolState.of("decode", 3, deployment(3, ready=2, updated=3, current=3))], None)
    assert [(c.status, c.reason, c.message) for c in scaling] == [
        ("True", "Serving", "decode 2/3 ready"),
        ("True", "RollingOut", "decode 2/3 ready"),
    ]
    applied = st.serving_conditions(ready, "updated ConfigMap/x-decode-engine")
    assert (applied[1].reason, applied[1].message) == ("Applied", "updated ConfigMap/x-decode-engine")
    zero = st.serving_conditions([st.PoolState.of("decode", 0, deployment(0, 0, 0, 0))], None)
    assert (zero[0].status, zero[0].reason) == ("False", "ScaledToZero")


def pod(name, waiting=None, scheduled=None, deleting=False):
    status = {"containerStatuses": [{"name": "server", "state": {"waiting": waiting} if waiting else {"running": {}}}]}
    if scheduled:
        status = {"conditions": [{"type": "PodScheduled", "status": "False", **scheduled}]}
    meta = {"name": name} | ({"deletionTimestamp": "2026-11-24T00:00:00Z"} if deleting else {})
    return {"metadata": meta, "status": status}


def test_a_stuck_pod_says_why_a_pool_is_not_ready():
    secret = {"reason": "CreateContainerConfigError", "message": 'secret "rag-key" not found'}
    assert pod_trouble("decode", [pod("d-1"), pod("d-2", {"reason": "ContainerCreating"})]) is None  # on its way
    trouble = pod_trouble("decode", [pod("d-2", secret), pod("d-1", {"reason": "ImagePullBackOff"})])
    assert (trouble.reason, trouble.message) == (
        "ImagePullBackOff",
        "decode pod d-1: ImagePullBackOff (and 1 more decode pod stuck)",
    )
    three = pod_trouble("decode", [pod(f"d-{i}", secret) for i in range(3)] + [pod("d-3")])
    assert three.message == 'decode pod d-0: secret "rag-key" not found (and 2 more decode pods stuck)'
    assert pod_trouble("decode", [pod("d-1", secret, deleting=True)]) is None
    gpu = {"reason": "Unschedulable", "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}
    trouble = pod_trouble("prefill", [pod("p-1", scheduled=gpu)])
    assert trouble.reason == "Unschedulable" and "Insufficient nvidia.com/gpu" in trouble.message

    none_ready = [st.PoolState.of("decode", 2, deployment(ready=0))]
    ready, progressing = st.serving_conditions(none_ready, None, pod_trouble("decode", [pod("d-2", secret)]))
    assert (ready.status, ready.reason) == ("False", "CreateContainerConfigError")
    assert ready.message == 'decode 0/2 ready; decode pod d-2: secret "rag-key" not found'
    assert (progressing.status, progressing.reason) == ("False", "CreateContainerConfigError")
    half = [st.PoolState.of("decode", 2, deployment(ready=1))]  # one serves: Ready, but stuck
    ready, progressing = st.serving_conditions(half, None, pod_trouble("decode", [pod("d-2", secret)]))
    assert (ready.status, ready.reason) == ("True", "Serving")
    assert ready.message == 'decode 1/2 ready; decode pod d-2: secret "rag-key" not found'
    assert (progressing.status, progressing.reason) == ("False", "CreateContainerConfigError")


def test_a_failed_download_says_its_own_words():
    """The storage initializer's one-line error (its log's tail, FallbackToLogsOnError) is what
    `kubectl get llmis` shows, not the kubelet's back-off."""
    error = "llm-fleet fetch-model: hf://org/nope: no such model repository on https://huggingface.co"
    init = {
        "name": "fetch-model",
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "message": f"Fetching...\n{error}\n"}},
    }
    stuck = {"metadata": {"name": "c-1"}, "status": {"initContainerStatuses": [init], "containerStatuses": []}}
    trouble = pod_trouble("colocated", [stuck])
    assert (trouble.reason, trouble.message) == ("CrashLoopBackOff", f"colocated pod c-1: fetch-model failed: {error}")


def test_pods_the_deployment_cannot_create_say_why():
    # a ResourceQuota refuses the pods: no pod exists to report it, the Deployment does
    quota = deployment(ready=0, current=0, updated=0)
    quota["status"]["conditions"] = [
        {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},
        {
            "type": "ReplicaFailure",
            "status": "True",
            "reason": "FailedCreate",
            "message": 'pods "rag-decode-x" is forbidden: exceeded quota: gpu-quota',
        },
    ]
    ready, progressing = st.serving_conditions([st.PoolState.of("decode", 2, quota)], None)
    assert (ready.status, ready.reason) == ("False", "FailedCreate")
    assert "exceeded quota: gpu-quota" in ready.message and ready.message.startswith("decode 0/2 ready; decode")
    assert (progressing.status, progressing.reason) == ("False", "FailedCreate")
    late = deployment(ready=1)
    late["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": 'ReplicaSet "rag-decode-7d9" has timed out progressing.',
        }
    ]
    ready, progressing = st.serving_conditions([st.PoolState.of("decode", 2, late)], None)
    assert (ready.status, ready.reason) == ("True", "Serving")
    assert (progressing.status, progressing.reason) == ("False", "ProgressDeadlineExceeded")


def test_status_patch_is_none_when_nothing_changed():
    current = {
        "observedGeneration": 2,
        "conditions": [{"type": "Ready", "status": "True"}],
        "pools": {"decode": {"replicas": 2, "readyReplicas": 2}},
        "tuner": {"replicas": {"decode": 2}},  # the tuner's: not ours to compare or touch
        "latency": {"ttftP95Ms": 120},
    }
    desired = {
        "observedGeneration": 2,
        "conditions": [{"type": "Ready", "status": "True"}],
        "pools": {"decode": {"replicas": 2, "readyReplicas": 2}},
    }
    assert st.status_patch(current, desired) is None
    assert st.status_patch(current, {**desired, "observedGeneration": 3}) == {**desired, "observedGeneration": 3}


def test_status_patch_removes_pools_that_went_away():
    current = {"pools": {"colocated": {"replicas": 1}}}
    patch = st.status_patch(current, {"pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}})
    assert patch == {"pools": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "colocated": None}}


def test_timestamps_are_rfc3339_utc():
    assert st.now().endswith("Z") and "T" in st.now() and "." not in st.now()


def test_replacing_makes_the_stored_value_exactly_the_new_one():
    stored = {"latency": {"ttftP95Ms": 120, "itlP95Ms": 40, "at": "t1"}, "tuner": {"replicas": {"prefill": 2}}}
    wanted = {"latency": {"ttftP95Ms": 130, "at": "t2"}, "tuner": {"replicas": {"colocated": 3}}}
    patch = {key: st.replacing(stored.get(key), value) for key, value in wanted.items()}
    assert patch == {
        "latency": {"itlP95Ms": None, "ttftP95Ms": 130, "at": "t2"},
        "tuner": {"replicas": {"prefill": None, "colocated": 3}},
    }
    assert st.merge_patched(stored, patch) == wanted
