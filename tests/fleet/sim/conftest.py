"""Simulator fixtures: a synthetic cost profile (no torch, no calibration) and spec builders."""

from __future__ import annotations

from typing import Any

import pytest

from llmfleet.operator.resource.spec import InferenceServiceSpec, parse_spec
from llmfleet.sim.cost_model import CostModel

# Shaped like builtin:small in bfloat16 on a 2-core CPU (llm-fleet calibrate), rounded.
SMALL_LIKE = {
    "intercept": 0.027,
    "tokens": 2.0e-4,
    "seqs": 2.0e-4,
    "decode_groups": 2.3e-3,
    "kv_read": 8.0e-9,
    "prefill_attn": 1.4e-10,
    "prefills": 2.0e-4,
}


def synthetic_profile(**coefficients: float) -> CostModel:
    return CostModel(
        coefficients=SMALL_LIKE | coefficients,
        model="builtin:small",
        dtype="bfloat16",
        threads=2,
        kv_bytes_per_token=36864,
        max_model_len=4096,
    )


@pytest.fixture
def profile() -> CostModel:
    return synthetic_profile()


def make_spec(
    *,
    ttft_ms: float = 2000,
    itl_ms: float = 200,
    engine: dict[str, Any] | None = None,
    bounds: dict[str, Any] | None = None,
    min_replicas: int = 1,
    max_replicas: int = 4,
    replicas: int | None = None,
    autotune: dict[str, Any] | None = None,
    mode: str = "colocated",
) -> InferenceServiceSpec:
    pool: dict[str, Any] = {
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "engine": {"maxBatchSize": 16, "maxNumBatchedTokens": 512, "batchTimeoutMs": 0} | (engine or {}),
        "bounds": bounds or {},
    }
    if replicas is not None:
        pool["replicas"] = replicas
    pools = {"colocated": pool} if mode == "colocated" else {"prefill": dict(pool), "decode": dict(pool)}
    return parse_spec(
        {
            "model": {"builtin": "small"},
            "slo": {"ttftP95Ms": ttft_ms, "itlP95Ms": itl_ms},
            "mode": mode,
            "pools": pools,
            "autotune": {"intervalSeconds": 10, "scaleDownStabilizationSeconds": 60, "cooldownSeconds": 30}
            | (autotune or {}),
        }
    )
