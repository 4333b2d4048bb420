"""Real server processes for the robustness cases: a colocated server (with an API key, so that
what needs none shows), and a disaggregated fleet (prefill, decode, router) sharing a transfer
token. builtin:tiny in float32 with small caches, one torch thread each: they share two cores."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from llmfleet.server.wire.auth import KV_TOKEN_ENV, KV_TOKEN_HEADER

# The operator against the emulated API server, and helm renders of the chart (test_operator_escalation.py)
from tests.chart.conftest import helm, render, tool_env  # noqa: F401
from tests.operator.conftest import cluster_options, kube  # noqa: F401
from tests.support import ServerProcess

MODEL = "tiny"
API_KEY = "robust-key"
TOKEN = "robust-fleet-token"
FLEET_ENV = {"OMP_NUM_THREADS": "1", KV_TOKEN_ENV: TOKEN}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TRANSFER = {KV_TOKEN_HEADER: TOKEN}


# Short, so that schemathesis' cases without max_tokens end in time; test_poison needs longer lives
CONTEXT = 128


def engine_config(tmp: Path, context: int = CONTEXT) -> Path:
    path = tmp / "engine.yaml"
    path.write_text(f"dtype: float32\nkv_block_size: 8\nkv_cache_memory_mb: 16\nmax_model_len: {context}\n")
    return path


def serve(
    tmp: Path, name: str, *args: str, env: dict | None = None, config: bool = True, context: int = CONTEXT
) -> ServerProcess:
    common = ("--model", "builtin:tiny", "--served-model-name", MODEL)
    return ServerProcess(
        *common,
        *args,
        config=engine_config(tmp, context) if config else None,
        log_path=tmp / f"{name}.log",
        env=FLEET_ENV | (env or {}),
    )


@dataclass
class Fleet:
    tmp: Path
    colocated: ServerProcess
    prefill: ServerProcess
    decode: ServerProcess
    router: ServerProcess
    pool_file: Path  # the decode server's prefill pool


@pytest.fixture(scope="session")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("robust")) as started:
        yield started


@contextlib.contextmanager
def running_fleet(tmp: Path, context: int = CONTEXT) -> Iterator[Fleet]:
    """The colocated server and the disaggregated fleet, each with a `context`-token limit."""
    pool = tmp / "prefill-pool.yaml"
    colocated = serve(tmp, "colocated", "--api-key", API_KEY, context=context)
    prefill = serve(tmp, "prefill", "--role", "prefill", context=context)
    pool.write_text(f"prefill:\n- {prefill.url}\n")
    decode = serve(tmp, "decode", "--role", "decode", "--endpoints-file", str(pool), context=context)
    started = [colocated, prefill, decode]
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as waiting:
            list(waiting.map(lambda s: s.wait_ready(240), started))
        urls = ("--prefill-url", prefill.url, "--decode-url", decode.url)
        router = ServerProcess(
            "--role", "router", "--served-model-name", MODEL, *urls, log_path=tmp / "router.log", env=FLEET_ENV
        )
        started.append(router)
        router.wait_ready(60)
        yield Fleet(tmp, colocated, prefill, decode, router, pool)
    finally:
        for server in started:
            server.stop()


def post(url: str, path: str, body: dict | bytes, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **(headers or {})}
        return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=timeout)
    return httpx.post(f"{url}{path}", json=body, headers=headers or {}, timeout=timeout)


def rss_mb(pid: int) -> float:
    """A process's resident memory, in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def report(line: str) -> None:
    """Figures for the record: printed (pytest -s) and kept beside the run's logs."""
    print(f"\n[robustness] {line}")
    path = os.environ.get("LLMFLEET_ROBUSTNESS_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(line + "\n")
