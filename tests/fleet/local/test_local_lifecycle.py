"""The local fleet's life cycle as a new user meets it: the router on the client port (its own
/metrics there), a pool that goes to zero and comes back for a request, a scale-down that lets a
long stream finish, the terminal closed under a running stream, `up FILE`, and the view in an
80x24 terminal."""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import pty
import subprocess
import sys
import termios
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import yaml
from rich.console import Console

from llmfleet.local.fleet import LocalFleet
from llmfleet.local.up import load_service
from llmfleet.local.view import render
from tests.fleet.local.test_local_fleet import FleetProcess
from tests.support import free_port


def service_file(tmp_path: Path, name: str = "tiny", **spec) -> Path:
    doc = {
        "apiVersion": "llmfleet.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {"model": {"builtin": "tiny"}, "slo": {"ttftP95Ms": 500, "itlP95Ms": 100}, **spec},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def stream(url: str, max_tokens: int, started: threading.Event | None = None, model: str = "tiny") -> dict:
    """One streamed completion: its tokens, finish reason, whether it ended with [DONE], and how
    long it took."""
    body = {
        "model": model,
        "prompt": "long",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    out = {"tokens": 0, "finish": None, "done": False, "started": time.monotonic()}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(600, connect=10)) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                choice = (chunk.get("choices") or [{}])[0]
                out["finish"] = choice.get("finish_reason") or out["finish"]
                out["tokens"] = (chunk.get("usage") or {}).get("completion_tokens", out["tokens"])
                if started is not None:
                    started.set()
    out["seconds"] = time.monotonic() - out["started"]
    return out


def test_the_client_port_is_the_router_with_its_own_metrics_and_up_takes_the_file_bare(tmp_path, repo_root):
    fleet = FleetProcess(tmp_path, str(repo_root / "examples" / "local.yaml"))  # `up FILE`, no -f
    try:
        fleet.wait_ready()
        reply = httpx.post(
            f"{fleet.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{fleet.url}/metrics", timeout=5).text
        assert 'role="router"' in metrics and 'role="colocated"' not in metrics  # one process's, labelled
        assert "llmfleet_router_cold_start_seconds_count" in metrics
        assert "model='tiny'" in fleet.output() and "prometheus-targets.json" in fleet.output()
    finally:
        assert fleet.stop() == 0, fleet.output()


@pytest.mark.timeout(300)
def test_a_pool_goes_to_zero_when_idle_and_a_request_brings_it_back(tmp_path):
    """Idle -> 0 servers -> requests arrive -> served, none lost; the cold start is measured."""
    path = service_file(
        tmp_path,
        pools={"colocated": {"minReplicas": 0, "maxReplicas": 2, "engine": {"kvCacheMemoryMb": 64}}},
        autotune={"intervalSeconds": 5, "scaleToZeroAfterSeconds": 10},
    )
    fleet = FleetProcess(tmp_path, "-f", str(path))
    try:
        fleet.wait_ready()
        deadline = time.monotonic() + 120
        while fleet.server_pids() or "replicas 1 -> 0" not in fleet.output():
            assert time.monotonic() < deadline, fleet.output()
            time.sleep(0.5)
        # an idle server exits as soon as it is told to drain; the router drops it at its next
        # read of the endpoints file (every second), which can come after the exit
        while (load := httpx.get(f"{fleet.url}/load", timeout=5).json())["servers"] != {"colocated": []}:
            assert time.monotonic() < deadline, load
            time.sleep(0.25)

        body = {"model": "tiny", "prompt": "wake up", "max_tokens": 8}
        sent = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(
                pool.map(lambda _: httpx.post(f"{fleet.url}/v1/completions", json=body, timeout=120), range(4))
            )
        waited = time.monotonic() - sent
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]  # none lost at zero
        router = httpx.get(f"{fleet.url}/load", timeout=5).json()
        print(
            f"from zero: 4 requests answered in {waited:.1f} s; the router held them "
            f"{router['last_cold_start_s']:.1f} s; {fleet.output().split('cold start: ')[-1].splitlines()[0]}"
        )
        assert "woken, colocated 0 -> 1" in fleet.output() and "cold start: colocated ready" in fleet.output()
        assert router["held"] == 0 and 0 < router["last_cold_start_s"] <= waited
    finally:
        assert fleet.stop() == 0, fleet.output()


