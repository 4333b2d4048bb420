"""Dashboards and Prometheus rules: the committed files are what fleet/dashboards.py generates,
the rules pass promtool's unit tests, the chart ships them, and every dashboard query runs against
a real Prometheus that scraped real servers under load: it parses, and it returns data."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from llmfleet.dashboards import OPERATOR_METRICS, all_queries, rendered, rules_file

from ..prometheus_support import PrometheusProcess, TargetGroup, require_prometheus
from ..support import ServerProcess
from .conftest import CHART, by_kind

LABELS = {"namespace": "test", "inference_service": "tiny", "pool": "colocated"}
VARIABLES = {"$namespace": "test", "$service": "tiny", "$pool": "colocated", "$__rate_interval": "20s",
             "$ttft_slo_ms": "500", "$itl_slo_ms": "100"}  # fmt: skip


def test_committed_files_are_generated():
    for relative, text in rendered().items():
        assert (CHART / relative).read_text() == text, f"{relative}: run `python -m llmfleet.dashboards`"


def test_rules_pass_promtool_unit_tests():
    promtool = shutil.which("promtool") or pytest.skip("promtool is not installed (scripts/install-tools.sh)")
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules_test.yaml"]):
        result = subprocess.run([promtool, *args], cwd=CHART / "prometheus", capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_ships_the_rules_as_a_prometheus_rule(render):
    assert by_kind(render(), "PrometheusRule") == []  # off by default
    (rule,) = by_kind(render({"prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus"}}}),
                      "PrometheusRule")  # fmt: skip
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["spec"]["groups"] == rules_file()["groups"]


def test_dashboards_have_the_template_variables():
    for name, text in rendered().items():
        if name.endswith(".json"):
            board = yaml.safe_load(text)
            names = {v["name"] for v in board["templating"]["list"]}
            assert {"datasource", "namespace", "service", "pool"} <= names, name


def _concrete(expr: str, instance: str) -> str:
    out = expr.replace("$instance", instance)
    for variable, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(variable, value)
    assert "$" not in out, out
    return out


def _load(url: str, stop: threading.Event) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        i = 0
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"dashboards {i}", "max_tokens": 12, "stream": i % 2 == 0}
            http.post("/v1/completions", json=body)
            i += 1


@pytest.mark.prometheus
def test_every_query_parses_and_returns_data_from_real_servers(tmp_path):
    require_prometheus()
    rules = rules_file()
    for group in rules["groups"]:
        group["interval"] = "1s"  # evaluate now, not in 30 s
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules))
    with (
        ServerProcess("--model", "builtin:tiny", "--served-model-name", "tiny") as a,
        ServerProcess("--model", "builtin:tiny", "--served-model-name", "tiny") as b,
    ):
        targets = [TargetGroup([s.url.removeprefix("http://") for s in (a, b)], LABELS)]
        stop = threading.Event()
        loaders = [threading.Thread(target=_load, args=(s.url, stop)) for s in (a, b)]
        for t in loaders:
            t.start()
        try:
            with PrometheusProcess(targets, rule_files=[rules_path]) as prometheus:
                prometheus.wait_for("sum(rate(vllm:generation_tokens_total[20s])) > 0", timeout=60)
                time.sleep(5)  # a few more scrapes under load
                instance = a.url.removeprefix("http://")
                empty = []
                for expr in all_queries():
                    result = prometheus.query(_concrete(expr, instance))  # raises on a parse error
                    if not result and not any(m in expr for m in OPERATOR_METRICS):
                        empty.append(expr)
                assert not empty, "queries without data:\n" + "\n".join(empty)
                for rule in rules["groups"][0]["rules"]:
                    prometheus.wait_for(rule["record"], timeout=30)
        finally:
            stop.set()
            for t in loaders:
                t.join(60)
