"""The in-process app on the real engine loop with the fake hash runner, for every test here."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from llmfleet.server.config import EngineConfig
from llmfleet.server.openai.app import create_app
from tests.server.fakes import fake_state


@pytest.fixture
def make_state():
    states = []

    def make(config: EngineConfig | None = None, **runner_kwargs):
        state = fake_state(config, **runner_kwargs)
        states.append(state)
        return state

    yield make
    for state in states:
        state.engine.shutdown()


@pytest.fixture
def state(make_state):
    return make_state()


@pytest.fixture
def client(state):
    with TestClient(create_app(state)) as c:
        yield c
