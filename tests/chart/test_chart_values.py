"""Values that used to render wrong or pass unchecked: the Recreate strategy on an upgrade from
peering, podLabels against the selector, label keys and values, the liveness path and quoted
arguments, numeric image tags, the `helm test` pod's scheduling, and the docs of both."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart.conftest import CHART, RELEASE, RELEASE_NAMESPACE, VARIANTS, one, values_args
from tests.chart.test_chart_manifests import VALIDATE_VERSION, operator_container

SCHEMA_ERROR = "values don't meet the specifications of the schema"
SELECTOR = {
    "app.kubernetes.io/name": "llm-fleet",
    "app.kubernetes.io/instance": RELEASE,
    "app.kubernetes.io/component": "operator",
}


def template(helm, tmp_path: Path, *args: str, values: dict[str, Any] | None = None, check: bool = True):
    return helm(
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        RELEASE_NAMESPACE,
        *values_args(values or {}, tmp_path),
        *args,
        check=check,
    )


def docs_of(out: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(out) if d]


def test_recreate_strategy_clears_rolling_update(render) -> None:
    """An upgrade from peering (RollingUpdate) to standalone must drop the old rollingUpdate:
    the API server refuses it beside Recreate (kubernetes#24198), and a left-out field is kept."""
    strategy = one(render(), "Deployment")["spec"]["strategy"]
    assert strategy == {"type": "Recreate", "rollingUpdate": None}
    assert one(render(VARIANTS["peering"]), "Deployment")["spec"]["strategy"] == {"type": "RollingUpdate"}


def test_pod_labels_cannot_override_the_selector_labels(helm, tmp_path: Path) -> None:
    out = template(
        helm,
        tmp_path,
        "--set",
        r"podLabels.app\.kubernetes\.io/component=foo",
        "--set",
        "podLabels.team=ml",
        "--show-only",
        "templates/deployment.yaml",
    ).stdout
    pod_labels_block = out.split("template:", 1)[1].split("annotations:", 1)[0]
    assert pod_labels_block.count("app.kubernetes.io/component:") == 1, pod_labels_block  # no duplicate key
    deployment = one(docs_of(out), "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels == {**SELECTOR, "team": "ml"}  # the selector wins, the rest of podLabels is kept
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    kubernetes_validate.validate(deployment, VALIDATE_VERSION, strict=True)


LONG = "a" * 64


@pytest.mark.parametrize(
    ("values", "where", "message"),
    [
        ({"nameOverride": "Fleet"}, "/nameOverride", "does not match pattern"),
        ({"nameOverride": "fleet-"}, "/nameOverride", "does not match pattern"),
        ({"nameOverride": LONG}, "/nameOverride", "maxLength"),
        ({"fullnameOverride": "my_fleet"}, "/fullnameOverride", "does not match pattern"),
        ({"fullnameOverride": LONG}, "/fullnameOverride", "maxLength"),
        ({"grafana": {"dashboards": {"label": "a/b/c"}}}, "/grafana/dashboards/label", "does not match pattern"),
        ({"grafana": {"dashboards": {"label": "Example.com/x"}}}, "/grafana/dashboards/label", "does not match"),
        ({"grafana": {"dashboards": {"label": "dash board"}}}, "/grafana/dashboards/label", "does not match"),
        ({"grafana": {"dashboards": {"label": LONG}}}, "/grafana/dashboards/label", "does not match"),
        ({"grafana": {"dashboards": {"label": "b" * 254 + "/x"}}}, "/grafana/dashboards/label", "does not match"),
        ({"podMonitorLabels": {"release": "kube prometheus"}}, "/podMonitorLabels/release", "does not match"),
        ({"podMonitorLabels": {"release": "-x"}}, "/podMonitorLabels/release", "does not match"),
        ({"podMonitorLabels": {"release": LONG}}, "/podMonitorLabels/release", "maxLength"),
        ({"podMonitorLabels": {"bad key": "x"}}, "invalid propertyName 'bad key'", ""),
        (
            {"metricsNamespaceLabels": {"x.io/scrapes": "yes!"}},
            "/metricsNamespaceLabels/x.io~1scrapes",
            "does not match",
        ),
        ({"metricsNamespaceLabels": {"x.io/": "true"}}, "invalid propertyName 'x.io/'", ""),
        ({"podLabels": {"team": "a/b"}}, "/podLabels/team", "does not match"),
        ({"podLabels": {"_team": "ml"}}, "invalid propertyName '_team'", ""),
        ({"liveness": {"path": "/healthz now"}}, "/liveness/path", "does not match pattern"),
        ({"liveness": {"path": "/healthz?x=1"}}, "/liveness/path", "does not match pattern"),
        ({"liveness": {"path": "/healthz#x"}}, "/liveness/path", "does not match pattern"),
        ({"liveness": {"path": '/a"b'}}, "/liveness/path", "does not match pattern"),
        ({"liveness": {"path": "healthz"}}, "/liveness/path", "does not match pattern"),
        ({"image": {"tag": True}}, "/image/tag", "want number or string"),
    ],
)
def test_schema_refuses_malformed_names_labels_and_paths(
    helm, tmp_path: Path, values: dict, where: str, message: str
) -> None:
    result = template(helm, tmp_path, values=values, check=False)
    assert result.returncode != 0, f"{values} rendered"
    assert SCHEMA_ERROR in result.stderr and where in result.stderr and message in result.stderr, result.stderr


def test_schema_accepts_valid_names_and_labels(render) -> None:
    """The control for the refusals above: real label keys and values, empty values included."""
    values = {
        "nameOverride": "fleet",
        "fullnameOverride": "llm-fleet-operator",
        "grafana": {"dashboards": {"enabled": True, "label": "grafana.example.com/dashboard_v1", "labelValue": ""}},
        "podMonitorLabels": {"release": "kube-prometheus-stack", "example.com/tier": "", "A_b.c": "X.y_z"},
        "metricsNamespaceLabels": {"kubernetes.io/metadata.name": "monitoring"},
        "podLabels": {"team": "ml", "example.com/cost-center": "c" * 63},
        "liveness": {"path": "/healthz/live-1.0_~x"},
    }
    docs = render(values)
    assert one(docs, "Deployment")["metadata"]["name"] == "llm-fleet-operator"
    args = operator_container(docs)["args"]
    assert "--pod-monitor-label=example.com/tier=" in args
    assert "--liveness=http://0.0.0.0:8080/healthz/live-1.0_~x" in args


def test_arguments_built_from_values_are_quoted(helm, tmp_path: Path) -> None:
    """Without the schema (a copy of the chart), no value may break the Deployment's YAML: every
    argument built from values is quoted, and the probes' path too."""
    chart = tmp_path / "llm-fleet"
    shutil.copytree(CHART, chart)
    (chart / "values.schema.json").unlink()
    for other in (chart / "templates").rglob("*.yaml"):  # the other objects are not under test here
        if other.name != "deployment.yaml":
            other.unlink()
    hostile = "x #y: [z], &a *b {c} 'd' \"e\" | >"
    values = {
        "liveness": {"path": f"/{hostile}"},
        "watchNamespaces": ["&ns"],
        "podSecurity": {"allow": ["{hostPath}"]},
        "podMonitorLabels": {"k": hostile},
        "metricsNamespaceLabels": {"m": "#n"},
        "peering": {"enabled": True, "name": "*peer"},
    }
    out = helm(
        "template", RELEASE, str(chart), *values_args(values, tmp_path), "--show-only", "templates/deployment.yaml"
    ).stdout
    container = operator_container(docs_of(out))
    for arg in (
        f"--liveness=http://0.0.0.0:8080/{hostile}",
        "--namespace=&ns",
        "--pod-security-allow={hostPath}",
        f"--pod-monitor-label=k={hostile}",
        "--metrics-namespace-label=m=#n",
        "--peering=*peer",
    ):
        assert arg in container["args"], (arg, container["args"])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == f"/{hostile}", probe


@pytest.mark.parametrize(
    ("args", "image", "version"),
    [
        (["--set", "image.tag=20250101"], "registry.example/llm-fleet:20250101", "20250101"),  # an int64
        (["--set", "image.tag=1.2"], "registry.example/llm-fleet:1.2", "1.2"),
        (["--set-string", "image.tag=20250101"], "registry.example/llm-fleet:20250101", "20250101"),
    ],
)
def test_numeric_image_tags_set_on_the_command_line(
    helm, tmp_path: Path, args: list[str], image: str, version: str
) -> None:
    docs = docs_of(template(helm, tmp_path, *args).stdout)
    container = operator_container(docs)
    assert container["image"] == image
    assert one(docs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/version"] == version


@pytest.mark.parametrize(("tag", "shown"), [(20250101, "20250101"), (1.2, "1.2"), (7, "7")])
def test_numeric_image_tags_in_a_values_file(render, tag: float, shown: str) -> None:
    """A values file's number arrives as a float64: 20250101 must not print as 2.0250101e+07."""
    docs = render({"image": {"tag": tag}, "test": {"image": {"tag": tag}}})
    container = operator_container(docs)
    assert container["image"] == f"registry.example/llm-fleet:{shown}"
    assert one(docs, "Pod")["spec"]["containers"][0]["image"] == f"curlimages/curl:{shown}"
    assert one(docs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/version"] == shown


def test_helm_test_pod_is_scheduled_and_pulled_like_the_operator(render) -> None:
    values = {
        "imagePullSecrets": [{"name": "registry-creds"}],
        "nodeSelector": {"node-role.example.com/system": "true"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}
                    ]
                }
            }
        },
    }
    docs = render(values)
    operator = one(docs, "Deployment")["spec"]["template"]["spec"]
    test_pod = one(docs, "Pod")
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity"):
        assert test_pod["spec"].get(key) == operator.get(key) == values[key], key
    kubernetes_validate.validate(test_pod, VALIDATE_VERSION, strict=True)
    assert not {"imagePullSecrets", "nodeSelector", "tolerations", "affinity"} & one(render(), "Pod")["spec"].keys()


