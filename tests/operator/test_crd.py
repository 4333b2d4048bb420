"""The CRD: generated from the code (no drift), and its schema accepts the examples and rejects
bad specs; what the schema lets through but the operator cannot serve is a SpecError."""

from __future__ import annotations

import copy

import jsonschema
import pytest
import yaml

from llmfleet.operator import crdgen
from llmfleet.operator.spec import SpecError, parse_spec

EXAMPLES = ["local.yaml", "colocated-chat.yaml", "disaggregated-long-prompt.yaml"]


@pytest.fixture(scope="module")
def crd(repo_root):
    return yaml.safe_load((repo_root / "crds" / "inferenceservice.yaml").read_text())


def test_committed_crd_is_generated(repo_root):
    assert (repo_root / "crds" / "inferenceservice.yaml").read_text() == crdgen.render(), (
        "crds/inferenceservice.yaml is stale: run `python -m llmfleet.operator.crdgen > crds/inferenceservice.yaml`"
    )


def schema_of(crd) -> dict:
    """The openAPIV3Schema as JSON schema (drop Kubernetes extensions jsonschema ignores anyway)."""
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_shape(crd):
    version = crd["spec"]["versions"][0]
    assert crd["spec"]["names"]["shortNames"] == ["llmis", "llmsvc"]
    assert "isvc" not in crd["spec"]["names"]["shortNames"]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]][:4] == ["Mode", "Ready", "Prefill", "Decode"]
    engine = schema_of(crd)["properties"]["spec"]["properties"]["pools"]["properties"]["decode"]["properties"]["engine"]
    assert engine["properties"]["policy"]["enum"] == ["static", "dynamic", "continuous"]
    assert engine["properties"]["maxBatchSize"]["minimum"] == 1


@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_pass_schema_and_operator(repo_root, crd, example):
    doc = yaml.safe_load((repo_root / "examples" / example).read_text())
    jsonschema.validate(doc, schema_of(crd))
    parse_spec(doc["spec"])


BASE = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}}


def with_(path: str, value):
    spec = copy.deepcopy(BASE)
    node = spec
    keys = path.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


SCHEMA_REJECTS = {
    "missing slo": {"model": {"builtin": "tiny"}},
    "negative ttft": with_("slo.ttftP95Ms", -5),
    "unknown mode": with_("mode", "sharded"),
    "unknown builtin": with_("model.builtin", "huge"),
    "zero max replicas": with_("pools.colocated.maxReplicas", 0),
    "unknown policy": with_("pools.colocated.engine.policy", "fastest"),
    "batch size 0": with_("pools.colocated.engine.maxBatchSize", 0),
    "string batch": with_("pools.colocated.engine.maxBatchSize", "big"),
    "headroom 2": with_("autotune.headroom", 2),
    "interval 1s": with_("autotune.intervalSeconds", 1),
}


@pytest.mark.parametrize("case", list(SCHEMA_REJECTS))
def test_schema_rejects(crd, case):
    doc = {"apiVersion": "llmfleet.io/v1alpha1", "kind": "InferenceService", "spec": SCHEMA_REJECTS[case]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, schema_of(crd))


# What the structural schema cannot say (CEL rules, which jsonschema does not run, and facts
# only the operator checks) must still come back as a clear reason.
OPERATOR_REJECTS = {
    "both builtin and path": (with_("model.path", "/models/x"), "InvalidSpec", "exactly one"),
    "relative path": ({**BASE, "model": {"path": "models/x"}}, "InvalidSpec", "absolute"),
    "min > max replicas": (
        with_("pools.colocated", {"minReplicas": 5, "maxReplicas": 2}),
        "InvalidSpec",
        "minReplicas 5 > maxReplicas 2",
    ),
    "disaggregated without pools": (with_("mode", "disaggregated"), "InvalidSpec", "needs pools"),
    "inverted bounds": (
        with_("pools.colocated.bounds", {"maxBatchSize": {"min": 64, "max": 8}}),
        "InvalidSpec",
        "min 64.0 > max 8.0",
    ),
    "unknown engine knob": (
        with_("pools.colocated.engine", {"maxBatchSize": 8, "turbo": True}),
        "InvalidEngineConfig",
        "turbo",
    ),
}


@pytest.mark.parametrize("case", list(OPERATOR_REJECTS))
def test_operator_rejects_with_a_reason(case):
    spec, reason, fragment = OPERATOR_REJECTS[case]
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    assert err.value.reason == reason
    assert fragment in str(err.value)
