"""Grafana dashboards and Prometheus rules for llm-fleet, generated from one place.

``python -m llmfleet.operator.deploy.dashboards`` writes charts/llm-fleet/dashboards/*.json (shipped by the chart
as sidecar ConfigMaps, importable by hand) and charts/llm-fleet/prometheus/*.yaml (recording and
alert rules; the chart ships them as a PrometheusRule). A test checks the committed files equal
this output, and runs every query against a real Prometheus that scraped real servers and the
operator's tuner metrics.

Every server series carries ``namespace``, ``inference_service``, ``pool`` and ``pod`` (PodMonitor
relabeling in a cluster); the dashboards select them with template variables. The operator's own
series (``llmfleet_tuner_*``, ``llmfleet_slo_seconds``) carry ``namespace`` and
``inference_service`` themselves, so its scrape job must keep them (``honor_labels: true``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from llmfleet.operator.metrics import promql
from llmfleet.operator.tuner.decision import KNOB_FIELDS, OUT_OF_REACH, TOO_MANY

POOL_LABELS = "namespace, inference_service, pool"  # a pool name is unique only within its service
SERVICE_LABELS = "namespace, inference_service"
POOL_LEGEND = "{{inference_service}}/{{pool}}"
SELECTOR = 'namespace=~"$namespace",inference_service=~"$service",pool=~"$pool"'
POD_SELECTOR = SELECTOR + ',pod=~"$pod"'  # the PodMonitor copies the pod name into `pod`
# For the operator's per-service series (llmfleet_tuner_hold, llmfleet_slo_seconds), which carry no
# pool; its per-pool ones (decisions, knob values, replicas) take SELECTOR like the servers'.
SERVICE_SELECTOR = 'namespace=~"$namespace",inference_service=~"$service"'
# The template variables' source: every role exports it, the router too (it has no engine gauges).
ROLE_INFO = "llmfleet_role_info"
RATE = "$__rate_interval"
E2E = "vllm:e2e_request_latency_seconds"
PROMPT_LENGTH = promql.PROMPT_LENGTH
GENERATION_LENGTH = "vllm:request_generation_tokens"
STEP = "llmfleet_step_duration_seconds"
SCHEDULER = "llmfleet_scheduler_duration_seconds"
KNOBS = "|".join(KNOB_FIELDS.values())  # the tuned knobs, as the servers name them
DECISIONS = "llmfleet_tuner_decisions_total"
SLO = "llmfleet_slo_seconds"  # exported by the operator (operator/decision_metrics.py) with its tuner on


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


def _quantiles(metric: str, selector: str, by: str = POOL_LABELS, legend: str = POOL_LEGEND) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in promql.QUANTILES
    ]


def _per_pool(aggregation: str, expr: str) -> str:
    """One series per pool of each InferenceService: pools of two services share names."""
    return f"{aggregation} by ({POOL_LABELS}) ({expr})"


def _spec_knob_names(expr: str) -> str:
    """The servers' knob labels (EngineConfig fields) renamed to the spec's, which the tuner uses."""
    for spec_name, field in KNOB_FIELDS.items():
        expr = f'label_replace({expr}, "knob", "{spec_name}", "knob", "{field}")'
    return expr


def _slo_line(kind: str) -> tuple[str, str]:
    """The SLO as flat lines: each selected InferenceService's, as the operator exports them, else the
    dashboard's own variable (milliseconds; the panels are in seconds). `or on ()`: the variable only
    where no service's SLO is exported."""
    exported = f'max by ({SERVICE_LABELS}) ({SLO}{{{SERVICE_SELECTOR},kind="{kind}"}})'
    return f"{exported} or on () vector(${kind}_slo_ms / 1000)", "SLO {{inference_service}}"


def _variables(pod: bool) -> list[dict[str, Any]]:
    def query(name: str, label: str, metric: str, selector: str = "") -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "refresh": 2,
            "includeAll": True,
            "allValue": ".*",  # not a regex of every value: stays short on a large fleet
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
        query("namespace", "namespace", ROLE_INFO),
        query("service", "inference_service", ROLE_INFO, 'namespace=~"$namespace"'),
        query("pool", "pool", ROLE_INFO, SERVICE_SELECTOR),
        # Only where the operator exports no llmfleet_slo_seconds (its tuner is off, or no operator).
        slo("ttft_slo_ms", "TTFT p95 SLO (ms), if not exported", "500"),
        slo("itl_slo_ms", "ITL p95 SLO (ms), if not exported", "100"),
    ]
    if pod:
        variables.append(query("pod", "pod", ROLE_INFO, SELECTOR))
    return variables


