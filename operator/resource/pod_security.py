"""What an InferenceService may ask of its pods and of the operator: by default nothing that
reaches past the pod.

Whoever may create an InferenceService must not get, through the operator, what they could not
do with a pod of their own: the node's filesystem or namespaces, privileges, added capabilities,
another ServiceAccount's identity or token, a Secret the spec names for no purpose of its own
(apiKeySecret, kvTransferSecret and imagePullSecrets are such purposes), or requests the operator
sends from its own place in the network to an address the spec names (its Prometheus, whose
answers reach status and Events). Each rule has a key; an
admin allows a key for the whole operator (``llm-fleet operator --pod-security-allow KEY``, the
chart's ``podSecurity.allow``).

The operator refuses a spec that breaks a rule (Degraded, reason Forbidden, nothing applied), and
the chart's ValidatingAdmissionPolicy refuses it at the API server: both read RULES, the policy
as each rule's CEL (scripts/chart-sync.py writes them to charts/llm-fleet/files/). Both look at
the spec as stored: the checks here read the raw dict, as CEL does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

REASON = "Forbidden"
ALLOW_VALUE = "podSecurity.allow"  # where the chart takes the keys


def server_account_name(name: str) -> str:
    """The ServiceAccount the operator makes for an InferenceService's model servers."""
    return f"{name}-server"


@dataclass(frozen=True)
class Rule:
    key: str  # what an admin allows
    refuses: str  # in words, for messages and docs
    cel: str  # true when the InferenceService (``object``) keeps the rule, as the admission policy checks it
    found: Callable[[dict[str, Any], str], list[str]]  # (spec, name) -> the fields that break it

    def message(self, fields: Iterable[str] = ()) -> str:
        where = ", ".join(fields)
        return (
            f"{where + ': ' if where else ''}{self.refuses} is not allowed here "
            f"(an admin may allow it: the operator's --pod-security-allow {self.key}, the chart's {ALLOW_VALUE})"
        )


