"""The report of a run, on hand-made results: what a minute is judged on, a run with nothing to
judge, and why requests failed."""

from __future__ import annotations

import json

from llmfleet.sim.fleet import SimOptions, SimResult
from llmfleet.sim.metric_source import RequestRecord
from llmfleet.sim.report import per_minute, print_summary, summarize, write_json


def record(arrival: float, status: str, token_times: list[float], detail: str = "") -> RequestRecord:
    return RequestRecord(0, arrival, 16, 4, token_times=token_times, status=status, detail=detail)


def result_of(records: list[RequestRecord], measure_from: float = 0.0) -> SimResult:
    last = max((r.arrival for r in records), default=0.0)
    return SimResult(
        name="t",
        mode="colocated",
        slo_ttft_s=1.0,
        slo_itl_s=1.0,
        controller="fixed",
        end=last + 5.0,
        last_arrival=last,
        records=records,
        timeline=[],
        decisions=[],
        pod_lifetimes=[],
        options=SimOptions(),
        measure_from=measure_from,
    )


def test_a_request_rejected_or_aborted_after_its_first_token_misses_its_minute() -> None:
    for failed in ("aborted", "rejected"):  # a pod killed mid-stream; a decode pod's 400 after the prefill
        result = result_of([record(0.0, "finished", [0.1, 0.2]), record(1.0, failed, [1.1, 1.2])])
        (minute,) = per_minute(result)
        assert minute["met"] is False and minute["ttft_p95_s"] is None  # infinite, written as null
        assert summarize(result)["slo_attainment"] == 0.0


def test_a_run_with_no_minute_judged_has_no_attainment(capsys, tmp_path) -> None:
    result = result_of([record(0.0, "finished", [0.1, 0.2])], measure_from=60.0)  # the warm-up took it all
    summary = summarize(result)
    assert summary["slo_minutes"] == 0 and summary["slo_attainment"] is None
    print_summary(result, summary)
    assert "no minutes judged" in capsys.readouterr().out
    report = json.loads(write_json(result, tmp_path / "r.json", summary).read_text())
    assert report["summary"]["slo_attainment"] is None


def test_the_reasons_for_failures_are_counted_by_kind_and_shown(capsys, tmp_path) -> None:
    too_long = "400 from colocated-{}: This model's maximum context length is 2048 tokens. However, your request has {}"
    records = [
        record(0.0, "rejected", [], too_long.format(1, 3000)),
        record(0.5, "rejected", [], too_long.format(2, 5000)),
        record(1.0, "rejected", [], "429 from colocated-1: the queue is full (8 waiting)"),
        record(2.0, "aborted", [2.1], "colocated-2 killed at the end of its 30 s drain"),
        record(3.0, "finished", [3.1, 3.2]),
    ]
    result = result_of(records)
    summary = summarize(result)
    assert [(r["status"], r["count"]) for r in summary["reasons"]] == [("rejected", 2), ("rejected", 1), ("aborted", 1)]
    first = summary["reasons"][0]
    assert first["reason"].startswith("400 from colocated-N: This model's maximum context length is N tokens")
    assert first["example"] == too_long.format(1, 3000)
    print_summary(result, summary)
    out = capsys.readouterr().out
    assert f"why: 2 rejected, e.g.: {too_long.format(1, 3000)}" in out
    assert "1 aborted: colocated-2 killed at the end of its 30 s drain" in out
    report = json.loads(write_json(result, tmp_path / "r.json", summary).read_text())
    assert report["summary"]["reasons"] == summary["reasons"]


def test_a_parallel_pool_costs_its_devices(capsys) -> None:
    result = result_of([record(0.0, "finished", [0.1, 0.2])])
    result.pod_lifetimes = [("colocated-1", "colocated", 0.0, 60.0), ("colocated-2", "colocated", 30.0, 60.0)]
    summary = summarize(result)
    assert summary["device_minutes"] == summary["replica_minutes"] == 1.5  # one device a replica
    print_summary(result, summary)
    assert "device-minutes" not in capsys.readouterr().out
    result.devices = {"colocated": 4}  # tensor 2 x pipeline 2
    summary = summarize(result)
    assert summary["replica_minutes"] == 1.5 and summary["device_minutes"] == 6.0
    assert summary["device_minutes_by_pool"] == {"colocated": 6.0}
    print_summary(result, summary)
    assert "device-minutes 6.0" in capsys.readouterr().out