def decision_annotation() -> str:
    """Decisions in the last minute: counter changes, plus series born at 1 (the operator pre-creates
    each pool's series at 0, but a decision in its very first run creates and counts in one go)."""
    d = f"{DECISIONS}{{{SELECTOR}}}"
    return f"sum by ({POOL_LABELS}, knob, direction) (changes({d}[1m]) > 0 or ({d} > 0 unless {d} offset 1m))"


def _dashboard(uid: str, title: str, panels: list[dict[str, Any]], *, pod: bool) -> dict[str, Any]:
    annotations = [
        {
            "name": "Tuner decisions",
            "enable": True,
            "iconColor": "orange",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "expr": decision_annotation(),
            "titleFormat": "tuner",
            "textFormat": f"{POOL_LEGEND} {{{{knob}}}} {{{{direction}}}}",
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
    s, pool = SELECTOR, POOL_LEGEND
    panels = [
        _panel(
            "Requests/s",
            [(_per_pool("sum", f"rate({promql.REQUEST_SUCCESS}{{{s}}}[{RATE}])"), pool)],
            "reqps",
            0,
            0,
            description="Finished requests per second, per pool.",
        ),
        _panel(
            "Tokens/s",
            [
                (_per_pool("sum", f"rate({promql.PROMPT_TOKENS}{{{s}}}[{RATE}])"), f"prompt {pool}"),
                (_per_pool("sum", f"rate({promql.GENERATION_TOKENS}{{{s}}}[{RATE}])"), f"generated {pool}"),
            ],
            "short",
            12,
            0,
        ),
        _panel(
            "Time to first token",
            [*_quantiles(promql.TTFT, s), _slo_line("ttft")],
            "s",
            0,
            8,
            description="p50/p95/p99 per pool against the InferenceService's TTFT p95 SLO: what clients see "
            "is a colocated pool's, or in disaggregated mode the router's (the tuner holds prefill pools to the "
            "SLO less what a decode server adds).",
        ),
        _panel(
            "Inter-token latency",
            [*_quantiles(promql.ITL, s), _slo_line("itl")],
            "s",
            12,
            8,
            description="p50/p95/p99 per pool against the ITL p95 SLO (the tuner's: colocated and decode pools).",
        ),
        _panel("End-to-end latency", _quantiles(E2E, s), "s", 0, 16),
        _panel("Queue time", _quantiles(promql.QUEUE_TIME, s), "s", 12, 16),
        _panel(
            "Queue",
            [
                (_per_pool("sum", f"{promql.WAITING}{{{s}}}"), f"waiting {pool}"),
                (_per_pool("sum", f"{promql.RUNNING}{{{s}}}"), f"running {pool}"),
            ],
            "short",
            0,
            24,
        ),
        _panel(
            "KV cache usage",
            [
                (_per_pool("max", f"{promql.KV_USAGE}{{{s}}}"), f"max {pool}"),
                (_per_pool("avg", f"{promql.KV_USAGE}{{{s}}}"), f"mean {pool}"),
            ],
            "percentunit",
            12,
            24,
        ),
        _panel(
            "Batch size (running requests per step)",
            [
                (
                    f"{_per_pool('sum', f'rate({promql.BATCH_SIZE}_sum{{{s}}}[{RATE}])')} / "
                    f"{_per_pool('sum', f'rate({promql.BATCH_SIZE}_count{{{s}}}[{RATE}])')}",
                    f"mean {pool}",
                ),
                (_per_pool("max", f'llmfleet_config_knob{{{s},knob="max_batch_size"}}'), f"maxBatchSize {pool}"),
            ],
            "short",
            0,
            32,
        ),
        _panel(
            "Replicas per pool",
            [
                (_per_pool("count", f"{ROLE_INFO}{{{s}}}"), f"serving {pool}"),
                (_per_pool("max", f"llmfleet_tuner_replicas{{{s}}}"), f"tuner {pool}"),
            ],
            "short",
            12,
            32,
        ),
        _panel(
            "Knob values",
            [
                (
                    _spec_knob_names(f'max by ({POOL_LABELS}, knob) (llmfleet_config_knob{{{s},knob=~"{KNOBS}"}})'),
                    f"applied {pool} {{{{knob}}}}",
                ),
                (
                    f'max by ({POOL_LABELS}, knob) (llmfleet_tuner_knob_value{{{s},knob!="replicas"}})',
                    f"tuner {pool} {{{{knob}}}}",
                ),
            ],
            "short",
            0,
            40,
            description="What the servers applied (live config), and the tuner's targets (operator metrics), "
            "both under the spec's knob names. Applied lags the target by one config rollout.",
        ),
        _panel(
            "Tuner decisions",
            [
                (
                    f"sum by ({POOL_LABELS}, knob, direction) (increase({DECISIONS}{{{s}}}[5m]))",
                    f"{pool} {{{{knob}}}} {{{{direction}}}}",
                ),
                (
                    f"max by ({SERVICE_LABELS}) (llmfleet_tuner_hold{{{SERVICE_SELECTOR}}})",
                    "holding {{inference_service}}",
                ),
                (
                    f"max by ({SERVICE_LABELS}) (llmfleet_tuner_observe_mode{{{SERVICE_SELECTOR}}})",
                    "observe mode {{inference_service}}",
                ),
                (
                    f"max by ({POOL_LABELS}, reason) (llmfleet_tuner_scaling_limited{{{s}}})",
                    f"limited {pool} {{{{reason}}}}",
                ),
            ],
            "short",
            12,
            40,
            description="From the operator's metrics: changes per 5 min, 1 while holding, 1 in observe mode "
            "(autotune.mode: observe: the changes are what the tuner would have made), and 1 while a pool's "
            "replicas are held from what its SLOs ask, by the ScalingLimited condition's reason.",
        ),
        _panel(
            "Fleet cost: replica-minutes run vs needed",
            [
                (
                    f'max by ({POOL_LABELS}) (llmfleet_tuner_replica_minutes{{{s},kind="spent"}})',
                    f"run {pool}",
                ),
                (
                    f'max by ({POOL_LABELS}) (llmfleet_tuner_replica_minutes{{{s},kind="needed"}})',
                    f"needed {pool}",
                ),
            ],
            "short",
            0,
            48,
            description="Over the tuner's trailing 10 minutes: the replica-minutes each pool ran, and those the "
            "tuner's own demand estimate (and latency projection) said it needed.",
        ),
        _panel(
            "Fleet cost: excess",
            [(_per_pool("max", f"llmfleet_tuner_excess_ratio{{{s}}}"), f"excess {pool}")],
            "short",
            12,
            48,
            description="Replica-minutes run over those needed (1 = no excess), per pool, over the last 10 minutes.",
        ),
    ]
    return _dashboard("llm-fleet-overview", "llm-fleet / Fleet overview", panels, pod=False)


def pod_detail() -> dict[str, Any]:
    s = POD_SELECTOR

    def quantiles(metric: str) -> list[tuple[str, str]]:
        return _quantiles(metric, s, "pod", "{{pod}}")

    def mean(metric: str) -> str:
        return f"sum by (pod) (rate({metric}_sum{{{s}}}[{RATE}])) / sum by (pod) (rate({metric}_count{{{s}}}[{RATE}]))"

    panels = [
        _panel("Engine step time", [*quantiles(STEP)], "s", 0, 0),
        _panel("Scheduler time per step", [(mean(SCHEDULER), "mean {{pod}}")], "s", 12, 0),
        _panel("Batch size", [(mean(promql.BATCH_SIZE), "mean {{pod}}")], "short", 0, 8),
        _panel("Tokens per step", [(mean(promql.ITERATION_TOKENS), "mean {{pod}}")], "short", 12, 8),
        _panel(
            "Preemptions/s",
            [
                (f"sum by (pod) (rate({promql.PREEMPTIONS}{{{s}}}[{RATE}]))", "KV {{pod}}"),
                (f"sum by (pod) (rate({promql.BATCH_SHED}{{{s}}}[{RATE}]))", "batch cut {{pod}}"),
            ],
            "short",
            0,
            16,
        ),
        _panel("KV cache usage", [(f"max by (pod) ({promql.KV_USAGE}{{{s}}})", "{{pod}}")], "percentunit", 12, 16),
        _panel("Time to first token", [*quantiles(promql.TTFT), _slo_line("ttft")], "s", 0, 24),
        _panel("Inter-token latency", [*quantiles(promql.ITL), _slo_line("itl")], "s", 12, 24),
        _panel(
            "Requests",
            [
                (f"sum by (pod) ({promql.RUNNING}{{{s}}})", "running {{pod}}"),
                (f"sum by (pod) ({promql.WAITING}{{{s}}})", "waiting {{pod}}"),
                (f"sum by (pod) (llmfleet_requests_in_flight{{{s}}})", "HTTP in flight {{pod}}"),
            ],
            "short",
            0,
            32,
        ),
        _panel(
            "Applied config generation",
            [
                (f"max by (pod) (llmfleet_config_generation{{{s}}})", "{{pod}}"),
                (
                    f"sum by (pod) (increase(llmfleet_config_errors_total{{{s}}}[1h]))",
                    "rejected files (1h) {{pod}}",
                ),
            ],
            "short",
            12,
            32,
            description="A knob change from the tuner lands as a new generation.",
        ),
        _panel("End-to-end latency", quantiles(E2E), "s", 0, 40),
        _panel("Queue time", quantiles(promql.QUEUE_TIME), "s", 12, 40),
        _panel(
            "Prompt length",
            quantiles(PROMPT_LENGTH),
            "short",
            0,
            48,
            description="Tokens per finished request's prompt: the shape the budget and the pool ratio follow.",
        ),
        _panel(
            "Generation length",
            quantiles(GENERATION_LENGTH),
            "short",
            12,
            48,
            description="Tokens generated per finished request: long outputs call for bigger batches.",
        ),
        _panel(
            "Prefix cache hit rate",
            [
                (
                    f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{s}}}[{RATE}])) / "
                    f"sum by (pod) (rate(vllm:prefix_cache_queries_total{{{s}}}[{RATE}]))",
                    "{{pod}}",
                )
            ],
            "percentunit",
            0,
            56,
            description="Prompt tokens found in the prefix cache, of those looked up: their KV is not computed.",
        ),
    ]
    return _dashboard("llm-fleet-pod", "llm-fleet / Engine per pod", panels, pod=True)