@pytest.mark.timed
@pytest.mark.timeout(600)
def test_a_scale_down_lets_a_stream_longer_than_the_old_30_s_drain_finish(tmp_path):
    """The pool's drain (its longest stream: builtin:small's 4096 tokens at the 100 ms ITL SLO)
    sets the server's --drain-timeout: a server scaled down mid-stream finishes it, then exits."""
    path = service_file(
        tmp_path,
        model={"builtin": "small"},
        pools={"colocated": {"minReplicas": 0, "engine": {"kvCacheMemoryMb": 512, "dtype": "float32"}}},
        autotune={"enabled": False},
    )
    name, spec = load_service(str(path))
    assert spec.drain_seconds("colocated") == 600
    fleet = LocalFleet(name, spec, tmp_path / "run", free_port())
    result: dict = {}
    try:
        fleet.start()
        deadline = time.monotonic() + 240
        while not fleet.serving():
            assert time.monotonic() < deadline, fleet.view.history
            fleet.supervise()
            time.sleep(0.2)
        server = fleet.pools["colocated"].servers[0]
        assert server.proc.args[server.proc.args.index("--drain-timeout") + 1] == "600"
        # how fast this machine decodes: size the stream to outlast the old drain by half again or more
        probe = stream(fleet.router.url, 40)
        per_token = probe["seconds"] / max(probe["tokens"], 1)
        tokens = min(3900, int(60 / per_token))
        started = threading.Event()
        client = threading.Thread(target=lambda: result.update(stream(fleet.router.url, tokens, started)))
        client.start()
        assert started.wait(60)
        time.sleep(2)
        fleet.apply("colocated", 0, {})  # the scale-down: the streaming server drains (SIGTERM)
        scaled_down = time.monotonic()
        fleet.supervise()
        assert server.draining and server in fleet.pools["colocated"].draining
        client.join(600)
        drained = time.monotonic() - scaled_down
        while server.alive:
            time.sleep(0.2)
        print(f"a stream of {result['tokens']} tokens went on {drained:.0f} s after the scale-down and finished")
    finally:
        fleet.stop(timeout=10)
    assert result["done"] and result["finish"] == "length" and result["tokens"] == tokens
    assert drained > 30  # longer than the old fixed drain
    assert server.proc.returncode == 0  # drained, not killed


@pytest.mark.timeout(240)
def test_closing_the_terminal_drains_the_fleet_and_running_streams_finish(tmp_path):
    """The terminal going away (SIGHUP to the session) drains, as the docs say: the live view's
    next write to the dead terminal no longer ends `up` with every stream cut."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\x00\x50\x00\x00\x00\x00\x00")  # 24 rows, 80 columns

    def controlling_terminal() -> None:  # as a shell's job in the terminal window: its session, its tty
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    command = [sys.executable, "-m", "llmfleet.cli", "up", "--port", str(port), "--run-dir", str(tmp_path / "run")]
    up = subprocess.Popen(
        command, stdin=slave, stdout=slave, stderr=slave, preexec_fn=controlling_terminal, close_fds=True
    )
    os.close(slave)
    screen: list[bytes] = []

    def read_screen() -> None:  # a terminal shows what it is sent
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            screen.append(data)

    threading.Thread(target=read_screen, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert up.poll() is None and time.monotonic() < deadline, b"".join(screen)[-3000:]
            try:
                if httpx.post(
                    f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}
                ).is_success:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert b"events" in b"".join(screen)  # the live view was on the terminal
        result: dict = {}
        started = threading.Event()
        client = threading.Thread(target=lambda: result.update(stream(url, 1800, started)))
        client.start()
        assert started.wait(60)
        os.close(master)  # the terminal window closes: the kernel hangs up its session
        client.join(120)
        assert up.wait(60) == 0
    finally:
        if up.poll() is None:
            up.kill()
    assert result["done"] and result["finish"] == "length" and result["tokens"] == 1800, result
    log = (tmp_path / "run" / "fleet.log").read_text()
    assert "draining the fleet" in log and "stopped" in log


def test_the_view_fits_an_80_by_24_terminal(tmp_path, repo_root):
    for example in ("local", "local-disaggregated"):
        name, spec = load_service(str(repo_root / "examples" / f"{example}.yaml"))
        fleet = LocalFleet(name, spec, tmp_path / example, 8000)
        fleet.router = types.SimpleNamespace(serving=True)
        fleet.view.history = [f"12:00:{i:02d} event {i}: " + "x" * 100 for i in range(30)]
        console = Console(record=True, width=80, height=24, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(render(fleet, "http://127.0.0.1:8000", 24))
        lines = console.export_text().splitlines()
        assert len(lines) <= 24, "\n".join(lines)
        text = "\n".join(lines)
        header = next(line for line in lines if line.lstrip().startswith("pool"))
        for column in ("ready", "batch", "wait", "budget", "TTFT", "ITL", "queue", "req/s", "waiting"):
            assert f" {column} " in f" {header} ", header  # whole, not cut to "wai…"
        assert "events" in text and "event 29" in text  # the newest events are on screen
        assert f"send model='{fleet.served_name}'" in text and "builtin:tiny" not in text.split("send model")[0]
