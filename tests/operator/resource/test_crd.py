"""The CRD: generated from the code (no drift), a valid structural schema with a description on
every field, accepting the examples and rejecting a table of bad specs, with the CEL rules run;
what the schema lets through but the operator cannot serve is a SpecError with a reason."""

from __future__ import annotations

import copy
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llmfleet.operator.resource.crd import render
from llmfleet.operator.resource.spec import SpecError, parse_spec, require_image
from tests.operator.resource import crdcheck

EXAMPLES = [
    "local.yaml",
    "local-disaggregated.yaml",
    "colocated-chat.yaml",
    "disaggregated-long-prompt.yaml",
    "quickstart.yaml",
    "tensor-parallel.yaml",
    "multi-node.yaml",
]


@pytest.fixture(scope="module")
def crd(repo_root):
    return yaml.safe_load((repo_root / "crds" / "inferenceservice.yaml").read_text())


def test_committed_crd_is_generated(repo_root):
    assert (repo_root / "crds" / "inferenceservice.yaml").read_text() == render(), (
        "crds/inferenceservice.yaml is stale: "
        "run `python -m llmfleet.operator.resource.crd > crds/inferenceservice.yaml`"
    )


def test_crd_is_a_valid_custom_resource_definition(crd):
    kubernetes_validate.validate(crd, "1.33", strict=True)


def walk(schema: dict[str, Any], path: str = "", named: bool = False):
    """(path, node, named): named is True for a property, False for list items and map values."""
    yield path, schema, named
    for key, sub in (schema.get("properties") or {}).items():
        yield from walk(sub, f"{path}.{key}", True)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from walk(schema[key], f"{path}[]", False)


def test_schema_is_structural_and_explained(crd):
    """What the API server demands of a structural schema, and what `kubectl explain` shows."""
    for path, node, named in walk(crdcheck.version_schema(crd)):
        free = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert "type" in node or free, f"{path}: no type"
        assert not ("properties" in node and "additionalProperties" in node), f"{path}: both kinds of keys"
        if named and path.startswith((".spec", ".status")) and not path.endswith((".min", ".max")):
            assert node.get("description"), f"{path}: no description"


def test_crd_shape(crd):
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["llmis", "llmsvc"]
    assert "isvc" not in crd["spec"]["names"]["shortNames"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Mode",
        "Ready",
        "Reason",
        "Prefill",
        "Decode",
        "Batch",
        "TTFT-p95",
        "ITL-p95",
        "Age",
        "URL",
    ]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority")]
    assert wide == ["URL"]  # kubectl get -o wide
    schema = crdcheck.version_schema(crd)
    for name, path in columns.items():  # every column points at a field the schema declares
        if path.startswith(".metadata."):
            continue
        node = schema
        for key in re.sub(r"\[\?\(.*?\)\]", "[]", path).strip(".").split("."):
            node = (node.get("properties") or {}).get(key.removesuffix("[]")) or node.get("additionalProperties") or {}
            if key.endswith("[]"):  # a list filtered to one item: its items' schema
                node = node.get("items") or {}
            assert node, f"column {name}: {path} is not in the schema"
    pools = schema["properties"]["spec"]["properties"]["pools"]["properties"]
    assert set(pools) == {"colocated", "prefill", "decode"}
    engine = pools["decode"]["properties"]["engine"]["properties"]
    assert engine["policy"]["enum"] == ["static", "dynamic", "continuous"]
    assert engine["maxBatchSize"]["minimum"] == 1
    assert "Start-up only" in engine["kvBlockSize"]["description"]
    assert "Start-up only" not in engine["maxBatchSize"]["description"]
    assert set(pools["decode"]["properties"]["bounds"]["properties"]) == {
        "maxBatchSize",
        "batchTimeoutMs",
        "maxNumBatchedTokens",
    }


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_pass_schema_and_operator(repo_root, crd, example):
    doc = yaml.safe_load((repo_root / "examples" / example).read_text())
    assert crdcheck.validate(doc, crd) == []
    assert crdcheck.pruned(doc["spec"], crdcheck.version_schema(crd)["properties"]["spec"]) == doc["spec"]
    parse_spec(doc["spec"])


BASE = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}}


def with_(path: str, value, base=BASE):
    spec = copy.deepcopy(base)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


def document(spec):
    return {"apiVersion": "llmfleet.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": "x"}, "spec": spec}


PVC = {"persistentVolumeClaim": {"claimName": "weights"}}

