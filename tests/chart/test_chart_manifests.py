"""What `helm template` renders: valid for Kubernetes (kubernetes-validate --strict for built-in kinds,
the CRDs' own schemas for custom kinds), the operator's arguments per value variant, a locked-down
security context, the `helm test` hook, Grafana dashboard ConfigMaps and NOTES.txt."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import CHART, RELEASE, RELEASE_NAMESPACE, VARIANTS, WATCHED, by_kind, one, values_args

VALIDATE_VERSION = "1.33"


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> openAPIV3Schema, for every CRD the chart ships."""
    schemas = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd:
                continue
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = version["schema"]["openAPIV3Schema"]
    # Kinds of CRDs the chart does not ship (the Prometheus operator's): trimmed copies of their schemas.
    schemas[("monitoring.coreos.com/v1", "PrometheusRule")] = json.loads(
        (Path(__file__).parent / "schemas" / "prometheusrule.json").read_text()
    )
    return schemas


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    specs = [
        (f"Deployment/{d['metadata']['name']}", d["spec"]["template"]["spec"]) for d in by_kind(docs, "Deployment")
    ]
    specs += [(f"Pod/{d['metadata']['name']}", d["spec"]) for d in by_kind(docs, "Pod")]
    return specs


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "operator")


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_are_valid_kubernetes(render, variant: str) -> None:
    schemas = crd_schemas()
    docs = render(VARIANTS[variant])
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in schemas:
            jsonschema.validate(doc, schemas[key])
        else:
            kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)


LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize(
    "tag", ["main-20240101-0123456789abcdef0123456789abcdef01234567-linux-amd64", "0.1.0@sha256:0123abcd"]
)
def test_any_image_tag_makes_valid_labels(render, tag: str) -> None:
    """An image tag may hold 128 characters, a digest's "@" and ":"; a label value 63 of a narrower set
    (the API server checks that, not kubernetes-validate)."""
    docs = render({"image": {"tag": tag}})
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{tag}")
    for doc in docs:
        for value in (doc["metadata"].get("labels") or {}).values():
            assert len(value) <= 63 and LABEL_VALUE.match(value), (doc["kind"], value)


def test_dashboard_configmaps_keep_distinct_names_under_a_long_release_name(helm, tmp_path: Path) -> None:
    release = "ml-platform-inference-operator-prod-euw1-a"  # 42 characters: helm allows 53
    out = helm(
        "template",
        release,
        str(CHART),
        "--set",
        "grafana.dashboards.enabled=true",
        "--set",
        "grafana.dashboards.labelValue=1",
        *values_args({}, tmp_path),
    ).stdout
    maps = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]
    names = [d["metadata"]["name"] for d in maps]
    assert len(names) == len(set(names)) == 2 and all(len(n) <= 63 for n in names), names
    assert all(d["metadata"]["labels"]["grafana_dashboard"] == "1" for d in maps)  # a number, quoted


