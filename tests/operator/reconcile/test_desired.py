"""The pure reconcile function: golden manifests (validated by kubernetes-validate --strict),
knob changes touch only the ConfigMap, replica changes only Deployment replicas, bounds win."""

from __future__ import annotations

import os

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfleet.operator.deploy.rbac import allows
from llmfleet.operator.reconcile.desired import Owner, desired_objects, dump, grace_seconds
from llmfleet.operator.resource.spec import REASONING_PARSERS, ROUTER_POLICIES, TOOL_CALL_PARSERS, SpecError, parse_spec
from llmfleet.operator.resource.tuner_state import TunerState, effective_engine, effective_replicas
from llmfleet.server.config import EngineConfig
from llmfleet.server.parsers.reasoning import REASONING_PARSERS as SERVER_REASONING
from llmfleet.server.parsers.tools import TOOL_CALL_PARSERS as SERVER_PARSERS
from llmfleet.server.router.policies import POLICIES as SERVER_POLICIES

EXAMPLES = [
    "local",
    "colocated-chat",
    "disaggregated-long-prompt",
    "local-disaggregated",
    "quickstart",
    "tensor-parallel",
    "multi-node",
]
CUSTOM_API_VERSIONS = ("monitoring.coreos.com/v1", "leaderworkerset.x-k8s.io/v1")  # no schema in kubernetes-validate
# The oldest Kubernetes the pods run on (preStop `sleep` is on by default from 1.30) and a recent one.
KUBERNETES_VERSIONS = ("1.30", "1.35")
OWNER = Owner("svc", "ml", "0c0ffee0-0000-4000-8000-000000000001")
POD_LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "llmfleet.io/inference-service",
    "llmfleet.io/pool",
}


def load(repo_root, name):
    doc = yaml.safe_load((repo_root / "examples" / f"{name}.yaml").read_text())
    return Owner(doc["metadata"]["name"], "ml", OWNER.uid), parse_spec(doc["spec"])


def by_kind(objects, kind):
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def engine_yaml(objects, name):
    return yaml.safe_load(by_kind(objects, "ConfigMap")[name]["data"]["engine.yaml"])


@pytest.mark.parametrize("example", EXAMPLES)
def test_golden_manifests(repo_root, example):
    owner, spec = load(repo_root, example)
    objects = desired_objects(owner, spec, pod_monitor=True)
    for obj in objects:
        if obj["apiVersion"] not in CUSTOM_API_VERSIONS:
            for version in KUBERNETES_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["ownerReferences"] == [owner.reference()]
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["llmfleet.io/inference-service"] == owner.name
    golden = repo_root / "tests" / "operator" / "golden" / f"{example}.yaml"
    rendered = dump(objects)
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert rendered == golden.read_text(), f"{golden.name} changed; rerun with UPDATE_GOLDEN=1 if intended"
    assert list(yaml.safe_load_all(golden.read_text())) == objects