# spec -> a fragment of the API server's message
SCHEMA_REJECTS = {
    "missing slo": ({"model": {"builtin": "tiny"}}, "'slo' is a required property"),
    "missing itl": (with_("slo", {"ttftP95Ms": 100}), "'itlP95Ms' is a required property"),
    "ttft below 1 ms": (with_("slo.ttftP95Ms", 0.5), "less than the minimum"),
    "itl past an hour": (with_("slo.itlP95Ms", 1e306), "greater than the maximum"),
    "unknown mode": (with_("mode", "sharded"), "is not one of"),
    "unknown builtin": (with_("model.builtin", "huge"), "is not one of"),
    "zero max replicas": (with_("pools.colocated.maxReplicas", 0), "less than the minimum"),
    "negative min replicas": (with_("pools.colocated.minReplicas", -1), "less than the minimum"),
    "unknown policy": (with_("pools.colocated.engine.policy", "fastest"), "is not one of"),
    "batch size 0": (with_("pools.colocated.engine.maxBatchSize", 0), "less than the minimum"),
    "string batch": (with_("pools.colocated.engine.maxBatchSize", "big"), "is not of type"),
    "bad gpu quantity": (with_("pools.colocated.resources", {"limits": {"nvidia.com/gpu": "one"}}), "does not match"),
    "negative cpu request": (with_("router.resources", {"requests": {"cpu": "-500m"}}), "does not match"),
    "bad toleration effect": (with_("pools.colocated.tolerations", [{"effect": "Sometimes"}]), "is not one of"),
    "headroom 2": (with_("autotune.headroom", 2), "greater than the maximum"),
    "interval 1s": (with_("autotune.intervalSeconds", 1), "less than the minimum"),
    "unknown router policy": (with_("router.policy", "random"), "is not one of"),
    "startup timeout 5 s": (with_("pod.startupTimeoutSeconds", 5), "less than the minimum"),
    "startup timeout past a day": (with_("pod.startupTimeoutSeconds", 10**12), "greater than the maximum"),
    "negative max surge": (with_("pod.maxSurge", -1), "less than the minimum"),
    "max surge in words": (with_("pod.maxSurge", "lots"), "does not match"),
    # names and keys the API server would refuse in the Deployment, after other objects were written
    "a service account name with _": (with_("pod.serviceAccountName", "Bad_Name"), "does not match"),
    "a pull secret with a space": (with_("pod.imagePullSecrets", ["my registry"]), "does not match"),
    "an API key Secret in capitals": (with_("apiKeySecret", {"name": "My_Secret"}), "does not match"),
    "a Secret key with a space": (with_("kvTransferSecret", {"name": "kv", "key": "a b"}), "does not match"),
    "no image": (with_("image", ""), "should be non-empty"),
    # CEL rules
    "both builtin and path": (with_("model.path", "/models/x"), "exactly one of builtin, path or uri"),
    "neither builtin nor path": (with_("model", {"name": "x"}), "exactly one of builtin, path or uri"),
    "both builtin and uri": (with_("model.uri", "hf://org/name"), "exactly one of builtin, path or uri"),
    "an s3 uri": (with_("model", {"uri": "s3://bucket/model"}), "does not match"),
    "a Hub id without hf://": (with_("model", {"uri": "org/name"}), "does not match"),
    "a claim path that leaves the claim": (with_("model", {"uri": "pvc://weights/a/../../etc"}), "may not hold '..'"),
    "a claim that is no name": (with_("model", {"uri": "pvc://Weights/a"}), "does not match"),
    "a volume with a uri": (with_("model", {"uri": "pvc://weights/a", "volume": PVC}), "volume goes with path"),
    "a cache for a claim": (
        with_("model", {"uri": "pvc://weights/a", "cache": {"claimName": "c"}}),
        "go with an hf:// uri",
    ),
    "a token for a built-in": (with_("model.tokenSecret", {"name": "hf"}), "go with an hf:// uri"),
    "a cache both shared and per pod": (
        with_("model", {"uri": "hf://org/name", "cache": {"claimName": "c", "sizeLimit": "40Gi"}}),
        "not both",
    ),
    "a cache size in words": (
        with_("model", {"uri": "hf://org/name", "cache": {"sizeLimit": "big"}}),
        "does not match",
    ),
    "path outside the volume": (with_("model", {"path": "/data/x", "volume": PVC}), "must lie under /models"),
    "path out of the volume by '..'": (with_("model", {"path": "/models/../etc", "volume": PVC}), "'..' segment"),
    "path up and out by '..'": ({**BASE, "model": {"path": "../../etc"}}, "'..' segment"),
    "path ending in '..'": ({**BASE, "model": {"path": "/models/llama/.."}}, "'..' segment"),
    "path longer than PATH_MAX": ({**BASE, "model": {"path": "/m" * 2049}}, "is too long"),
    "min > max replicas": (with_("pools.colocated", {"minReplicas": 5, "maxReplicas": 2}), "minReplicas must be"),
    "replicas above max": (with_("pools.colocated", {"replicas": 9, "maxReplicas": 4}), "replicas must lie"),
    "inverted bounds": (with_("pools.colocated.bounds", {"maxBatchSize": {"min": 64, "max": 8}}), "min must be"),
    "disaggregated without pools": (with_("mode", "disaggregated"), "needs pools.prefill and pools.decode"),
    "disaggregated without decode": (
        with_("pools", {"prefill": {}}, with_("mode", "disaggregated")),
        "needs pools.prefill and pools.decode",
    ),
    "a rollout that cannot move": (with_("pod", {"maxSurge": 0, "maxUnavailable": "0%"}), "cannot both be 0"),
    "a rollout that cannot move, zeros": (with_("pod", {"maxSurge": "00%", "maxUnavailable": 0}), "cannot both be 0"),
    "two autoscalers": (with_("externalAutoscaler", True), "needs autotune.enabled: false"),
    "fewer routers at most than at least": (
        with_("router", {"replicas": 3, "maxReplicas": 2}),
        "router.maxReplicas must be >= router.replicas",
    ),
    "router autoscaling without a CPU request": (with_("router", {"maxReplicas": 4}), "needs router.resources"),
    "a season shorter than its bins": (with_("autotune", {"seasonSeconds": 300}), "0 (off) or >= 600"),
}