def _get(node: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _volume(spec: dict[str, Any]) -> dict[str, Any]:
    volume = _get(spec, "model", "volume")
    return volume if isinstance(volume, dict) else {}


def _projected(spec: dict[str, Any], source: str) -> list[str]:
    sources = _get(_volume(spec), "projected", "sources")
    return [
        f"spec.model.volume.projected.sources[{i}].{source}"
        for i, item in enumerate(sources if isinstance(sources, list) else [])
        if isinstance(item, dict) and source in item
    ]


def _pod_flag(field: str) -> Callable[[dict[str, Any], str], list[str]]:
    return lambda spec, name: [f"spec.pod.{field}"] if _get(spec, "pod", field) is True else []


def _host_path(spec: dict[str, Any], name: str) -> list[str]:
    return ["spec.model.volume.hostPath"] if "hostPath" in _volume(spec) else []


def _secret_volume(spec: dict[str, Any], name: str) -> list[str]:
    direct = ["spec.model.volume.secret"] if "secret" in _volume(spec) else []
    return direct + _projected(spec, "secret")


def _token_volume(spec: dict[str, Any], name: str) -> list[str]:
    return _projected(spec, "serviceAccountToken")


def _secret_env(spec: dict[str, Any], name: str) -> list[str]:
    env = _get(spec, "pod", "env")
    return [
        f"spec.pod.env[{i}].valueFrom.secretKeyRef"
        for i, item in enumerate(env if isinstance(env, list) else [])
        if _get(item, "valueFrom", "secretKeyRef") is not None
    ]


def _service_account(spec: dict[str, Any], name: str) -> list[str]:
    account = _get(spec, "pod", "serviceAccountName")
    return ["spec.pod.serviceAccountName"] if account not in (None, server_account_name(name)) else []


def _prometheus_url(spec: dict[str, Any], name: str) -> list[str]:
    return ["spec.autotune.prometheusUrl"] if _get(spec, "autotune", "prometheusUrl") is not None else []


def _privileged(spec: dict[str, Any], name: str) -> list[str]:
    context = _get(spec, "pod", "securityContext") or {}
    return [
        f"spec.pod.securityContext.{f}" for f in ("privileged", "allowPrivilegeEscalation") if context.get(f) is True
    ]


def _capabilities(spec: dict[str, Any], name: str) -> list[str]:
    added = _get(spec, "pod", "securityContext", "capabilities", "add")
    return ["spec.pod.securityContext.capabilities.add"] if added else []


# CEL over the InferenceService as the API server stores it; `has()` guards every optional field.
_VOLUME = "object.spec.model.volume"
_SOURCES = f"{_VOLUME}.projected.sources"
_POD = "object.spec.pod"
_CONTEXT = f"{_POD}.securityContext"


def _no_projected(source: str) -> str:
    return f"!has({_VOLUME}.projected) || !has({_SOURCES}) || {_SOURCES}.all(s, !has(s.{source}))"


def _pod_flag_cel(field: str) -> str:
    return f"!has({_POD}) || !has({_POD}.{field}) || !{_POD}.{field}"


def _unset_or_false(path: str) -> str:
    return f"(!has({path}) || !{path})"


RULES: tuple[Rule, ...] = (
    Rule(
        "hostPath",
        "a hostPath volume (the node's filesystem)",
        f"!has({_VOLUME}) || !has({_VOLUME}.hostPath)",
        _host_path,
    ),
    Rule(
        "secretVolume",
        "a Secret mounted as a volume",
        f"!has({_VOLUME}) || (!has({_VOLUME}.secret) && ({_no_projected('secret')}))",
        _secret_volume,
    ),
    Rule(
        "serviceAccountToken",
        "a projected ServiceAccount token",
        f"!has({_VOLUME}) || {_no_projected('serviceAccountToken')}",
        _token_volume,
    ),
    Rule(
        "secretEnv",
        "env from a Secret (apiKeySecret and kvTransferSecret name the Secrets the servers read)",
        f"!has({_POD}) || !has({_POD}.env) || {_POD}.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef))",
        _secret_env,
    ),
    Rule(
        "serviceAccount",
        "a ServiceAccount other than the one the operator makes (<name>-server)",
        f"!has({_POD}) || !has({_POD}.serviceAccountName) "
        f"|| {_POD}.serviceAccountName == object.metadata.name + '-server'",
        _service_account,
    ),
    Rule(
        "hostNetwork",
        "the node's network namespace (hostNetwork)",
        _pod_flag_cel("hostNetwork"),
        _pod_flag("hostNetwork"),
    ),
    Rule("hostPID", "the node's process namespace (hostPID)", _pod_flag_cel("hostPID"), _pod_flag("hostPID")),
    Rule("hostIPC", "the node's IPC namespace (hostIPC)", _pod_flag_cel("hostIPC"), _pod_flag("hostIPC")),
    Rule(
        "privileged",
        "a privileged container or privilege escalation",
        f"!has({_POD}) || !has({_CONTEXT}) || ({_unset_or_false(f'{_CONTEXT}.privileged')} "
        f"&& {_unset_or_false(f'{_CONTEXT}.allowPrivilegeEscalation')})",
        _privileged,
    ),
    Rule(
        "capabilities",
        "added Linux capabilities",
        f"!has({_POD}) || !has({_CONTEXT}) || !has({_CONTEXT}.capabilities) "
        f"|| !has({_CONTEXT}.capabilities.add) || size({_CONTEXT}.capabilities.add) == 0",
        _capabilities,
    ),
    Rule(
        "prometheusUrl",
        "a Prometheus of its own for the operator to query (the operator's --prometheus-url is the admin's)",
        "!has(object.spec.autotune) || !has(object.spec.autotune.prometheusUrl)",
        _prometheus_url,
    ),
)
KEYS = tuple(rule.key for rule in RULES)


def refusals(spec: dict[str, Any], name: str, allow: Iterable[str] = ()) -> list[str]:
    """What in ``spec`` (as stored) breaks a rule the operator does not allow, one message each."""
    allowed = set(allow)
    return [rule.message(fields) for rule in RULES if rule.key not in allowed and (fields := rule.found(spec, name))]


def unknown_keys(allow: Iterable[str]) -> list[str]:
    return sorted(set(allow) - set(KEYS))
