"""The tuner bench's scoring (bench/tuner_scores.py): minutes an unannounced step explains, the
cheapest contender at an attainment, the oracle lower bound and the scale-down lag."""

from llmfleet.bench.tuner_cases import CASES, DAY_S, DAYS, SEASON_CASES, diurnal, draw, spec_for
from llmfleet.bench.tuner_scores import attainment, cheapest_reaching, oracle, scale_down_lag, step_minutes


def test_minutes_within_start_up_and_an_interval_of_a_step_are_set_apart() -> None:
    # a step 330 s into a run measured from 300 s: 30-70 s of its minutes 0 and 1
    assert step_minutes([330.0], 300.0, minutes=5, excused_s=40.0) == {0, 1}
    assert step_minutes([], 300.0, minutes=5, excused_s=40.0) == set()
    assert attainment([True, False, None, True], excluded={1}) == (2, 2)


def test_bursty_has_its_rate_steps_and_the_ramps_none() -> None:
    bursty = next(c for c in CASES if c.workload == "bursty")
    steps = draw(bursty, None).steps
    assert steps == (420.0, 630.0)  # 0.5 -> 1.5 req/s after 120 s, 0.5 -> 3 after 330 s, past the warm-up
    assert draw(next(c for c in CASES if c.workload == "diurnal"), None).steps == ()
    rates = [rate for _, rate in diurnal(None).phases]
    assert min(rates) >= 0.4 and max(rates) == 1.6 and rates.index(1.6) > 10


def test_daily_steps_repeats_its_step_each_day_and_its_spec_knows_the_day() -> None:
    case = next(c for c in CASES if c.workload == "daily-steps")
    drawn = draw(case, None)
    assert drawn.steps == tuple(300.0 + 480.0 + day * DAY_S for day in range(DAYS))  # past the warm-up
    assert spec_for(case).autotune.season_seconds == DAY_S and case.ramp
    assert drawn.requests[-1].arrival_s < 300.0 + DAYS * DAY_S


def test_working_days_step_at_nine_each_whole_day_with_the_season_and_without() -> None:
    with_season, without = SEASON_CASES
    drawn = draw(with_season, 11, quick=True)  # one day
    assert drawn.steps == (drawn.warmup_s + 9 * 3600.0,)  # past the warm-up
    assert 86000.0 < drawn.requests[-1].arrival_s < drawn.warmup_s + 86400.0
    assert spec_for(with_season).autotune.season_seconds == 86400 and with_season.ramp
    assert spec_for(without).autotune.season_seconds == 0 and not without.ramp
    assert with_season.tuner_only and without.tuner_only
    assert not {c.workload for c in SEASON_CASES} & {c.workload for c in CASES}  # not in the default bench


def test_days_long_workloads_run_only_with_tuner_only(capsys) -> None:
    from llmfleet.cli import main

    assert main(["bench", "tuner", "--workloads", "working-days"]) == 2
    assert "days long, run with --tuner-only" in capsys.readouterr().out


def test_the_cheapest_run_that_reaches_an_attainment() -> None:
    runs = [
        {"slo_minutes_met": 9, "replica_minutes": 40.0},
        {"slo_minutes_met": 10, "replica_minutes": 60.0},
        {"slo_minutes_met": 10, "replica_minutes": 50.0},
    ]
    assert cheapest_reaching(runs, 9)["replica_minutes"] == 40.0
    assert cheapest_reaching(runs, 10)["replica_minutes"] == 50.0
    assert cheapest_reaching(runs, 11) is None


def test_the_oracle_takes_each_minutes_fewest_and_pays_start_up_for_each_added_pod() -> None:
    runs = [
        {"replicas_total": 2, "per_minute": [True, False, True, None]},
        {"replicas_total": 4, "per_minute": [True, True, True, None]},
    ]
    rm, counts = oracle(runs, 4, startup_s=30.0, least=1, most=8)
    assert counts == [2, 4, 2, 1]
    assert rm == 2 + 4 + 2 + 1 + 2 * 30.0 / 60.0
    # the runs it is held against paid for 3.5 minutes (a last minute cut short), or for 4.25 (a
    # drain after the last minute's arrivals, paid at that minute's count)
    assert oracle(runs, 4, 30.0, 1, 8, span_minutes=3.5)[0] == 2 + 4 + 2 + 0.5 * 1 + 2 * 30.0 / 60.0
    assert oracle(runs, 4, 30.0, 1, 8, span_minutes=4.25)[0] == 2 + 4 + 2 + 1.25 * 1 + 2 * 30.0 / 60.0
    # a two-request trace: seconds of one pod, not a whole minute, so never above the runs' cost
    assert oracle([{"replicas_total": 1, "per_minute": [True]}], 1, 30.0, 1, 8, span_minutes=0.1)[0] == 0.1


def test_the_scale_down_lag_is_the_longest_time_above_the_need() -> None:
    runs = [(t, {"colocated": (8, 8.0 if t < 100 else 3.0)}) for t in range(0, 300, 10)]
    assert scale_down_lag(runs, 0.0) == 200.0  # 8 held from 100 s to 290 s, last needed at 90 s
    down = [(t, {"colocated": (8 if t < 200 else 3, 8.0 if t < 100 else 3.0)}) for t in range(0, 300, 10)]
    assert scale_down_lag(down, 0.0) == 100.0
    assert scale_down_lag(down, 250.0) == 0.0  # after the measured start, 3 pods for a need of 3