@pytest.mark.parametrize("case", list(SCHEMA_REJECTS))
def test_schema_rejects(crd, case):
    spec, fragment = SCHEMA_REJECTS[case]
    if any(
        word in fragment
        for word in ("must", "exactly", "needs", "may not", "goes", "go with", "not both", "segment", "(off)")
    ):
        pytest.importorskip("celpy")
    errors = crdcheck.validate(document(spec), crd)
    assert errors, f"{case}: accepted"
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize(
    "model",
    [
        {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"},
        {"uri": "hf://gpt2@0123456789abcdef0123456789abcdef01234567"},
        {"uri": "hf://org/name@refs/pr/1", "tokenSecret": {"name": "hf"}, "cache": {"claimName": "hf-cache"}},
        {"uri": "hf://org/name", "cache": {"sizeLimit": "40Gi"}},
        {"uri": "pvc://weights"},
        {"uri": "pvc://weights/llama-3/8b"},
        {"path": "/models/x", "volume": PVC},
    ],
)
def test_model_sources_pass_the_schema_and_the_operator(crd, model):
    pytest.importorskip("celpy")
    spec = with_("model", model)
    assert crdcheck.validate(document(spec), crd) == []
    assert crdcheck.pruned(spec, crdcheck.version_schema(crd)["properties"]["spec"]) == spec
    parse_spec(spec)


@pytest.mark.parametrize(
    ("name", "accepted"),
    [
        ("chat", True),
        ("llama-3-8b", True),
        ("a" * 53, True),  # "-colocated" makes its longest Service name 63 characters
        ("a" * 54, False),
        ("qwen2.5-7b", False),  # a dot: fine for a Deployment, not for a Service
        ("7b-chat", False),  # a digit first
    ],
)
def test_the_name_must_fit_every_service_the_operator_names_after_it(crd, name, accepted):
    pytest.importorskip("celpy")
    errors = crdcheck.validate({**document(BASE), "metadata": {"name": name}}, crd)
    assert (errors == []) == accepted, errors


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/models/llama", "/models/llama"),
        ("/models//llama/./", "/models/llama"),
        ("/models/", "/models"),
        ("/models/llama..3", "/models/llama..3"),  # dots within a name are no '..' segment
    ],
)
def test_a_model_path_is_served_normalized_and_passes_the_schema(crd, path, served):
    pytest.importorskip("celpy")
    spec = {**BASE, "model": {"path": path, "volume": PVC}}
    assert crdcheck.validate(document(spec), crd) == []
    assert parse_spec(spec).model.server_arg == served


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "half", "float"])
def test_every_dtype_spelling_the_server_takes_passes_the_schema(crd, dtype):
    """vLLM's half and float: the server took them, kubectl apply refused them."""
    spec = with_("pools.colocated.engine.dtype", dtype)
    assert crdcheck.validate(document(spec), crd) == []
    parse_spec(spec)


