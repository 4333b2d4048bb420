"""Shared test settings. Area-specific fixtures live in each tests/<area>/conftest.py."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Tests never download: keep the built-in models in one cache for the whole run.
os.environ.setdefault("LLMFLEET_CACHE", str(REPO / ".cache" / "llm-fleet"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO
