"""The local fleet with a disaggregated spec: a router on the client port in front of prefill and
decode pools, found through the endpoints file the fleet keeps current while pools scale."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from llmfleet.local.fleet import LocalFleet, router_args
from llmfleet.local.up import load_service
from llmfleet.server import cli as server_cli
from tests.support import ServerProcess, free_port

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "local-disaggregated.yaml"


def _router_role_available() -> bool:
    """The roles' contract: `serve --role router --endpoints-file PATH`, prefill and decode roles."""
    parser = argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    return "--endpoints-file" in parser.format_help()


needs_router = pytest.mark.skipif(
    not _router_role_available(),
    reason="`llm-fleet serve --role router --endpoints-file` is not in this build yet (disaggregated roles)",
)


def test_the_local_router_runs_the_cluster_routers_args_with_an_endpoints_file(tmp_path):
    name, spec = load_service(str(EXAMPLE))
    args = router_args(name, spec, tmp_path / "endpoints.yaml")
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags == {
        "--role": "router",
        "--served-model-name": "tiny-pd",
        "--router-policy": "load",
        "--hold-timeout": "300",
        "--max-held": "1024",
        "--drain-timeout": "300",  # builtin:tiny's 2048 tokens at the 100 ms ITL SLO, and 10 s: 215, rounded up
        "--endpoints-file": str(tmp_path / "endpoints.yaml"),
        "--router-mode": "disaggregated",
    }


def _fleet_pids(run_dir: Path) -> list[int]:
    """Every `llm-fleet serve` of this fleet: pool servers name their config, the router its endpoints file."""
    found = subprocess.run(["pgrep", "-f", f"llmfleet.cli serve .*{run_dir}/"], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" in status.read_text()
    except OSError:
        return True


@needs_router
def test_a_disaggregated_spec_serves_the_openai_client_through_the_router(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    run_dir = tmp_path / "run"
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed below
    command = [sys.executable, "-m", "llmfleet.cli", "up", "--no-tui", "--port", str(port), "--run-dir", str(run_dir)]
    up = subprocess.Popen([*command, "-f", str(EXAMPLE)], stdout=log, stderr=subprocess.STDOUT)
    auto_tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")  # as the example's toolCallParser
    colocated = ServerProcess("--model", "builtin:tiny", *auto_tools, log_path=tmp_path / "colocated.log")

    def output() -> str:
        log.flush()
        return (tmp_path / "up.log").read_text()

    try:
        deadline = time.monotonic() + 180
        while "ready: " not in output():  # logged once the router and both pools answer /ready
            assert up.poll() is None and time.monotonic() < deadline, output()
            time.sleep(0.3)
        colocated.wait_ready()
        endpoints = yaml.safe_load((run_dir / "endpoints.yaml").read_text())
        assert len(endpoints["prefill"]) == 1 and len(endpoints["decode"]) == 1

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert client.models.list().data[0].id == "tiny-pd"
        prompt = "The fleet splits prefill from decode"
        routed = client.completions.create(model="tiny-pd", prompt=prompt, max_tokens=12, temperature=0)
        local = openai.OpenAI(base_url=f"{colocated.url}/v1", api_key="unused")
        direct = local.completions.create(model="builtin:tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert routed.choices[0].text == direct.choices[0].text  # fp32 greedy: the KV moved intact
        assert routed.usage.completion_tokens == 12

        stream = client.chat.completions.create(  # greedy: a sampled first token can be the end token
            model="tiny-pd", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        # tool_choice 'auto' (tools alone): the decode server reads the call (a regex makes the model write one)
        regex = r'Sure[.] <tool_call>\{"name": "time", "arguments": \{"tz": "[A-Z]{3}"\}\}</tool_call>'
        asked = {
            "messages": [{"role": "user", "content": "time?"}],
            "max_tokens": 120,
            "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "time"}}],
            "extra_body": {"structured_outputs": {"regex": regex}},
        }
        routed = client.chat.completions.create(model="tiny-pd", **asked).choices[0]
        direct = local.chat.completions.create(model="builtin:tiny", **asked).choices[0]
        assert routed.finish_reason == "tool_calls" and routed.message.content == "Sure. "
        (call,) = routed.message.tool_calls
        assert call.function.name == "time" and call.function == direct.message.tool_calls[0].function
        pids = _fleet_pids(run_dir)
        assert len(pids) == 3, pids  # router, prefill, decode
    finally:
        colocated.stop()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(90)
        log.close()
    text = (tmp_path / "up.log").read_text()
    assert up.returncode == 0, text
    assert "stopped" in text
    assert all(_gone(pid) for pid in pids), text


@pytest.mark.timed
@needs_router
def test_pools_scale_by_start_and_drain_under_traffic_and_the_router_follows(tmp_path):
    """The actuator's path for a disaggregated spec: a decode replica added joins the router's
    endpoints once ready; one removed drains while streams go on; a knob lands in the pool's file."""
    name, spec = load_service(str(EXAMPLE))
    fleet = LocalFleet(name, spec, tmp_path, free_port())
    errors: list[str] = []
    done = [0]
    stop = threading.Event()

    def traffic() -> None:
        body = {"model": "tiny-pd", "prompt": "scale", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=f"http://127.0.0.1:{fleet.port}", timeout=120) as http:
            while not stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        lines = list(response.iter_lines())
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                    continue
                data = [line for line in lines if line.startswith("data: ")]
                if response.status_code != 200 or data[-1:] != ["data: [DONE]"] or '"error"' in "".join(data):
                    errors.append(f"{response.status_code}: {lines[-2:]}")
                done[0] += 1

    def supervise_until(condition, what: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {fleet.view.history}"
            fleet.supervise()
            time.sleep(0.2)

    def endpoints() -> dict[str, list[str]]:
        return yaml.safe_load(fleet.endpoints_file.read_text())

    clients = [threading.Thread(target=traffic) for _ in range(3)]
    try:
        fleet.start()
        supervise_until(fleet.serving, "the router and both pools")
        for client in clients:
            client.start()

        fleet.apply("decode", 2, {})
        supervise_until(lambda: len(endpoints()["decode"]) == 2, "the second decode server in the endpoints file")
        before = done[0]
        supervise_until(lambda: done[0] >= before + 6, "requests through two decode servers")

        fleet.apply("decode", 1, {"maxBatchSize": 8})
        fleet.supervise()
        assert len(endpoints()["decode"]) == 1  # the draining server leaves the router's list at once
        assert yaml.safe_load(fleet.pools["decode"].config_path.read_text())["max_batch_size"] == 8
        supervise_until(lambda: not fleet.pools["decode"].draining, "the drained decode server to exit")
        before = done[0]
        supervise_until(lambda: done[0] >= before + 3, "requests after the scale-down")
    finally:
        stop.set()
        for client in clients:
            if client.is_alive():
                client.join(120)
        fleet.stop(timeout=30)
    assert not errors, errors
    assert not any(server.alive for server in fleet.processes())
    assert any("drained" in line for line in fleet.view.history), fleet.view.history
