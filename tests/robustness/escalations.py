"""InferenceServices that try to make the operator a confused deputy (issue 41), each with the
pod security key (operator/resource/pod_security.py) that refuses it, and specs that must pass.
tests/robustness/test_operator_escalation.py tries them against the operator in the emulator and
against the chart's admission policy; tests/chart checks the policy's CEL on them too."""

from __future__ import annotations

import copy
from typing import Any

NAME = "evil"
BASE: dict[str, Any] = {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}}
SECRET_ENV = {"name": "STOLEN", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "password"}}}
TOKEN = {"serviceAccountToken": {"path": "token", "audience": "https://kubernetes.default.svc"}}


def spec(**changes: Any) -> dict[str, Any]:
    """BASE with dotted-path changes: spec(**{"pod.hostNetwork": True})."""
    out = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = out
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def model_volume(volume: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"path": "/models/llama", "volume": volume}}


# name -> (spec, the keys that refuse it); model.path's '..' is the CRD's rule and InvalidSpec
ESCALATIONS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "hostPath /": ({**BASE, **model_volume({"hostPath": {"path": "/"}})}, {"hostPath"}),
    "hostNetwork": (spec(**{"pod.hostNetwork": True}), {"hostNetwork"}),
    "hostPID": (spec(**{"pod.hostPID": True}), {"hostPID"}),
    "hostIPC": (spec(**{"pod.hostIPC": True}), {"hostIPC"}),
    "privileged": (spec(**{"pod.securityContext.privileged": True}), {"privileged"}),
    "allowPrivilegeEscalation": (spec(**{"pod.securityContext.allowPrivilegeEscalation": True}), {"privileged"}),
    "capabilities add SYS_ADMIN": (
        spec(**{"pod.securityContext.capabilities": {"add": ["SYS_ADMIN"]}}),
        {"capabilities"},
    ),
    "foreign serviceAccountName": (spec(**{"pod.serviceAccountName": "deployer"}), {"serviceAccount"}),
    "projected SA token": ({**BASE, **model_volume({"projected": {"sources": [TOKEN]}})}, {"serviceAccountToken"}),
    "projected SA token of another SA": (
        {**BASE, **model_volume({"projected": {"sources": [TOKEN]}}), "pod": {"serviceAccountName": "deployer"}},
        {"serviceAccountToken", "serviceAccount"},
    ),
    "Secret volume": ({**BASE, **model_volume({"secret": {"secretName": "db-password"}})}, {"secretVolume"}),
    "projected Secret": (
        {**BASE, **model_volume({"projected": {"sources": [{"secret": {"name": "db-password"}}]}})},
        {"secretVolume"},
    ),
    "Secret env": (spec(**{"pod.env": [SECRET_ENV]}), {"secretEnv"}),
    "the cloud's metadata service as Prometheus": (
        spec(**{"autotune.prometheusUrl": "http://169.254.169.254/latest/meta-data"}),
        {"prometheusUrl"},
    ),
}
# Refused as unservable (InvalidSpec) by the operator and by the CRD's own CEL rule, not by a key.
PATH_ESCAPES: dict[str, dict[str, Any]] = {
    "model.path ../../etc": {**BASE, "model": {"path": "../../etc"}},
    "model.path /models/../etc": {**BASE, "model": {"path": "/models/../etc", "volume": {"emptyDir": {}}}},
}

# What stays allowed: the spec's own Secret fields, plain env, the operator's account, a PVC.
ALLOWED: dict[str, dict[str, Any]] = {
    "the tiny model": BASE,
    "a PVC, the API key and KV token Secrets, plain env": {
        **BASE,
        **model_volume({"persistentVolumeClaim": {"claimName": "weights"}}),
        "apiKeySecret": {"name": "api"},
        "kvTransferSecret": {"name": "kv"},
        "pod": {
            "env": [
                {"name": "LOG_LEVEL", "value": "debug"},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "imagePullSecrets": ["registry"],
            "serviceAccountName": f"{NAME}-server",
            "securityContext": {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"add": []}},
            "hostNetwork": False,
        },
    },
    "a projected ConfigMap": {
        **BASE,
        **model_volume({"projected": {"sources": [{"configMap": {"name": "weights-index"}}]}}),
    },
}