def test_pod_options_pass_the_schema_and_survive_its_pruning(crd):
    # a field the schema does not declare is dropped by the API server without a word
    from tests.operator.reconcile.test_desired import POD_OPTIONS

    doc = document(with_("pod", POD_OPTIONS))
    assert crdcheck.validate(doc, crd) == []
    spec_schema = crdcheck.version_schema(crd)["properties"]["spec"]
    assert crdcheck.pruned(doc["spec"], spec_schema) == doc["spec"]
    assert crdcheck.pruned({**doc["spec"], "typo": 1}, spec_schema) == doc["spec"]  # pruning does prune


def test_schema_applies_defaults(crd):
    doc = crdcheck.apply_defaults(document(with_("pools.decode", {})), crdcheck.version_schema(crd))
    spec = doc["spec"]
    assert spec["mode"] == "colocated" and "image" not in spec  # the operator's default: the chart's image
    assert spec["autotune"] == {
        "enabled": True,
        "intervalSeconds": 30,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 300,
        "cooldownSeconds": 60,
        "headroom": 0.2,
        "scaleToZeroAfterSeconds": 300,
        "mode": "act",
        "predictive": True,
        "seasonSeconds": 86400,
    }
    assert spec["pools"]["decode"]["minReplicas"] == 1 and spec["pools"]["decode"]["maxReplicas"] == 4
    # the operator reads a defaulted spec exactly as it reads the sparse one
    assert parse_spec(spec) == parse_spec(with_("pools.decode", {}))


def test_a_spec_without_image_takes_the_operators_default(monkeypatch):
    monkeypatch.setenv("LLMFLEET_SERVER_IMAGE", "registry.example/llm-fleet:1.0-cuda")
    assert parse_spec(BASE).image == "registry.example/llm-fleet:1.0-cuda"
    assert parse_spec({**BASE, "image": "mine:dev"}).image == "mine:dev"
    monkeypatch.delenv("LLMFLEET_SERVER_IMAGE")
    spec = parse_spec(BASE)  # the local fleet needs none
    with pytest.raises(SpecError) as err:
        require_image(spec)
    assert err.value.reason == "NoImage" and "--server-image or $LLMFLEET_SERVER_IMAGE" in str(err.value)