def test_object_set_per_mode(repo_root):
    owner, spec = load(repo_root, "local")
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in desired_objects(owner, spec))
    assert kinds == [  # the router in front of a colocated pool too
        "ConfigMap/tiny-colocated-engine",
        "ConfigMap/tiny-wake",
        "Deployment/tiny-colocated",
        "Deployment/tiny-router",
        "NetworkPolicy/tiny-colocated",
        "PodDisruptionBudget/tiny-colocated",
        "PodDisruptionBudget/tiny-router",
        "Role/tiny-router",
        "RoleBinding/tiny-router",
        "Service/tiny",
        "Service/tiny-colocated",
        "ServiceAccount/tiny-router",
        "ServiceAccount/tiny-server",
    ]
    router = by_kind(desired_objects(owner, spec), "Deployment")["tiny-router"]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--colocated-service") + 1] == "tiny-colocated" and "--prefill-service" not in args
    assert by_kind(desired_objects(owner, spec), "Service")["tiny"]["spec"]["selector"]["llmfleet.io/pool"] == "router"
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    objects = desired_objects(owner, spec, pod_monitor=True)
    assert set(by_kind(objects, "Deployment")) == {"rag-prefill", "rag-decode", "rag-router"}
    assert set(by_kind(objects, "ConfigMap")) == {"rag-prefill-engine", "rag-decode-engine", "rag-wake"}
    assert set(by_kind(objects, "NetworkPolicy")) == {"rag-prefill", "rag-decode"}
    assert set(by_kind(objects, "PodDisruptionBudget")) == {"rag-prefill", "rag-decode", "rag-router"}
    assert set(by_kind(objects, "PodMonitor")) == {"rag"}
    labelled = desired_objects(owner, spec, pod_monitor=True, pod_monitor_labels={"release": "kps"})
    assert by_kind(labelled, "PodMonitor")["rag"]["metadata"]["labels"]["release"] == "kps"
    assert set(by_kind(objects, "Role")) == {"rag-router"}
    # the servers' own account (no token, no Role), not the namespace's default
    assert set(by_kind(objects, "ServiceAccount")) == {"rag-router", "rag-server"}
    assert by_kind(objects, "ServiceAccount")["rag-server"]["automountServiceAccountToken"] is False
    for pool in ("prefill", "decode"):
        assert by_kind(objects, "Deployment")[f"rag-{pool}"]["spec"]["template"]["spec"]["serviceAccountName"] == (
            "rag-server"
        )
    binding = by_kind(objects, "RoleBinding")["rag-router"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rag-router", "namespace": "ml"}]
    router_pod = by_kind(objects, "Deployment")["rag-router"]["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "rag-router" and router_pod["automountServiceAccountToken"]
    assert not by_kind(objects, "Deployment")["rag-decode"]["spec"]["template"]["spec"]["automountServiceAccountToken"]
    services = by_kind(objects, "Service")
    assert set(services) == {"rag", "rag-prefill", "rag-decode"}
    assert services["rag"]["spec"]["selector"]["llmfleet.io/pool"] == "router"
    assert "clusterIP" not in services["rag"]["spec"]  # the client endpoint balances over routers
    for pool in ("prefill", "decode"):  # headless: one DNS record per ready pod, for the router
        assert services[f"rag-{pool}"]["spec"]["clusterIP"] == "None"
        assert services[f"rag-{pool}"]["spec"]["ports"] == [
            {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        ]


def test_children_block_their_owners_deletion_as_rbac_allows(repo_root):
    """blockOwnerDeletion: true needs update on inferenceservices/finalizers where the
    OwnerReferencesPermissionEnforcement admission plugin runs (OpenShift's default)."""
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    refs = [ref for o in desired_objects(owner, spec, pod_monitor=True) for ref in o["metadata"]["ownerReferences"]]
    assert refs and all(ref["blockOwnerDeletion"] for ref in refs)
    assert allows("llmfleet.io", "inferenceservices/finalizers", "update")


def test_pods_follow_the_conventions(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    for name, deployment in by_kind(desired_objects(owner, spec), "Deployment").items():
        pool = name.removeprefix("rag-")
        template = deployment["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert set(labels) >= POD_LABELS and labels["llmfleet.io/pool"] == pool
        assert labels["app.kubernetes.io/component"] == pool
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        pod = template["spec"]
        (container,) = pod["containers"]
        args = container["args"]
        assert container["command"] == ["llm-fleet"] and args[:3] == ["serve", "--role", pool]
        assert args[args.index("--port") + 1] == "8000"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        # drain: preStop, then the server's --drain-timeout, all inside the grace period
        drain = int(args[args.index("--drain-timeout") + 1])
        assert drain == spec.drain_seconds(pool)
        assert container["lifecycle"]["preStop"]["sleep"]["seconds"] + drain < pod["terminationGracePeriodSeconds"]
        assert pod["terminationGracePeriodSeconds"] == grace_seconds(drain)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert args[args.index("--metrics-port") + 1] == str(ports["metrics"]) and ports["http"] == 8000
        if pool == "router":
            assert args[args.index("--prefill-service") + 1] == "rag-prefill"
            assert args[args.index("--decode-service") + 1] == "rag-decode"
            continue
        assert args[args.index("--config") + 1] == "/etc/llm-fleet/engine.yaml"
        assert args[args.index("--model") + 1] == "hf://Qwen/Qwen2-7B-Instruct"
        assert args[args.index("--download-dir") + 1] == "/models"  # the cache the init container filled
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/etc/llm-fleet"]["readOnly"] and mounts["/models"]["readOnly"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["engine-config"]["configMap"]["name"] == f"rag-{pool}-engine"
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "qwen-cache"
        (init,) = pod["initContainers"]
        assert init["args"] == ["fetch-model", "hf://Qwen/Qwen2-7B-Instruct", "--download-dir", "/models"]


def test_an_api_key_secret_reaches_every_pod_as_vllm_api_key(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    keyed = parse_spec({**spec.model_dump(by_alias=True, exclude_none=True), "apiKeySecret": {"name": "rag-key"}})
    deployments = by_kind(desired_objects(owner, keyed), "Deployment")
    assert set(deployments) == {"rag-prefill", "rag-decode", "rag-router"}
    for deployment in deployments.values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLLM_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "rag-key", "key": "api-key"}}
        assert "/health" in str(container["livenessProbe"])  # probes stay on open paths
    plain = by_kind(desired_objects(owner, spec), "Deployment")["rag-router"]
    assert "VLLM_API_KEY" not in str(plain)


def test_the_model_volume_is_named_by_the_operator_whatever_its_source_says(repo_root):
    """A name in model.volume replaced "models": two volumes named tmp (an apply the API server
    fails with a 500, retried for ever), or a mount of a volume that no longer existed."""
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    volume = {"persistentVolumeClaim": {"claimName": "weights"}, "name": "tmp"}
    named = parse_spec({**raw, "model": {"path": "/models/qwen", "volume": volume}})
    for deployment in by_kind(desired_objects(owner, named), "Deployment").values():
        volumes = [v["name"] for v in deployment["spec"]["template"]["spec"].get("volumes", [])]
        assert len(volumes) == len(set(volumes))
        mounts = {m["name"] for c in deployment["spec"]["template"]["spec"]["containers"] for m in c["volumeMounts"]}
        assert mounts <= set(volumes)


def test_a_kv_transfer_secret_reaches_the_router_and_every_server(repo_root):
    from llmfleet.server.wire.auth import KV_TOKEN_ENV

    owner, spec = load(repo_root, "disaggregated-long-prompt")
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    tokened = parse_spec({**raw, "kvTransferSecret": {"name": "rag-kv"}})
    for deployment in by_kind(desired_objects(owner, tokened), "Deployment").values():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env[KV_TOKEN_ENV]["valueFrom"] == {"secretKeyRef": {"name": "rag-kv", "key": "token"}}
    with pytest.raises(SpecError, match="kvTransferSecret for LLMFLEET_KV_TRANSFER_TOKEN"):
        parse_spec({**raw, "pod": {"env": [{"name": KV_TOKEN_ENV, "value": "x"}]}})


POD_OPTIONS = {
    "imagePullSecrets": ["registry"],
    "serviceAccountName": "models-reader",
    "priorityClassName": "inference",
    "runtimeClassName": "nvidia",
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "annotations": {"team": "search"},
    "labels": {"team": "search", "app.kubernetes.io/name": "theirs"},
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
            }
        }
    },
    "startupTimeoutSeconds": 1800,  # a large model from a slow volume
    "maxSurge": 0,  # no spare GPU for one more pod
    "maxUnavailable": "25%",
}


def test_pod_options_reach_the_pods_as_a_pod_spec_takes_them(repo_root):
    # a private registry, a workload identity, a GPU runtime class, a token in the env, scheduling
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    spec = parse_spec({**spec.model_dump(by_alias=True, exclude_none=True), "pod": POD_OPTIONS})
    deployments = by_kind(desired_objects(owner, spec), "Deployment")
    for name, deployment in deployments.items():
        template = deployment["spec"]["template"]
        pod = template["spec"]
        assert pod["imagePullSecrets"] == [{"name": "registry"}] and pod["priorityClassName"] == "inference"
        assert pod["affinity"] == POD_OPTIONS["affinity"]
        assert {"name": "HF_TOKEN", "valueFrom": POD_OPTIONS["env"][0]["valueFrom"]} in pod["containers"][0]["env"]
        assert template["metadata"]["labels"]["team"] == "search"
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "llm-fleet"  # ours win
        assert template["metadata"]["annotations"]["team"] == "search"
        router = name == "rag-router"  # keeps the account that reads EndpointSlices, and needs no GPU
        assert pod["serviceAccountName"] == ("rag-router" if router else "models-reader")
        assert pod.get("runtimeClassName") == (None if router else "nvidia")
        probe = pod["containers"][0]["startupProbe"]
        assert probe["periodSeconds"] * probe["failureThreshold"] == 1800
        assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": "25%"}
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(deployment, version, strict=True)


def test_what_an_admin_allows_reaches_the_engine_pods_only(repo_root):
    """pod_security.py refuses these unless allowed; allowed, they land as a pod spec takes them:
    host namespaces (with the cluster's DNS kept for hostNetwork), a privileged container (which
    must allow escalation), added capabilities beside the dropped ones."""
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    asked = {
        "hostNetwork": True,
        "hostIPC": True,
        "securityContext": {"privileged": True, "capabilities": {"add": ["IPC_LOCK", "SYS_RESOURCE", "IPC_LOCK"]}},
    }
    spec = parse_spec({**spec.model_dump(by_alias=True, exclude_none=True), "pod": asked})
    for name, deployment in by_kind(desired_objects(owner, spec), "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        context = pod["containers"][0]["securityContext"]
        if name == "rag-router":
            assert "hostNetwork" not in pod and "hostIPC" not in pod and "privileged" not in context
            assert context == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }
            continue
        assert (pod["hostNetwork"], pod["hostIPC"], pod["dnsPolicy"]) == (True, True, "ClusterFirstWithHostNet")
        assert "hostPID" not in pod
        assert context["privileged"] is True and context["allowPrivilegeEscalation"] is True
        assert context["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_RESOURCE"]}
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(deployment, version, strict=True)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"env": [{"name": "VLLM_API_KEY", "value": "x"}]}, "set by the operator"),
        ({"env": [{"value": "x"}]}, "needs a name"),
        ({"labels": {"llmfleet.io/pool": "x"}}, "selector labels"),
        # what the API server would refuse after other objects had been written: a half-applied edit
        ({"labels": {"team": "a b"}}, "label team: value 'a b' must be"),
        ({"labels": {"team": "x" * 64}}, "at most 63"),
        ({"labels": {"Example.com/team": "a"}}, "prefix must be a DNS subdomain"),
        ({"labels": {"-team": "a"}}, "name must be 1-63"),
        ({"annotations": {"a/b/c": "anything goes in a value"}}, "annotation a/b/c: the key's prefix"),
        ({"annotations": {"": "x"}}, "name must be 1-63"),
    ],
)
def test_pod_options_cannot_take_what_the_operator_sets(options, words):
    spec = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}, "pod": options}
    with pytest.raises(SpecError, match=words):
        parse_spec(spec)


