"""`llm-fleet load`, `up` and `operator` end a wrong command line, an endpoint they cannot use or
a Ctrl-C in one line and an exit code, never a traceback."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

import pytest
import yaml

from llmfleet.cli import main
from llmfleet.local.processes import free_port


class _Endpoint(BaseHTTPRequestHandler):
    """An OpenAI endpoint in miniature: /v1/models (behind a key when the server has one) and a
    streamed /v1/completions of one token; anything else is FastAPI's 404."""

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            return self._answer(404, {"detail": "Not Found"})
        if self.server.api_key and self.headers.get("Authorization") != f"Bearer {self.server.api_key}":
            return self._answer(401, {"error": "Unauthorized"})
        self._answer(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/completions":
            return self._answer(404, {"detail": "Not Found"})
        if self.server.refusal:
            return self._answer(400, {"error": {"message": self.server.refusal, "type": "BadRequestError"}})
        self.server.answered.set()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


class EndpointURL(str):
    """The miniature endpoint's URL; ``answered`` is set once it has streamed a completion."""

    answered: threading.Event


def _serve_endpoint(api_key: str | None = None, refusal: str | None = None) -> Iterator[EndpointURL]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    server.api_key, server.refusal = api_key, refusal
    server.answered = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = EndpointURL(f"http://127.0.0.1:{server.server_address[1]}")
        url.answered = server.answered
        yield url
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def endpoint() -> Iterator[str]:
    yield from _serve_endpoint()


@pytest.fixture
def keyed_endpoint() -> Iterator[str]:
    yield from _serve_endpoint(api_key="sesame")


SHORT_LOAD = ["--rate", "20", "--duration", "0.3"]


def _main_interrupted(argv: list[str]) -> int:
    """``main(argv)`` for a command that gets a Ctrl-C: one that escapes would stop pytest itself."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C reached the user as a KeyboardInterrupt traceback")


# --- load ---


def test_load_without_the_key_a_server_requires_says_to_set_it(keyed_endpoint, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(["load", "--url", keyed_endpoint, *SHORT_LOAD]) == 2
    error = capsys.readouterr().err
    assert "401 Unauthorized" in error and "set VLLM_API_KEY" in error and len(error.splitlines()) == 1


def test_load_with_a_wrong_key_says_it_is_not_the_servers(keyed_endpoint, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_API_KEY", "wrong")
    assert main(["load", "--url", keyed_endpoint, *SHORT_LOAD]) == 2
    assert "VLLM_API_KEY is not its key" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_load_takes_the_url_as_an_openai_base_url_is_written(endpoint, suffix, monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert main(["load", "--url", endpoint + suffix, *SHORT_LOAD]) == 0
    total = capsys.readouterr().out.splitlines()[-1]
    assert total.startswith("total: sent ") and "errors 0" in total


def test_load_at_something_that_is_no_openai_endpoint_is_one_line(endpoint, capsys):
    assert main(["load", "--url", f"{endpoint}/other", *SHORT_LOAD]) == 2  # /other/v1/models: 404
    assert capsys.readouterr().err.strip().endswith("/v1/models: 404 Not Found")


def test_load_says_why_its_requests_failed(capsys):
    for url in _serve_endpoint(refusal="This model's maximum context length is 2048 tokens"):
        assert main(["load", "--url", url, *SHORT_LOAD]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("total: sent ") and "done 0" in lines[-2]
    sent = int(lines[-2].split("sent ")[1].split(",")[0])
    assert lines[-1] == f"  {sent} x HTTP 400, e.g. This model's maximum context length is 2048 tokens"


def test_load_interrupted_prints_what_it_measured(monkeypatch, capsys):
    import llmfleet.local.load as load

    async def interrupted(args, total) -> None:
        total.sent, total.done = 3, 2
        raise KeyboardInterrupt

    monkeypatch.setattr(load, "generate_load", interrupted)
    assert _main_interrupted(["load", *SHORT_LOAD]) == 130
    out = capsys.readouterr()
    assert out.out.startswith("interrupted: sent 3, done 2, errors 0") and out.err == "interrupted\n"


def test_ctrl_c_at_load_ends_it_with_its_summary_and_no_traceback(endpoint):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    command = [sys.executable, "-m", "llmfleet.cli", "load", "--url", endpoint, "--rate", "20", "--duration", "60"]
    # Ctrl-C as at a terminal: a test run started in the background (`cmd &`) inherits SIGINT
    # ignored, and a Python started so keeps it ignored, as a shell's background job should
    terminal = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=terminal
    )
    try:
        # started and sending: on a loaded machine its imports alone can take seconds
        assert endpoint.answered.wait(60), "load sent nothing in 60 s"
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "interrupted: sent " in out and err == "interrupted\n"


# --- every command ---


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_ctrl_c_in_any_command_is_one_line_and_exit_130(command, monkeypatch, capsys):
    import importlib

    from llmfleet.cli import SUBCOMMANDS

    def interrupted(args) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(SUBCOMMANDS[command]), "run", interrupted)
    assert _main_interrupted([command, "hi"] if command == "generate" else [command]) == 130
    assert capsys.readouterr().err == "interrupted\n"


# --- up ---


@pytest.fixture
def no_fleet(monkeypatch):
    """A check that lets `up` through would start a fleet: fail the test instead."""
    import llmfleet.local.fleet

    def started(*args, **kwargs):
        raise AssertionError("`up` started a fleet")

    monkeypatch.setattr(llmfleet.local.fleet, "LocalFleet", started)


def _service_file(tmp_path, name: str):
    doc = yaml.safe_load(resources.files("llmfleet.local").joinpath("default.yaml").read_text())
    doc["metadata"]["name"] = name
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("name", ["team/tiny", "Tiny", "tiny.v2"])
def test_up_refuses_a_name_the_operator_would_refuse(name, tmp_path, no_fleet, capsys):
    service = _service_file(tmp_path, name)
    assert main(["up", "-f", str(service), "--port", str(free_port()), "--no-tui"]) == 2
    error = capsys.readouterr().err
    assert f"name {name!r} cannot name this fleet's Services" in error and len(error.splitlines()) == 1


def test_up_with_a_run_dir_it_cannot_write_is_one_line(tmp_path, no_fleet, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for run_dir, why in ((a_file, "File exists"), (a_file / "sub", "Not a directory")):
        assert main(["up", "--run-dir", str(run_dir), "--port", str(free_port()), "--no-tui"]) == 2
        assert capsys.readouterr().err == f"error: --run-dir {run_dir}: {why}\n"