DASHBOARDS = {"fleet-overview.json": fleet_overview, "engine-pod.json": pod_detail}


# -- Prometheus rules -------------------------------------------------------------------------

# A p95 SLO lets 5% of observations exceed the threshold: that is the error budget. Burning it B
# times too fast means a fraction 0.05*B over the threshold, i.e. the (1 - 0.05*B) quantile above
# it, so burn rates come from the histograms we already have. The page follows the SRE workbook's
# multiwindow rule: burn rate 14.4 over 1 h (2% of a 30-day budget), still burning over 5 min.
BUDGET = 0.05
FAST_BURN = 14.4
FAST_BURN_QUANTILE = round(1 - BUDGET * FAST_BURN, 2)  # 0.28
SLO_KINDS = {"ttft": ("TTFT", promql.TTFT), "itl": ("ITL", promql.ITL)}
# The pools each SLO is judged on: where clients see it. TTFT on colocated pools and, in
# disaggregated mode, on the router, which relays the decode server's first token after the
# prefill, the KV fetch and any wait for a decode slot (the tuner holds the prefill pool to the
# SLO less what a decode server adds, operator/tuner/law.py); ITL where tokens are generated.
# Every mode has routers: a fleet with a colocated pool is judged on it alone (_judged).
SLO_POOLS = {"ttft": "colocated|router", "itl": "colocated|decode"}
# Short, so "no decision for 15 minutes" is the alert's `for:`, not window + `for:` (2m: two
# scrapes of the operator even at a 1-minute scrape interval).
DECISION_WINDOW = "2m"
# "No engine step for 5 minutes": this window plus the alert's 3-minute `for:`.
STALL_WINDOW = "2m"
# A target that answered a scrape within this window and no longer does is down; one that never
# has is still loading its model.
TARGET_SEEN_WINDOW = "1h"


