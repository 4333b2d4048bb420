"""pod_security.py: what each rule finds in a spec, the messages, the allowlist."""

from __future__ import annotations

import pytest

from llmfleet.operator.resource import pod_security
from tests.robustness.escalations import ALLOWED, ESCALATIONS, NAME


@pytest.mark.parametrize("case", list(ESCALATIONS))
def test_each_escalation_is_found_by_its_rules(case):
    spec, keys = ESCALATIONS[case]
    messages = pod_security.refusals(spec, NAME)
    assert len(messages) == len(keys)
    assert pod_security.refusals(spec, NAME, keys) == []  # allowed, it passes


@pytest.mark.parametrize("case", list(ALLOWED))
def test_what_the_spec_allows_passes(case):
    assert pod_security.refusals(ALLOWED[case], NAME) == []


def test_messages_name_the_fields_and_the_key_that_allows_them():
    spec, _ = ESCALATIONS["projected SA token of another SA"]
    assert pod_security.refusals(spec, NAME) == [
        "spec.model.volume.projected.sources[0].serviceAccountToken: a projected ServiceAccount token is not "
        "allowed here (an admin may allow it: the operator's --pod-security-allow serviceAccountToken, the "
        "chart's podSecurity.allow)",
        "spec.pod.serviceAccountName: a ServiceAccount other than the one the operator makes (<name>-server) is "
        "not allowed here (an admin may allow it: the operator's --pod-security-allow serviceAccount, the "
        "chart's podSecurity.allow)",
    ]


def test_the_operators_own_account_is_no_foreign_one():
    spec = {"pod": {"serviceAccountName": pod_security.server_account_name("chat")}}
    assert pod_security.refusals(spec, "chat") == []
    assert pod_security.refusals(spec, "other") != []


def test_malformed_options_are_no_crash():
    odd = {"model": {"volume": "hostPath"}, "pod": {"env": "x", "securityContext": None}}
    assert pod_security.refusals(odd, NAME) == []


def test_unknown_keys():
    assert pod_security.unknown_keys(["hostPath", "hostpath", "root"]) == ["hostpath", "root"]
