"""Grafana dashboards and Prometheus rules for llm-fleet, generated from one place.

``python -m llmfleet.dashboards`` writes charts/llm-fleet/dashboards/*.json (shipped by the chart
as sidecar ConfigMaps, importable by hand) and charts/llm-fleet/prometheus/*.yaml (recording and
alert rules; the chart ships them as a PrometheusRule). A test checks the committed files equal
this output, and runs every query against a real Prometheus that scraped real servers.

Every series carries ``namespace``, ``inference_service`` and ``pool`` (PodMonitor relabeling in
a cluster, static labels in the local fleet); the dashboards select them with template variables.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from llmfleet.operator import promql

SELECTOR = 'namespace=~"$namespace",inference_service=~"$service",pool=~"$pool"'
POD_SELECTOR = SELECTOR + ',instance=~"$instance"'
TUNER_SELECTOR = 'namespace=~"$namespace",inference_service=~"$service"'
RATE = "$__rate_interval"
E2E = "vllm:e2e_request_latency_seconds"
STEP = "llmfleet_step_duration_seconds"
SCHEDULER = "llmfleet_scheduler_duration_seconds"
KNOBS = "max_batch_size|batch_timeout_ms|max_num_batched_tokens"
DECISIONS = "llmfleet_tuner_decisions_total"

# Queries that read the operator's own metrics (llmfleet_tuner_*): empty where no operator runs
# (the local fleet logs its decisions instead), so the data test checks only that they parse.
OPERATOR_METRICS = ("llmfleet_tuner_",)


# -- building blocks --------------------------------------------------------------------------


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }


def _panel(
    title: str,
    targets: list[tuple[str, str]],
    unit: str,
    x: int,
    y: int,
    *,
    w: int = 12,
    description: str = "",
    thresholds: list[tuple[str, float | None]] | None = None,
) -> dict[str, Any]:
    panel: dict[str, Any] = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]}},
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
    }
    return panel


def _quantiles(metric: str, selector: str, by: str = "pool") -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by}}}}}",
        )
        for q in promql.QUANTILES
    ]


def _slo_line(variable: str) -> tuple[str, str]:
    """The SLO as a flat line (dashboard variables in milliseconds, the panels in seconds)."""
    return f"vector(${variable} / 1000)", "SLO"


def _variables(pod: bool) -> list[dict[str, Any]]:
    def query(name: str, label: str, metric: str, selector: str = "") -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": f"label_values({metric}{{{selector}}}, {label})", "refId": "var"},
            "definition": f"label_values({metric}{{{selector}}}, {label})",
            "current": {"text": "All", "value": "$__all"},
        }

    def slo(name: str, label: str, default: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "textbox",
            "query": default,
            "current": {"text": default, "value": default},
        }

    variables = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
        query("namespace", "namespace", promql.RUNNING),
        query("service", "inference_service", promql.RUNNING, 'namespace=~"$namespace"'),
        query("pool", "pool", promql.RUNNING, 'namespace=~"$namespace",inference_service=~"$service"'),
        slo("ttft_slo_ms", "TTFT p95 SLO (ms)", "500"),
        slo("itl_slo_ms", "ITL p95 SLO (ms)", "100"),
    ]
    if pod:
        variables.append(query("instance", "instance", promql.RUNNING, SELECTOR))
    return variables


def _dashboard(uid: str, title: str, panels: list[dict[str, Any]], *, pod: bool) -> dict[str, Any]:
    annotations = [
        {
            "name": "Tuner decisions",
            "enable": True,
            "iconColor": "orange",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "expr": f"sum by (pool, knob, direction) (changes({DECISIONS}{{{TUNER_SELECTOR}}}[1m])) > 0",
            "titleFormat": "tuner",
            "textFormat": "{{pool}} {{knob}} {{direction}}",
            "step": "30s",
        }
    ]
    for i, panel in enumerate(panels):
        panel["id"] = i + 1
    return {
        "uid": uid,
        "title": title,
        "tags": ["llm-fleet", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": _variables(pod)},
        "annotations": {"list": annotations},
        "panels": panels,
    }


# -- the dashboards ---------------------------------------------------------------------------


def fleet_overview() -> dict[str, Any]:
    s = SELECTOR
    panels = [
        _panel(
            "Requests/s",
            [(f"sum by (pool) (rate({promql.REQUEST_SUCCESS}{{{s}}}[{RATE}]))", "{{pool}}")],
            "reqps",
            0,
            0,
            description="Finished requests per second, per pool.",
        ),
        _panel(
            "Tokens/s",
            [
                (f"sum by (pool) (rate({promql.PROMPT_TOKENS}{{{s}}}[{RATE}]))", "prompt {{pool}}"),
                (f"sum by (pool) (rate({promql.GENERATION_TOKENS}{{{s}}}[{RATE}]))", "generated {{pool}}"),
            ],
            "short",
            12,
            0,
        ),
        _panel(
            "Time to first token",
            [*_quantiles(promql.TTFT, s), _slo_line("ttft_slo_ms")],
            "s",
            0,
            8,
            description="p50/p95/p99 per pool against the InferenceService's TTFT p95 SLO.",
        ),
        _panel(
            "Inter-token latency",
            [*_quantiles(promql.ITL, s), _slo_line("itl_slo_ms")],
            "s",
            12,
            8,
            description="p50/p95/p99 per pool against the ITL p95 SLO.",
        ),
        _panel("End-to-end latency", _quantiles(E2E, s), "s", 0, 16),
        _panel("Queue time", _quantiles(promql.QUEUE_TIME, s), "s", 12, 16),
        _panel(
            "Queue",
            [
                (f"sum by (pool) ({promql.WAITING}{{{s}}})", "waiting {{pool}}"),
                (f"sum by (pool) ({promql.RUNNING}{{{s}}})", "running {{pool}}"),
            ],
            "short",
            0,
            24,
        ),
        _panel(
            "KV cache usage",
            [
                (f"max by (pool) ({promql.KV_USAGE}{{{s}}})", "max {{pool}}"),
                (f"avg by (pool) ({promql.KV_USAGE}{{{s}}})", "mean {{pool}}"),
            ],
            "percentunit",
            12,
            24,
        ),
        _panel(
            "Batch size (running requests per step)",
            [
                (
                    f"sum by (pool) (rate({promql.BATCH_SIZE}_sum{{{s}}}[{RATE}])) / "
                    f"sum by (pool) (rate({promql.BATCH_SIZE}_count{{{s}}}[{RATE}]))",
                    "mean {{pool}}",
                ),
                (f'max by (pool) ({"llmfleet_config_knob"}{{{s},knob="max_batch_size"}})', "maxBatchSize {{pool}}"),
            ],
            "short",
            0,
            32,
        ),
        _panel(
            "Replicas per pool",
            [
                (f"count by (pool) ({promql.RUNNING}{{{s}}})", "serving {{pool}}"),
                (f"max by (pool) (llmfleet_tuner_replicas{{{TUNER_SELECTOR}}})", "tuner {{pool}}"),
            ],
            "short",
            12,
            32,
        ),
        _panel(
            "Knob values",
            [(f'max by (pool, knob) (llmfleet_config_knob{{{s},knob=~"{KNOBS}"}})', "{{pool}} {{knob}}")],
            "short",
            0,
            40,
            description="What the servers applied (live config).",
        ),
        _panel(
            "Tuner decisions",
            [
                (
                    f"sum by (pool, knob, direction) (increase({DECISIONS}{{{TUNER_SELECTOR}}}[5m]))",
                    "{{pool}} {{knob}} {{direction}}",
                ),
                (f"max(llmfleet_tuner_hold{{{TUNER_SELECTOR}}})", "holding"),
            ],
            "short",
            12,
            40,
            description="From the operator's metrics: changes per 5 min, and 1 while holding.",
        ),
    ]
    return _dashboard("llm-fleet-overview", "llm-fleet / Fleet overview", panels, pod=False)


def pod_detail() -> dict[str, Any]:
    s = POD_SELECTOR

    def mean(metric: str) -> str:
        return (
            f"sum by (instance) (rate({metric}_sum{{{s}}}[{RATE}])) / "
            f"sum by (instance) (rate({metric}_count{{{s}}}[{RATE}]))"
        )

    panels = [
        _panel("Engine step time", [*_quantiles(STEP, s, "instance")], "s", 0, 0),
        _panel("Scheduler time per step", [(mean(SCHEDULER), "mean {{instance}}")], "s", 12, 0),
        _panel("Batch size", [(mean(promql.BATCH_SIZE), "mean {{instance}}")], "short", 0, 8),
        _panel("Tokens per step", [(mean(promql.ITERATION_TOKENS), "mean {{instance}}")], "short", 12, 8),
        _panel(
            "Preemptions/s",
            [(f"sum by (instance) (rate({promql.PREEMPTIONS}{{{s}}}[{RATE}]))", "{{instance}}")],
            "short",
            0,
            16,
        ),
        _panel(
            "KV cache usage", [(f"max by (instance) ({promql.KV_USAGE}{{{s}}})", "{{instance}}")], "percentunit", 12, 16
        ),
        _panel("Time to first token", [*_quantiles(promql.TTFT, s, "instance"), _slo_line("ttft_slo_ms")], "s", 0, 24),
        _panel("Inter-token latency", [*_quantiles(promql.ITL, s, "instance"), _slo_line("itl_slo_ms")], "s", 12, 24),
        _panel(
            "Requests",
            [
                (f"sum by (instance) ({promql.RUNNING}{{{s}}})", "running {{instance}}"),
                (f"sum by (instance) ({promql.WAITING}{{{s}}})", "waiting {{instance}}"),
                (f"sum by (instance) (llmfleet_requests_in_flight{{{s}}})", "HTTP in flight {{instance}}"),
            ],
            "short",
            0,
            32,
        ),
        _panel(
            "Applied config generation",
            [
                (f"max by (instance) (llmfleet_config_generation{{{s}}})", "{{instance}}"),
                (
                    f"sum by (instance) (increase(llmfleet_config_errors_total{{{s}}}[1h]))",
                    "rejected files (1h) {{instance}}",
                ),
            ],
            "short",
            12,
            32,
            description="A knob change from the tuner lands as a new generation.",
        ),
    ]
    return _dashboard("llm-fleet-pod", "llm-fleet / Engine per pod", panels, pod=True)


DASHBOARDS = {"fleet-overview.json": fleet_overview, "engine-pod.json": pod_detail}


# -- Prometheus rules -------------------------------------------------------------------------

POOL_LABELS = "namespace, inference_service, pool"


def recording_rules() -> list[dict[str, str]]:
    rules = []
    for name, metric in (("ttft", promql.TTFT), ("itl", promql.ITL), ("queue_time", promql.QUEUE_TIME)):
        for q in (0.5, 0.95, 0.99):
            rules.append(
                {
                    "record": f"llmfleet:{name}_seconds:p{round(q * 100)}_5m",
                    "expr": f"histogram_quantile({q}, sum by (le, {POOL_LABELS}) (rate({metric}_bucket[5m])))",
                }
            )
    for name, metric in (
        ("prompt_tokens", promql.PROMPT_TOKENS),
        ("generation_tokens", promql.GENERATION_TOKENS),
        ("requests", promql.REQUEST_SUCCESS),
    ):
        rules.append({"record": f"llmfleet:{name}:rate5m", "expr": f"sum by ({POOL_LABELS}) (rate({metric}[5m]))"})
    rules.append({"record": "llmfleet:pods:count", "expr": f"count by ({POOL_LABELS}) ({promql.RUNNING})"})
    return rules


def alert_rules() -> list[dict[str, Any]]:
    def alert(name: str, expr: str, minutes: int, severity: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": f"{minutes}m",
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description},
        }

    return [
        alert(
            "LLMFleetTTFTAboveSLO",
            "llmfleet:ttft_seconds:p95_5m > on (namespace, inference_service) group_left "
            'max by (namespace, inference_service) (llmfleet_slo_seconds{kind="ttft"})',
            10,
            "warning",
            "TTFT p95 above its SLO for 10 minutes",
            "{{ $labels.namespace }}/{{ $labels.inference_service }} pool {{ $labels.pool }}: TTFT p95 "
            "{{ $value | humanizeDuration }} over the SLO; the tuner is at its bounds or holding.",
        ),
        alert(
            "LLMFleetITLAboveSLO",
            "llmfleet:itl_seconds:p95_5m > on (namespace, inference_service) group_left "
            'max by (namespace, inference_service) (llmfleet_slo_seconds{kind="itl"})',
            10,
            "warning",
            "ITL p95 above its SLO for 10 minutes",
            "{{ $labels.namespace }}/{{ $labels.inference_service }} pool {{ $labels.pool }}: ITL p95 "
            "{{ $value | humanizeDuration }} over the SLO.",
        ),
        alert(
            "LLMFleetTunerStuck",
            "max by (namespace, inference_service) (llmfleet_tuner_hold) == 1",
            15,
            "warning",
            "The tuner has held for 15 minutes",
            "{{ $labels.namespace }}/{{ $labels.inference_service }}: the tuner holds (stale or missing metrics); "
            "see the TunerActive condition for why.",
        ),
        alert(
            "LLMFleetMetricsStale",
            f"absent_over_time({promql.RUNNING}[5m]) or (count by (namespace, inference_service) "
            "(llmfleet_tuner_replicas > 0) unless count by (namespace, inference_service) "
            f"({promql.RUNNING}))",
            5,
            "critical",
            "No engine metrics for 5 minutes",
            "No vllm:num_requests_running series scraped{{ if $labels.inference_service }} for "
            "{{ $labels.namespace }}/{{ $labels.inference_service }}{{ end }}: the tuner cannot act; "
            "check the PodMonitor and the pods.",
        ),
    ]


def rules_file() -> dict[str, Any]:
    return {
        "groups": [
            {"name": "llm-fleet.recording", "interval": "30s", "rules": recording_rules()},
            {"name": "llm-fleet.alerts", "rules": alert_rules()},
        ]
    }


# -- files ------------------------------------------------------------------------------------


def rendered() -> dict[str, str]:
    """Relative path under charts/llm-fleet -> file content."""
    files = {f"dashboards/{name}": json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}
    header = "# Generated by `python -m llmfleet.dashboards`; edit fleet/dashboards.py instead.\n"
    files["prometheus/rules.yaml"] = header + yaml.safe_dump(rules_file(), sort_keys=False, width=200)
    return files


def all_queries() -> list[str]:
    """Every PromQL expression of the dashboards (panels and annotations)."""
    out = []
    for build in DASHBOARDS.values():
        board = build()
        out += [t["expr"] for p in board["panels"] for t in p["targets"]]
        out += [a["expr"] for a in board["annotations"]["list"]]
    return out


def main(argv: list[str] | None = None) -> int:
    chart = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / "charts" / "llm-fleet")
    for relative, text in rendered().items():
        path = chart / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