def _quantile_rule(name: str, metric: str, q: float, window: str, selector: str = "") -> dict[str, str]:
    series = f"{metric}_bucket{{{selector}}}" if selector else f"{metric}_bucket"
    return {
        "record": f"llmfleet:{name}_seconds:p{round(q * 100)}_{window}",
        "expr": f"histogram_quantile({q:g}, sum by (le, {POOL_LABELS}) (rate({series}[{window}])))",
    }


def recording_rules() -> list[dict[str, str]]:
    rules = [
        _quantile_rule(name, metric, q, "5m")
        for name, metric in promql.LATENCY_HISTOGRAMS.items()
        for q in promql.QUANTILES
    ]
    for kind, (_, metric) in SLO_KINDS.items():
        pools = f'pool=~"{SLO_POOLS[kind]}"'  # burn rates only feed the alerts
        rules += [_quantile_rule(kind, metric, FAST_BURN_QUANTILE, window, pools) for window in ("5m", "1h")]
    for name, metric in (
        ("prompt_tokens", promql.PROMPT_TOKENS),
        ("generation_tokens", promql.GENERATION_TOKENS),
        ("requests", promql.REQUEST_SUCCESS),
    ):
        rules.append({"record": f"llmfleet:{name}:rate5m", "expr": f"sum by ({POOL_LABELS}) (rate({metric}[5m]))"})
    rules.append({"record": "llmfleet:pods:count", "expr": f"count by ({POOL_LABELS}) ({promql.RUNNING})"})
    return rules


