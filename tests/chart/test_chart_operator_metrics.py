"""The operator's own metrics endpoint in the chart: `--metrics-port` as the real CLI parses it, the
`metrics` port on the pod and the Service, and the optional ServiceMonitor that scrapes it with the
series' own labels."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from llmfleet.operator.cli import add_arguments
from tests.chart.conftest import CHART, RELEASE_NAMESPACE, by_kind, one, values_args
from tests.chart.test_chart_manifests import VALIDATE_VERSION, operator_container

MONITORED = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus"}}}}


def operator_args(docs: list[dict[str, Any]]) -> argparse.Namespace:
    """The rendered arguments through `llm-fleet operator`'s own parser: a flag it does not know fails here."""
    args = operator_container(docs)["args"]
    assert args[0] == "operator"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(args[1:])


def ports(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in obj}


def test_metrics_are_served_on_the_pod_and_the_service_by_default(render) -> None:
    docs = render()
    assert operator_args(docs).metrics_port == 8081
    container_ports = ports(operator_container(docs)["ports"])
    assert container_ports["metrics"]["containerPort"] == 8081
    service = one(docs, "Service")
    assert ports(service["spec"]["ports"])["metrics"] == {
        "name": "metrics",
        "port": 8081,
        "targetPort": "metrics",
        "protocol": "TCP",
    }
    assert by_kind(docs, "ServiceMonitor") == []  # only with the Prometheus operator, on request


def test_a_custom_port_and_turning_metrics_off(render) -> None:
    docs = render({"metrics": {"port": 9100}})
    assert operator_args(docs).metrics_port == 9100
    assert ports(operator_container(docs)["ports"])["metrics"]["containerPort"] == 9100
    for doc in docs:
        kubernetes_validate.validate(doc, VALIDATE_VERSION, strict=True)

    off = render({"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})
    assert operator_args(off).metrics_port == 0  # the CLI's "off"
    assert "metrics" not in ports(operator_container(off)["ports"])
    assert "metrics" not in ports(one(off, "Service")["spec"]["ports"])
    assert by_kind(off, "ServiceMonitor") == []  # nothing to scrape


def test_the_service_monitor_scrapes_the_operator_service_keeping_the_series_labels(render) -> None:
    docs = render(MONITORED)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    service = one(docs, "Service")
    # It selects exactly the operator's Service, in the release namespace, by a port that Service has.
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in ports(service["spec"]["ports"])
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
    # llmfleet_tuner_* carry the InferenceService's own `namespace`: without honorLabels Prometheus
    # renames it exported_namespace and every dashboard's tuner panel comes up empty.
    assert endpoint["honorLabels"] is True

    elsewhere = one(
        render({"metrics": {"serviceMonitor": {"enabled": True, "namespace": "monitoring"}}}), "ServiceMonitor"
    )
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert elsewhere["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}


def test_lint_strict_with_the_service_monitor(helm, tmp_path: Path) -> None:
    result = helm("lint", "--strict", str(CHART), *values_args(MONITORED, tmp_path))
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"metrics": {"port": 80}}, "minimum"),  # non-root cannot bind below 1024
        ({"metrics": {"port": 8080}}, "metrics.port and liveness.port must differ"),
        ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "does not match pattern"),
        ({"metrics": {"scrape": True}}, "additional properties 'scrape'"),
    ],
)
def test_bad_metrics_values_are_rejected(helm, tmp_path: Path, values: dict, message: str) -> None:
    result = helm("template", "fleet", str(CHART), *values_args(values, tmp_path), check=False)
    assert result.returncode != 0, f"{values} rendered:\n{result.stdout[:400]}"
    assert message in result.stderr, result.stderr
