"""What a pool spent against what it needed: replica-seconds over a trailing window, the replicas
it ran against the count its own demand estimate (and latency projection) asked for, run by run.
The ratio is the fleet's excess, shown in each decision, in status and on the dashboards.

A replica of a tensor- or pipeline-parallel pool runs on several devices: what it costs is
device-minutes, its replica-minutes times its devices, reported beside them (the excess is the
same ratio either way)."""

from __future__ import annotations

import itertools
from typing import Any

from pydantic import BaseModel, Field

MAX_POINTS = 128


class Spend(BaseModel):
    points: list[tuple[float, float, float]] = Field(default_factory=list)  # (time, replicas, needed)

    def record(self, at: float, replicas: float, needed: float, window_s: float) -> None:
        self.points = [p for p in self.points if at - p[0] <= window_s and p[0] < at]
        self.points.append((at, replicas, needed))
        del self.points[:-MAX_POINTS]

    def summary(self, at: float, window_s: float, devices: int = 1) -> dict[str, Any] | None:
        """Replica-minutes spent and needed over the window (each run's count held until the
        next), and their ratio; with ``devices`` per replica above one, device-minutes too. None
        before two runs."""
        points = [p for p in self.points if at - p[0] <= window_s]
        if len(points) < 2:
            return None
        spent = needed = 0.0
        for (t0, replicas, need), (t1, _, _) in itertools.pairwise(points):
            spent += replicas * (t1 - t0)
            needed += need * (t1 - t0)
        span = points[-1][0] - points[0][0]
        out = {
            "windowSeconds": round(span),
            "replicaMinutes": round(spent / 60.0, 2),
            "neededReplicaMinutes": round(needed / 60.0, 2),
            "excess": round(spent / needed, 3) if needed > 0 else None,
        }
        if devices > 1:
            out["deviceMinutes"] = round(spent * devices / 60.0, 2)
            out["neededDeviceMinutes"] = round(needed * devices / 60.0, 2)
        return out
