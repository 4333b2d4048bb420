"""A model over two "nodes" as a LeaderWorkerSet runs it: the node-rank 0 server (the API) and a
``--headless`` one, two processes on loopback meeting at --master-addr:--master-port, their
shards summing through gloo as nodes that share no memory do; and the placement flags a server
refuses in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from llmfleet.cli import main
from llmfleet.server.config import EngineConfig
from llmfleet.server.core.request import SamplingParams
from llmfleet.server.engine.build import build_engine
from tests.support import ServerProcess, free_port


def test_a_leader_and_a_headless_node_serve_one_model(tmp_path):
    master, headless_port = free_port(), free_port()
    placement = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(master)]
    common = ["builtin:tiny", "--dtype", "float32", "--tensor-parallel-size", "2", *placement]
    worker_node = ["--node-rank", "1", "--headless", "--port", str(headless_port)]
    headless = subprocess.Popen(
        [sys.executable, "-m", "llmfleet.cli", "serve", *common, *worker_node],
        stdout=(tmp_path / "headless.log").open("w"),
        stderr=subprocess.STDOUT,
        # as a node that shares no memory with the leader's: the shards sum through gloo
        env=os.environ | {"LLMFLEET_SHM_ALLREDUCE": "0"},
    )
    leader = ServerProcess(*common, "--node-rank", "0", log_path=tmp_path / "leader.log")
    try:
        leader.wait_ready(180)
        assert httpx.get(f"http://127.0.0.1:{headless_port}/health", timeout=5).status_code == 200
        body = {"model": "builtin:tiny", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
        answer = httpx.post(f"{leader.url}/v1/completions", json=body, timeout=60).json()
        single, _ = build_engine("builtin:tiny", EngineConfig(dtype="float32", kv_cache_memory_mb=4))
        want = single.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0))[0]
        assert answer["usage"]["completion_tokens"] == 6
        assert answer["choices"][0]["text"] == single_text(want)
        assert "tensor shards sum through gloo: off here" in (tmp_path / "headless.log").read_text()
        assert "sum through gloo: another shard cannot map the file" in (tmp_path / "leader.log").read_text()
        leader.terminate()
        assert leader.proc.wait(60) == 0
        assert headless.wait(60) == 0  # its workers ended with the leader's stop
    finally:
        leader.stop()
        if headless.poll() is None:
            headless.kill()


def single_text(tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    from llmfleet.server.runner.builtin_models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny")).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--headless"], "--headless and --node-rank need --nnodes of 2 or more"),
        (["--nnodes", "2"], "--nnodes of 2 or more needs --master-port"),
        (["--nnodes", "2", "--master-port", "1", "--node-rank", "2", "--headless"], "--node-rank must be from 0 to 1"),
        (["--nnodes", "2", "--master-port", "1", "--node-rank", "1"], "every other node runs --headless"),
    ],
)
def test_placement_flags_that_cannot_work_are_one_line(argv, words, capsys):
    assert main(["serve", "builtin:tiny", "--port", str(free_port()), *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_layout_the_model_cannot_take_is_one_line():
    start = time.monotonic()
    with pytest.raises(SystemExit) as stop:
        main(["serve", "builtin:tiny", "--port", str(free_port()), "--tensor-parallel-size", "3"])
    assert "tensor parallel size 3 does not divide the model's 4 attention heads" in str(stop.value.code)
    assert time.monotonic() - start < 30  # refused before any worker started
