"""Dashboards and Prometheus rules: the committed files are what operator/deploy/dashboards.py generates,
the rules pass promtool's unit tests, the chart ships them, and every dashboard query runs against
a real Prometheus that scraped real servers under load and a real tuner's metrics: it parses, and
it returns data. The alert expressions run there too, and fire exactly where the data says so."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import threading
import time
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest, start_http_server

from llmfleet.operator import decision_metrics
from llmfleet.operator.deploy.dashboards import DASHBOARDS, all_queries, fleet_overview, rendered, rules_file
from llmfleet.operator.metrics.prometheus import PrometheusSource
from llmfleet.operator.metrics.source import PoolRef
from llmfleet.operator.resource.spec import parse_spec
from llmfleet.operator.resource.tuner_state import TunerState
from llmfleet.operator.tuner.run import Autotuner, PoolView, views_from_state
from llmfleet.server.http.server_metrics import ServerMetrics
from llmfleet.server.router.router_metrics import RouterMetrics
from tests.chart.conftest import CHART, VARIANTS, by_kind
from tests.chart.test_chart_manifests import crd_schemas
from tests.prometheus_support import PrometheusProcess, TargetGroup, require_prometheus
from tests.support import ServerProcess, free_port

LABELS = {"namespace": "test", "inference_service": "tiny", "pool": "colocated"}
PODS = ("tiny-colocated-0", "tiny-colocated-1")
VARIABLES = {
    "$namespace": "test",
    "$service": "tiny",
    "$pool": "colocated",
    "$pod": PODS[0],
    "$__rate_interval": "20s",
    "$ttft_slo_ms": "500",
    "$itl_slo_ms": "100",
}
# An ITL SLO no CPU meets and a TTFT SLO every request meets: the tuner must act, and of the
# latency alerts exactly the ITL ones must match.
SPEC = parse_spec(
    {
        "model": {"builtin": "tiny"},
        "slo": {"ttftP95Ms": 60000, "itlP95Ms": 0.01},
        "pools": {"colocated": {"engine": {"maxBatchSize": 16, "kvCacheMemoryMb": 64}}},
        "autotune": {"intervalSeconds": 5, "cooldownSeconds": 0},
    }
)
REF = PoolRef(LABELS["namespace"], LABELS["inference_service"], LABELS["pool"])
# an ITL SLO of 10 us: the tuner asks for more pods than maxReplicas (ScalingLimited) too
ALERTS_WITH_DATA = {"LLMFleetITLAboveSLO", "LLMFleetITLErrorBudgetFastBurn", "LLMFleetScalingLimited"}


def boards() -> dict[str, dict[str, Any]]:
    return {name: build() for name, build in DASHBOARDS.items()}


def test_committed_files_are_generated():
    for relative, text in rendered().items():
        assert (CHART / relative).read_text() == text, (
            f"{relative}: run `python -m llmfleet.operator.deploy.dashboards`"
        )


def test_rules_pass_promtool_unit_tests():
    promtool = shutil.which("promtool") or pytest.skip("promtool is not installed (scripts/install-tools.sh)")
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "rules_test.yaml"]):
        result = subprocess.run([promtool, *args], cwd=CHART / "prometheus", capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test():
    tested = {
        case["alertname"]
        for test in yaml.safe_load((CHART / "prometheus" / "rules_test.yaml").read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {rule["alert"] for rule in rules_file()["groups"][1]["rules"]}
    assert alerts <= tested, f"alerts never seen firing in rules_test.yaml: {sorted(alerts - tested)}"


def test_the_chart_ships_the_rules_as_a_prometheus_rule(render):
    assert by_kind(render(), "PrometheusRule") == []  # off by default
    (rule,) = by_kind(render(VARIANTS["prometheus-rule"]), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus"
    assert rule["spec"]["groups"] == rules_file()["groups"]


def test_the_prometheus_rule_schema_catches_typos(render):
    """A control for the chart's strict validation of the PrometheusRule: a typo'd field must fail."""
    schema = crd_schemas()[("monitoring.coreos.com/v1", "PrometheusRule")]
    (rule,) = by_kind(render(VARIANTS["prometheus-rule"]), "PrometheusRule")
    jsonschema.validate(rule, schema)
    rule["spec"]["groups"][1]["rules"][0]["expresion"] = rule["spec"]["groups"][1]["rules"][0].pop("expr")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rule, schema)


def test_dashboards_have_the_template_variables():
    for name, board in boards().items():
        names = {v["name"] for v in board["templating"]["list"]}
        assert {"datasource", "namespace", "service", "pool"} <= names, name
        assert "pod" in names or name != "engine-pod.json"


def test_dashboards_are_well_formed():
    """What Grafana would silently get wrong: duplicate ids or refIds, overlapping panels, a panel
    that ignores the datasource variable or the service selection."""
    for name, board in boards().items():
        json.loads(json.dumps(board))  # plain JSON
        assert len({p["id"] for p in board["panels"]}) == len(board["panels"]), name
        cells: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            g = panel["gridPos"]
            area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not area & cells, f"{name}: {panel['title']} overlaps another panel"
            assert g["x"] + g["w"] <= 24, f"{name}: {panel['title']} is wider than the grid"
            cells |= area
            assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
                assert '=~"$service"' in target["expr"] or "vector(" in target["expr"], target["expr"]


def _overview_queries() -> list[str]:
    board = fleet_overview()
    return [t["expr"] for p in board["panels"] for t in p["targets"]] + [
        a["expr"] for a in board["annotations"]["list"]
    ]


def test_overview_keeps_each_services_pools_apart():
    """Two InferenceServices may both have a pool "colocated": with $service = All, a series per
    pool name alone would add their requests and mix their latency buckets into one p95."""
    for expr in _overview_queries():
        for labels in re.findall(r"\b(?:sum|max|min|avg|count) by \(([^)]*)\)", expr):
            assert {"namespace", "inference_service"} <= {x.strip() for x in labels.split(",")}, expr


def test_tuner_series_with_a_pool_follow_the_pool_variable():
    for expr in _overview_queries():
        for selector in re.findall(r"llmfleet_tuner_(?:decisions_total|knob_value|replicas)\{([^}]*)\}", expr):
            assert 'pool=~"$pool"' in selector, expr


def test_every_role_exports_the_template_variables_series():
    """The router exports no engine gauges: variables read from those could never offer its pool."""
    metrics = {_variable_match(variable)[1] for variable in _variables()}
    for registry in (RouterMetrics("tiny").registry, ServerMetrics("tiny", "decode").registry):
        exported = generate_latest(registry).decode()
        for metric in metrics:
            assert re.search(rf"^{re.escape(metric)}\{{", exported, re.M), metric


# -- against a real Prometheus ------------------------------------------------------------------


def _concrete(expr: str) -> str:
    out = expr
    for variable, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(variable, value)
    assert "$" not in out, out
    return out


def _variables() -> list[dict[str, Any]]:
    return [v for board in boards().values() for v in board["templating"]["list"] if v["type"] == "query"]


def _variable_match(variable: dict[str, Any]) -> re.Match[str]:
    """label_values(metric{...}, label): the metric, its selector, the label."""
    match = re.fullmatch(r"label_values\(([\w:]+)(\{.*\})?, (\w+)\)", variable["query"]["query"])
    assert match, variable
    return match


def _variable_queries() -> list[str]:
    """Grafana's label_values(metric{...}, label) as the PromQL that answers it."""
    return [f"group by ({m[3]}) ({m[1]}{m[2] or ''})" for m in map(_variable_match, _variables())]


