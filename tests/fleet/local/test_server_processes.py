"""The local fleet's server processes: the pods' readiness and liveness probes, played on a
stand-in server process whose answers the test sets."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from llmfleet.local import processes
from llmfleet.local.processes import ServerProcess

STAND_IN = """
import http.server, json, pathlib, sys
answers = pathlib.Path(sys.argv[2])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(json.loads(answers.read_text()).get(self.path, 404))
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A ServerProcess running a tiny HTTP server in place of `llm-fleet serve`; the returned
    function sets what /ready and /health answer."""
    script, answers = tmp_path / "stand_in.py", tmp_path / "answers.json"
    script.write_text(STAND_IN)
    real_popen = processes.subprocess.Popen

    def popen(command, **kwargs):
        port = command[command.index("--port") + 1]
        return real_popen([sys.executable, str(script), port, str(answers)], **kwargs)

    def answer(ready: int = 200, health: int = 200) -> None:
        answers.write_text(json.dumps({"/ready": ready, "/health": health}))

    answer()
    monkeypatch.setattr(processes.subprocess, "Popen", popen)
    server = ServerProcess("s-1", [], tmp_path / "s-1.log")
    server.wait_ready(timeout=20)
    yield server, answer
    server.kill()


def test_a_server_failing_its_readiness_probe_gets_no_traffic_until_it_passes(stand_in):
    server, answer = stand_in
    t = time.monotonic()
    assert server.probe(t) is None  # the probes start a period after start-up
    answer(ready=503)
    assert server.probe(t + 5) is None and server.serving  # one miss of the two it takes
    assert "failed its readiness probe" in server.probe(t + 10)
    assert not server.serving and server.alive
    answer()
    assert "passes its readiness probe again" in server.probe(t + 15)
    assert server.serving


def test_a_server_failing_its_liveness_probe_is_killed_for_a_restart(stand_in):
    server, answer = stand_in
    t = time.monotonic()
    server.probe(t)
    answer(health=503)
    assert server.probe(t + 10) is None and server.probe(t + 20) is None  # two misses of three
    assert "failed 3 liveness probes" in server.probe(t + 30)
    assert not server.alive


def test_the_fleet_reaches_a_server_at_the_address_it_binds():
    assert processes.reachable_url("0.0.0.0", 80) == "http://127.0.0.1:80"
    assert processes.reachable_url("::", 80) == "http://[::1]:80"
    assert processes.reachable_url("::1", 80) == "http://[::1]:80"
    assert processes.reachable_url("localhost", 80) == "http://localhost:80"


def test_a_busy_port_is_found_in_the_hosts_own_address_family():
    from llmfleet.arguments import bind_problem

    try:
        listener = socket.socket(socket.AF_INET6)
        listener.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with listener:
        listener.listen()
        port = listener.getsockname()[1]
        assert bind_problem("::1", port)
    assert bind_problem("::1", port) is None


def test_two_servers_started_together_are_never_told_one_port(monkeypatch):
    """The kernel offered port 35749 to two binds in a row in a CI run: the prefill and decode
    servers of one fixture were both told it, the decode server could not bind, and the prefill
    server answered the readiness checks and the requests meant for it."""
    offered = iter([35749, 35749, 35749, 35750])

    class Kernel:  # a socket that binds where the kernel's next offer says
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes, "_HANDED_OUT", {})
    monkeypatch.setattr(processes.socket, "socket", Kernel)
    assert [processes.free_port(), processes.free_port()] == [35749, 35750]
