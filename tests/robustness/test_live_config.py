"""The live config file, on a real server: a directory in its place, or a file past the size bound
(refused unread, at once), is reported as an invalid file is, a log line and
llmfleet_config_errors_total, and the server keeps its last good config and keeps serving."""

from __future__ import annotations

import os
import shutil
import time

from llmfleet.server.config import MAX_CONFIG_BYTES
from tests.robustness.conftest import AUTH, MODEL, post


def errors(server) -> float:
    return server.metrics().get("llmfleet_config_errors_total{}", 0.0)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_what_cannot_be_a_config_is_reported_and_the_server_keeps_serving(fleet):
    server, path = fleet.colocated, fleet.tmp / "engine.yaml"
    good = path.read_text()
    before = errors(server)
    try:
        path.unlink()
        path.mkdir()
        assert wait_for(lambda: errors(server) == before + 1)
        assert "is not a file (a directory)" in server.log_path.read_text()
        path.rmdir()
        path.write_bytes(b"max_batch_size: 5\n" + b"#" * MAX_CONFIG_BYTES)
        started = time.monotonic()
        assert wait_for(lambda: errors(server) == before + 2)
        assert time.monotonic() - started < 5  # refused unread, not parsed for seconds
        assert f"at most {MAX_CONFIG_BYTES} are read" in server.log_path.read_text()
        answer = post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, AUTH)
        assert answer.status_code == 200
    finally:
        if path.is_dir():
            shutil.rmtree(path)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(good)
        os.replace(tmp, path)