# What the operator itself must catch: clusters without CEL (before 1.25) let all of these through,
# and some facts only the operator checks. Each comes back as a reason, never an exception.
OPERATOR_REJECTS = {
    "both builtin and path": (with_("model.path", "/models/x"), "InvalidSpec", "exactly one"),
    "both path and uri": ({**BASE, "model": {"path": "/models/x", "uri": "hf://o/n"}}, "InvalidSpec", "exactly one"),
    "a claim path that leaves the claim": (
        {**BASE, "model": {"uri": "pvc://weights/a/../../etc"}},
        "InvalidSpec",
        "may not leave the claim",
    ),
    "a Hub id the Hub refuses": ({**BASE, "model": {"uri": "hf://org--x/name"}}, "InvalidSpec", "no Hugging Face"),
    "a revision with ..": ({**BASE, "model": {"uri": "hf://org/name@a..b"}}, "InvalidSpec", "must be a branch"),
    "an s3 uri": ({**BASE, "model": {"uri": "s3://bucket/m"}}, "InvalidSpec", "use hf://org/name[@revision]"),
    "a volume with a uri": (
        {**BASE, "model": {"uri": "pvc://w/a", "volume": PVC}},
        "InvalidSpec",
        "model.volume goes with model.path",
    ),
    "a token for a claim": (
        {**BASE, "model": {"uri": "pvc://w/a", "tokenSecret": {"name": "hf"}}},
        "InvalidSpec",
        "go with an hf:// model.uri",
    ),
    "HF_TOKEN twice": (
        {
            **BASE,
            "model": {"uri": "hf://o/n", "tokenSecret": {"name": "hf"}},
            "pod": {"env": [{"name": "HF_TOKEN", "value": "x"}]},
        },
        "InvalidSpec",
        "keep one",
    ),
    "HF_HUB_OFFLINE in the pod env": (
        with_("pod", {"env": [{"name": "HF_HUB_OFFLINE", "value": "0"}]}),
        "InvalidSpec",
        "env HF_HUB_OFFLINE is set by the operator",
    ),
    "relative path": ({**BASE, "model": {"path": "models/x"}}, "InvalidSpec", "absolute"),
    "path outside the volume": (
        {**BASE, "model": {"path": "/data/x", "volume": PVC}},
        "InvalidSpec",
        "outside the model volume",
    ),
    "path out of the volume by '..'": (
        {**BASE, "model": {"path": "/models/../etc", "volume": PVC}},
        "InvalidSpec",
        "model.path '/models/../etc' has a '..' segment",
    ),
    "path up and out by '..'": ({**BASE, "model": {"path": "/../../etc"}}, "InvalidSpec", "'..' segment"),
    "min > max replicas": (
        with_("pools.colocated", {"minReplicas": 5, "maxReplicas": 2}),
        "InvalidSpec",
        "minReplicas 5 > maxReplicas 2",
    ),
    "disaggregated without pools": (with_("mode", "disaggregated"), "InvalidSpec", "needs pools"),
    "a rollout that cannot move": (with_("pod", {"maxSurge": "0%", "maxUnavailable": 0}), "InvalidSpec", "both be 0"),
    # what the API server would refuse in the Deployment (a 422), or in a server-side apply (a 500 retried for ever)
    "a rollout that cannot move, zeros": (
        with_("pod", {"maxSurge": "00%", "maxUnavailable": 0}),
        "InvalidSpec",
        "both be 0",
    ),
    "more than all pods unavailable": (with_("pod", {"maxUnavailable": "150%"}), "InvalidSpec", "at most 100%"),
    "an env name twice": (
        with_("pod", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}),
        "InvalidSpec",
        "env A is given twice",
    ),
    "a pull secret twice": (with_("pod", {"imagePullSecrets": ["r", "r"]}), "InvalidSpec", "names a Secret twice"),
    "two autoscalers": (with_("externalAutoscaler", True), "InvalidSpec", "needs autotune.enabled: false"),
    "router autoscaling without a CPU request": (
        with_("router", {"maxReplicas": 4}),
        "InvalidSpec",
        "router.maxReplicas needs router.resources.requests.cpu",
    ),
    "inverted bounds": (
        with_("pools.colocated.bounds", {"maxBatchSize": {"min": 64, "max": 8}}),
        "InvalidSpec",
        "min 64.0 > max 8.0",
    ),
    "bounds with no whole number in them": (
        with_("pools.colocated.bounds", {"maxBatchSize": {"min": 10.2, "max": 10.8}}),
        "InvalidSpec",
        "bounds.maxBatchSize: no value the engine accepts lies within it (whole numbers from 1 to 4096)",
    ),
    "a bound beyond what the engine accepts": (
        with_("pools.colocated.bounds", {"batchTimeoutMs": {"min": 70000}}),
        "InvalidSpec",
        "bounds.batchTimeoutMs: no value the engine accepts lies within it (from 0 to 60000)",
    ),
    "an SLO past an hour": (  # its drain time once overflowed the reconcile into a retry loop
        with_("slo", {"ttftP95Ms": 500, "itlP95Ms": 1e306}),
        "InvalidSpec",
        "slo.itlP95Ms: Input should be less than or equal to 3600000",
    ),
    "a start-up timeout past a day": (
        with_("pod", {"startupTimeoutSeconds": 10**12}),
        "InvalidSpec",
        "pod.startupTimeoutSeconds: Input should be less than or equal to 86400",
    ),
    "a Prometheus URL no request can go to": (
        with_("autotune", {"prometheusUrl": "http://[::1"}),
        "InvalidSpec",
        "prometheusUrl 'http://[::1' is not a URL",
    ),
    "a Prometheus address without its scheme": (
        with_("autotune", {"prometheusUrl": "prometheus:9090"}),
        "InvalidSpec",
        "is not an http(s) URL",
    ),
    "unknown engine knob": (
        with_("pools.colocated.engine", {"maxBatchSize": 8, "turbo": True}),
        "InvalidEngineConfig",
        "turbo",
    ),
    "engine knob out of range": (
        with_("pools.colocated.engine", {"maxBatchSize": 0}),
        "InvalidEngineConfig",
        "maxBatchSize: Input should be greater than or equal to 1",
    ),
}


@pytest.mark.parametrize("case", list(OPERATOR_REJECTS))
def test_operator_rejects_with_a_reason(case):
    spec, reason, fragment = OPERATOR_REJECTS[case]
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.reason == reason
    assert fragment in str(err.value)
