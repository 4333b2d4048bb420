"""sim-fidelity's reading of the machine's speed from a real run's steps (the rest needs torch)."""

from __future__ import annotations

import pytest

from llmfleet.bench.sim_fidelity import machine_speed
from llmfleet.sim.cost_model import CostModel, StepFeatures

DECODE = StepFeatures(tokens=1, seqs=1, decode_groups=1, kv_read=256, prefill_attn=0, prefills=0)
COST = CostModel({"intercept": 0.02, "tokens": 1e-3})  # a decode step: 21 ms


def test_the_run_slowdown_is_measured_over_modelled_time() -> None:
    steps = [(DECODE, 0.021 * 1.2)] * 500
    speed = machine_speed(steps, COST)
    assert speed["slowdown"] == pytest.approx(1.2)
    assert speed["span_p10"] == pytest.approx(1.2) and speed["span_p90"] == pytest.approx(1.2)


def test_drift_within_the_run_shows_in_the_spans() -> None:
    # 10.5 s at the profile's speed, then 21 s at half of it: spans of 5 s see both
    steps = [(DECODE, 0.021)] * 500 + [(DECODE, 0.042)] * 500
    speed = machine_speed(steps, COST)
    assert speed["slowdown"] == pytest.approx(1.5)
    assert speed["span_p10"] == pytest.approx(1.0) and speed["span_p90"] == pytest.approx(2.0)


def test_no_steps_means_no_slowdown() -> None:
    assert machine_speed([], COST) == {"slowdown": 1.0, "span_p10": 1.0, "span_p90": 1.0}


def test_calibrate_first_measures_the_dtype_asked_for(tmp_path, monkeypatch, capsys) -> None:
    from llmfleet.bench import sim_fidelity
    from llmfleet.cli import main
    from llmfleet.sim import calibrate

    asked = {}

    def measured(model, grid, **options):
        asked.update(options, grid=grid)
        raise SystemExit(0)  # what was asked for is all this test needs

    monkeypatch.setattr(calibrate, "calibrate", measured)
    monkeypatch.setattr(sim_fidelity, "wait_quiet", lambda *a: None)
    with pytest.raises(SystemExit):
        main(
            [
                "bench",
                "sim-fidelity",
                "--quick",
                "--calibrate",
                "--dtype",
                "float32",
                "--model",
                "builtin:tiny",
                "--profile",
                str(tmp_path / "p.json"),
                "--out",
                str(tmp_path),
            ]
        )
    assert asked["dtype"] == "float32" and asked["grid"] is calibrate.GRIDS["quick"]
    assert "(quick grid, dtype float32)" in capsys.readouterr().out
