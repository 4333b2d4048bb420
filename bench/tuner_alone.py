"""`llm-fleet bench tuner --tuner-only`: the tuner's own runs on every draw, without the fixed
grid, the HPA targets and the oracle that the full bench scores it against.

Those runs do not depend on the control law, so a change to the law shows in the tuner's runs
alone: minutes met (an unannounced step's minutes set apart, as the full bench sets them),
replica-minutes, direction changes, the scale-down lag and, on the ramps, the forecast against
the reactive law. On two processes that takes under a minute for the 27 draws, where the full
bench takes about 24; the checks against fixed fleets and HPA come from a full run once a
change looks worth keeping."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from llmfleet.bench.tuner_cases import Case, Drawn, draw
from llmfleet.bench.tuner_eval import ATTAINMENT_TARGET, minutes_cell, prediction_cell, prediction_check, tuner_run
from llmfleet.bench.tuner_scores import judged_minutes, reaches, scale_down_lag

HEADER = ["workload", "draw", "minutes met", "replica-min", "dir. changes", "down lag", "prediction vs reactive"]


def run(
    cases: Sequence[Case],
    seeds: Sequence[int | None],
    cost,
    startup_s: float,
    workers: int | None,
    out_dir: Path,
    quick: bool = False,
    draws: Mapping[tuple[str, int | None], Drawn] | None = None,
) -> list[dict[str, Any]]:
    """Each case and draw under the tuner, and on the ramps under its reactive law alone, run and
    scored as the full bench (tuner_eval.py) runs and scores it; print the table and totals,
    write tuner_alone.json. A draw found in ``draws`` (by workload and seed) is used as it is;
    the others are drawn in their jobs."""
    draws = draws or {}
    jobs = [(case, seed, True) for seed in seeds for case in cases]
    jobs += [(case, seed, False) for seed in seeds for case in cases if case.ramp]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        scored = list(
            pool.map(
                _scored,
                *zip(*[(c, s, p, cost, startup_s, quick, draws.get((c.workload, s))) for c, s, p in jobs], strict=True),
            )
        )
    reactive = {(r["workload"], r["seed"]): r for r in scored if not r["predictive"]}
    rows = []
    for row in (r for r in scored if r["predictive"]):
        alone = reactive.get((row["workload"], row["seed"]))
        row["prediction"] = prediction_check(row["run"], None if alone is None else alone["run"])
        rows.append(row)
    for row in scored:
        del row["run"]
    print_rows(rows)
    (out_dir / "tuner_alone.json").write_text(json.dumps({"workloads": scored}, indent=1, default=str) + "\n")
    print(f"wrote {out_dir / 'tuner_alone.json'}")
    return rows


def _scored(
    case: Case,
    seed: int | None,
    predictive: bool,
    cost,
    startup_s: float,
    quick: bool,
    drawn: Drawn | None = None,
) -> dict[str, Any]:
    """One tuner run and its scores; ``run`` keeps what the prediction check reads."""
    drawn = drawn or draw(case, seed, quick)
    result = tuner_run(case, cost, drawn.requests, startup_s, drawn.warmup_s, predictive)
    excused_s = startup_s + float(case.autotune["intervalSeconds"])
    return {
        "workload": case.workload,
        "seed": seed,
        "predictive": predictive,
        "minutes": judged_minutes(result["per_minute"], drawn.steps, drawn.warmup_s, excused_s),
        "per_minute": "".join("-" if ok is None else "." if ok else "x" for ok in result["per_minute"]),
        "replica_minutes": result["replica_minutes"],
        "direction_changes": result["max_direction_changes_per_window"],
        "scale_down_lag_s": scale_down_lag(result["needed"], drawn.warmup_s),
        "run": {k: result[k] for k in ("slo_minutes", "slo_minutes_met", "replica_minutes")},
    }


def print_rows(rows: list[dict[str, Any]]) -> None:
    from llmfleet.bench.report import print_table

    print("\n== the tuner alone (--tuner-only: no fixed grid, HPA or oracle to score it against)")
    table = []
    for row in rows:
        table.append(
            [
                row["workload"],
                "default" if row["seed"] is None else str(row["seed"]),
                minutes_cell(row["minutes"]),
                f"{row['replica_minutes']:.1f}",
                str(row["direction_changes"]),
                f"{row['scale_down_lag_s']:.0f} s",
                prediction_cell(row["prediction"]),
            ]
        )
    print_table(HEADER, table)
    minutes = [r["minutes"] for r in rows]
    met, judged = sum(m["met"] for m in minutes), sum(m["judged"] for m in minutes)
    reaching = sum(reaches(m, ATTAINMENT_TARGET) for m in minutes)
    spent = sum(r["replica_minutes"] for r in rows)
    print(
        f"   draws meeting >= {ATTAINMENT_TARGET:.0%} of their minutes: {reaching}/{len(rows)}; "
        f"minutes met {met}/{judged}; replica-minutes {spent:.1f}"
    )
