"""Shared test settings. Area-specific fixtures live in each tests/<area>/conftest.py."""

import fcntl
import os
import pathlib

import pytest
from hypothesis import HealthCheck, settings

REPO = pathlib.Path(__file__).resolve().parents[1]

# Tests never download: keep the built-in models in one cache for the whole run.
os.environ.setdefault("LLMFLEET_CACHE", str(REPO / ".cache" / "llm-fleet"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton kernels (server/runner/triton_kernels.py) run through Triton's interpreter on a CPU; it
# is chosen when Triton is first imported, so here, before anything imports it.
if os.environ.get("LLMFLEET_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Property tests judge what comes out, not how fast: hypothesis's 200 ms deadline per example and
# its too-slow health check would fail them on a loaded 2-core CI machine, at random.
settings.register_profile("llmfleet", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("llmfleet")


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@pytest.fixture(autouse=True)
def _timed_tests_take_turns(request):
    """A test marked ``timed`` holds a lock on a file in the cache while it runs, so the pytest-xdist
    workers (scripts/test.sh) never run two of them at once: each drives real traffic against an
    SLO and would read the other's load as its own."""
    if request.node.get_closest_marker("timed") is None:
        yield
        return
    lock = pathlib.Path(os.environ["LLMFLEET_CACHE"]) / "timed-tests.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes
        yield