def test_the_summary_shows_the_ratio_and_the_prediction_beside_the_cost() -> None:
    from llmfleet.bench.tuner_eval import SUMMARY_HEADER, summary_rows

    tuner = {"replica_minutes": 60.0, "max_direction_changes_per_window": 1}
    row = {
        "workload": "chat-disagg",
        "seed": None,
        "tuner": tuner,
        "minutes": {"met": 15, "judged": 15, "step_met": 0, "step_judged": 0},
        "hpa": {"slo_minutes_met": 15, "slo_minutes": 15},
        "fixed_at_equal_attainment": {"replica_minutes": 75.0},
        "hpa_at_equal_attainment": None,
        "oracle": {"replica_minutes": 50.0},
        "scale_down_lag_s": 120.0,
        "ratio": {"tuner": [2.42, 2.08], "best_fixed": [2, 3], "within_one": True},
        "prediction": {"missed": 1, "missed_reactive": 2, "extra_replica_minutes": 0.019, "met": True},
    }
    (cells,) = summary_rows([row])
    shown = dict(zip(SUMMARY_HEADER, cells, strict=True))
    assert shown["vs fixed (equal)"] == "0.80x" and shown["vs HPA (equal)"] == "-" and shown["vs oracle"] == "1.20x"
    assert shown["P:D vs best"] == "2.4:2.1 vs 2:3"
    assert shown["prediction vs reactive"] == "1 vs 2 missed, +1.9%"


def test_the_fixed_pairs_run_at_every_combination_of_their_pools_knobs() -> None:
    """A hand-set disaggregated fleet picks its prefill budget and decode batch cap too, so the
    cheapest fixed pair is searched over them, and each pool gets only its own knob."""
    from llmfleet.bench.tuner_cases import spec_for
    from llmfleet.bench.tuner_eval import pair_knob_sets

    case = next(c for c in CASES if c.workload == "chat-disagg")
    sets = pair_knob_sets(case)
    assert len(sets) == 9 and {s["decode"]["maxBatchSize"] for s in sets} == {8, 16, 32}
    assert {s["prefill"]["maxNumBatchedTokens"] for s in sets} == {256, 2048, 4096}
    assert pair_knob_sets(case, quick=True) == [
        {"prefill": {"maxNumBatchedTokens": 256}, "decode": {"maxBatchSize": 8}}
    ]
    spec = spec_for(case, replicas=(2, 3), autotune=False, pool_knobs=sets[-1])
    assert (
        spec.pools["decode"].engine["maxBatchSize"] == 32 and spec.pools["decode"].engine["maxNumBatchedTokens"] == 256
    )
    assert (
        spec.pools["prefill"].engine["maxNumBatchedTokens"] == 4096
        and spec.pools["prefill"].engine["maxBatchSize"] == 8
    )
    assert pair_knob_sets(next(c for c in CASES if c.workload == "chat")) == [{}]  # colocated: its own grid


def test_tuner_only_runs_the_tuner_alone_and_totals_its_draws(tmp_path, monkeypatch, capsys) -> None:
    """`bench tuner --tuner-only`: the tuner's runs scored as the full bench scores them, without
    the fixed grid, HPA and oracle (which do not depend on the law)."""
    import json

    from llmfleet.bench import tuner_eval
    from llmfleet.cli import main

    def full(*args, **kwargs):
        raise AssertionError("the full evaluation ran")

    monkeypatch.setattr(tuner_eval, "evaluate", full)
    argv = ["bench", "tuner", "--tuner-only", "--quick", "--workloads", "chat", "--workers", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== the tuner alone (--tuner-only" in out
    assert "draws meeting >= 99% of their minutes: " in out and "/1; minutes met " in out
    (row,) = json.loads((tmp_path / "tuner_alone.json").read_text())["workloads"]
    assert row["workload"] == "chat" and row["predictive"] and row["minutes"]["judged"] == 5


def test_the_tuner_and_the_hpa_start_where_the_case_says_and_a_fixed_fleet_at_its_own_size() -> None:
    """`bench tuner --trace --initial-replicas N`: your fleet as it runs today, for the tuner and
    the HPA alike; the bench's own workloads start at one pod."""
    import dataclasses

    from llmfleet.bench.tuner_cases import spec_for

    chat = next(c for c in CASES if c.workload == "chat")
    assert spec_for(chat).pools["colocated"].initial_replicas == 1
    yours = dataclasses.replace(chat, initial_replicas=5)
    assert spec_for(yours).pools["colocated"].initial_replicas == 5
    assert spec_for(yours, replicas=3, autotune=False).pools["colocated"].initial_replicas == 3
    disagg = dataclasses.replace(next(c for c in CASES if c.workload == "chat-disagg"), initial_replicas=2)
    assert {p.initial_replicas for p in spec_for(disagg).pools.values()} == {2}


def test_seeds_are_read_as_draws_in_the_order_given() -> None:
    from argparse import Namespace

    from llmfleet.bench.arguments import seeds
    from llmfleet.bench.tuner_eval import seeds_of

    assert seeds("default, 11,12,") == [None, 11, 12]
    assert seeds_of(Namespace(seeds=seeds("13,default"), seed=None)) == [13, None]
    assert seeds_of(Namespace(seeds=None, seed=7)) == [7]