def _load(url: str, stop: threading.Event) -> None:
    """Short requests back to back, every other one streamed."""
    with httpx.Client(base_url=url, timeout=60) as http:
        i = 0
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"dashboards {i}", "max_tokens": 12, "stream": i % 2 == 0}
            if body["stream"]:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for _ in response.iter_lines():
                        pass
            else:
                http.post("/v1/completions", json=body)
            i += 1


class StateActuator:
    """The operator's actuator without a cluster: the tuner's state, as reconcile would apply it."""

    def __init__(self) -> None:
        self.state = TunerState()

    def observe(self) -> dict[str, PoolView]:
        return views_from_state(SPEC, self.state)

    def apply(self, pool: str, replicas: int | None, knobs: dict[str, float]) -> None:
        self.state.knobs[pool] = {**self.state.knobs.get(pool, {}), **knobs}
        if replicas is not None:
            self.state.replicas[pool] = replicas


def _tune_and_export(tuner: Autotuner, actuator: StateActuator):
    """One run of the operator's tuner daemon: decide from Prometheus, export the outcome."""

    async def run():
        try:
            return await tuner.step(actuator, time.time())
        finally:
            await tuner.source.aclose()

    outcome = asyncio.run(run())
    decision_metrics.record(REF.namespace, REF.inference_service, outcome, SPEC.slo)
    return outcome


