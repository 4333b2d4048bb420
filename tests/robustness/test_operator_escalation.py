"""An InferenceService as a way to run any pod (issue 41): each escalation in escalations.py is
tried against the real operator in the emulated API server and against the chart's
ValidatingAdmissionPolicy (its CEL run by cel-python; for model.path, the CRD's own CEL rule),
and the refusals are counted and printed (run with -s to see the table).

The operator must refuse every one with a Degraded condition (Forbidden, or InvalidSpec for a
path) and one Warning, and create nothing for it; the policy must refuse every one too."""

from __future__ import annotations

import functools

import yaml

from llmfleet.operator.resource import pod_security
from tests.chart.admission import refusals
from tests.operator.conftest import CRD_FILE, inference_service, operator_running, settle
from tests.operator.resource import crdcheck
from tests.robustness.escalations import ESCALATIONS, PATH_ESCAPES

CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "Secret", "ServiceAccount", "Role")


@functools.cache
def _crd() -> dict:
    return yaml.safe_load(CRD_FILE.read_text())


def _names() -> dict[str, str]:
    cases = [*ESCALATIONS, *PATH_ESCAPES]
    return {case: f"escalation-{n}" for n, case in enumerate(cases)}


def test_every_escalation_is_refused_by_the_operator_and_by_the_admission_policy(kube, render):
    names = _names()
    specs = {**{case: spec for case, (spec, _) in ESCALATIONS.items()}, **PATH_ESCAPES}
    by_operator: dict[str, str] = {}
    with operator_running(kube):  # kopf's runner takes stdout while it runs: the table comes after
        for case, spec in specs.items():
            # the CRD's schema alone lets the pod options through; the path escapes it refuses (CEL)
            kube.create(inference_service(names[case], spec), schema_checked=case in ESCALATIONS)
        for case in specs:
            obj = settle(kube, names[case], 1)
            degraded = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
            warnings = [e["reason"] for e in kube.events(names[case]) if e["type"] == "Warning"]
            if degraded["status"] == "True" and warnings == [degraded["reason"]]:
                by_operator[case] = f"{degraded['reason']}: {degraded['message']}"
    created = {kind: sorted(kube.list(kind)) for kind in CHILD_KINDS}
    assert created == {kind: [] for kind in CHILD_KINDS}, f"an escalation got objects created: {created}"

    policy = next(d for d in render({}) if d["kind"] == "ValidatingAdmissionPolicy")
    by_policy: dict[str, str] = {}
    for case, spec in specs.items():
        document = inference_service(names[case], spec)
        refused = refusals(policy, document) if case in ESCALATIONS else crdcheck.validate(document, _crd())
        if refused:
            by_policy[case] = ("policy: " if case in ESCALATIONS else "CRD rule: ") + refused[0][:50]

    width = max(map(len, specs))
    print(f"\n{'escalation attempt':<{width}}  operator  admission")
    for case in specs:
        print(f"{case:<{width}}  {'refused' if case in by_operator else 'ADMITTED':<8}  ", end="")
        print("refused" if case in by_policy else "ADMITTED")
    print(
        f"escalation attempts: {len(specs)}; refused by the operator: {len(by_operator)}; "
        f"by the admission policy (model.path: the CRD's rule): {len(by_policy)}"
    )
    assert set(by_operator) == set(specs), f"the operator let through: {sorted(set(specs) - set(by_operator))}"
    assert set(by_policy) == set(specs), f"admission let through: {sorted(set(specs) - set(by_policy))}"
    for case, (_, keys) in ESCALATIONS.items():  # each refused for the reasons the table gives
        said = {key for key in pod_security.KEYS if f"--pod-security-allow {key}," in by_operator[case]}
        assert by_operator[case].startswith(pod_security.REASON) and said == keys, (case, by_operator[case])
    for case in PATH_ESCAPES:
        assert by_operator[case].startswith("InvalidSpec"), (case, by_operator[case])