def test_readme_says_the_templates_refuse_replicas_without_peering(helm, tmp_path: Path) -> None:
    """replicaCount > 1 without peering is a template `fail`, not a schema refusal: so says the README."""
    result = template(helm, tmp_path, values={"replicaCount": 2}, check=False)
    assert "needs peering.enabled=true" in result.stderr and SCHEMA_ERROR not in result.stderr
    readme = re.sub(r"\s+", " ", (CHART / "README.md").read_text())
    schema_claim = readme.split("`values.schema.json` rejects", 1)[1].split(";", 1)[0]
    assert "replicaCount" not in schema_claim, schema_claim
    assert "the templates refuse combinations of values, such as `replicaCount` > 1 without peering" in readme


def notes(helm, tmp_path: Path, *args: str) -> str:
    out = helm(
        "install",
        RELEASE,
        str(CHART),
        "--dry-run=client",
        "--namespace",
        RELEASE_NAMESPACE,
        *values_args({}, tmp_path),
        *args,
    ).stdout
    return out.split("NOTES:", 1)[1]


def test_prometheus_rule_without_service_monitor_warns(helm, tmp_path: Path) -> None:
    """Most alerts read the operator's own metrics: without a scrape of the operator they never fire."""
    warning = "WARNING: prometheusRule.enabled without a ServiceMonitor"
    assert warning in notes(helm, tmp_path, "--set", "prometheusRule.enabled=true")
    both = ("--set", "prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true")
    assert warning not in notes(helm, tmp_path, *both)
    assert warning in notes(helm, tmp_path, *both, "--set", "metrics.enabled=false")
    assert warning not in notes(helm, tmp_path)
    values_doc = (CHART / "values.yaml").read_text().split("\nprometheusRule:", 1)[0].rsplit("\n\n", 1)[1]
    assert "metrics.serviceMonitor" in values_doc, values_doc
    lines = (CHART / "README.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith("| `prometheusRule.enabled`"))
    assert "metrics.serviceMonitor.enabled" in row, row
