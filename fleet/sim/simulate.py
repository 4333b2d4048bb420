"""One call to simulate a fleet: a spec, a cost profile, a trace and a controller -> SimResult.
The CLI and the benches (sim-fidelity, tuner evaluation) go through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from llmfleet.operator.resource import service_file
from llmfleet.operator.resource.spec import InferenceServiceSpec, parse_spec
from llmfleet.operator.tuner.law import TunerConfig
from llmfleet.sim.control import TunerController
from llmfleet.sim.cost_model import CostModel
from llmfleet.sim.fleet import Fleet, SimOptions, SimResult
from llmfleet.sim.hpa import HPAConfig, QueueLengthHPA
from llmfleet.workloads import RequestSpec

ControllerKind = Literal["tuner", "hpa", "fixed"]


def simulate(
    spec: InferenceServiceSpec,
    cost: CostModel,
    requests: list[RequestSpec],
    *,
    controller: ControllerKind = "tuner",
    options: SimOptions | None = None,
    name: str = "sim",
    hpa: HPAConfig | None = None,
    tuner: TunerConfig | None = None,
    measure_from: float = 0.0,
) -> SimResult:
    """Run ``requests`` through a fleet of ``spec`` under ``controller``; the report covers what
    happens from ``measure_from`` on (after a warm-up)."""
    tuners: list[TunerController] = []

    def tuned(fleet: Fleet) -> TunerController:
        tuners.append(TunerController(fleet, tuner))
        return tuners[-1]

    if controller == "tuner":
        factory = tuned
    elif controller == "hpa":
        factory = lambda fleet: QueueLengthHPA(fleet, hpa)  # noqa: E731
    elif controller == "fixed":
        factory = None
    else:
        raise ValueError(f"unknown controller {controller!r}: tuner, hpa or fixed")
    result = Fleet(spec, cost, requests, options, factory, name=name).run()
    result.notes["stabilization_window_s"] = float(spec.autotune.scale_down_stabilization_seconds)
    if tuners:
        result.notes["tuner_needed"] = tuners[0].needed
        result.notes["tuner_runs"] = tuners[0].runs
        result.notes["scaling_limited"] = tuners[0].limited
    result.measure_from = measure_from
    return result


def read_service(path: str | Path) -> tuple[str, InferenceServiceSpec]:
    """(name, spec) of the first InferenceService in a YAML file."""
    return service_file.read_service(Path(path), "sim")


def with_fixed(spec: InferenceServiceSpec, pool: str, replicas: int, knobs: dict[str, Any]) -> InferenceServiceSpec:
    """A copy of ``spec`` whose ``pool`` starts at ``replicas`` with ``knobs`` (camelCase engine
    fields), for runs without a controller (the fixed-configuration grid)."""
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    pool_raw = raw["pools"].setdefault(pool, {})
    pool_raw["replicas"] = replicas
    pool_raw["minReplicas"] = min(pool_raw.get("minReplicas", 1), replicas)
    pool_raw["maxReplicas"] = max(pool_raw.get("maxReplicas", replicas), replicas)
    pool_raw["engine"] = {**pool_raw.get("engine", {}), **knobs}
    bounds = pool_raw.setdefault("bounds", {})
    for knob, value in knobs.items():  # keep the fixed value inside the bounds effective_engine applies
        if knob in bounds:
            low, high = bounds[knob].get("min"), bounds[knob].get("max")
            bounds[knob] = {
                "min": value if low is None else min(low, value),
                "max": value if high is None else max(high, value),
            }
    return parse_spec(raw)