def test_the_models_parsers_reach_every_model_server(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    model = {"toolCallParser": "hermes", "reasoningParser": "qwen3", "chatTemplate": template}
    parsed = parse_spec(raw | {"model": raw["model"] | model})
    deployments = by_kind(desired_objects(owner, parsed), "Deployment")
    for name in ("rag-prefill", "rag-decode"):  # prefill refuses what decode would: both read them
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
        assert args[args.index("--reasoning-parser") + 1] == "qwen3"
        assert args[args.index("--chat-template") + 1] == template
    for flag in ("--tool-call-parser", "--reasoning-parser", "--chat-template"):
        assert flag not in str(deployments["rag-router"])
        assert flag not in str(desired_objects(owner, spec))
    assert tuple(sorted(SERVER_PARSERS)) == TOOL_CALL_PARSERS  # the CRD's enums are the server's choices
    assert tuple(sorted(SERVER_REASONING)) == REASONING_PARSERS


@pytest.mark.parametrize(
    ("template", "words"),
    [
        ("{% for m in messages %}\n{{ m.content }", "line 2: unexpected '}'"),
        ("You are a helpful assistant.", "it holds no Jinja"),  # the server would take it for a file name
    ],
)
def test_a_chat_template_the_server_would_refuse_is_refused_with_why(template, words):
    model = {"builtin": "tiny", "chatTemplate": template}
    with pytest.raises(SpecError, match=r"model\.chatTemplate is no chat template") as refused:
        parse_spec({"model": model, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}})
    assert words in str(refused.value)


