"""`llm-fleet calibrate` on builtin:tiny with the quick grid: the grid's shapes and the serving
replay's steps both go into the fit, and the profile round-trips (a few seconds, real engine)."""

from __future__ import annotations

from llmfleet.sim.calibrate import GRIDS, calibrate
from llmfleet.sim.cost_model import CostModel


def test_the_fit_takes_the_grid_and_a_serving_replay(tmp_path) -> None:
    profile = calibrate("builtin:tiny", GRIDS["quick"], threads=1)
    kinds = {s["kind"] for s in profile.samples}
    assert {"decode", "mixed", "prefill", "serving"} <= kinds
    replayed = [s for s in profile.samples if s["kind"] == "serving"]
    assert len(replayed) > GRIDS["quick"].replay  # every step of the replay, not one per request
    assert "serving" in profile.quality.by_kind
    loaded = CostModel.load(profile.save(tmp_path / "tiny.json"))
    assert loaded.coefficients == profile.coefficients and loaded.describe() == profile.describe()
