"""The tuner bench's verdict on the HPA target says what makes it hard to read alone."""

import pytest

from llmfleet.bench.tuner_eval import _hpa_note


def row(hpa_attainment: float, hpa_minutes: float, fixed_minutes: float | None = 60.0) -> dict:
    hpa = {"slo_attainment": hpa_attainment, "slo_minutes_met": 8, "slo_minutes": 10, "replica_minutes": hpa_minutes}
    return {"hpa": hpa, "best_fixed": None if fixed_minutes is None else {"replica_minutes": fixed_minutes}}


@pytest.mark.parametrize(
    ("case", "note"),
    [
        (row(0.8, 100.0), "; the HPA meets 8/10"),  # a baseline that misses minutes
        (row(1.0, 76.0), "; 0.7x the HPA is 0.89x best fixed"),  # the target lies below the best fixed fleet
        (row(1.0, 100.0), ""),  # 0.7x of it is 1.17x the best fixed fleet: reachable
        (row(1.0, 76.0, fixed_minutes=None), ""),  # no fixed configuration met the SLOs
    ],
)
def test_the_hpa_verdict_explains_itself(case: dict, note: str) -> None:
    assert _hpa_note(case) == note
