"""The start-up warm-up's switch and the engine bench's probe of it (bfloat16 on a CPU only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmfleet.server.config import EngineConfig
from llmfleet.server.engine.build import build_engine
from llmfleet.server.runner.step_shapes import warm_up_sizes
from tests.server.runner.device import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="only a CPU runner pads and warms up")


def test_llmfleet_warm_up_0_skips_it(monkeypatch):
    config = EngineConfig(dtype="bfloat16", kv_cache_memory_mb=4, max_num_batched_tokens=64)
    warmed, _ = build_engine("builtin:tiny", config, device="cpu")
    assert warmed.runner.warm_sizes == frozenset(warm_up_sizes(64))
    monkeypatch.setenv("LLMFLEET_WARM_UP", "0")
    cold, _ = build_engine("builtin:tiny", config, device="cpu")
    assert cold.runner.warm_sizes == frozenset()


def test_the_bench_probe_reports_its_passes():
    out = subprocess.run(
        [sys.executable, "-m", "llmfleet.bench.warm_up_probe", "builtin:tiny", "bfloat16"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result) == {"build_s", "first_pass_s", "second_pass_s"}
    assert all(seconds > 0 for seconds in result.values())
