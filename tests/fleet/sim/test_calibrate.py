"""`llm-fleet calibrate` on builtin:tiny with the quick grid: the grid's shapes and the serving
replay's steps both go into the fit, and the profile round-trips (a few seconds, real engine)."""

from __future__ import annotations

from llmfleet.sim.calibrate import GRIDS, calibrate, fit_advice
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


def _poor_profile() -> CostModel:
    """The reference profile's samples, each slowed by a busy machine by up to 3x at random."""
    import random

    from llmfleet.bench.tuner_eval import REFERENCE_PROFILE
    from llmfleet.sim.cost_model import FEATURES, Sample, fit

    reference = CostModel.load(REFERENCE_PROFILE)
    rng = random.Random(3)
    samples = [Sample.from_dict(s) for s in reference.samples]
    noisy = [Sample(s.features, s.seconds * rng.choice((1.0, 1.0, 2.5, 3.0)), s.kind) for s in samples]
    coefficients, quality = fit(noisy, FEATURES, trim=0)
    return CostModel(coefficients=coefficients, model="builtin:small", quality=quality)


def test_a_poor_fit_is_not_written_and_says_what_to_do(tmp_path, monkeypatch, capsys) -> None:
    from llmfleet.bench.tuner_eval import REFERENCE_PROFILE
    from llmfleet.cli import main
    from llmfleet.sim import calibrate as calibrate_module

    assert fit_advice(CostModel.load(REFERENCE_PROFILE)) == ""  # the reference fit is good
    poor = _poor_profile()
    assert poor.quality.problems()
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *args, **kwargs: poor)
    out = tmp_path / "small.json"
    assert main(["calibrate", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "WARNING: a poor fit" in printed and "quieter machine" in printed and "not written" in printed
    assert not out.exists()
    assert main(["calibrate", "--out", str(out), "--force"]) == 0
    assert out.is_file()