def _judged(record: str, kind: str) -> str:
    """A recorded quantile on the pools its SLO is judged on. TTFT: the colocated pool, else the
    router (a disaggregated fleet's), never both for one service, which would alert twice."""
    if kind != "ttft":
        return f'{record}{{pool=~"{SLO_POOLS[kind]}"}}'
    colocated = f'{record}{{pool="colocated"}}'
    return f'({colocated} or ({record}{{pool="router"}} unless on ({SERVICE_LABELS}) {colocated}))'


def _over_slo(record: str, kind: str) -> str:
    """A pool's recorded quantile where it exceeds its InferenceService's SLO (pool labels kept), for
    the pools the SLO is judged on."""
    quantile = _judged(record, kind)
    return f'{quantile} > on ({SERVICE_LABELS}) group_left max by ({SERVICE_LABELS}) ({SLO}{{kind="{kind}"}})'


def alert_rules() -> list[dict[str, Any]]:
    def alert(name: str, expr: str, minutes: int, severity: str, summary: str, description: str) -> dict[str, Any]:
        return {
            "alert": name,
            "expr": expr,
            "for": f"{minutes}m",
            "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description},
        }

    where = "{{ $labels.namespace }}/{{ $labels.inference_service }} pool {{ $labels.pool }}"
    burn = f"p{round(FAST_BURN_QUANTILE * 100)}"
    alerts = []
    for kind, (name, _) in SLO_KINDS.items():
        alerts += [
            alert(
                f"LLMFleet{name}AboveSLO",
                _over_slo(f"llmfleet:{kind}_seconds:p95_5m", kind),
                10,
                "warning",
                f"{name} p95 above its SLO for 10 minutes",
                f"{where}: {name} p95 {{{{ $value | humanizeDuration }}}} over the SLO; the tuner is at its "
                "bounds or holding.",
            ),
            alert(
                f"LLMFleet{name}ErrorBudgetFastBurn",
                f"({_over_slo(f'llmfleet:{kind}_seconds:{burn}_1h', kind)}) and on ({POOL_LABELS}) "
                f"({_over_slo(f'llmfleet:{kind}_seconds:{burn}_5m', kind)})",
                2,
                "critical",
                f"{name} error budget burning {FAST_BURN:g}x too fast",
                f"{where}: over {round(BUDGET * FAST_BURN * 100)}% of {name} observations exceed the SLO over the "
                f"last hour and the last 5 minutes (the hour's {burn} is {{{{ $value | humanizeDuration }}}}); "
                "a 30-day error budget lasts 2 days at this rate.",
            ),
        ]
    violating = " or ".join(f"({_over_slo(f'llmfleet:{kind}_seconds:p95_5m', kind)})" for kind in SLO_KINDS)
    alerts += [
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
            "LLMFleetTunerIdleWhileViolating",
            f"max by ({POOL_LABELS}) ({violating}) "
            f"unless on ({SERVICE_LABELS}) (sum by ({SERVICE_LABELS}) (increase({DECISIONS}[{DECISION_WINDOW}])) > 0) "
            f"and on ({SERVICE_LABELS}) (max by ({SERVICE_LABELS}) (llmfleet_tuner_hold) == 0)",
            15,
            "warning",
            "The SLO is violated and the tuner has changed nothing for 15 minutes",
            f"{where}: p95 TTFT or ITL over the SLO while the tuner runs but decides nothing: every knob is at "
            "its bound and the pool at maxReplicas (raise them, or add capacity), or the SLO is out of reach.",
        ),
        alert(
            "LLMFleetScalingLimited",
            # seen in every 5 minutes: a run whose window reads under the limit does not restart the 15
            f"max by ({POOL_LABELS}, reason) "
            f'(max_over_time(llmfleet_tuner_scaling_limited{{reason=~"{TOO_MANY}|{OUT_OF_REACH}"}}[5m])) == 1',
            15,
            "warning",
            "The tuner cannot scale to what the SLO asks",
            f"{where}: {{{{ $labels.reason }}}} for 15 minutes: the replicas the SLOs ask for are above "
            "maxReplicas, or no replica count meets an SLO; the ScalingLimited condition says which and what to do.",
        ),
        # Per pool: one pool without series starves the tuner while another reports. Only pools the
        # tuner runs: without it nothing says what should run (no fleet is no fault), and
        # LLMFleetTargetDown covers pods that are there but cannot be scraped.
        alert(
            "LLMFleetMetricsStale",
            f"max by ({POOL_LABELS}) (llmfleet_tuner_replicas > 0) "
            f"unless on ({POOL_LABELS}) count by ({POOL_LABELS}) ({promql.RUNNING})",
            15,  # longer than a pod may take to load its model before it serves /metrics (600 s by default)
            "critical",
            "No engine metrics for 15 minutes",
            f"{where} should run pods, but Prometheus has no {promql.RUNNING} series for it: the tuner cannot "
            "act; check the PodMonitor and the pods.",
        ),
        # Only a pod that has been scraped: a server opens its ports once its model is loaded, and
        # a download or a load may take longer than 5 minutes (the startup probe bounds it).
        alert(
            "LLMFleetTargetDown",
            f'up{{inference_service!=""}} == 0 and on (job, instance) max_over_time(up[{TARGET_SEEN_WINDOW}]) == 1',
            5,
            "warning",
            "A fleet pod cannot be scraped",
            f"{where}: Prometheus has failed to scrape {{{{ $labels.instance }}}} for 5 minutes, after scraping "
            "it before.",
        ),
        alert(
            "LLMFleetEngineStalled",
            f"({promql.RUNNING} + {promql.WAITING} > 0) "
            f"unless on (job, instance) (rate({STEP}_count[{STALL_WINDOW}]) > 0)",
            3,
            "critical",
            "An engine has requests but runs no steps",
            f"{where}: {{{{ $labels.instance }}}} holds requests but has run no engine step for 5 minutes "
            "(engine thread stuck, or a step that never returns); its clients are hanging.",
        ),
    ]
    return alerts


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
    header = (
        "# Generated by `python -m llmfleet.operator.deploy.dashboards`; edit operator/deploy/dashboards.py instead.\n"
    )
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
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m llmfleet.operator.deploy.dashboards", description="Write the Grafana dashboards."
    )
    default = Path(__file__).resolve().parents[2] / "charts" / "llm-fleet"  # the repository root
    parser.add_argument("chart", nargs="?", type=Path, default=default, help="chart directory (default: %(default)s)")
    chart = parser.parse_args(argv).chart
    for relative, text in rendered().items():
        path = chart / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
