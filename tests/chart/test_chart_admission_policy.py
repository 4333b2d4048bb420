"""The pod security rules as the chart's ValidatingAdmissionPolicy: rendered by helm (on by
default, less the keys podSecurity.allow names, bound to watchNamespaces when set), and its CEL
run by cel-python on the escalation specs and the allowed ones, agreeing with the operator's own
check (operator/resource/pod_security.py) on each."""

from __future__ import annotations

import pytest

from llmfleet.operator.resource import pod_security
from tests.chart.admission import refusals
from tests.chart.conftest import CHART, WATCHED, by_kind, one
from tests.robustness.escalations import ALLOWED, ESCALATIONS, NAME

POLICY = "ValidatingAdmissionPolicy"
BINDING = "ValidatingAdmissionPolicyBinding"


def inference_service(spec: dict, name: str = NAME) -> dict:
    return {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": spec,
    }


def refused_keys(policy: dict, spec: dict) -> set[str]:
    """The pod security keys whose validation refuses ``spec`` (messages name their key)."""
    messages = refusals(policy, inference_service(spec)) or []
    return {key for key in pod_security.KEYS for m in messages if f"--pod-security-allow {key}," in m}


def test_the_rules_file_is_generated_from_the_operators_rules(chart_sync) -> None:
    text = (CHART / "files" / "pod-security-rules.yaml").read_text()
    assert text == chart_sync.pod_security_file_text(), "run `python scripts/chart-sync.py`"


def test_on_by_default_with_every_rule_and_bound_everywhere(render) -> None:
    docs = render({})
    policy, binding = one(docs, POLICY), one(docs, BINDING)
    assert [v["expression"] for v in policy["spec"]["validations"]] == [r.cel for r in pod_security.RULES]
    assert {v["reason"] for v in policy["spec"]["validations"]} == {"Forbidden"}
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["inferenceservices"]  # not inferenceservices/status: the operator's writes
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert "--pod-security-allow" not in str(one(docs, "Deployment")["spec"]["template"]["spec"]["containers"])


def test_allowed_keys_leave_the_policy_and_reach_the_operator(render) -> None:
    docs = render({"podSecurity": {"allow": ["hostPath", "secretEnv"]}})
    policy = one(docs, POLICY)
    expected = [r.cel for r in pod_security.RULES if r.key not in ("hostPath", "secretEnv")]
    assert [v["expression"] for v in policy["spec"]["validations"]] == expected
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--pod-security-allow")] == [
        "--pod-security-allow=hostPath",
        "--pod-security-allow=secretEnv",
    ]


def test_every_key_allowed_or_the_policy_off_renders_none(render) -> None:
    for values in ({"podSecurity": {"allow": list(pod_security.KEYS)}}, {"admissionPolicy": {"enabled": False}}):
        docs = render(values)
        assert not by_kind(docs, POLICY) and not by_kind(docs, BINDING), values


def test_a_namespaced_install_binds_the_policy_to_its_namespaces(render) -> None:
    binding = one(render({"watchNamespaces": WATCHED}), BINDING)
    (expression,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expression == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": WATCHED}


def test_an_unknown_key_is_refused_by_the_values_schema(helm) -> None:
    result = helm("template", "x", str(CHART), "--set", "podSecurity.allow={hostpath}", check=False)
    assert result.returncode != 0 and "podSecurity" in result.stderr


@pytest.mark.parametrize("case", list(ESCALATIONS))
def test_the_policy_refuses_each_escalation_as_the_operator_does(render, case) -> None:
    spec, keys = ESCALATIONS[case]
    policy = one(render({}), POLICY)
    assert refused_keys(policy, spec) == keys
    refused_by_operator = {r.key for r in pod_security.RULES if r.found(spec, NAME)}
    assert refused_by_operator == keys


@pytest.mark.parametrize("case", list(ESCALATIONS))
def test_an_allowed_key_lets_its_escalation_through(render, case) -> None:
    spec, keys = ESCALATIONS[case]
    policy = one(render({"podSecurity": {"allow": sorted(keys)}}), POLICY)
    assert refusals(policy, inference_service(spec)) == []
    assert pod_security.refusals(spec, NAME, keys) == []


@pytest.mark.parametrize("case", list(ALLOWED))
def test_the_policy_admits_what_the_spec_allows(render, repo_root, case) -> None:
    policy = one(render({}), POLICY)
    assert refusals(policy, inference_service(ALLOWED[case])) == []
    assert pod_security.refusals(ALLOWED[case], NAME) == []


def test_the_examples_pass(render, repo_root) -> None:
    import yaml

    policy = one(render({}), POLICY)
    for path in sorted((repo_root / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                assert refusals(policy, doc) == [], path.name


def test_updates_that_leave_the_spec_alone_are_not_checked(render) -> None:
    """kopf's finalizer and annotations on an object made before the policy (or with a key allowed
    then) must still land: only a create, or an update of the spec, is judged."""
    policy = one(render({}), POLICY)
    spec, _ = ESCALATIONS["hostPath /"]
    old = inference_service(spec)
    annotated = {**old, "metadata": {**old["metadata"], "finalizers": ["operator.llmfleet.io/finalizer"]}}
    assert refusals(policy, annotated, old, "UPDATE") is None
    edited = inference_service({**spec, "image": "llm-fleet:2"})
    assert refusals(policy, edited, old, "UPDATE")  # a changed spec is judged again
