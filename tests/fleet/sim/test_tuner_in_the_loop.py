"""The real tuner on simulated metrics moves each workload shape's knobs the way the shape calls
for, from the same starting point. A synthetic cost profile shaped like builtin:small on a 2-core
CPU; nothing here imports torch (the last test checks that in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmfleet.sim.fleet import SimOptions
from llmfleet.sim.report import print_summary, summarize
from llmfleet.sim.simulate import simulate
from llmfleet.sim.trace import builtin_workload
from tests.fleet.sim.conftest import make_spec

START = {"maxBatchSize": 8, "maxNumBatchedTokens": 256, "batchTimeoutMs": 20}
BOUNDS = {"maxBatchSize": {"min": 2, "max": 64}, "maxNumBatchedTokens": {"min": 64, "max": 4096}}


def final_knobs(result) -> dict[str, float]:
    return {k: result.timeline[-1].pools["colocated"][k] for k in START}


@pytest.mark.parametrize(
    ("workload", "slo", "knob", "direction"),
    [
        ("chat", (400, 200), "batchTimeoutMs", -1),  # short prompts: TTFT-bound, the window shrinks
        ("long-prompt", (1000, 400), "maxNumBatchedTokens", +1),  # prefill-bound: a bigger token budget
        ("creative", (2000, 150), "maxBatchSize", +1),  # long outputs: decode-bound, bigger batches
    ],
)
def test_knobs_move_the_way_the_shape_calls_for(profile, workload, slo, knob, direction) -> None:
    spec = make_spec(
        ttft_ms=slo[0],
        itl_ms=slo[1],
        engine=START,
        bounds=BOUNDS,
        max_replicas=6,
        autotune={"scaleDownStabilizationSeconds": 120},
    )
    requests = builtin_workload(workload, duration_s=300.0, rate_scale=2.0).requests()
    result = simulate(spec, profile, requests, controller="tuner", options=SimOptions(startup_s=30.0))
    moved = final_knobs(result)[knob] - START[knob]
    assert moved * direction > 0, (knob, final_knobs(result), [d.reason for d in result.decisions])
    assert result.conserved
    assert summarize(result)["max_direction_changes_per_window"] <= 1


def test_the_simulator_runs_without_torch(tmp_path) -> None:
    code = """
import sys
from llmfleet.sim.simulate import simulate
from llmfleet.sim.trace import builtin_workload
from tests.fleet.sim.conftest import make_spec, synthetic_profile
result = simulate(make_spec(), synthetic_profile(), builtin_workload("chat", 30.0).requests())
assert result.conserved and result.records
assert "torch" not in sys.modules, "the simulator imported torch"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_summary_says_where_the_tuner_was_held_from_what_the_slos_ask(profile, capsys) -> None:
    """Long prompts at six times their rate on at most one pod: the tuner's ScalingLimited reasons,
    counted over its runs, in the summary and its print, so a spec can be tried before a cluster
    says the same in status."""
    spec = make_spec(ttft_ms=1000, itl_ms=400, engine=START, bounds=BOUNDS, max_replicas=1)
    requests = builtin_workload("long-prompt", duration_s=180.0, rate_scale=6.0).requests()
    result = simulate(spec, profile, requests, controller="tuner", options=SimOptions(startup_s=30.0))
    summary = summarize(result)
    limited = summary["scaling_limited"]["TooManyReplicas"]
    assert 0 < limited["runs"] <= summary["tuner_runs"]
    assert "held at maxReplicas 1" in limited["message"]
    print_summary(result, summary)
    assert "ScalingLimited TooManyReplicas in " in capsys.readouterr().out
