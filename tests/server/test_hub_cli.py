"""`llm-fleet serve --model org/name` and `llm-fleet fetch-model` as processes, downloading from a
fake Hub on loopback (HF_ENDPOINT): the model is fetched, cached and served under its repository
id; a missing repository ends in one line and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.fakehub import FakeHub, hub_env, tiny_repo
from tests.support import ServerProcess


@pytest.fixture
def hub(monkeypatch):
    with FakeHub() as hub:
        hub_env(monkeypatch, hub)
        yield hub


def llm_fleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmfleet.cli", *args], capture_output=True, text=True, timeout=300)


def test_fetch_model_prints_the_snapshot_it_filled(hub, tmp_path):
    shas = tiny_repo(hub, "test-org/tiny")
    done = llm_fleet("fetch-model", "hf://test-org/tiny@v1", "--download-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    path = tmp_path / "models--test-org--tiny" / "snapshots" / shas["v1"]
    assert done.stdout.strip() == str(path)
    assert (path / "notes.txt").read_text() == "v1"


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("hf://test-org/nothing", "hf://test-org/nothing: no such model repository on http://127.0.0.1:"),
        ("hf://test-org/tiny@v9", "hf://test-org/tiny@v9: the repository has no revision 'v9'"),
        ("hf://a/../b", "'hf://a/../b' names no Hugging Face repository"),
    ],
)
def test_fetch_model_errors_are_one_line(hub, tmp_path, model, words):
    tiny_repo(hub, "test-org/tiny")
    done = llm_fleet("fetch-model", model, "--download-dir", str(tmp_path))
    assert done.returncode == 1
    assert done.stderr.startswith(f"llm-fleet fetch-model: {words}"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.timeout(300)
def test_serve_downloads_a_hub_model_and_serves_it(hub, tmp_path):
    tiny_repo(hub, "test-org/tiny")
    server = ServerProcess("--model", "test-org/tiny", "--download-dir", str(tmp_path), log_path=tmp_path / "log")
    try:
        server.wait_ready(timeout=240)
        models = httpx.get(f"{server.url}/v1/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["test-org/tiny"]  # the repository id, as vLLM names it
        answer = httpx.post(  # sampled, so an EOS may come early: ignore_eos makes the 4 tokens certain
            f"{server.url}/v1/completions",
            json={"model": "test-org/tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
    assert (tmp_path / "models--test-org--tiny" / "refs" / "main").is_file()
    assert hub.requests("GET", "/resolve/")


def test_serve_of_a_missing_repository_exits_with_one_line(hub, tmp_path):
    done = llm_fleet("serve", "--model", "test-org/nothing", "--download-dir", str(tmp_path))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("llm-fleet serve: cannot load test-org/nothing: hf://test-org/nothing: no such model"), last
