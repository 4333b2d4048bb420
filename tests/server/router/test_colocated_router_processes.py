"""The router in front of colocated servers, as real processes on loopback: the metrics port a
NetworkPolicy opens to Prometheus serves nothing else, and killing one of two routers under load
costs only the streams that router carried.

The router kill plays the client Service: each request goes to the routers in turn, skipping one
whose process is gone (kube-proxy drops an endpoint once its pod is gone). Each client counts
what it saw."""

from __future__ import annotations

import collections
import json
import threading
import time

import httpx
import pytest

from tests.support import ServerProcess, free_port

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def engine_config(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("dtype: float32\nkv_cache_memory_mb: 32\n")
    return path


def test_the_metrics_port_serves_only_what_scrapers_read(tmp_path):
    metrics_port = free_port()
    args = ("--served-model-name", "tiny", "--metrics-port", str(metrics_port))
    with ServerProcess(*args, config=engine_config(tmp_path), log_path=tmp_path / "s.log", env=ONE_THREAD) as server:
        scrape = f"http://127.0.0.1:{metrics_port}"
        assert "vllm:num_requests_running" in httpx.get(f"{scrape}/metrics", timeout=5).text
        assert httpx.get(f"{scrape}/load", timeout=5).json()["running"] == 0
        assert httpx.get(f"{scrape}/ready", timeout=5).status_code == 200
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        refused = httpx.post(f"{scrape}/v1/completions", json=body, timeout=5)
        assert refused.status_code == 404 and "metrics port" in refused.json()["error"]["message"]
        assert httpx.get(f"{scrape}/v1/models", timeout=5).status_code == 404
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200


class Client:
    """Streams one completion after another through the routers, counting outcomes per router."""

    def __init__(self, routers: list[ServerProcess], offset: int) -> None:
        self.routers = routers
        self.turn = offset
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self.streams: list[tuple[str, float, float, str]] = []  # (router, opened, ended, outcome)

    def next_router(self) -> ServerProcess:
        alive = [r for r in self.routers if r.proc.poll() is None]
        self.turn += 1
        return alive[self.turn % len(alive)]

    def run(self, stop: threading.Event) -> None:
        body = {"model": "tiny", "prompt": "the router dies", "max_tokens": 120, "stream": True}
        while not stop.is_set():
            router = self.next_router()
            name = router.log_path.stem
            tokens, done = 0, False
            opened = time.monotonic()
            try:
                with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=30) as response:
                    for line in response.iter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            chunk = _chunk(line[6:])
                            if chunk is None:
                                break  # cut mid-event by the dying router: the stream is cut
                            tokens += bool(chunk.get("choices"))
            except httpx.ConnectError:
                self.seen[(name, "refused")] += 1  # never started: a client's retry costs nothing
                continue
            except httpx.HTTPError:
                pass
            outcome = "completed" if done and tokens else "cut"
            self.seen[(name, outcome)] += 1
            self.streams.append((name, opened, time.monotonic(), outcome))


def _chunk(data: str) -> dict | None:
    """A streamed event's JSON, or None where a killed process cut it off mid-line."""
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None


@pytest.mark.timed
@pytest.mark.timeout(240)
def test_killing_one_of_two_routers_under_load_costs_only_the_streams_it_carried(tmp_path):
    config = engine_config(tmp_path)
    servers = [
        ServerProcess("--served-model-name", "tiny", config=config, log_path=tmp_path / f"s{i}.log", env=ONE_THREAD)
        for i in range(2)
    ]
    routers = []
    try:
        for server in servers:
            server.wait_ready(180)
        flags = [a for s in servers for a in ("--colocated-url", s.url)]
        for name in ("router-a", "router-b"):
            routers.append(
                ServerProcess(
                    "--role", "router", "--served-model-name", "tiny", *flags, log_path=tmp_path / f"{name}.log"
                )
            )
        for router in routers:
            router.wait_ready(60)
        clients = [Client(routers, i) for i in range(4)]
        stop = threading.Event()
        threads = [threading.Thread(target=c.run, args=(stop,)) for c in clients]
        for t in threads:
            t.start()
        time.sleep(6)
        signalled_at = time.monotonic()
        routers[0].terminate(9)  # SIGKILL: no drain
        routers[0].proc.wait(10)
        killed_at = time.monotonic()  # a stream opened later finds it gone: refused, never cut
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        for process in [*routers, *servers]:
            process.stop()

    # the streams router-a carried as it died: opened through it before it was gone, open when signalled
    carried = sum(
        name == "router-a" and opened < killed_at and ended >= signalled_at
        for c in clients
        for name, opened, ended, _ in c.streams
    )
    total = collections.Counter()
    for i, client in enumerate(clients):
        print(f"client {i}: {dict(client.seen)}")
        total.update(client.seen)
    print(f"router-a carried {carried} streams when it was killed; {time.monotonic() - killed_at:.1f} s after")
    assert total[("router-b", "cut")] == 0  # the surviving router lost nothing
    assert total[("router-a", "cut")] <= carried  # only the streams the dead router carried
    assert total[("router-b", "completed")] > 0 and total[("router-a", "completed")] > 0
    assert all(client.seen[("router-b", "completed")] > 0 for client in clients)  # every client went on