def _assert_knob_lines_pair(prometheus: PrometheusProcess) -> None:
    """The "Knob values" panel: each knob the tuner sets has an applied line of the same name."""
    (panel,) = [p for p in fleet_overview()["panels"] if p["title"] == "Knob values"]
    applied, target = ({r["metric"]["knob"] for r in prometheus.query(_concrete(t["expr"]))} for t in panel["targets"])
    assert target and target <= applied, (target, applied)


@pytest.mark.prometheus
def test_every_query_parses_and_returns_data_from_real_servers(tmp_path):
    require_prometheus()
    rules = rules_file()
    for group in rules["groups"]:
        group["interval"] = "1s"  # evaluate now, not in 30 s
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump(rules))
    servers = [ServerProcess("--model", "builtin:tiny", "--served-model-name", "tiny") for _ in PODS]
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        # The operator's metrics endpoint (as `llm-fleet operator --metrics-port` serves it).
        operator_port = free_port()
        exporter, _ = start_http_server(operator_port, addr="127.0.0.1", registry=decision_metrics.REGISTRY)
        stack.callback(decision_metrics.forget, REF.namespace, REF.inference_service)
        stack.callback(exporter.shutdown)
        targets = [
            TargetGroup([s.url.removeprefix("http://")], {**LABELS, "pod": pod})
            for s, pod in zip(servers, PODS, strict=True)
        ]
        targets.append(TargetGroup([f"127.0.0.1:{operator_port}"]))  # its series carry their own labels
        prometheus = stack.enter_context(PrometheusProcess(targets, rule_files=[rules_path]))

        actuator = StateActuator()
        prometheus.wait_for('up{pool="colocated"} == 1', timeout=30)
        # No traffic yet: the daemon's first run, which creates the decision series at 0.
        _tune_and_export(Autotuner(SPEC, PrometheusSource(prometheus.url), {"colocated": REF}), actuator)

        loaders = [threading.Thread(target=_load, args=(s.url, stop)) for s in servers for _ in range(2)]
        for t in loaders:
            t.start()
        stack.callback(lambda: [t.join(60) for t in loaders])
        stack.callback(stop.set)
        prometheus.wait_for("sum(rate(vllm:generation_tokens_total[20s])) > 0", timeout=60)
        prometheus.wait_for("sum(increase(vllm:inter_token_latency_seconds_count[30s])) > 100", timeout=60)
        # A scrape of the series at 0 from just before the decision, so the increase below sees
        # it however long the waits above took on a busy machine.
        prometheus.wait_for("timestamp(llmfleet_tuner_decisions_total) > time() - 15", timeout=60)

        second = _tune_and_export(Autotuner(SPEC, PrometheusSource(prometheus.url), {"colocated": REF}), actuator)
        assert second.decision.changes, second.decision.hold_reason or second.decision.reasons
        # a run after it, with its memory: the fleet's spend against its need spans two runs
        memory = second.decision.memory
        _tune_and_export(Autotuner(SPEC, PrometheusSource(prometheus.url), {"colocated": REF}, memory=memory), actuator)
        # The alerts' window: a scrape of this (busy) process that misses its 1 s timeout only
        # narrows it, while a 30 s window can hold no sample from before the decision at all.
        prometheus.wait_for("sum(increase(llmfleet_tuner_decisions_total[2m])) > 0", timeout=60)

        for query in _variable_queries():
            assert prometheus.query(_concrete(query)), f"template variable without values: {query}"
        empty = [expr for expr in all_queries() if not prometheus.query(_concrete(expr))]  # raises on parse errors
        assert not empty, "queries without data:\n" + "\n".join(empty)
        _assert_knob_lines_pair(prometheus)
        for rule in rules["groups"][0]["rules"]:
            prometheus.wait_for(rule["record"], timeout=30)

        # The alerts' expressions, on the same data: the label joins between the servers' series,
        # the recording rules and the operator's series hold, and only the ITL SLO is violated.
        matched = {rule["alert"] for rule in rules["groups"][1]["rules"] if prometheus.query(rule["expr"])}
        # A scrape that misses its 1 s timeout on a busy machine is a real `up == 0`: not checked here.
        assert matched - {"LLMFleetTargetDown"} == ALERTS_WITH_DATA