def test_strict_validation_catches_unknown_fields(render) -> None:
    """A control for the test above: a typo'd field must fail, or passing proves nothing."""
    deployment = json.loads(json.dumps(one(render(), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VALIDATE_VERSION, strict=True)


def test_crds_are_valid_kubernetes() -> None:
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if crd:
                kubernetes_validate.validate(crd, VALIDATE_VERSION, strict=True)


def test_default_operator_serves_all_namespaces_standalone(render) -> None:
    docs = render()
    container = operator_container(docs)
    assert container["command"] == ["llm-fleet"]
    args = container["args"]
    assert args[0] == "operator"
    assert "--all-namespaces" in args and "--standalone" in args
    assert not any(a.startswith(("--namespace", "--peering")) for a in args)
    assert "LLMFLEET_PROMETHEUS_URL" not in env_of(container)  # unset: the operator scrapes pods directly
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two standalone operators at once
    assert deployment["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert container["image"] == "registry.example/llm-fleet:0.1.0-cuda"  # the values' (conftest.IMAGE)
    # the server pods run it too, where an InferenceService sets no spec.image
    assert env_of(container)["LLMFLEET_SERVER_IMAGE"] == "registry.example/llm-fleet:0.1.0-cuda"
    assert not by_kind(docs, "ClusterKopfPeering") and not by_kind(docs, "KopfPeering")


def test_listed_namespaces_and_prometheus_url(render) -> None:
    container = operator_container(render(VARIANTS["namespaces"]))
    args = container["args"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={ns}" for ns in WATCHED]
    assert "--all-namespaces" not in args
    assert env_of(container)["LLMFLEET_PROMETHEUS_URL"] == "http://prometheus.monitoring:9090"


def test_pod_monitor_labels_reach_the_operator(render) -> None:
    args = operator_container(render(VARIANTS["pod-monitor-labels"]))["args"]
    assert "--pod-monitor-label=release=kube-prometheus-stack" in args
    assert not [a for a in operator_container(render({}))["args"] if a.startswith("--pod-monitor-label")]


def test_metrics_namespace_labels_reach_the_operator(render) -> None:
    args = operator_container(render(VARIANTS["metrics-namespaces"]))["args"]
    assert "--metrics-namespace-label=llmfleet.io/scrapes=true" in args
    assert not [a for a in operator_container(render({}))["args"] if a.startswith("--metrics-namespace-label")]


def test_peering_mode(render) -> None:
    docs = render(VARIANTS["peering"])
    args = operator_container(docs)["args"]
    assert "--peering=llm-fleet" in args and "--standalone" not in args
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert env_of(operator_container(docs))["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "llm-fleet"

    namespaced = render(VARIANTS["peering-namespaces"])
    peerings = by_kind(namespaced, "KopfPeering")  # kopf peers per namespace when not cluster-wide
    assert sorted(p["metadata"]["namespace"] for p in peerings) == sorted(WATCHED)
    assert not by_kind(namespaced, "ClusterKopfPeering")


def test_liveness_probes_service_and_port_agree(render) -> None:
    docs = render({"liveness": {"port": 9123, "path": "/alive"}})
    container = operator_container(docs)
    assert "--liveness=http://0.0.0.0:9123/alive" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["health"] == 9123  # beside "metrics" (test_chart_operator_metrics.py)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/alive", "port": "health"}, probe
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["port"] == 9123 and service["spec"]["ports"][0]["targetPort"] == "health"
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_security_context_is_locked_down(render, variant: str) -> None:
    for where, spec in pod_specs(render(VARIANTS[variant])):
        pod = spec.get("securityContext", {})
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        assert not any("hostPath" in v for v in spec.get("volumes", [])), where
        for container in spec["containers"] + spec.get("initContainers", []):
            sc = container.get("securityContext", {})
            name = f"{where}/{container['name']}"
            assert sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is True, name
            assert sc.get("runAsUser", pod.get("runAsUser")) not in (0, None), name
            assert sc.get("allowPrivilegeEscalation") is False, name
            assert sc.get("readOnlyRootFilesystem") is True, name
            assert sc.get("privileged", False) is False, name
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], name
            assert not sc.get("capabilities", {}).get("add"), name
            assert container.get("resources", {}).get("limits", {}).get("memory"), name
            # A read-only root needs a writable /tmp for Python and curl.
            assert any(m["mountPath"] == "/tmp" for m in container.get("volumeMounts", [])), name


def test_helm_test_hook_checks_liveness_and_crd(render) -> None:
    docs = render()
    pod = one(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    container = pod["spec"]["containers"][0]
    service = one(docs, "Service")
    port = service["spec"]["ports"][0]["port"]
    assert env_of(container)["OPERATOR"] == f"{service['metadata']['name']}.{RELEASE_NAMESPACE}.svc:{port}"
    script = "\n".join(container["args"])
    assert "$OPERATOR/healthz" in script
    crd = yaml.safe_load((CHART / "crds" / "inferenceservice.yaml").read_text())
    group, version = crd["spec"]["group"], crd["spec"]["versions"][0]["name"]
    assert f"/apis/{group}/{version}" in script and crd["spec"]["names"]["plural"] in script


def test_service_account_and_own_account(render) -> None:
    docs = render()
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account

    own = render(VARIANTS["own-account"])
    assert not by_kind(own, "ServiceAccount")
    assert not [d for d in own if d["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    assert one(own, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-bot"


def shipped_dashboards() -> list[Path]:
    return sorted((CHART / "dashboards").glob("*.json"))


def test_shipped_dashboards_render_as_configmaps(render) -> None:
    assert not [d for d in render() if d["kind"] == "ConfigMap"], "dashboards must be off by default"
    configmaps = by_kind(render(VARIANTS["dashboards"]), "ConfigMap")
    assert len(configmaps) == len(shipped_dashboards())
    for path in shipped_dashboards():
        assert isinstance(json.loads(path.read_text()), dict), f"{path.name} is not a JSON object"


def test_dashboard_configmaps(render, tmp_path: Path) -> None:
    """On a copy of the chart with two dashboards: one ConfigMap each, sidecar label, JSON intact."""
    chart = tmp_path / "llm-fleet"
    shutil.copytree(CHART, chart)
    dashboards = {
        "test-overview.json": {"title": "Test overview", "panels": [{"expr": 'sum(rate(x{a="b"}[1m]))'}]},
        "Pod_Detail.json": {"title": "Pod detail", "templating": {"list": []}},
    }
    for name, body in dashboards.items():
        (chart / "dashboards" / name).write_text(json.dumps(body, indent=2))
    values = {"grafana": {"dashboards": {"enabled": True, "label": "grafana_dashboard", "labelValue": "1"}}}

    configmaps = by_kind(render(values, chart=chart), "ConfigMap")
    assert len(configmaps) == len(dashboards) + len(shipped_dashboards())
    found = {}
    for cm in configmaps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == RELEASE_NAMESPACE
        ((key, text),) = cm["data"].items()
        found[key] = (cm["metadata"]["name"], json.loads(text))
    for name, body in dashboards.items():
        assert found[name][1] == body
    assert found["Pod_Detail.json"][0] == f"{RELEASE}-llm-fleet-dashboard-pod-detail"

    labelled = {"enabled": True, "label": "team_dash", "labelValue": "yes", "namespace": "grafana"}
    custom = {"grafana": {"dashboards": labelled}}
    for cm in by_kind(render(custom, chart=chart), "ConfigMap"):
        assert cm["metadata"]["labels"]["team_dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "grafana"

    off = {"grafana": {"dashboards": {"enabled": False}}}
    assert not by_kind(render(off, chart=chart), "ConfigMap")


def test_notes_render(helm, tmp_path: Path) -> None:
    """NOTES.txt renders (helm template skips it; a client-side dry-run install does not)."""
    out = helm(
        "install",
        "fleet",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        RELEASE_NAMESPACE,
        "--set",
        "watchNamespaces={team-a}",
        *values_args({}, tmp_path),
    ).stdout
    notes = out.split("NOTES:", 1)[1]
    assert "It serves InferenceServices in: team-a." in notes
    assert f"helm test fleet -n {RELEASE_NAMESPACE}" in notes
    assert "kubectl get inferenceservices" in notes


def test_the_server_image_may_differ_from_the_operators(render) -> None:
    """A CPU image for the operator, a CUDA one for the GPU servers."""
    values = {"image": {"tag": "0.1.0-cpu"}, "serverImage": "registry.example/llm-fleet:0.1.0-cuda"}
    container = operator_container(render(values))
    assert container["image"] == "registry.example/llm-fleet:0.1.0-cpu"
    assert env_of(container)["LLMFLEET_SERVER_IMAGE"] == "registry.example/llm-fleet:0.1.0-cuda"