def test_a_chat_template_is_checked_as_transformers_renders_it():
    # loop controls and transformers' {% generation %} block: the model server renders both
    template = (
        "{% for m in messages %}{% if loop.index > 8 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}\n{% endfor %}"
    )
    parse_spec({"model": {"builtin": "tiny", "chatTemplate": template}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}})


def test_the_router_policy_reaches_the_router(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    parsed = parse_spec(raw | {"router": raw["router"] | {"policy": "prefix"}})
    (container,) = by_kind(desired_objects(owner, parsed), "Deployment")["rag-router"]["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["args"][container["args"].index("--router-policy") + 1] == "prefix"
    assert set(SERVER_POLICIES) == set(ROUTER_POLICIES)  # the CRD's enum is the router's choice


def test_engine_config_map_is_what_the_server_reads(repo_root):
    owner, spec = load(repo_root, "colocated-chat")
    config = EngineConfig.model_validate(engine_yaml(desired_objects(owner, spec), "chat-colocated-engine"))
    assert config.max_batch_size == 64 and config.max_num_batched_tokens == 2048 and config.dtype == "bfloat16"


def test_reconcile_is_deterministic(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    assert desired_objects(owner, spec) == desired_objects(owner, spec)


def test_knob_change_touches_only_the_config_map(repo_root):
    owner, spec = load(repo_root, "local")
    before = desired_objects(owner, spec)
    after = desired_objects(owner, spec, TunerState(knobs={"colocated": {"maxBatchSize": 32, "batchTimeoutMs": 7}}))
    changed = [b["kind"] for b, a in zip(before, after, strict=True) if a != b]
    assert changed == ["ConfigMap"]
    engine = engine_yaml(after, "tiny-colocated-engine")
    assert engine["max_batch_size"] == 32 and engine["batch_timeout_ms"] == 7.0


def test_restart_only_field_rolls_the_pods(repo_root):
    owner, spec = load(repo_root, "local")
    before = by_kind(desired_objects(owner, spec), "Deployment")["tiny-colocated"]
    spec.pools["colocated"].engine["kvBlockSize"] = 32
    after = by_kind(desired_objects(owner, spec), "Deployment")["tiny-colocated"]
    key = "llmfleet.io/restart-checksum"
    assert (
        before["spec"]["template"]["metadata"]["annotations"][key]
        != after["spec"]["template"]["metadata"]["annotations"][key]
    )


def test_replica_change_touches_only_replicas_and_bounds_win(repo_root):
    owner, spec = load(repo_root, "local")
    before = desired_objects(owner, spec)
    after = desired_objects(owner, spec, TunerState(replicas={"colocated": 2}))
    diffs = [(b, a) for b, a in zip(before, after, strict=True) if a != b]
    assert len(diffs) == 1 and diffs[0][1]["kind"] == "Deployment"
    assert diffs[0][1]["spec"]["replicas"] == 2
    assert {**diffs[0][1]["spec"], "replicas": 1} == diffs[0][0]["spec"]
    # the tuner asks for more than maxReplicas (3) and a batch above its bound (64): spec bounds win
    wild = desired_objects(
        owner, spec, TunerState(replicas={"colocated": 50}, knobs={"colocated": {"maxBatchSize": 999}})
    )
    assert by_kind(wild, "Deployment")["tiny-colocated"]["spec"]["replicas"] == 3
    assert engine_yaml(wild, "tiny-colocated-engine")["max_batch_size"] == 64


def test_tuner_values_the_engine_rejects_are_ignored(repo_root):
    _, spec = load(repo_root, "disaggregated-long-prompt")  # prefill has no bounds
    tuner = TunerState(knobs={"prefill": {"maxBatchSize": 0, "batchTimeoutMs": "soon", "maxNumBatchedTokens": 4096}})
    engine = effective_engine(spec, "prefill", tuner)
    assert engine.max_batch_size == 16 and engine.batch_timeout_ms == 0.0  # the spec's values
    assert engine.max_num_batched_tokens == 4096


@pytest.mark.parametrize(("asked", "expected"), [(4, 11), (None, 11), (40, 20)])
def test_a_fractional_bound_on_a_whole_number_knob_holds_whole_numbers_within_it(asked, expected):
    """int() truncated the clamped value: min 10.5 gave 10, below the bound (the tuner reads 11)."""
    spec = parse_spec(
        {
            "model": {"builtin": "tiny"},
            "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
            "pools": {
                "colocated": {"engine": {"maxBatchSize": 4}, "bounds": {"maxBatchSize": {"min": 10.5, "max": 20.5}}}
            },
        }
    )
    tuner = TunerState(knobs={} if asked is None else {"colocated": {"maxBatchSize": asked}})
    assert effective_engine(spec, "colocated", tuner).max_batch_size == expected


knob_values = st.one_of(st.none(), st.integers(-10, 10_000), st.floats(-5, 1e5, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(
    replicas=st.one_of(st.none(), st.integers(-5, 100)),
    batch=knob_values,
    timeout=knob_values,
    tokens=knob_values,
)
def test_whatever_the_tuner_asks_the_result_is_within_bounds(replicas, batch, timeout, tokens):
    spec = parse_spec(
        {
            "model": {"builtin": "tiny"},
            "slo": {"ttftP95Ms": 500, "itlP95Ms": 100},
            "pools": {
                "colocated": {
                    "minReplicas": 1,
                    "maxReplicas": 6,
                    "engine": {"maxBatchSize": 16},
                    "bounds": {"maxBatchSize": {"min": 4, "max": 64}, "batchTimeoutMs": {"min": 0, "max": 50}},
                }
            },
        }
    )
    knobs = {k: v for k, v in {"maxBatchSize": batch, "batchTimeoutMs": timeout, "maxNumBatchedTokens": tokens}.items()}
    tuner = TunerState(
        replicas={} if replicas is None else {"colocated": replicas},
        knobs={"colocated": {k: v for k, v in knobs.items() if v is not None}},
    )
    assert 1 <= effective_replicas(spec, "colocated", tuner) <= 6
    engine = effective_engine(spec, "colocated", tuner)
    assert 4 <= engine.max_batch_size <= 64
    assert 0 <= engine.batch_timeout_ms <= 50
    assert 1 <= engine.max_num_batched_tokens <= 1 << 20
    EngineConfig.model_validate(engine.model_dump())  # always a config the server accepts


def test_the_drain_fits_the_longest_stream_a_pool_can_serve():
    """drainSeconds, else maxModelLen tokens at the ITL SLO plus a margin, rounded up to a step,
    capped; the router relays every pool's streams and gets the longest; the grace period wraps
    the drain."""
    from llmfleet.operator.resource.spec import DRAIN_CAP_SECONDS

    def spec(itl_ms: float, pools: dict, builtin: str | None = "tiny") -> object:
        model = {"builtin": builtin} if builtin else {"path": "/models/m"}
        return parse_spec(
            {"model": model, "slo": {"ttftP95Ms": 500, "itlP95Ms": itl_ms}, "mode": "disaggregated", "pools": pools}
        )

    long_context = {"prefill": {}, "decode": {"engine": {"maxModelLen": 1000}}}
    assert spec(50, long_context).drain_seconds("decode") == 60  # 1000 x 50 ms and the margin, rounded up
    assert spec(50, long_context).drain_seconds("prefill") == 120  # builtin:tiny's 2048: 103 + 10 s
    assert spec(50, long_context).drain_seconds("router") == 120
    # an SLO edit within a step leaves the pod template, which would roll the pods, as it is
    assert {spec(itl, long_context).drain_seconds("prefill") for itl in (49, 52, 53)} == {120}
    assert spec(50, long_context, builtin=None).drain_seconds("prefill") == DRAIN_CAP_SECONDS  # context unknown
    assert spec(1000, long_context).drain_seconds("prefill") == DRAIN_CAP_SECONDS  # 2048 s: capped
    given = {"prefill": {"drainSeconds": 900}, "decode": {"drainSeconds": 0}}
    assert spec(50, given).drain_seconds("prefill") == 900 and spec(50, given).drain_seconds("decode") == 0
    objects = desired_objects(OWNER, spec(50, given))
    router = by_kind(objects, "Deployment")["svc-router"]["spec"]["template"]["spec"]
    assert router["terminationGracePeriodSeconds"] == grace_seconds(900)


def test_routers_with_a_max_are_scaled_by_an_autoscaler_that_owns_their_replicas(repo_root):
    owner, spec = load(repo_root, "disaggregated-long-prompt")
    objects = desired_objects(owner, spec, scaled={"router": 5})
    (hpa,) = by_kind(objects, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rag-router"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    deployments = by_kind(objects, "Deployment")
    router = deployments.pop("rag-router")
    assert router["spec"]["replicas"] == 5  # as the autoscaler left them, not the spec's 2
    assert router["metadata"]["annotations"]["llmfleet.io/replicas"] == "external"
    assert all("llmfleet.io/replicas" not in d["metadata"].get("annotations", {}) for d in deployments.values())
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    assert allows("autoscaling", "horizontalpodautoscalers", "create")

    fixed = parse_spec({**spec.model_dump(by_alias=True, exclude_none=True), "router": {"replicas": 3}})
    objects = desired_objects(owner, fixed, scaled={"router": 5})
    assert not by_kind(objects, "HorizontalPodAutoscaler")
    assert by_kind(objects, "Deployment")["rag-router"]["spec"]["replicas"] == 3


@pytest.mark.parametrize(
    ("router", "words"),
    [
        ({"replicas": 3, "maxReplicas": 2}, "router.maxReplicas 2 < router.replicas 3"),
        ({"maxReplicas": 4}, "needs router.resources.requests.cpu"),
    ],
)
def test_router_scaling_the_autoscaler_cannot_do_is_refused(router, words):
    with pytest.raises(SpecError, match=words):
        parse_spec({"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 50}, "router": router})
